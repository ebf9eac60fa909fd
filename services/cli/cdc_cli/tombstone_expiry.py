"""Expiring tombstones as the merger does, by bronze's ingest time.

Tombstones (deleted keys and the sequence of their delete) stop a late, older event from
resurrecting a deleted row. They expire once the merger has merged bronze events of the
entity ingested ``merger.tombstone_retention_hours`` after the tombstone, counted in
bronze's ingest time, not the wall clock, so a quiet or lagging pipeline keeps what its
late events may still need. A retention given to ``cdc maintenance`` may only lengthen
the configured one.
"""

from __future__ import annotations

import datetime as dt

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import (
    ENTITY_COLUMN,
    INGESTED_AT,
)
from cdc_shared.contracts.silver import DELETED_AT

from cdc_cli.checkpoints import (
    DeltaLog,
    as_utc,
    merger_backlog,
)
from cdc_cli.retention import RetentionTooShortError
from cdc_cli.stream_needs import ingested_positions, merger_progress
from cdc_cli.table_state import TableState, TableWrites


def tombstone_retention(configured: float | None, requested: float | None) -> float | None:
    """The tombstone retention to expire by: the configured one, or a longer one asked for.

    ``configured`` is ``merger.tombstone_retention_hours`` (None: kept forever). It is the
    window the pipeline expects late events in, and the merger expires by it too, so a
    shorter ``requested`` one is refused (RetentionTooShortError): change the configuration
    to expire sooner. None: expire nothing.
    """
    if requested is None:
        return configured
    if configured is None or requested < configured:
        kept = "null: tombstones are kept" if configured is None else f"{configured:g} hours"
        raise RetentionTooShortError(
            f"refusing to expire tombstones after {requested:g} hours: shorter than "
            f"merger.tombstone_retention_hours ({kept}), the window in which late events "
            "are expected and could resurrect deleted keys. --tombstone-retention-hours "
            "may only lengthen it; to expire sooner, change the configuration (the merger "
            "then does so too)"
        )
    return requested


def merged_ingest_times(
    config: PipelineConfig, entities: list[EntityConfig], state: TableState
) -> dict[str, tuple[dt.datetime | None, str]]:
    """Per entity, the latest bronze ingest time among its events the merger has merged.

    The clock the merger ages tombstones by (``TableMerge.expire_tombstones``: the latest
    ingest time of what it merged), as (that time, "") or (None, why nothing expires).
    The entity's rows up to its progress (silver's log) are what the merger merged. When
    no later bronze version holds rows of it (its backlog is empty), those are all its
    rows in bronze's version read now. Otherwise they are its rows ingested before the
    first of its rows the merger has not merged (the ingestor stamps each batch with one
    time, and its batches come one after the other), found in bronze's Change Data Feed
    after the progress: both reads need only files VACUUM keeps (the current version's,
    and those the merger still needs), never an older version's.
    """
    times: dict[str, tuple[dt.datetime | None, str]] = {}
    bronze = DeltaLog(state, config.layout.bronze())
    ingested = {} if bronze.latest is None else ingested_positions(config, state, bronze, entities)
    for entity in entities:
        progress = merger_progress(config, state, entity.name)
        if progress is None or bronze.latest is None:
            times[entity.name] = None, "kept: the merger has merged nothing of bronze yet"
            continue
        where = {ENTITY_COLUMN: entity.name}
        backlog = merger_backlog(
            bronze, entity.name, entity.source_topic, progress, ingested[entity.name]
        )
        unmerged = None
        if backlog.count:
            unmerged = state.change_feed_min(
                bronze.path, INGESTED_AT, progress, bronze.latest, where
            )
        newest = state.column_max(bronze.path, INGESTED_AT, bronze.latest, where, unmerged)
        if newest is None:
            times[entity.name] = None, "kept: the merger has merged nothing of it from bronze"
        else:
            times[entity.name] = as_utc(newest), ""
    return times


def expire_by_ingest_time(
    config: PipelineConfig,
    entity: EntityConfig,
    state: TableState,
    hours: float | None,
    merged: tuple[dt.datetime | None, str],
    writes: TableWrites | None = None,
) -> tuple[int, str]:
    """Expire the entity's tombstones as the merger does: (how many, which and why).

    A tombstone goes once the merger has merged events ingested ``hours`` after it was
    recorded (``merged``: from :func:`merged_ingest_times`), through the expiry the
    merger runs (``cdc_shared.streaming.tables.expire_tombstones``) through ``writes``. Without
    ``writes`` (a dry run): count those that would go, by the same column and cutoff, and
    expire none.
    """
    if hours is None:
        return 0, "kept: merger.tombstone_retention_hours is null (tombstones never expire)"
    until, why = merged
    if until is None:
        return 0, why
    cutoff = until - dt.timedelta(hours=hours)
    path = config.layout.tombstones(entity.name)
    dry_run = writes is None
    if writes is None:
        expired = state.count_before(path, DELETED_AT, cutoff)
    else:
        expired = writes.expire_tombstones(path, cutoff)
    verb = "would expire" if dry_run else "expired"
    return expired, (
        f"{verb} those recorded before {cutoff.isoformat(timespec='seconds')}: {hours:g} "
        f"hours of bronze ingest time before the last merged event's, "
        f"{until.isoformat(timespec='seconds')}"
    )
