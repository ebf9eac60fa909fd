"""``cdc maintenance``: OPTIMIZE, VACUUM that never breaks a table or a stream, tombstone expiry.

VACUUM deletes data files that left the table (replaced by a MERGE or an OPTIMIZE, or
change-data files) longer ago than the retention. Two limits keep it safe:

- **Delta's minimum**, the table's ``delta.deletedFileRetentionDuration`` (Delta's
  default when unset: ``DEFAULT_RETENTION_HOURS``): a writer's files are unreferenced
  until its commit lands, and a reader may still be reading a version whose files a later
  commit removed; a shorter retention can delete either, corrupting a commit or failing a
  stream. Below it VACUUM is refused, unless
  ``force_short_retention`` is given and no service shows signs of running: no
  configured ``/health`` endpoint answers, and no data commit on bronze or silver and no
  progress in any service's checkpoint within the quiet period (:func:`signs_of_life`).
- **What the streams still need**: a stream that still has to read table version ``v``
  needs every file that version ``v`` or a later one added or referenced; such a file can
  only have left the table at a commit after ``v``. So the retention is safe for a stream
  when ``now - retention`` is not later than the commit time of ``v``, the oldest version
  the stream has not read completely (from its checkpoint; see :mod:`cdc_cli.checkpoints`),
  not counting commits that add no data (an OPTIMIZE, a VACUUM), which streams skip. Per
  table: ``bronze/<entity>`` is read by the merger; ``silver/<entity>`` by
  publisher-kafka and publisher-es (a publisher that has not started yet will read from
  its configured ``starting_version`` (default 0) or ``starting_timestamp``, so it holds
  VACUUM back to that point unless it is ignored as not deployed);
  ``silver/_tombstones/<entity>`` is read as a whole by the merger, never streamed.

Both are checked before anything runs, and again right before each VACUUM.

A dry run (``dry_run``) makes the same checks, refuses what a run would refuse, and
changes nothing: it lists the files each VACUUM would delete (by Delta's own rules for
``VACUUM ... DRY RUN``, so the count is the one a VACUUM right then would delete,
OPTIMIZE aside), the tombstones that would expire (counted by the same cutoff), and each
table's file count for OPTIMIZE, which Delta cannot plan without running it. It reads
through a :class:`TableState`: without a JVM by default
(:class:`cdc_cli.delta_log.DeltaLogState`: delta-rs, the streams' checkpoint files and
the tables' logs read directly), or through Spark (:class:`SparkTables`), as a run does.

Tombstones (deleted keys and the sequence of their delete) stop a late, older event
from resurrecting a deleted row. They expire as the merger expires them
(``merger.tombstone_retention_hours``; ``null`` keeps them): once the merger has merged
bronze events ingested that many hours after the tombstone, counted in bronze's ingest
time, not the wall clock, so a quiet or lagging pipeline keeps what its late events may
still need. A retention given here may only lengthen the configured one.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cdc_shared.config import (
    ChangeFeedConfig,
    EntityConfig,
    PipelineConfig,
    StreamingServiceConfig,
    s3a_bucket,
)
from cdc_shared.layout import MERGER, PUBLISHER_ES, PUBLISHER_KAFKA, SERVICES, display_name
from cdc_shared.silver import DELETED_AT
from cdc_shared.stream_checkpoint import entity_source

from cdc_cli.checkpoints import (
    SparkState,
    StateReader,
    as_utc,
    commit_file_counter,
    data_commits_from,
    delta_position,
    last_committed_batch,
    state_reader,
)

if TYPE_CHECKING:  # a dry run reads without PySpark: it is imported where a session is used
    from pyspark.sql import SparkSession

SAFETY_MARGIN = dt.timedelta(minutes=5)
DEFAULT_RETENTION_HOURS = 168.0  # Delta's default deletedFileRetentionDuration: 7 days
DEFAULT_QUIET = dt.timedelta(minutes=10)
SILVER_READERS = (PUBLISHER_KAFKA, PUBLISHER_ES)
RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
HEALTH_TIMEOUT_S = 2.0
_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_VACUUM_LOGGING = "spark.databricks.delta.vacuum.logging.enabled"
_INGESTED_AT = "ingested_at"  # bronze's ingest time (cdc_ingestor.decode)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
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


class WritersMayRunError(RuntimeError):
    """Maintenance would commit to object-storage tables another process may write."""


class ServicesMayRunError(RuntimeError):
    """A retention below Delta's minimum was forced while a service may still run."""


class TableState(StateReader, Protocol):
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

    def newest_modification(self, folder: str) -> dt.datetime | None:
        """The newest modification time of an entry of ``folder``; None when it has none."""
        ...

    def column_max(self, path: str, column: str, version: int) -> Any:
        """The greatest value of ``column`` in version ``version`` of the table at ``path``."""
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

    def column_max(self, path: str, column: str, version: int) -> Any:
        """The greatest value of ``column`` in version ``version`` of the table at ``path``."""
        from pyspark.sql import functions as F

        rows = self.spark.read.format("delta").option("versionAsOf", version).load(path)
        row = rows.agg(F.max(column)).head()
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
    """Every table touched, and the stream needs the retention was checked against."""

    tables: list[TableResult] = field(default_factory=list)
    needs: list[StreamNeed] = field(default_factory=list)
    dry_run: bool = False  # nothing was changed: the figures are what a run would do

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``cdc maintenance --json``)."""
        return {
            "dry_run": self.dry_run,
            "tables": [asdict(t) for t in self.tables],
            "needs": [
                {**asdict(n), "since": n.since.isoformat(timespec="seconds")} for n in self.needs
            ],
        }


def _need_from_checkpoint(
    state: StateReader,
    service: str,
    table: str,
    path: str,
    checkpoint: str,
    change_feed: bool,
    entity: str,
) -> tuple[bool, StreamNeed | None]:
    """(whether the stream started, what it needs: None when it is caught up).

    Versions that add no data (OPTIMIZE, VACUUM) are skipped by a stream reading changes,
    so the need starts at the first data-changing version it has not read; a stream still
    reading a snapshot needs that snapshot's version whatever it was. ``change_feed``: the
    stream reads the table's Change Data Feed (the publishers) rather than its added files.
    """
    batch = last_committed_batch(state, checkpoint)
    offset = None if batch is None else entity_source(batch, state, checkpoint, entity)
    if batch is None or offset is None:
        return False, None
    position = delta_position(offset, commit_file_counter(state, path, change_feed))
    history = state.history(path)
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


def stream_needs(
    config: PipelineConfig,
    entity: EntityConfig,
    source: StateReader | SparkSession,
    ignore_services: tuple[str, ...] = (),
) -> list[StreamNeed]:
    """What the merger needs of bronze and the publishers of silver, for one entity.

    Read through ``source``, a reader or a SparkSession (read through :class:`SparkState`).
    """
    state = state_reader(source)
    needs: list[StreamNeed] = []
    bronze = config.layout.bronze(entity.name)
    if MERGER not in ignore_services and state.table_version(bronze) is not None:
        _, need = _need_from_checkpoint(
            state,
            MERGER,
            f"bronze/{entity.name}",
            bronze,
            config.checkpoint_path(MERGER, entity.name),
            change_feed=False,
            entity=entity.name,
        )
        # A merger that has not started reads bronze's latest snapshot when it does.
        if need is not None:
            needs.append(need)
    silver = config.layout.silver(entity.name)
    if state.table_version(silver) is not None:
        settings: dict[str, ChangeFeedConfig] = {
            PUBLISHER_KAFKA: config.publisher_kafka,
            PUBLISHER_ES: config.publisher_es,
        }
        for service in SILVER_READERS:
            if service in ignore_services:
                continue
            table = f"silver/{entity.name}"
            started, need = _need_from_checkpoint(
                state,
                service,
                table,
                silver,
                config.checkpoint_path(service, entity.name),
                change_feed=True,
                entity=entity.name,
            )
            if not started:
                need = _unstarted_publisher_need(state, service, table, silver, settings[service])
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


def health_endpoints(config: PipelineConfig) -> list[tuple[str, str]]:
    """(service, ``/health`` URL) of every service the configuration gives a metrics port.

    Each service's own port and the one of ``cdc run`` (the application), on the
    configured ``metrics_host``; a wildcard bind address is probed on this host.
    """
    sections: list[StreamingServiceConfig] = [getattr(config, s) for s in SERVICES]
    binds = [
        (display_name(service), section.metrics_host, section.metrics_port)
        for service, section in zip(SERVICES, sections, strict=True)
    ]
    application = config.application
    binds.append(("cdc run", application.metrics_host, application.metrics_port))
    endpoints = []
    for name, bind, port in binds:
        if not port:
            continue
        host = "127.0.0.1" if bind in _WILDCARD_HOSTS else bind
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        endpoints.append((name, f"http://{host}:{port}/health"))
    return endpoints


def health_answer(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """What ``url`` says about a service there; None when no service of ours answers.

    A service's ``/health`` answers 200 or 503 (running, or starting or failing): both
    are a running service. A refused connection, or another HTTP answer (some other
    server on that port), is none. Anything else (a timeout, an unknown host) cannot
    rule a service out, so it is reported too. Proxies from the environment are ignored.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as answer:
            status = int(answer.status)
    except urllib.error.HTTPError as exc:
        status = exc.code
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return None
        return f"no clear answer ({exc.reason})"
    except OSError as exc:  # a timeout or reset while reading the answer
        return f"no clear answer ({exc})"
    return f"answers {status}" if status in (200, 503) else None


def signs_of_life(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    quiet: dt.timedelta = DEFAULT_QUIET,
    now: dt.datetime | None = None,
) -> list[str]:
    """What suggests a service may be running; empty when nothing does.

    A live writer lease (``cdc_shared.writer_lease``); a configured ``/health`` endpoint
    that answers; a data commit on an entity's bronze (the ingestor) or silver (the
    merger) within ``quiet``; a stream checkpoint of any
    service for an entity that planned or committed a micro-batch within ``quiet``
    (the publishers, which write no table). OPTIMIZE and VACUUM commits do not count: they
    add no data and are maintenance's own. A service idle for longer than ``quiet`` whose
    ``/health`` cannot be reached from here is not seen: that is what the operator's
    ``--force-short-retention`` vouches for. Leases are read the way ``state`` reads
    files (without a JVM from object storage too).
    """
    from cdc_shared.writer_lease import live_leases

    def read_lease(path: str) -> bytes | None:
        text = state.read_text_if_exists(path)
        return None if text is None else text.encode()

    now = now or dt.datetime.now(dt.UTC)
    since = now - quiet
    signs = live_leases(config.storage_root, SERVICES, [e.name for e in entities], read_lease)
    for service, url in health_endpoints(config):
        answer = health_answer(url)
        if answer is not None:
            signs.append(f"{service}: {url} {answer}")
    minutes = f"{quiet.total_seconds() / 60:g} minutes"
    for entity in entities:
        tables = {
            f"bronze/{entity.name}": config.layout.bronze(entity.name),
            f"silver/{entity.name}": config.layout.silver(entity.name),
        }
        for table, path in tables.items():
            if state.table_version(path) is None:
                continue
            written = data_commits_from(state.history(path), 0)
            if written and written[-1].timestamp > since:
                last = written[-1]
                signs.append(
                    f"{table}: {last.operation} committed version {last.version} at "
                    f"{last.timestamp.isoformat(timespec='seconds')}, within {minutes}"
                )
        for service in SERVICES:
            checkpoint = config.checkpoint_path(service, entity.name).rstrip("/")
            progressed = [
                state.newest_modification(f"{checkpoint}/{d}") for d in ("offsets", "commits")
            ]
            latest = max((t for t in progressed if t is not None), default=None)
            if latest is not None and latest > since:
                signs.append(
                    f"{display_name(service)}'s checkpoint for {entity.name} progressed at "
                    f"{latest.isoformat(timespec='seconds')}, within {minutes}"
                )
    return signs


def check_services_stopped(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    short: list[RetentionMinimum],
    hours: float,
    quiet: dt.timedelta,
) -> None:
    """Raise ServicesMayRunError, with every sign, if a service may run (forced VACUUM)."""
    signs = signs_of_life(config, entities, state, quiet)
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


def merged_ingest_time(
    config: PipelineConfig, entity: EntityConfig, state: TableState
) -> dt.datetime | None:
    """The latest bronze ingest time among the events the merger has merged.

    The clock the merger ages tombstones by (``EntityMerge.expire_tombstones``: the latest
    ingest time of its batch). Bronze's snapshot just before the first data commit the
    merger has not read completely holds exactly what it merged (the commits between add
    no data), and VACUUM keeps that snapshot's files while the merger needs the next one.
    The history is read before the checkpoint, so a commit landing meanwhile is not taken
    for merged. None when the merger has merged nothing yet (or is still reading its first
    snapshot).
    """
    bronze = config.layout.bronze(entity.name)
    if state.table_version(bronze) is None:
        return None
    history = state.history(bronze)
    checkpoint = config.checkpoint_path(MERGER, entity.name)
    batch = last_committed_batch(state, checkpoint)
    offset = None if batch is None else entity_source(batch, state, checkpoint, entity.name)
    if batch is None or offset is None:
        return None
    position = delta_position(offset, commit_file_counter(state, bronze, False))
    if position.snapshot:
        return None
    unread = data_commits_from(history, position.next_version)
    merged = unread[0].version - 1 if unread else max(history)
    if merged < min(history):
        return None
    newest = state.column_max(bronze, _INGESTED_AT, merged)
    return None if newest is None else as_utc(newest)


def expire_by_ingest_time(
    config: PipelineConfig,
    entity: EntityConfig,
    state: TableState,
    hours: float | None,
    spark: SparkSession | None = None,
) -> tuple[int, str]:
    """Expire the entity's tombstones as the merger does: (how many, which and why).

    A tombstone goes once the merger has merged events ingested ``hours`` after it was
    recorded (:func:`merged_ingest_time`), through the merger's own ``expire_tombstones``
    on ``spark``. Without ``spark`` (a dry run): count those that would go, by the same
    column and cutoff, and expire none.
    """
    if hours is None:
        return 0, "kept: merger.tombstone_retention_hours is null (tombstones never expire)"
    until = merged_ingest_time(config, entity, state)
    if until is None:
        return 0, "kept: the merger has merged nothing yet"
    cutoff = until - dt.timedelta(hours=hours)
    path = config.layout.tombstones(entity.name)
    dry_run = spark is None
    if spark is None:
        expired = state.count_before(path, DELETED_AT, cutoff)
    else:
        from cdc_merger.apply import expire_tombstones

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


def _tables(config: PipelineConfig, entity: EntityConfig) -> dict[str, str]:
    """The tables maintenance touches for ``entity``, by name: bronze, silver, tombstones."""
    return {
        f"bronze/{entity.name}": config.layout.bronze(entity.name),
        f"silver/{entity.name}": config.layout.silver(entity.name),
        f"silver/_tombstones/{entity.name}": config.layout.tombstones(entity.name),
    }


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

    ``dry_run``: the same checks and refusals, then what each step would do, changing
    nothing (see the module docstring). It reads as ``engine`` says (one of
    ``cdc_cli.status.ENGINES``): delta-rs, without a JVM, or spark, through ``spark`` or
    a session built from the configuration. A run reads and writes through Spark.

    ``vacuum_hours`` None skips VACUUM; ``tombstones`` False skips the tombstone tables.
    Tombstones expire by ``merger.tombstone_retention_hours`` or by a longer
    ``tombstone_retention_hours``. Before changing anything it raises
    RetentionTooShortError when a retention is below a table's Delta minimum (unless
    ``force_short_retention``), would break a stream, or shortens the tombstone
    retention; ServicesMayRunError when a forced short retention meets signs of a running
    service. The stream and service checks are repeated right before each VACUUM
    (OPTIMIZE may have taken long). On an ``s3a://`` root it needs ``writers_stopped``
    (else WritersMayRunError, before anything runs).
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
        for entity in entities
        for name, path in _tables(config, entity).items()
        if (tombstones or "/_tombstones/" not in name) and state.table_version(path) is not None
    }
    minimums: dict[str, RetentionMinimum] = {}
    short: list[RetentionMinimum] = []
    if vacuum_hours is not None:
        minimums = {name: retention_minimum(state, name, path) for name, path in tables.items()}
        short = [m for m in minimums.values() if vacuum_hours < m.hours]
        _check_minimums(
            config,
            entities,
            state,
            [*minimums.values()],
            vacuum_hours,
            force_short_retention,
            quiet,
        )
    all_needs = [n for e in entities for n in stream_needs(config, e, state, ignore_services)]
    if vacuum_hours is not None:
        check_vacuum_retention(all_needs, vacuum_hours)

    below = {m.table for m in short}

    def vacuum(entity: EntityConfig, table: str) -> int | None:
        assert vacuum_hours is not None
        if "/_tombstones/" not in table:  # the merger reads tombstones whole, never streamed
            fresh = stream_needs(config, entity, state, ignore_services)
            check_vacuum_retention([n for n in fresh if n.table == table], vacuum_hours)
        if table in below:
            check_services_stopped(config, entities, state, short, vacuum_hours, quiet)
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

    report = MaintenanceReport(needs=all_needs, dry_run=dry_run)
    for entity in entities:
        for table in (f"bronze/{entity.name}", f"silver/{entity.name}"):
            if table not in tables:
                continue
            removed, added, files = optimized(table)
            vacuumed = None if vacuum_hours is None else vacuum(entity, table)
            report.tables.append(TableResult(table, files, removed, added, vacuum_hours, vacuumed))
        table = f"silver/_tombstones/{entity.name}"
        if table in tables:
            writer = None if dry_run else spark
            expired, note = expire_by_ingest_time(config, entity, state, expiry_hours, writer)
            vacuumed = None if vacuum_hours is None else vacuum(entity, table)
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
    """The report as text: the streams' needs, then one line per table."""
    now = dt.datetime.now(dt.UTC)
    lines = ["dry run: nothing was changed"] if report.dry_run else []
    lines.append("streams still reading older versions:" if report.needs else "no stream lags")
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
