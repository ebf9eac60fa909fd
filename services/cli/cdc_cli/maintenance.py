"""``cdc maintenance``: OPTIMIZE, VACUUM that never breaks a table or a service, tombstone expiry.

The tables: ``bronze`` (one table for every entity, shared: maintained whatever entities
are selected), and per entity ``silver/<entity>`` and its tombstones
(``silver/_tombstones/<entity>``).

VACUUM deletes data files that left the table (replaced by a MERGE or an OPTIMIZE, or
change-data files) longer ago than the retention. Two limits keep it safe:

- **Delta's minimum**, the table's ``delta.deletedFileRetentionDuration`` (Delta's
  default when unset: ``DEFAULT_RETENTION_HOURS``): a writer's files are unreferenced
  until its commit lands, and a reader may still be reading a version whose files a later
  commit removed; a shorter retention can delete either, corrupting a commit or failing a
  read. Below it VACUUM is refused, unless ``force_short_retention`` is given and no
  service shows signs of running: no live writer lease, no configured ``/health``
  endpoint that answers, and no data commit on bronze or silver and no progress in any
  service's group checkpoint within the quiet period (:func:`cdc_cli.liveness.signs_of_life`).
- **What the services still need**: a service that still has to read table version
  ``v`` needs every file that version ``v`` or a later one added or referenced; such a
  file can only have left the table at a commit after ``v``. So the retention is safe
  when ``now - retention`` is not later than the commit time of ``v``, the oldest
  version a service still has to read, not counting versions that hold nothing it reads
  (an OPTIMIZE, a VACUUM, a MERGE that changed nothing). Each table's progress is read
  where the service keeps it (see :mod:`cdc_cli.checkpoints`):

  - bronze is read by the merger, each table from its own progress (silver's log, app id
    ``cdc-merger``) through bronze's Change Data Feed: per table, the oldest version
    after its progress that holds rows of it (a table without progress is read from
    bronze's start). Bronze keeps what every table still needs: the oldest of them;
  - ``silver/<entity>`` is read by publisher-kafka (its change topic's progress group)
    and publisher-es (its progress document), each from the last version it published
    through silver's Change Data Feed. A publisher that has not started yet will read
    from its configured ``starting_version`` (default 0) or ``starting_timestamp``, so it
    holds VACUUM back to that point unless it is ignored as not deployed; a progress that
    cannot be read (Kafka, Elasticsearch down) refuses VACUUM of silver;
  - ``silver/_tombstones/<entity>`` is read as a whole by the merger, never by version.

Both are checked before anything runs, and again right before each VACUUM. Reading a
version also needs its commit in the table's log, which Delta removes after
``delta.logRetentionDuration`` (30 days unless set) at a log checkpoint, whoever
writes it: a version needed for longer is reported (``notices``), never fixed here.

The tables of the releases before one bronze (``bronze/<entity>``) and their stream
checkpoints (``_checkpoints/``) are left alone: the services read them only at their
first start of this release (the merger drains each old bronze table into silver then).
Maintenance says which exist, and which can be deleted (``notices``).

A dry run (``dry_run``) makes the same checks, refuses what a run would refuse, and
changes nothing: it lists the files each VACUUM would delete (by Delta's own rules for
``VACUUM ... DRY RUN``, so the count is the one a VACUUM right then would delete,
OPTIMIZE aside), the tombstones that would expire (counted by the same cutoff), and each
table's file count for OPTIMIZE, which Delta cannot plan without running it. It reads
through a :class:`TableState`: without a JVM by default
(:class:`cdc_cli.delta_log.DeltaLogState`: delta-rs, the tables' logs and the
checkpoint files read directly), or through Spark (:class:`SparkTables`), as a run does.

Tombstones (deleted keys and the sequence of their delete) stop a late, older event
from resurrecting a deleted row. They expire as the merger expires them
(``merger.tombstone_retention_hours``; ``null`` keeps them): once the merger has merged
bronze events of the entity ingested that many hours after the tombstone, counted in
bronze's ingest time, not the wall clock, so a quiet or lagging pipeline keeps what its
late events may still need. A retention given here may only lengthen the configured one.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cdc_shared.config import (
    ChangeFeedConfig,
    EntityConfig,
    PipelineConfig,
    s3a_bucket,
)
from cdc_shared.layout import (
    ENTITY_COLUMN,
    MERGER,
    MERGER_LEGACY_APP,
    MERGER_PROGRESS_APP,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    SERVICES,
    display_name,
)
from cdc_shared.silver import DELETED_AT

from cdc_cli.checkpoints import (
    DeltaLog,
    SparkState,
    StateReader,
    as_utc,
    change_feed_versions,
    merger_backlog,
    recorded_positions,
    state_reader,
)
from cdc_cli.liveness import DEFAULT_QUIET, ActivityReader, signs_of_life

if TYPE_CHECKING:  # a dry run reads without PySpark: it is imported where a session is used
    from elasticsearch import Elasticsearch
    from pyspark.sql import SparkSession

SAFETY_MARGIN = dt.timedelta(minutes=5)
DEFAULT_RETENTION_HOURS = 168.0  # Delta's default deletedFileRetentionDuration: 7 days
DEFAULT_LOG_RETENTION_HOURS = 720.0  # Delta's default logRetentionDuration: 30 days
SILVER_READERS = (PUBLISHER_KAFKA, PUBLISHER_ES)
RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
LOG_RETENTION_PROPERTY = "delta.logRetentionDuration"
#: The one bronze table, as maintenance names it.
BRONZE = "bronze"
_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_VACUUM_LOGGING = "spark.databricks.delta.vacuum.logging.enabled"
_INGESTED_AT = "ingested_at"  # bronze's ingest time (cdc_shared.bronze)
# Spark's interval units as Delta's table properties use them ("interval 7 days").
_INTERVAL_UNITS = {
    "week": 7 * 24.0,
    "day": 24.0,
    "hour": 1.0,
    "minute": 1 / 60,
    "second": 1 / 3600,
    "millisecond": 1 / 3_600_000,
    "microsecond": 1 / 3_600_000_000,
}


class RetentionTooShortError(RuntimeError):
    """A requested retention would delete files (or tombstones) a table or stream still needs."""


class ProgressUnknownError(RetentionTooShortError):
    """A service's progress cannot be read: what VACUUM may delete cannot be told."""


class WritersMayRunError(RuntimeError):
    """Maintenance would commit to object-storage tables another process may write."""


class ServicesMayRunError(RuntimeError):
    """A retention below Delta's minimum was forced while a service may still run."""


class TableState(ActivityReader, Protocol):
    """What maintenance reads of the tables and checkpoints, beyond a :class:`StateReader`.

    Two of them: :class:`SparkTables` (Delta Lake through the session a run holds anyway)
    and :class:`cdc_cli.delta_log.DeltaLogState` (no JVM: a dry run's).
    """

    def table_properties(self, path: str) -> dict[str, str]:
        """The table properties of the Delta table at ``path``."""
        ...

    def data_file_count(self, path: str) -> int:
        """The data files of the table's latest version (what OPTIMIZE would bin-pack)."""
        ...

    def column_max(
        self,
        path: str,
        column: str,
        version: int,
        where: Mapping[str, str] | None = None,
        below: dt.datetime | None = None,
    ) -> Any:
        """The greatest value of ``column`` in version ``version`` of the table at ``path``.

        ``where``: only the rows whose columns hold these values; ``below``: only the rows
        whose timestamp ``column`` is before it.
        """
        ...

    def change_feed_min(
        self, path: str, column: str, since: int, until: int, where: Mapping[str, str]
    ) -> Any:
        """The least value of ``column`` among rows a range of versions changed.

        The versions after ``since`` up to ``until`` (the table's Change Data Feed), the
        rows whose columns hold the ``where`` values; None when there are none.
        """
        ...

    def count_before(self, path: str, column: str, moment: dt.datetime) -> int:
        """Rows of the table at ``path`` whose timestamp ``column`` is before ``moment``."""
        ...

    def vacuum_dry_run(self, path: str, hours: float, table_retention_hours: float) -> int:
        """How many paths ``VACUUM ... RETAIN hours HOURS DRY RUN`` lists for the table.

        ``table_retention_hours``: the table's ``delta.deletedFileRetentionDuration``.
        """
        ...


class SparkTables(SparkState):
    """A :class:`TableState` through a SparkSession: Delta Lake's and Hadoop's own answers."""

    def table_properties(self, path: str) -> dict[str, str]:
        """The table properties of the Delta table at ``path``."""
        from delta.tables import DeltaTable

        row = DeltaTable.forPath(self.spark, path).detail().select("properties").head()
        return dict((row["properties"] if row is not None else None) or {})

    def data_file_count(self, path: str) -> int:
        """The data files of the table's latest version (what OPTIMIZE would bin-pack)."""
        from delta.tables import DeltaTable

        detail = DeltaTable.forPath(self.spark, path).detail().select("numFiles").head()
        return 0 if detail is None else int(detail["numFiles"])

    def newest_modification(self, folder: str) -> dt.datetime | None:
        """The newest modification time of an entry of ``folder``; None when it has none."""
        from cdc_shared.jvm_bridge import hadoop_path

        fs, path = hadoop_path(self.spark, folder)
        if not fs.exists(path):
            return None
        times = [int(status.getModificationTime()) for status in fs.listStatus(path)]
        return dt.datetime.fromtimestamp(max(times) / 1000, dt.UTC) if times else None

    def column_max(
        self,
        path: str,
        column: str,
        version: int,
        where: Mapping[str, str] | None = None,
        below: dt.datetime | None = None,
    ) -> Any:
        """The greatest value of ``column`` in version ``version`` of the table at ``path``.

        ``where``: only the rows whose columns hold these values; ``below``: only the rows
        whose timestamp ``column`` is before it.
        """
        from pyspark.sql import functions as F

        rows = self.spark.read.format("delta").option("versionAsOf", version).load(path)
        for name, wanted in (where or {}).items():
            rows = rows.where(F.col(name) == F.lit(wanted))
        if below is not None:
            rows = rows.where(F.col(column) < F.lit(below))
        row = rows.agg(F.max(column)).head()
        value = None if row is None else row[0]
        return as_utc(value) if isinstance(value, dt.datetime) else value

    def change_feed_min(
        self, path: str, column: str, since: int, until: int, where: Mapping[str, str]
    ) -> Any:
        """The least value of ``column`` among rows a range of versions changed.

        The versions after ``since`` up to ``until`` (the table's Change Data Feed), the
        rows whose columns hold the ``where`` values; None when there are none.
        """
        from pyspark.sql import functions as F

        rows = (
            self.spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", since + 1)
            .option("endingVersion", until)
            .load(path)
        )
        for name, wanted in where.items():
            rows = rows.where(F.col(name) == F.lit(wanted))
        row = rows.agg(F.min(column)).head()
        value = None if row is None else row[0]
        return as_utc(value) if isinstance(value, dt.datetime) else value

    def count_before(self, path: str, column: str, moment: dt.datetime) -> int:
        """Rows of the table at ``path`` whose timestamp ``column`` is before ``moment``."""
        from pyspark.sql import functions as F

        rows = self.spark.read.format("delta").load(path)
        return int(rows.where(F.col(column) < F.lit(moment)).count())

    def vacuum_dry_run(self, path: str, hours: float, table_retention_hours: float) -> int:
        """How many paths Delta Lake's ``VACUUM ... RETAIN hours HOURS DRY RUN`` lists."""
        listed = _vacuum(self.spark, path, hours, hours < table_retention_hours, dry_run=True)
        return 0 if listed is None else listed


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


@dataclass(frozen=True)
class TableResult:
    """What maintenance did to one table (a dry run: what it would do)."""

    table: str
    files: int | None = None  # a dry run's data files now, in place of OPTIMIZE's figures
    optimized_files_removed: int | None = None
    optimized_files_added: int | None = None
    vacuum_retention_hours: float | None = None
    vacuumed_files: int | None = None
    tombstones_expired: int | None = None
    tombstones_note: str | None = None  # which tombstones expired, or why none did


@dataclass(frozen=True)
class MaintenanceReport:
    """Every table touched, and the services' needs the retention was checked against."""

    tables: list[TableResult] = field(default_factory=list)
    needs: list[StreamNeed] = field(default_factory=list)
    dry_run: bool = False  # nothing was changed: the figures are what a run would do
    #: What an operator should know and maintenance left alone (earlier releases' tables
    #: and checkpoints, versions needed beyond the log's retention).
    notices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``cdc maintenance --json``)."""
        return {
            "dry_run": self.dry_run,
            "notices": self.notices,
            "tables": [asdict(t) for t in self.tables],
            "needs": [
                {**asdict(n), "since": n.since.isoformat(timespec="seconds")} for n in self.needs
            ],
        }


def _too_old(service: str, table: str, version: int) -> RetentionTooShortError:
    return RetentionTooShortError(
        f"{service} still has to read {table} version {version}, which is no longer in the "
        "table's log: its files may already be gone; rebuild what it feeds from the table"
    )


def _ingested(
    config: PipelineConfig,
    state: StateReader,
    bronze: DeltaLog,
    entities: list[EntityConfig],
) -> dict[str, dict[str, int] | None]:
    """Per entity, the furthest the ingestor may have written its topic (None: unknown).

    Bronze's own newest record of the topic; without one, the last batch its group's
    checkpoint planned.
    """
    from cdc_cli.status import ingestor_checkpoint

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


def bronze_needs(config: PipelineConfig, source: StateReader | SparkSession) -> list[StreamNeed]:
    """What the merger still needs of bronze: per table, the oldest version it has to read.

    Every table of the pipeline, whatever the selection: bronze is one table. A table's
    need is the oldest bronze version after its progress that holds rows of it
    (:func:`cdc_cli.checkpoints.merger_backlog`); an idle table needs nothing, however
    old its progress.
    """
    state = state_reader(source)
    bronze = DeltaLog(state, config.layout.bronze())
    if bronze.latest is None:
        return []
    ingested = _ingested(config, state, bronze, list(config.entities))
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
        from confluent_kafka import KafkaException
        from elasticsearch import ApiError, TransportError

        from cdc_cli import status

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
            from cdc_cli.status import status_client

            self._es = status_client(self.config)
        return self._es

    def close(self) -> None:
        """Release the Elasticsearch client, if one was made."""
        if self._es is not None:
            self._es.close()


def silver_needs(
    config: PipelineConfig,
    entity: EntityConfig,
    source: StateReader | SparkSession,
    ignore_services: tuple[str, ...] = (),
    progress: PublisherProgress | None = None,
) -> list[StreamNeed]:
    """What the publishers still need of the entity's silver: the oldest version to read.

    Per publisher: the oldest version after its progress whose Change Data Feed holds
    changes; where a publisher that has not started will begin. ``progress`` reads the
    publishers' progress (one is made, and closed, when not given).
    """
    state = state_reader(source)
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
    source: StateReader | SparkSession,
    ignore_services: tuple[str, ...] = (),
) -> list[StreamNeed]:
    """What the merger needs of bronze and the publishers of the entities' silver tables.

    Read through ``source``, a reader or a SparkSession (read through :class:`SparkState`).
    """
    state = state_reader(source)
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
        hours = _log_retention_hours(state, path)
        if now - need.since > dt.timedelta(hours=hours):
            notices.append(
                f"{need.table}: {need.service} still has to read version {need.version}, "
                f"committed more than {LOG_RETENTION_PROPERTY} ({hours:g} hours) ago: Delta "
                "removes its commit from the log at the next log checkpoint, and the "
                f"service cannot read it then ({need.note})"
            )
    return notices


def _log_retention_hours(state: TableState, path: str) -> float:
    value = state.table_properties(path).get(LOG_RETENTION_PROPERTY)
    return DEFAULT_LOG_RETENTION_HOURS if value is None else interval_hours(str(value))


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
    hours = _log_retention_hours(state, bronze.path)
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


def compact(spark: SparkSession, path: str) -> tuple[int, int]:
    """OPTIMIZE (bin-packing) the table at ``path``: (files removed, files added).

    Safe beside a running merger: a compaction that loses a commit race is tried again.
    """
    from cdc_shared.tables import on_conflict_retry

    return on_conflict_retry(_compact)(spark, path)


def _compact(spark: SparkSession, path: str) -> tuple[int, int]:
    from delta.tables import DeltaTable

    metrics = DeltaTable.forPath(spark, path).optimize().executeCompaction().head()
    if metrics is None:
        return 0, 0
    m = metrics["metrics"]
    return int(m["numFilesRemoved"]), int(m["numFilesAdded"])


def interval_hours(text: str) -> float:
    """Hours in a Delta interval property such as ``interval 7 days`` or ``1 week 12 hours``.

    Delta reads these with Spark's interval syntax and refuses months and years for
    retentions; every other unit of that syntax is read here. Raises ValueError otherwise.
    """
    words = text.strip().lower().split()
    if words[:1] == ["interval"]:
        words = words[1:]
    if not words or len(words) % 2:
        raise ValueError(f"not an interval of <number> <unit> pairs: {text!r}")
    hours = 0.0
    for number, unit in zip(words[::2], words[1::2], strict=True):
        per_unit = _INTERVAL_UNITS.get(unit.removesuffix("s"))
        if per_unit is None or not re.fullmatch(r"[+-]?\d+(\.\d+)?", number):
            raise ValueError(f"not an interval Delta accepts for a retention: {text!r}")
        hours += float(number) * per_unit
    return hours


@dataclass(frozen=True)
class RetentionMinimum:
    """Delta's minimum VACUUM retention of one table, and where it comes from."""

    table: str  # e.g. "bronze/customers"
    hours: float
    source: str  # the property's value, or that it is Delta's default

    def __str__(self) -> str:
        return f"{self.table}: {self.hours:g} hours ({RETENTION_PROPERTY} {self.source})"


def retention_minimum(state: TableState, table: str, path: str) -> RetentionMinimum:
    """The table's ``delta.deletedFileRetentionDuration`` (unset: Delta's default).

    Raises RetentionTooShortError when the property cannot be read as an interval: VACUUM
    would not know how short is too short.
    """
    value = state.table_properties(path).get(RETENTION_PROPERTY)
    if value is None:
        return RetentionMinimum(table, DEFAULT_RETENTION_HOURS, "not set: Delta's default")
    try:
        return RetentionMinimum(table, interval_hours(str(value)), f"= {value!r}")
    except ValueError as exc:
        raise RetentionTooShortError(
            f"cannot tell Delta's minimum VACUUM retention of {table} ({path}): {exc}; set "
            f"the table's {RETENTION_PROPERTY} to e.g. 'interval 7 days'"
        ) from None


def check_vacuum_minimum(minimums: list[RetentionMinimum], hours: float) -> None:
    """Raise RetentionTooShortError naming every table ``hours`` is below Delta's minimum of."""
    short = [m for m in minimums if hours < m.hours]
    if short:
        raise RetentionTooShortError(
            f"refusing VACUUM with a retention of {hours:g} hours: below Delta's minimum of\n"
            + "\n".join(f"  {m}" for m in short)
            + "\nfiles younger than that may belong to a commit a running ingestor or merger "
            "has not finished, or to a version a stream is still reading: deleting them "
            "corrupts the table or fails the stream. Use --vacuum-hours "
            f"{math.ceil(max(m.hours for m in short))} or more; only with every service "
            "stopped, --force-short-retention"
        )


def _data_tables(config: PipelineConfig, entities: list[EntityConfig]) -> dict[str, str]:
    """The tables a running service commits data to: bronze and each entity's silver."""
    tables = {BRONZE: config.layout.bronze()}
    tables.update({f"silver/{e.name}": config.layout.silver(e.name) for e in entities})
    return tables


def check_services_stopped(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    short: list[RetentionMinimum],
    hours: float,
    quiet: dt.timedelta,
) -> None:
    """Raise ServicesMayRunError, with every sign, if a service may run (forced VACUUM)."""
    signs = signs_of_life(config, entities, _data_tables(config, entities), state, quiet)
    if signs:
        raise ServicesMayRunError(
            f"refusing --force-short-retention (VACUUM {hours:g} hours, below Delta's "
            f"minimum of {', '.join(str(m) for m in short)}): a service may be running:\n"
            + "\n".join(f"  {s}" for s in signs)
            + "\nstop every service (ingestor, merger, both publishers, `cdc run`) and retry "
            "once the quiet period has passed, or VACUUM with the table's minimum"
        )


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
    ingested = {} if bronze.latest is None else _ingested(config, state, bronze, entities)
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
                bronze.path, _INGESTED_AT, progress, bronze.latest, where
            )
        newest = state.column_max(bronze.path, _INGESTED_AT, bronze.latest, where, unmerged)
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
    spark: SparkSession | None = None,
) -> tuple[int, str]:
    """Expire the entity's tombstones as the merger does: (how many, which and why).

    A tombstone goes once the merger has merged events ingested ``hours`` after it was
    recorded (``merged``: from :func:`merged_ingest_times`), through the expiry the
    merger runs (``cdc_shared.tables.expire_tombstones``) on ``spark``. Without ``spark``
    (a dry run): count those that would go, by the same column and cutoff, and expire none.
    """
    if hours is None:
        return 0, "kept: merger.tombstone_retention_hours is null (tombstones never expire)"
    until, why = merged
    if until is None:
        return 0, why
    cutoff = until - dt.timedelta(hours=hours)
    path = config.layout.tombstones(entity.name)
    dry_run = spark is None
    if spark is None:
        expired = state.count_before(path, DELETED_AT, cutoff)
    else:
        from cdc_shared.tables import expire_tombstones

        expired = expire_tombstones(spark, path, cutoff)
    verb = "would expire" if dry_run else "expired"
    return expired, (
        f"{verb} those recorded before {cutoff.isoformat(timespec='seconds')}: {hours:g} "
        f"hours of bronze ingest time before the last merged event's, "
        f"{until.isoformat(timespec='seconds')}"
    )


def _vacuum(
    spark: SparkSession, path: str, hours: float, below_minimum: bool, dry_run: bool = False
) -> int | None:
    """VACUUM (``dry_run``: list what it would delete); the files deleted (or listed).

    Delta's own minimum check stays on unless a short retention was allowed.
    """
    from delta.tables import DeltaTable

    previous = {key: spark.conf.get(key, None) for key in (_RETENTION_CHECK, _VACUUM_LOGGING)}
    spark.conf.set(_RETENTION_CHECK, "false" if below_minimum else "true")
    spark.conf.set(_VACUUM_LOGGING, "true")
    try:
        if dry_run:
            listed = spark.sql(f"VACUUM delta.`{path}` RETAIN {hours!r} HOURS DRY RUN")
            return listed.count()
        table = DeltaTable.forPath(spark, path)
        table.vacuum(hours)
        last = table.history(1).select("operation", "operationMetrics").head()
    finally:
        for key, value in previous.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
    if last is None or last["operation"] != "VACUUM END":
        return None
    deleted = (last["operationMetrics"] or {}).get("numDeletedFiles")
    return None if deleted is None else int(deleted)


def _tables(config: PipelineConfig, entities: list[EntityConfig]) -> dict[str, str]:
    """The tables maintenance touches, by name: bronze, then each entity's silver, tombstones."""
    tables = {BRONZE: config.layout.bronze()}
    for entity in entities:
        tables[f"silver/{entity.name}"] = config.layout.silver(entity.name)
        tables[f"silver/_tombstones/{entity.name}"] = config.layout.tombstones(entity.name)
    return tables


def _table_state(
    config: PipelineConfig,
    engine: str,
    dry_run: bool,
    spark: SparkSession | None,
) -> tuple[TableState, SparkSession | None]:
    """How maintenance reads, and the session it writes through (see :func:`run_maintenance`).

    The session is None for a dry run without a JVM.
    """
    from cdc_cli.status import DELTA_RS, ENGINES

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    if dry_run and engine == DELTA_RS:
        from cdc_cli.delta_log import DeltaLogState

        return DeltaLogState(config), None
    from cdc_shared.spark import build_spark_session

    spark = spark or build_spark_session(config.spark, "cdc-maintenance")
    return SparkTables(spark), spark


def _table_needs(
    config: PipelineConfig,
    table: str,
    entity: EntityConfig | None,
    state: StateReader,
    ignore_services: tuple[str, ...],
) -> list[StreamNeed]:
    """What the services need of one table now (tombstones: nothing, they are read whole)."""
    if table == BRONZE:
        return [] if MERGER in ignore_services else bronze_needs(config, state)
    if entity is None or "/_tombstones/" in table:
        return []
    return silver_needs(config, entity, state, ignore_services)


def _needs_and_notices(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    tables: Mapping[str, str],
    ignore_services: tuple[str, ...],
    vacuum_hours: float | None,
) -> tuple[list[StreamNeed], list[str]]:
    """What the services need of the tables (checked against ``vacuum_hours``), and notices.

    Without VACUUM the needs only inform: a progress that cannot be read is a notice.
    """
    notices = legacy_notices(config, state)
    try:
        needs = stream_needs(config, entities, state, ignore_services)
    except ProgressUnknownError as unknown:
        if vacuum_hours is not None:
            raise
        needs = []
        notices.append(str(unknown))
    if vacuum_hours is not None:
        check_vacuum_retention(needs, vacuum_hours)
    now = dt.datetime.now(dt.UTC)
    notices += log_retention_notices(needs, state, tables, now)
    if MERGER not in ignore_services:
        notices += merger_log_notices(config, state, now)
    return needs, notices


def _check_minimums(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    minimums: list[RetentionMinimum],
    vacuum_hours: float,
    force_short_retention: bool,
    quiet: dt.timedelta,
) -> None:
    """Refuse a VACUUM retention below a table's Delta minimum.

    With ``force_short_retention`` it is allowed, and then only with every service
    stopped (``check_services_stopped``, with its ``quiet`` period).
    """
    short = [m for m in minimums if vacuum_hours < m.hours]
    if not force_short_retention:
        check_vacuum_minimum(minimums, vacuum_hours)
    elif short:
        check_services_stopped(config, entities, state, short, vacuum_hours, quiet)


def run_maintenance(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    *,
    optimize: bool = True,
    vacuum_hours: float | None = DEFAULT_RETENTION_HOURS,
    tombstones: bool = True,
    tombstone_retention_hours: float | None = None,
    ignore_services: tuple[str, ...] = (),
    writers_stopped: bool = False,
    force_short_retention: bool = False,
    quiet: dt.timedelta = DEFAULT_QUIET,
    dry_run: bool = False,
    spark: SparkSession | None = None,
    engine: str = "delta-rs",
) -> MaintenanceReport:
    """Check every retention first, then OPTIMIZE, VACUUM, expire tombstones.

    Bronze, shared by every entity, then each selected entity's silver and tombstones.
    ``dry_run``: the same checks and refusals, then what each step would do, changing
    nothing (see the module docstring). It reads as ``engine`` says (one of
    ``cdc_cli.status.ENGINES``): delta-rs, without a JVM, or spark, through ``spark`` or
    a session built from the configuration. A run reads and writes through Spark.

    ``vacuum_hours`` None skips VACUUM; ``tombstones`` False skips the tombstone tables.
    Tombstones expire by ``merger.tombstone_retention_hours`` or by a longer
    ``tombstone_retention_hours``. Before changing anything it raises
    RetentionTooShortError when a retention is below a table's Delta minimum (unless
    ``force_short_retention``), would delete what a service still has to read (or that
    cannot be told: ProgressUnknownError), or shortens the tombstone retention;
    ServicesMayRunError when a forced short retention meets signs of a running service.
    The needs and the service checks are repeated right before each VACUUM (OPTIMIZE may
    have taken long). On an ``s3a://`` root it needs ``writers_stopped`` (else
    WritersMayRunError, before anything runs).
    """
    entities = config.select_entities(entity_names)
    if s3a_bucket(config.storage_root) is not None and not writers_stopped and not dry_run:
        # Delta's S3 log store orders commits within one JVM only (docs/operations.md): a
        # commit of ours (OPTIMIZE, VACUUM's log entries, tombstone expiry) racing the
        # ingestor's or merger's could overwrite theirs.
        raise WritersMayRunError(
            "the storage root is on object storage, where maintenance must not commit "
            "beside the ingestor and merger: stop them, then pass --writers-stopped"
        )
    expiry_hours = tombstone_retention(
        config.merger.tombstone_retention_hours, tombstone_retention_hours
    )
    state, spark = _table_state(config, engine, dry_run, spark)
    tables = {
        name: path
        for name, path in _tables(config, entities).items()
        if (tombstones or "/_tombstones/" not in name) and state.table_version(path) is not None
    }
    every_entity = list(config.entities)  # a forced VACUUM of bronze concerns every writer
    minimums: dict[str, RetentionMinimum] = {}
    short: list[RetentionMinimum] = []
    if vacuum_hours is not None:
        minimums = {name: retention_minimum(state, name, path) for name, path in tables.items()}
        short = [m for m in minimums.values() if vacuum_hours < m.hours]
        _check_minimums(
            config,
            every_entity,
            state,
            [*minimums.values()],
            vacuum_hours,
            force_short_retention,
            quiet,
        )
    all_needs, notices = _needs_and_notices(
        config, entities, state, tables, ignore_services, vacuum_hours
    )
    expiring = [e for e in entities if f"silver/_tombstones/{e.name}" in tables]
    merged = merged_ingest_times(config, expiring, state) if expiry_hours is not None else {}

    below = {m.table for m in short}

    def vacuum(table: str, entity: EntityConfig | None) -> int | None:
        assert vacuum_hours is not None
        check_vacuum_retention(
            _table_needs(config, table, entity, state, ignore_services), vacuum_hours
        )
        if table in below:
            check_services_stopped(config, every_entity, state, short, vacuum_hours, quiet)
        if dry_run:
            return state.vacuum_dry_run(tables[table], vacuum_hours, minimums[table].hours)
        assert spark is not None
        return _vacuum(spark, tables[table], vacuum_hours, table in below)

    def optimized(table: str) -> tuple[int | None, int | None, int | None]:
        """OPTIMIZE's files removed and added, or (dry run) the data files it would read."""
        if not optimize:
            return None, None, None
        if dry_run:
            return None, None, state.data_file_count(tables[table])
        assert spark is not None
        return (*compact(spark, tables[table]), None)

    def maintain(table: str, entity: EntityConfig | None) -> None:
        removed, added, files = optimized(table)
        vacuumed = None if vacuum_hours is None else vacuum(table, entity)
        report.tables.append(TableResult(table, files, removed, added, vacuum_hours, vacuumed))

    report = MaintenanceReport(needs=all_needs, dry_run=dry_run, notices=notices)
    if BRONZE in tables:
        maintain(BRONZE, None)
    for entity in entities:
        if f"silver/{entity.name}" in tables:
            maintain(f"silver/{entity.name}", entity)
        table = f"silver/_tombstones/{entity.name}"
        if table in tables:
            writer = None if dry_run else spark
            expired, note = expire_by_ingest_time(
                config, entity, state, expiry_hours, merged.get(entity.name, (None, "")), writer
            )
            vacuumed = None if vacuum_hours is None else vacuum(table, entity)
            report.tables.append(
                TableResult(
                    table,
                    vacuum_retention_hours=vacuum_hours,
                    vacuumed_files=vacuumed,
                    tombstones_expired=expired,
                    tombstones_note=note,
                )
            )
    return report


def render(report: MaintenanceReport) -> str:
    """The report as text: notices, the services' needs, then one line per table."""
    now = dt.datetime.now(dt.UTC)
    lines = ["dry run: nothing was changed"] if report.dry_run else []
    lines.extend(f"note: {notice}" for notice in report.notices)
    lines.append("services still reading older versions:" if report.needs else "no service lags")
    lines.extend(
        f"  {n.table:<28} {n.service:<16} version {n.version} ({n.note}), "
        f"needs >= {math.ceil(n.hours(now))} h retention"
        for n in report.needs
    )
    for t in report.tables:
        parts = []
        if t.files is not None:
            parts.append(f"optimize would bin-pack {t.files} files")
        if t.optimized_files_removed is not None:
            parts.append(f"optimize {t.optimized_files_removed} -> {t.optimized_files_added} files")
        if t.tombstones_expired is not None:
            verb = "would expire" if report.dry_run else "expired"
            parts.append(f"{verb} {t.tombstones_expired} tombstones")
        if t.vacuum_retention_hours is not None:
            files = "?" if t.vacuumed_files is None else str(t.vacuumed_files)
            deleted = "would be deleted" if report.dry_run else "deleted"
            parts.append(f"vacuum {t.vacuum_retention_hours:g} h: {files} files {deleted}")
        lines.append(f"{t.table:<30} {'; '.join(parts) or 'nothing to do'}")
        if t.tombstones_note is not None:
            lines.append(f"{'':<30} tombstones {t.tombstones_note}")
    return "\n".join(lines)
