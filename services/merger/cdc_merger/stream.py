"""The merger's stream of a group of tables: bronze -> each table's silver (and history).

One Delta stream over bronze reads the group's entities' rows (only their ``entity``
column: which tables changed, and how much). Each micro-batch offers every table it
changed to the group's work queue (``cdc_shared.streaming.queue``) up to the batch's last
bronze version; each table due is then written from its own progress (silver's log) by
:class:`cdc_merger.merging.TableMerge`, and its history after it. Silver's new versions
are recorded in ``silver/_versions`` (:class:`SilverVersions`) as they commit: what the
publishers read.

At start, each table's progress is read from silver's and the history's logs (no JVM);
a table behind bronze (written in no batch before a stop, held by an earlier run, or
taken up new) is found by one look at bronze's change feed since the oldest progress,
and written from where it stood. A table that tables of releases before one bronze fed
first drains what it had not merged of them (:mod:`cdc_merger.legacy`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from cdc_shared.clients.delta_rs import read_logs, transaction_versions
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import interval_seconds
from cdc_shared.contracts import bronze
from cdc_shared.contracts.erasure import ErasureRequest
from cdc_shared.contracts.layout import MERGER_PROGRESS_APP
from cdc_shared.contracts.silver_side_tables import SILVER_VERSIONS_SCHEMA
from cdc_shared.contracts.stream_checkpoint import last_committed_batch, parse_offsets
from cdc_shared.jvm.bridge import HadoopFiles, delta_version
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.streaming.failures import Failure
from cdc_shared.streaming.groups import TableGroup
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.queue import BatchWrites, TableQueue
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.streaming.tables import (
    ensure_table,
    on_conflict_retry,
    table_properties,
    wait_for_table,
)
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_merger.erasure import ErasureWatch
from cdc_merger.legacy import drain_legacy_bronze
from cdc_merger.merging import SERVICE, TableMerge, ensure_quarantine

log = logging.getLogger("cdc_merger")
#: How the queue names a table's history write: ``<entity>/history``.
HISTORY = "/history"
#: How far behind bronze an idle table's recorded progress may fall (``_note_idle_progress``).
IDLE_PROGRESS_VERSIONS = 1000
IDLE_PROGRESS_PER_BATCH = 4


def bronze_end(offset: Any) -> int:
    """The last bronze version a Delta source offset covers (-1: none).

    Delta's offset names a version and a file index in it; a negative index stands
    before the version's files, so the version before is the last one read.
    """
    version, index = int(offset["reservoirVersion"]), int(offset["index"])
    return version - 1 if index < 0 else version


class SilverVersions:
    """Records silver's new versions in ``silver/_versions`` (for the publishers).

    A table's write notes its entity; a thread of its own appends the versions noted
    since its last append (one commit for all, the version each silver has then), so a
    hot table's commit is recorded while the batch goes on; ``flush`` waits until what
    was noted is recorded (each batch ends with it). Recorded twice is harmless: a
    publisher publishes what silver's feed holds past its own progress.
    """

    def __init__(self, spark: SparkSession, config: PipelineConfig) -> None:
        self.spark = spark
        self.config = config
        self.path = config.layout.silver_versions()
        self._noted: dict[str, int | None] = {}  # entity -> its version, if known
        self._lock = threading.Lock()
        self._appending = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="silver-versions", daemon=True)

    def start(self) -> None:
        """Make the table unless it exists; start the thread."""
        ensure_table(self.spark, self.path, SILVER_VERSIONS_SCHEMA, {"delta.appendOnly": "true"})
        if not self._thread.is_alive():
            self._thread.start()

    def note(self, entity: str, version: int | None = None) -> None:
        """``entity``'s silver has a new version (recorded soon), ``version`` if known.

        Unknown, it is read from the table's log as this process last committed or
        loaded it (no Spark job).
        """
        with self._lock:
            self._noted[entity] = version
        self._wake.set()

    def flush(self) -> None:
        """Record every version noted so far; raise what the append raised."""
        with self._appending:
            with self._lock:
                noted, self._noted = self._noted, {}
            if not noted:
                return
            now = dt.datetime.now(dt.UTC)
            silver = self.config.layout.silver
            rows = [
                (e, v if v is not None else delta_version(self.spark, silver(e)), now)
                for e, v in sorted(noted.items())
            ]
            _append(frame_from_rows(self.spark, rows, SILVER_VERSIONS_SCHEMA), self.path)

    def stop(self) -> None:
        """Stop the thread (what was noted is recorded by the last ``flush``)."""
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # the batch's own flush raises it
                log.exception("recording silver's versions failed; the batch's end retries")


@on_conflict_retry
def _append(rows: DataFrame, path: str) -> None:
    rows.coalesce(1).write.format("delta").mode("append").save(path)


@dataclass(eq=False)
class GroupMerge:
    """A group's stream: bronze's rows of its entities into each one's silver."""

    spark: SparkSession
    config: PipelineConfig
    group: TableGroup
    runner: StreamRunner
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)

    def __post_init__(self) -> None:
        self.bronze_path = self.config.layout.bronze()
        self.checkpoint = self.config.layout.checkpoint(SERVICE, self.group.name)
        self.versions = SilverVersions(self.spark, self.config)
        self.runner.on_close(self.versions.stop)
        self.tables: dict[str, TableMerge] = {}
        self.silver_versions: dict[str, int] = {}  # as read at start
        self._between: Callable[[], None] | None = None  # stops the writes between batches
        self.queue = TableQueue(
            self.spark,
            self.config.merger,
            self._write,
            self._table_failure,
            self.runner.hold_table,
            drain=self.group.once,
        )
        for entity in self.group.entities:
            self.add(entity)
        self.erasure_watch = ErasureWatch(
            self.config,
            {name: t.erasures for name, t in self.tables.items()},
            {name for name, t in self.tables.items() if t.layout.history is not None},
            self._offer_erasure,
        )

    def add(self, entity: EntityConfig) -> None:
        """Take up ``entity``: its rows are read from the query's next start."""
        self.tables[entity.name] = TableMerge(self.spark, self.config, entity, self.versions.note)
        if entity.freshness is not None:
            self.queue.freshness[entity.name] = interval_seconds(entity.freshness) or 0.0
        history = entity.history.freshness or entity.freshness
        if entity.history.enabled and history is not None:
            self.queue.freshness[entity.name + HISTORY] = interval_seconds(history) or 0.0

    def hold(self, entity: str, reason: str) -> bool:
        """Bronze's stream never fails for one table: nothing to go on without."""
        return False

    def prepare(self, wait_s: float) -> None:
        """Wait for bronze; each table's progress; what tables are behind (see the module)."""
        hint = "start the ingestor first"
        wait_for_table(self.spark, self.bronze_path, wait_s, hint, log)
        ensure_quarantine(self.spark, self.config)
        self.versions.start()
        self._type_tables()
        self._read_progress()
        for table in self.tables.values():
            drain_legacy_bronze(self.spark, self.config, table)
        for name, version in self.silver_versions.items():  # one lost with a crash, again
            self.versions.note(name, version)
        self.versions.flush()
        self._offer_behind()
        if self.group.once:
            self.erasure_watch.look()
        elif self._between is None:
            self.erasure_watch.start(self.runner.on_close)
        if self._between is None:  # the tables behind are written now, not at a next change
            self._between = self.queue.write_between_batches(
                self._written, partial(self.runner.fail_group, self.group.name)
            )
            if self._between is not None:
                self.runner.on_close(self._between)

    def _type_tables(self) -> None:
        """Each table's payload type and retention mark, as bronze's properties say.

        A table without rows in bronze has no type yet; one retention never touched, no mark.
        """
        properties = table_properties(self.spark, self.bronze_path)
        types = bronze.payload_types(properties)
        deleted_before = bronze.retention_marks(properties)
        for name, table in self.tables.items():
            if name in types:
                table.typed_as(types[name])
            table.deleted_before = deleted_before.get(name)

    def _read_progress(self) -> None:
        """Each table's progress (and silver's version), from silver's and the history's logs."""
        layout = self.config.layout
        silver = read_logs(
            self.config, {n: layout.silver(n) for n in self.tables}, MERGER_PROGRESS_APP
        )
        histories = {n: layout.history(n) for n, t in self.tables.items() if t.layout.history}
        history = transaction_versions(self.config, histories, MERGER_PROGRESS_APP)
        self.silver_versions = {n: s.version for n, s in silver.items() if s is not None}
        for name, table in self.tables.items():
            state = silver[name]
            table.progress = _or_none(None if state is None else state.transaction)
            table.history_progress = _or_none(history.get(name))

    def _offer_behind(self) -> None:
        """Offer the tables whose progress is behind where the checkpoint stood.

        One look at bronze's change feed (its entity column) since the oldest progress
        finds which of them have rows there. A new checkpoint reads from that progress
        anyway (``source``): nothing to look at then.
        """
        committed = last_committed_batch(HadoopFiles(self.spark), self.checkpoint)
        if committed is None or not committed.sources:
            return
        end = bronze_end(committed.sources[0])
        behind = {name: t.progress for name, t in self.tables.items() if t.progress < end}
        for name, table in self.tables.items():
            if table.layout.history and table.history_progress < min(table.progress, end):
                self.queue.offer(name + HISTORY, min(table.progress, end))
        if not behind:
            return
        since = min(behind.values())
        progress_of = F.create_map(*[x for n, p in behind.items() for x in (F.lit(n), F.lit(p))])
        rows = (
            self.spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", since + 1)
            .option("endingVersion", end)
            .load(self.bronze_path)
            .where(bronze.APPENDED)
            .where(F.col(bronze.ENTITY).isin(*behind))
            .where(F.col("_commit_version") > progress_of[F.col(bronze.ENTITY)])
            .groupBy(bronze.ENTITY)
            .count()
            .collect()
        )
        for name, count in rows:
            self.queue.offer(name, end, int(count))
        if rows:
            log.info(
                "tables behind where the stream stood are written from their own progress",
                extra={"entities": sorted(r[0] for r in rows), "until": end},
            )

    def source(self) -> DataFrame:
        """Bronze's group entities, as a Delta stream (their entity column only).

        A new checkpoint starts after the oldest progress of the group's tables (at the
        latest version when every table has reached it: its rows are offered again, to
        no effect).
        """
        # A retention delete (``cdc maintenance``) removes only rows merged already.
        reader = self.spark.readStream.format("delta").option("skipChangeCommits", "true")
        if last_committed_batch(HadoopFiles(self.spark), self.checkpoint) is None:
            oldest = min((t.progress for t in self.tables.values()), default=-1)
            latest = delta_version(self.spark, self.bronze_path)
            reader = reader.option("startingVersion", max(0, min(oldest + 1, latest)))
        settings = self.config.merger
        if settings.max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", settings.max_files_per_trigger)
        if settings.max_bytes_per_trigger:
            reader = reader.option("maxBytesPerTrigger", settings.max_bytes_per_trigger)
        rows = reader.load(self.bronze_path).where(F.col(bronze.ENTITY).isin(*self.tables))
        return rows.select(bronze.ENTITY)

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Offer the tables the batch changed, write those due, record silver's versions."""
        text = HadoopFiles(self.spark).read_text_if_exists(
            f"{self.checkpoint.rstrip('/')}/offsets/{batch_id}"
        )
        end = bronze_end(parse_offsets(text or "")[0]) if text else -1
        changed = batch.groupBy(bronze.ENTITY).count().collect()
        if changed:  # a type may have widened (a column added to the source)
            self._type_tables()
        for name, count in changed:
            self.queue.offer(name, end, int(count))
        writes = self.queue.run()
        self.versions.flush()
        if self.queue.holds_all(self.tables):
            raise self.runner.stop_all_held()  # the batch is not committed
        self._note_idle_progress(end)
        stats = writes.stats()
        stats.extra["bronze_version"] = end
        self.runner.report(self.group.name, batch_id, stats)

    def _offer_erasure(self, entity: str, request: ErasureRequest) -> None:
        """Have the table written up to the request's bronze version: the write erases."""
        table = self.tables[entity]
        if table.payload_type is None:  # never in bronze: no silver to erase from
            return
        self.queue.offer(entity, max(request.bronze_version, table.progress))
        if table.layout.history is not None:
            self.queue.offer(entity + HISTORY, table.progress)

    def _note_idle_progress(self, end: int) -> None:
        """Record, now and then, that idle tables are merged through ``end``.

        A table bronze holds no new rows of is merged through every batch's end, but its
        log says so only at its last write; a start then looks at bronze's change feed
        since the oldest progress for tables left behind. So a table nothing is pending
        for, whose recorded progress is ``IDLE_PROGRESS_VERSIONS`` or more behind, gets a
        commit of its progress alone (a few per batch): the look stays that short.
        """
        noted = 0
        for name, table in self.tables.items():
            if noted >= IDLE_PROGRESS_PER_BATCH:
                return
            if end - table.progress < IDLE_PROGRESS_VERSIONS or table.payload_type is None:
                continue
            if name in self.queue.pending or name in self.queue.held:
                continue
            if name + HISTORY in self.queue.pending or name + HISTORY in self.queue.held:
                continue
            table.note_progress(end)
            noted += 1

    def _written(self, writes: BatchWrites) -> None:
        """Tables written between batches: silver's versions recorded, the writes logged."""
        self.versions.flush()
        self.runner.report_between_batches(self.group.name, writes.stats())
        if self.queue.holds_all(self.tables):
            self.runner.stop_all_held()

    def _write(self, spark: SparkSession, key: str, until: int) -> BatchStats:
        if key.endswith(HISTORY):
            return self.tables[key.removesuffix(HISTORY)].write_history(spark, until)
        table = self.tables[key]
        stats = table.write(spark, until)
        if table.layout.history is not None and table.history_progress < table.progress:
            self.queue.offer(key + HISTORY, table.progress)
        return stats

    def _table_failure(self, table: str, error: BaseException) -> Failure | None:
        """A table's write failing: the service's reading of it (None: the batch fails)."""
        entity = table.removesuffix(HISTORY)
        return self.runner.failure_of(entity, error)


def _or_none(version: int | None) -> int:
    """A progress read from a log: -1 for none."""
    return -1 if version is None else version
