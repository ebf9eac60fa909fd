"""What the services still need of each table: the oldest version each has to read.

A service that still has to read table version ``v`` needs every file that version
``v`` or a later one added or referenced, so a VACUUM is safe when its cutoff is not later
than the commit of ``v`` (:func:`check_vacuum_retention`). Bronze is read by the merger,
each table from its own progress (silver's log, app id ``cdc-merger``); silver by the
two publishers, each from the last version it published (:class:`PublisherProgress`).
Versions that a table's log may drop before a service reads them, and the tables of the
releases before one bronze, are reported as notices.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import ChangeFeedConfig
from cdc_shared.contracts.layout import (
    MERGER,
    MERGER_LEGACY_APP,
    MERGER_PROGRESS_APP,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    SERVICES,
    display_name,
)
from confluent_kafka import KafkaException
from elasticsearch import ApiError, TransportError

from cdc_cli import status
from cdc_cli.checkpoints import (
    BRONZE,
    DeltaLog,
    StateReader,
    change_feed_versions,
    merger_backlog,
    recorded_positions,
)
from cdc_cli.retention import (
    LOG_RETENTION_PROPERTY,
    ProgressUnknownError,
    RetentionTooShortError,
    log_retention_hours,
)
from cdc_cli.status import ingestor_checkpoint, status_client
from cdc_cli.table_state import TableState

if TYPE_CHECKING:  # a dry run reads without PySpark: it is imported where a session is used
    from elasticsearch import Elasticsearch

SAFETY_MARGIN = dt.timedelta(minutes=5)
SILVER_READERS = (PUBLISHER_KAFKA, PUBLISHER_ES)


@dataclass(frozen=True)
class StreamNeed:
    """The oldest point of a table a service still has to read, and since when."""

    service: str
    table: str  # "bronze" or e.g. "silver/customers"
    version: int | None  # the oldest version it still has to read; None: from a timestamp
    since: dt.datetime  # commit time of that version (or the configured timestamp)
    note: str

    def hours(self, now: dt.datetime) -> float:
        """The shortest retention (hours) that keeps what this service needs, with margin."""
        return max(0.0, (now - self.since + SAFETY_MARGIN).total_seconds() / 3600)


def _too_old(service: str, table: str, version: int) -> RetentionTooShortError:
    return RetentionTooShortError(
        f"{service} still has to read {table} version {version}, which is no longer in the "
        "table's log: its files may already be gone; rebuild what it feeds from the table"
    )


def ingested_positions(
    config: PipelineConfig,
    state: StateReader,
    bronze: DeltaLog,
    entities: list[EntityConfig],
) -> dict[str, dict[str, int] | None]:
    """Per entity, the furthest the ingestor may have written its topic (None: unknown).

    Bronze's own newest record of the topic; without one, the last batch its group's
    checkpoint planned.
    """
    positions = recorded_positions(bronze, {e.source_topic: e.name for e in entities})
    furthest: dict[str, dict[str, int] | None] = {}
    for entity in entities:
        position = positions.get(entity.source_topic)
        if position is not None:
            furthest[entity.name] = position.offsets
            continue
        checkpoint = ingestor_checkpoint(config, state, entity, planned=True)
        furthest[entity.name] = None if checkpoint is None else checkpoint.offsets
    return furthest


def merger_progress(config: PipelineConfig, state: StateReader, entity: str) -> int | None:
    """The bronze version the merger merged ``entity`` through (silver's log); None: none."""
    silver = config.layout.silver(entity)
    if state.table_version(silver) is None:
        return None
    return state.transaction_version(silver, MERGER_PROGRESS_APP)


def bronze_needs(config: PipelineConfig, state: StateReader) -> list[StreamNeed]:
    """What the merger still needs of bronze: per table, the oldest version it has to read.

    Every table of the pipeline, whatever the selection: bronze is one table. A table's
    need is the oldest bronze version after its progress that holds rows of it
    (:func:`cdc_cli.checkpoints.merger_backlog`); an idle table needs nothing, however
    old its progress.
    """
    bronze = DeltaLog(state, config.layout.bronze())
    if bronze.latest is None:
        return []
    ingested = ingested_positions(config, state, bronze, list(config.entities))
    needs: list[StreamNeed] = []
    for entity in config.entities:
        progress = merger_progress(config, state, entity.name)
        written = ingested[entity.name]
        if progress is None and written is not None and not any(written.values()):
            continue  # nothing of it ingested yet: nothing of bronze to read
        backlog = merger_backlog(
            bronze,
            entity.name,
            entity.source_topic,
            -1 if progress is None else progress,
            ingested[entity.name],
        )
        if backlog.unreadable:
            raise _too_old(MERGER, BRONZE, min(backlog.unreadable))
        if not backlog.versions:
            continue
        oldest = backlog.versions[0]
        note = (
            f"{entity.name} not merged yet"
            if progress is None
            else f"{entity.name} merged through version {progress}"
        )
        needs.append(StreamNeed(MERGER, BRONZE, oldest.version, oldest.timestamp, note))
    return needs


def _unstarted_publisher_need(
    state: StateReader, service: str, table: str, path: str, settings: ChangeFeedConfig
) -> StreamNeed | None:
    """Where a publisher that has not started will begin reading silver."""
    if settings.starting_timestamp is not None:
        since = dt.datetime.fromisoformat(settings.starting_timestamp)
        since = since.replace(tzinfo=dt.UTC) if since.tzinfo is None else since  # Spark: UTC
        return StreamNeed(service, table, None, since, "not started: starting_timestamp")
    version = settings.starting_version or 0
    history = state.history(path)
    if version > max(history, default=-1):
        return None
    since = history[max(version, min(history))].timestamp
    return StreamNeed(service, table, version, since, f"not started: reads from version {version}")


class PublisherProgress:
    """Where each publisher stands in a silver table: the last version it published.

    publisher-kafka's in its change topic's progress group, publisher-es's in its progress
    document (before its first start of this release: an earlier release's checkpoint).
    One Elasticsearch client for every table, made on first use.
    """

    def __init__(self, config: PipelineConfig, state: StateReader) -> None:
        self.config = config
        self.state = state
        self._es: Elasticsearch | None = None

    def version(self, service: str, entity: EntityConfig) -> tuple[int | None, str]:
        """(the last silver version ``service`` published, None: not started; a note).

        ProgressUnknownError when its store does not answer.
        """
        try:
            if service == PUBLISHER_KAFKA:
                published = status.published_version(self.config, entity)
                return published, f"published up to version {published}"
            indexed = status.indexed_version(self._elasticsearch(), self.config, entity)
            if indexed is not None:
                return indexed, f"indexed up to version {indexed}"
            legacy = status.legacy_indexed_version(self.state, self.config, entity)
            return legacy, f"indexed up to version {legacy} (an earlier release's checkpoint)"
        except (KafkaException, ApiError, TransportError) as exc:
            raise ProgressUnknownError(
                f"cannot read {display_name(service)}'s progress for {entity.name} ({exc}): "
                f"VACUUM of silver/{entity.name} could delete what it has not published; "
                f"retry when it answers, or --ignore-service {service} if it is not deployed"
            ) from None

    def _elasticsearch(self) -> Elasticsearch:
        if self._es is None:
            self._es = status_client(self.config)
        return self._es

    def close(self) -> None:
        """Release the Elasticsearch client, if one was made."""
        if self._es is not None:
            self._es.close()


def silver_needs(
    config: PipelineConfig,
    entity: EntityConfig,
    state: StateReader,
    ignore_services: tuple[str, ...] = (),
    progress: PublisherProgress | None = None,
) -> list[StreamNeed]:
    """What the publishers still need of the entity's silver: the oldest version to read.

    Per publisher: the oldest version after its progress whose Change Data Feed holds
    changes; where a publisher that has not started will begin. ``progress`` reads the
    publishers' progress (one is made, and closed, when not given).
    """
    silver = DeltaLog(state, config.layout.silver(entity.name))
    if silver.latest is None:
        return []
    settings: dict[str, ChangeFeedConfig] = {
        PUBLISHER_KAFKA: config.publisher_kafka,
        PUBLISHER_ES: config.publisher_es,
    }
    reading = progress or PublisherProgress(config, state)
    table = f"silver/{entity.name}"
    needs: list[StreamNeed] = []
    try:
        for service in SILVER_READERS:
            if service in ignore_services:
                continue
            published, note = reading.version(service, entity)
            if published is None:
                need = _unstarted_publisher_need(
                    state, service, table, silver.path, settings[service]
                )
                if need is not None:
                    needs.append(need)
                continue
            changed, unreadable = change_feed_versions(silver, published)
            if unreadable:
                raise _too_old(service, table, unreadable[0])
            if changed:
                needs.append(
                    StreamNeed(service, table, changed[0].version, changed[0].timestamp, note)
                )
    finally:
        if progress is None:
            reading.close()
    return needs


def stream_needs(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: StateReader,
    ignore_services: tuple[str, ...] = (),
) -> list[StreamNeed]:
    """What the merger needs of bronze and the publishers of the entities' silver tables."""
    needs = [] if MERGER in ignore_services else bronze_needs(config, state)
    progress = PublisherProgress(config, state)
    try:
        for entity in entities:
            needs.extend(silver_needs(config, entity, state, ignore_services, progress))
    finally:
        progress.close()
    return needs


def log_retention_notices(
    needs: list[StreamNeed], state: TableState, paths: Mapping[str, str], now: dt.datetime
) -> list[str]:
    """A notice per need older than its table's log retention (``delta.logRetentionDuration``).

    Delta removes such versions' commits at its next log checkpoint, whoever commits:
    the service that needs them then fails to read them. VACUUM cannot help that.
    """
    notices = []
    for need in needs:
        path = paths.get(need.table)
        if path is None or need.version is None:
            continue
        hours = log_retention_hours(state, path)
        if now - need.since > dt.timedelta(hours=hours):
            notices.append(
                f"{need.table}: {need.service} still has to read version {need.version}, "
                f"committed more than {LOG_RETENTION_PROPERTY} ({hours:g} hours) ago: Delta "
                "removes its commit from the log at the next log checkpoint, and the "
                f"service cannot read it then ({need.note})"
            )
    return notices


def merger_log_notices(config: PipelineConfig, state: TableState, now: dt.datetime) -> list[str]:
    """A notice when the oldest table's merger progress is beyond bronze's log retention.

    A table without changes keeps its progress at its last change, and needs nothing of
    bronze's files; but a merger query that starts on a new checkpoint (its first start,
    a table moved to another group) reads bronze's log from the oldest progress of its
    tables, which Delta removes after ``delta.logRetentionDuration``.
    """
    bronze = DeltaLog(state, config.layout.bronze())
    if bronze.latest is None:
        return []
    progresses = {e.name: merger_progress(config, state, e.name) for e in config.entities}
    behind = {name: p for name, p in progresses.items() if p is not None and p < bronze.latest}
    if not behind:
        return []
    entity, oldest = min(behind.items(), key=lambda item: item[1])
    hours = log_retention_hours(state, bronze.path)
    commit = bronze.commit(oldest)
    if commit is not None and now - commit.timestamp <= dt.timedelta(hours=hours):
        return []
    return [
        f"bronze: {entity} is merged through version {oldest}, older than "
        f"{LOG_RETENTION_PROPERTY} ({hours:g} hours) or no longer in the log: a merger query "
        "starting on a new checkpoint reads bronze's log from the oldest progress of its "
        "tables, and fails once Delta has removed those commits"
    ]


def legacy_notices(config: PipelineConfig, state: StateReader) -> list[str]:
    """What the releases before one bronze left: their bronze tables, their checkpoints.

    Left alone by maintenance. An old bronze table is drained into silver at the merger's
    first start (silver's log records it): then it can be deleted. Old checkpoints are
    read only at each service's first start of this release.
    """
    notices = []
    layout = config.layout
    for entity in config.entities:
        old = layout.legacy_bronze(entity.name)
        if state.table_version(old) is None:
            continue
        silver = layout.silver(entity.name)
        drained = (
            state.table_version(silver) is not None
            and state.transaction_version(silver, MERGER_LEGACY_APP) is not None
        )
        notices.append(
            f"bronze/{entity.name}: the entity's bronze table of an earlier release, left "
            "alone: "
            + (
                "the merger drained it into silver, it can be deleted"
                if drained
                else "the merger drains it into silver at its first start, delete it after"
            )
        )
    for service in SERVICES:
        folder = layout.legacy_checkpoint(service, "_").rsplit("/", 1)[0]
        names = sorted(state.list_names(folder) or [])
        if names:
            notices.append(
                f"{folder}: stream checkpoints of an earlier release ({', '.join(names)}), "
                f"left alone: {display_name(service)} reads them only at its first start "
                "of this release; once it has run, they can be deleted"
            )
    return notices


def check_vacuum_retention(
    needs: list[StreamNeed], hours: float, now: dt.datetime | None = None
) -> None:
    """Raise RetentionTooShortError naming every stream ``hours`` would break."""
    now = now or dt.datetime.now(dt.UTC)
    broken = [n for n in needs if hours < n.hours(now)]
    if broken:
        lines = [
            f"  {n.table}: {n.service} still needs version "
            f"{n.version if n.version is not None else '(timestamp)'} committed at "
            f"{n.since.isoformat(timespec='seconds')} ({n.note}); needs at least "
            f"{math.ceil(n.hours(now))} hours"
            for n in broken
        ]
        raise RetentionTooShortError(
            f"refusing VACUUM with a retention of {hours:g} hours: it would delete files "
            "that services have not read yet:\n"
            + "\n".join(lines)
            + "\nlet those services catch up (see `cdc status`), or use a longer --vacuum-hours"
        )
