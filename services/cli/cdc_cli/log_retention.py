"""Retention of the append-only logs: bronze's and the quarantine's rows past their time.

Bronze and the quarantine keep every row unless the pipeline sets a retention
(``retention.bronze_hours``, an entity's ``bronze_retention_hours``,
``retention.quarantine_hours``). Then ``cdc maintenance`` deletes, per entity, the bronze
rows ingested longer ago than that, and the quarantined records quarantined longer ago.

Never a bronze row the merger still has to read: an entity's cut is moved back to the
oldest row ingested after its progress (silver's, or its history's when that is behind),
and an entity the merger has not written yet keeps every row. The services run on
through the delete: the merger's stream skips the delete's commit and its reads by
version take only the feed's inserts (``cdc_shared.contracts.bronze``). Before deleting,
maintenance records each entity's cut in bronze's properties
(``cdc.retention.deletedBefore.<entity>``), so a silver rebuilt from bronze later is
refused instead of silently missing rows (``cdc_merger.merging.BronzeRetainedError``).
Deleted rows stay in bronze's files until VACUUM removes them (``delta.deletedFileRetention
Duration`` after the delete, maintenance's own VACUUM).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import (
    ENTITY_COLUMN,
    INGESTED_AT,
    MERGER_PROGRESS_APP,
    QUARANTINE_WRITERS,
    RETENTION_PROPERTY,
)

from cdc_cli.checkpoints import BRONZE
from cdc_cli.stream_needs import merger_progress
from cdc_cli.table_state import TableState, TableWrites

#: When a quarantined record was quarantined (``cdc_shared.contracts.quarantine``).
QUARANTINED_AT = "quarantined_at"


@dataclass(frozen=True)
class Cut:
    """Rows of one log (of one entity, in bronze) older than ``before`` go."""

    table: str  # BRONZE or "quarantine/<service>"
    entity: str | None  # bronze: the entity; the quarantine: every entity
    before: dt.datetime
    note: str  # why there


@dataclass(frozen=True)
class Retained:
    """What retention did to one log (a dry run: would do)."""

    table: str
    deleted: int  # rows
    note: str  # whose rows, before when, and whose were kept


@dataclass(frozen=True)
class Kept:
    """An entity whose bronze rows retention keeps for now, and why."""

    entity: str
    note: str


def bronze_cuts(
    config: PipelineConfig, state: TableState, now: dt.datetime
) -> tuple[list[Cut], list[Kept]]:
    """Each entity's bronze cut (its retention, moved back to what the merger still reads)."""
    path = config.layout.bronze()
    latest = state.table_version(path)
    cuts: list[Cut] = []
    kept: list[Kept] = []
    if latest is None:
        return cuts, kept
    for entity in config.entities:
        hours = config.retention.bronze_hours_of(entity)
        if hours is None:
            continue
        progress = _merged_through(config, state, entity)
        if progress is None:
            kept.append(Kept(entity.name, "not merged yet: every row kept"))
            continue
        before = now - dt.timedelta(hours=hours)
        note = f"ingested over {hours:g} h ago"
        if progress < latest:
            pending = state.change_feed_min(
                path, INGESTED_AT, progress, latest, {ENTITY_COLUMN: entity.name}
            )
            if pending is not None and pending < before:
                before = pending
                note = f"ingested before the oldest row not merged yet (version > {progress})"
        cuts.append(Cut(BRONZE, entity.name, before, note))
    return cuts, kept


def _merged_through(config: PipelineConfig, state: TableState, entity: EntityConfig) -> int | None:
    """The bronze version the merger merged ``entity`` through; None when silver has none.

    Silver's progress, or its history's when that is behind.
    """
    progress = merger_progress(config, state, entity.name)
    if progress is None or not entity.history.enabled:
        return progress
    history = state.transaction_version(config.layout.history(entity.name), MERGER_PROGRESS_APP)
    return None if history is None else min(progress, history)


def quarantine_cuts(config: PipelineConfig, state: TableState, now: dt.datetime) -> list[Cut]:
    """Each quarantine table's cut (``retention.quarantine_hours``), where the table exists."""
    hours = config.retention.quarantine_hours
    if hours is None:
        return []
    before = now - dt.timedelta(hours=hours)
    return [
        Cut(f"quarantine/{service}", None, before, f"quarantined over {hours:g} h ago")
        for service in QUARANTINE_WRITERS
        if state.table_version(config.layout.quarantine(service)) is not None
    ]


def count(state: TableState, path: str, cut: Cut) -> int:
    """The rows ``cut`` would delete (a dry run's figure)."""
    column = INGESTED_AT if cut.entity is not None else QUARANTINED_AT
    where = None if cut.entity is None else {ENTITY_COLUMN: cut.entity}
    return state.count_before(path, column, cut.before, where)


def delete(writes: TableWrites, path: str, cuts: list[Cut]) -> int:
    """Delete the rows of ``cuts`` (all of one table) in one commit; how many went.

    Bronze's cuts are recorded in its properties first (``RETENTION_PROPERTY``).
    """
    if not cuts:
        return 0
    if cuts[0].entity is None:
        return writes.delete_rows(path, f"{QUARANTINED_AT} < {_micros(cuts[0].before)}", {})
    marks = {f"{RETENTION_PROPERTY}{c.entity}": c.before.isoformat() for c in cuts}
    predicate = " OR ".join(
        f"({ENTITY_COLUMN} = '{c.entity}' AND {INGESTED_AT} < {_micros(c.before)})" for c in cuts
    )
    return writes.delete_rows(path, predicate, marks)


def _micros(moment: dt.datetime) -> str:
    """``moment`` as a Spark SQL timestamp, whatever the session's time zone."""
    return f"timestamp_micros({round(moment.timestamp() * 1_000_000)})"


def apply(
    config: PipelineConfig, state: TableState, writes: TableWrites | None, now: dt.datetime
) -> list[Retained]:
    """Bronze's and the quarantine's retention: delete what is past it, one entry per log.

    ``writes`` None (a dry run): count what would go.
    """
    results = []
    cuts, kept = bronze_cuts(config, state, now)
    logs = [(BRONZE, config.layout.bronze(), cuts, kept)] if cuts or kept else []
    logs += [
        (cut.table, config.layout.quarantine(cut.table.split("/", 1)[1]), [cut], [])
        for cut in quarantine_cuts(config, state, now)
    ]
    for table, path, table_cuts, table_kept in logs:
        if writes is None:
            deleted = sum(count(state, path, cut) for cut in table_cuts)
        else:
            deleted = delete(writes, path, table_cuts)
        notes = [f"{c.entity or 'every entity'}: {c.note}" for c in table_cuts]
        notes += [f"{k.entity}: {k.note}" for k in table_kept]
        results.append(Retained(table, deleted, "; ".join(notes)))
    return results
