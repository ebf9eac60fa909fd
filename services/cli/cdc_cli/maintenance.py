"""``cdc maintenance``: OPTIMIZE, VACUUM that never breaks a stream, and tombstone expiry.

VACUUM deletes data files that left the table (replaced by a MERGE or an OPTIMIZE, or
change-data files) longer ago than the retention. A stream that still has to read table
version ``v`` needs every file that version ``v`` or a later one added or referenced; such
a file can only have left the table at a commit after ``v``. So the retention is safe for
a stream when ``now - retention`` is not later than the commit time of ``v``, the oldest
version the stream has not read completely (from its checkpoint; see
:mod:`cdc_cli.checkpoints`), not counting commits that add no data (an OPTIMIZE, a
VACUUM), which streams skip. Per table:

- ``bronze/<entity>`` is read by the merger;
- ``silver/<entity>`` by publisher-kafka and publisher-es (a publisher that has not
  started yet will read from its configured ``starting_version`` (default 0) or
  ``starting_timestamp``, so it holds VACUUM back to that point unless it is ignored as
  not deployed);
- ``silver/_tombstones/<entity>`` is read as a whole by the merger, never streamed.

A retention shorter than the slowest stream needs (plus a safety margin for the time
VACUUM takes to start) is refused before anything runs.

Tombstones (deleted keys and the sequence of their delete) stop a late, older event
from resurrecting a deleted row. Expiring them deletes rows whose ``deleted_at`` is older
than the tombstone retention; that is refused while the merger lags by more than the
retention, since the events it has not merged yet may be exactly such late events.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from cdc_merger.apply import expire_tombstones
from cdc_shared.config import ChangeFeedConfig, EntityConfig, PipelineConfig, s3a_bucket
from cdc_shared.tables import on_conflict_retry
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from cdc_cli.checkpoints import (
    commit_file_counter,
    data_commits_from,
    delta_position,
    is_delta_table,
    last_committed_batch,
    table_history,
)

SAFETY_MARGIN = dt.timedelta(minutes=5)
DEFAULT_RETENTION_HOURS = 168.0  # Delta's default deletedFileRetentionDuration: 7 days
SILVER_READERS = ("publisher_kafka", "publisher_es")
_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_VACUUM_LOGGING = "spark.databricks.delta.vacuum.logging.enabled"


class RetentionTooShortError(RuntimeError):
    """A requested retention would delete files (or tombstones) a stream still needs."""


class WritersMayRunError(RuntimeError):
    """Maintenance would commit to object-storage tables another process may write."""


@dataclass(frozen=True)
class StreamNeed:
    """The oldest point of a table a stream still has to read, and since when."""

    service: str
    table: str  # e.g. "silver/customers"
    version: int | None  # the oldest version not read completely; None: from a timestamp
    since: dt.datetime  # commit time of that version (or the configured timestamp)
    note: str

    def hours(self, now: dt.datetime) -> float:
        """The shortest retention (hours) that keeps what this stream needs, with margin."""
        return max(0.0, (now - self.since + SAFETY_MARGIN).total_seconds() / 3600)


@dataclass(frozen=True)
class TableResult:
    """What maintenance did to one table."""

    table: str
    optimized_files_removed: int | None = None
    optimized_files_added: int | None = None
    vacuum_retention_hours: float | None = None
    vacuumed_files: int | None = None
    tombstones_expired: int | None = None


@dataclass(frozen=True)
class MaintenanceReport:
    """Every table touched, and the stream needs the retention was checked against."""

    tables: list[TableResult] = field(default_factory=list)
    needs: list[StreamNeed] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``cdc maintenance --json``)."""
        return {
            "tables": [asdict(t) for t in self.tables],
            "needs": [
                {**asdict(n), "since": n.since.isoformat(timespec="seconds")} for n in self.needs
            ],
        }


def _need_from_checkpoint(
    spark: SparkSession,
    service: str,
    table: str,
    path: str,
    checkpoint: str,
    change_feed: bool,
) -> tuple[bool, StreamNeed | None]:
    """(whether the stream started, what it needs: None when it is caught up).

    Versions that add no data (OPTIMIZE, VACUUM) are skipped by a stream reading changes,
    so the need starts at the first data-changing version it has not read; a stream still
    reading a snapshot needs that snapshot's version whatever it was. ``change_feed``: the
    stream reads the table's Change Data Feed (the publishers) rather than its added files.
    """
    batch = last_committed_batch(spark, checkpoint)
    if batch is None or not batch.sources:
        return False, None
    position = delta_position(batch.sources[0], commit_file_counter(spark, path, change_feed))
    history = table_history(spark, path)
    note = f"checkpoint batch {batch.batch_id}"
    if position.snapshot and position.next_version in history:
        commit = history[position.next_version]
        return True, StreamNeed(service, table, commit.version, commit.timestamp, note)
    if position.next_version > max(history, default=-1):
        return True, None  # caught up: it needs only versions still to come
    if position.next_version < min(history):
        raise RetentionTooShortError(
            f"{service} still has to read {table} version {position.next_version}, which is "
            "no longer in the table's history: its files may already be gone; rebuild that "
            "stream"
        )
    unread = data_commits_from(history, position.next_version)
    if not unread:
        return True, None
    return True, StreamNeed(service, table, unread[0].version, unread[0].timestamp, note)


def _unstarted_publisher_need(
    spark: SparkSession, service: str, table: str, path: str, settings: ChangeFeedConfig
) -> StreamNeed | None:
    """Where a publisher that has not started will begin reading silver."""
    if settings.starting_timestamp is not None:
        since = dt.datetime.fromisoformat(settings.starting_timestamp)
        since = since.replace(tzinfo=dt.UTC) if since.tzinfo is None else since  # Spark: UTC
        return StreamNeed(service, table, None, since, "not started: starting_timestamp")
    version = settings.starting_version or 0
    history = table_history(spark, path)
    if version > max(history, default=-1):
        return None
    since = history[max(version, min(history))].timestamp
    return StreamNeed(service, table, version, since, f"not started: reads from version {version}")


def stream_needs(
    config: PipelineConfig,
    entity: EntityConfig,
    spark: SparkSession,
    ignore_services: tuple[str, ...] = (),
) -> list[StreamNeed]:
    """What the merger needs of bronze and the publishers of silver, for one entity."""
    needs: list[StreamNeed] = []
    bronze = config.layout.bronze(entity.name)
    if "merger" not in ignore_services and is_delta_table(spark, bronze):
        _, need = _need_from_checkpoint(
            spark,
            "merger",
            f"bronze/{entity.name}",
            bronze,
            config.checkpoint_path("merger", entity.name),
            change_feed=False,
        )
        # A merger that has not started reads bronze's latest snapshot when it does.
        if need is not None:
            needs.append(need)
    silver = config.layout.silver(entity.name)
    if is_delta_table(spark, silver):
        settings: dict[str, ChangeFeedConfig] = {
            "publisher_kafka": config.publisher_kafka,
            "publisher_es": config.publisher_es,
        }
        for service in SILVER_READERS:
            if service in ignore_services:
                continue
            table = f"silver/{entity.name}"
            started, need = _need_from_checkpoint(
                spark,
                service,
                table,
                silver,
                config.checkpoint_path(service, entity.name),
                change_feed=True,
            )
            if not started:
                need = _unstarted_publisher_need(spark, service, table, silver, settings[service])
            if need is not None:
                needs.append(need)
    return needs


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
            "that streams have not read yet:\n"
            + "\n".join(lines)
            + "\nlet those streams catch up (see `cdc status`), or use a longer --vacuum-hours"
        )


def check_tombstone_retention(
    needs: list[StreamNeed], hours: float, now: dt.datetime | None = None
) -> None:
    """Refuse expiring tombstones younger than the merger's lag (late events still unmerged)."""
    now = now or dt.datetime.now(dt.UTC)
    lagging = [n for n in needs if n.service == "merger" and hours < n.hours(now)]
    if lagging:
        n = lagging[0]
        raise RetentionTooShortError(
            f"refusing to expire tombstones older than {hours:g} hours: the merger has not "
            f"merged {n.table} since version {n.version} (committed "
            f"{n.since.isoformat(timespec='seconds')}); those events could resurrect keys "
            f"whose tombstones would be gone. Use at least {math.ceil(n.hours(now))} hours "
            "or let the merger catch up"
        )


@on_conflict_retry
def compact(spark: SparkSession, path: str) -> tuple[int, int]:
    """OPTIMIZE (bin-packing) the table at ``path``: (files removed, files added).

    Safe beside a running merger: a compaction that loses a commit race is tried again.
    """
    metrics = DeltaTable.forPath(spark, path).optimize().executeCompaction().head()
    if metrics is None:
        return 0, 0
    m = metrics["metrics"]
    return int(m["numFilesRemoved"]), int(m["numFilesAdded"])


def _vacuum(spark: SparkSession, path: str, hours: float) -> int | None:
    """VACUUM with Delta's own 7-day floor lifted (our stream check replaced it)."""
    previous = {key: spark.conf.get(key, None) for key in (_RETENTION_CHECK, _VACUUM_LOGGING)}
    spark.conf.set(_RETENTION_CHECK, "false")
    spark.conf.set(_VACUUM_LOGGING, "true")
    try:
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


def _expire_tombstones(spark: SparkSession, path: str, hours: float) -> int:
    return expire_tombstones(spark, path, dt.datetime.now(dt.UTC) - dt.timedelta(hours=hours))


def run_maintenance(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    *,
    optimize: bool = True,
    vacuum_hours: float | None = DEFAULT_RETENTION_HOURS,
    tombstone_retention_hours: float | None = DEFAULT_RETENTION_HOURS,
    ignore_services: tuple[str, ...] = (),
    writers_stopped: bool = False,
    spark: SparkSession | None = None,
) -> MaintenanceReport:
    """Check every retention against the streams first, then OPTIMIZE, VACUUM, expire.

    ``None`` for a retention skips that step. Raises RetentionTooShortError, before
    changing anything, when a retention would break a stream; the check is repeated right
    before each VACUUM (OPTIMIZE may have taken long). On an ``s3a://`` root it needs
    ``writers_stopped`` (else WritersMayRunError, before anything runs).
    """
    from cdc_shared.spark import build_spark_session

    entities = config.select_entities(entity_names)
    if s3a_bucket(config.storage_root) is not None and not writers_stopped:
        # Delta's S3 log store orders commits within one JVM only (docs/operations.md): a
        # commit of ours (OPTIMIZE, VACUUM's log entries, tombstone expiry) racing the
        # ingestor's or merger's could overwrite theirs.
        raise WritersMayRunError(
            "the storage root is on object storage, where maintenance must not commit "
            "beside the ingestor and merger: stop them, then pass --writers-stopped"
        )
    spark = spark or build_spark_session(config.spark, "cdc-maintenance")
    needs = {e.name: stream_needs(config, e, spark, ignore_services) for e in entities}
    all_needs = [n for per_entity in needs.values() for n in per_entity]
    if vacuum_hours is not None:
        check_vacuum_retention(all_needs, vacuum_hours)
    if tombstone_retention_hours is not None:
        check_tombstone_retention(all_needs, tombstone_retention_hours)

    report = MaintenanceReport(needs=all_needs)
    for entity in entities:
        tombstones = config.layout.tombstones(entity.name)
        layers = {"bronze": config.layout.bronze, "silver": config.layout.silver}
        for layer, path_of in layers.items():
            path = path_of(entity.name)
            if not is_delta_table(spark, path):
                continue
            removed = added = vacuumed = None
            if optimize:
                removed, added = compact(spark, path)
            if vacuum_hours is not None:
                table = f"{layer}/{entity.name}"
                fresh = stream_needs(config, entity, spark, ignore_services)
                check_vacuum_retention([n for n in fresh if n.table == table], vacuum_hours)
                vacuumed = _vacuum(spark, path, vacuum_hours)
            report.tables.append(
                TableResult(f"{layer}/{entity.name}", removed, added, vacuum_hours, vacuumed)
            )
        if tombstone_retention_hours is not None and is_delta_table(spark, tombstones):
            expired = _expire_tombstones(spark, tombstones, tombstone_retention_hours)
            vacuumed = None
            if vacuum_hours is not None:
                vacuumed = _vacuum(spark, tombstones, vacuum_hours)  # read whole, never streamed
            report.tables.append(
                TableResult(
                    f"silver/_tombstones/{entity.name}",
                    vacuum_retention_hours=vacuum_hours,
                    vacuumed_files=vacuumed,
                    tombstones_expired=expired,
                )
            )
    return report


def render(report: MaintenanceReport) -> str:
    """The report as text: the streams' needs, then one line per table."""
    now = dt.datetime.now(dt.UTC)
    lines = ["streams still reading older versions:" if report.needs else "no stream lags"]
    lines.extend(
        f"  {n.table:<28} {n.service:<16} version {n.version} ({n.note}), "
        f"needs >= {math.ceil(n.hours(now))} h retention"
        for n in report.needs
    )
    for t in report.tables:
        parts = []
        if t.optimized_files_removed is not None:
            parts.append(f"optimize {t.optimized_files_removed} -> {t.optimized_files_added} files")
        if t.tombstones_expired is not None:
            parts.append(f"expired {t.tombstones_expired} tombstones")
        if t.vacuum_retention_hours is not None:
            files = "?" if t.vacuumed_files is None else str(t.vacuumed_files)
            parts.append(f"vacuum {t.vacuum_retention_hours:g} h: {files} files deleted")
        lines.append(f"{t.table:<30} {'; '.join(parts) or 'nothing to do'}")
    return "\n".join(lines)
