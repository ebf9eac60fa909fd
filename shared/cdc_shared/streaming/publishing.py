"""The publishers' stream of a group of tables: silver's changes -> each table's target.

Both publishers read silver the same way. One Delta stream over ``silver/_versions``
(where the merger records each silver commit) reads the group's entities' rows; each
micro-batch offers every table whose silver moved to the group's work queue
(``cdc_shared.streaming.queue``), up to the newest version recorded; each table due is
published from its own progress (kept in its target: the change topic's progress group,
the index's progress document) up to there, reading silver's Change Data Feed by
version (``cdc_shared.streaming.changefeed.change_feed_range``). A table whose progress is behind
silver at start (written in no batch before a stop, held by an earlier run, new) is
offered from the start: one look at the versions recorded finds them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_shared.clients.delta_rs import read_logs
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import ChangeFeedConfig
from cdc_shared.config.values import interval_seconds
from cdc_shared.contracts.quarantine import QUARANTINE_SCHEMA
from cdc_shared.contracts.quarantine import properties_for as quarantine_properties
from cdc_shared.contracts.stream_checkpoint import last_committed_batch
from cdc_shared.jvm.bridge import HadoopFiles, delta_version
from cdc_shared.jvm.spark import side_by_side
from cdc_shared.streaming.failures import EntityStoppedError, Failure
from cdc_shared.streaming.groups import TableGroup
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.queue import BatchWrites, TableQueue
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.streaming.tables import ensure_table, wait_for_table

log = logging.getLogger("cdc_shared.streaming.publishing")
#: How many tables' publications start side by side (a producer's transactions, an index).
STARTS_AT_ONCE = 8


class TablePublisher(Protocol):
    """One table's publication: its silver's changes into its target."""

    def start(self) -> int:
        """Make what it writes (once); the silver version published up to (-1: none).

        EntityStoppedError when the table cannot be published for a reason of its own.
        """

    def publish(self, spark: SparkSession, since: int, until: int) -> BatchStats:
        """Publish silver's changes after version ``since`` up to ``until``, idempotently."""

    def close(self) -> None:
        """Release what it holds (a producer, a client)."""


#: Opens a table's publication (not started yet).
OpenTable = Callable[[EntityConfig], TablePublisher]


@dataclass(eq=False)
class ChangeFeedGroup:
    """A group's stream for a publisher (see the module docstring)."""

    spark: SparkSession
    config: PipelineConfig
    group: TableGroup
    runner: StreamRunner
    service: str
    settings: ChangeFeedConfig
    open_table: OpenTable
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)

    def __post_init__(self) -> None:
        self.path = self.config.layout.silver_versions()
        self.checkpoint = self.config.layout.checkpoint(self.service, self.group.name)
        self.tables: dict[str, TablePublisher] = {}
        self.progress: dict[str, int] = {}
        self.latest: dict[str, int] = {}
        self.versions_read = -1  # the version of silver/_versions prepare saw
        self._between: Callable[[], None] | None = None  # stops the writes between batches
        self.queue = TableQueue(
            self.spark,
            self.settings,
            self._write,
            self._failure,
            self.runner.hold_table,
            drain=self.group.once,
        )
        for entity in self.group.entities:
            self.add(entity)

    def add(self, entity: EntityConfig) -> None:
        """Take up ``entity``: started at the query's next start."""
        table = self.open_table(entity)
        self.tables[entity.name] = table
        self.runner.on_close(table.close)
        if entity.freshness is not None:
            self.queue.freshness[entity.name] = interval_seconds(entity.freshness) or 0.0

    def hold(self, entity: str, reason: str) -> bool:
        """The versions' stream never fails for one table: nothing to go on without."""
        return False

    def prepare(self, wait_s: float) -> None:
        """Wait for the merger's record of versions; start each table; offer those behind.

        The service's quarantine is made first (the tables' starts run side by side). A
        table is behind when its silver's latest version is past its progress (read
        from silver's log: a commit the merger did not record, e.g. an operator's fix,
        counts too).
        """
        wait_for_table(self.spark, self.path, wait_s, "start the merger first", log)
        ensure_table(
            self.spark,
            self.config.layout.quarantine(self.service),
            QUARANTINE_SCHEMA,
            quarantine_properties(self.config),
        )

        def start(name: str) -> None:
            try:
                self.progress[name] = self.tables[name].start()
            except EntityStoppedError as stopped:
                self.queue.held[name] = str(stopped)
                self.runner.stop_entity(name, str(stopped))

        waiting = [n for n in self.tables if n not in self.progress and n not in self.queue.held]
        for first in range(0, len(waiting), STARTS_AT_ONCE):  # each mostly waits on a server
            side_by_side(
                [functools.partial(start, n) for n in waiting[first : first + STARTS_AT_ONCE]]
            )
        layout = self.config.layout
        logs = read_logs(self.config, {n: layout.silver(n) for n in self.progress}, "")
        for name, state in logs.items():
            if state is None:
                continue
            self.latest[name] = max(state.version, self.latest.get(name, -1))
            if state.version > self.progress[name]:
                self.queue.offer(name, state.version)
        self.versions_read = delta_version(self.spark, self.path)
        if self._between is None:  # the tables behind are written now, not at a next change
            self._between = self.queue.write_between_batches(
                self._written, functools.partial(self.runner.fail_group, self.group.name)
            )
            if self._between is not None:
                self.runner.on_close(self._between)

    def source(self) -> DataFrame:
        """The merger's record of silver versions, the group's entities (a Delta stream).

        A new checkpoint starts at the version ``prepare`` saw: what came before, it
        offered already (that version's rows are offered again, to no effect).
        """
        reader = self.spark.readStream.format("delta")
        if last_committed_batch(HadoopFiles(self.spark), self.checkpoint) is None:
            reader = reader.option("startingVersion", max(0, self.versions_read))
        rows = reader.load(self.path).where(F.col("entity").isin(*self.tables))
        return rows.select("entity", "version")

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Offer the tables whose silver moved; publish those due."""
        for name, version, count in (
            batch.groupBy("entity").agg(F.max("version"), F.count(F.lit(1))).collect()
        ):
            if name in self.progress:
                self.latest[name] = max(int(version), self.latest.get(name, -1))
                self.queue.offer(name, int(version), int(count))
        writes = self.queue.run()
        if self.queue.holds_all(self.tables):
            raise self.runner.stop_all_held()  # the batch is not committed
        stats = writes.stats()
        stats.extra["lag"] = sum(
            max(0, latest - self.progress.get(name, -1)) for name, latest in self.latest.items()
        )
        self.runner.report(self.group.name, batch_id, stats)

    def _written(self, writes: BatchWrites) -> None:
        self.runner.report_between_batches(self.group.name, writes.stats())
        if self.queue.holds_all(self.tables):
            self.runner.stop_all_held()

    def _write(self, spark: SparkSession, name: str, until: int) -> BatchStats:
        since = self.progress[name]
        if until <= since:
            return BatchStats(counts={"skipped": 1})
        stats = self.tables[name].publish(spark, since, until)
        self.progress[name] = until
        return stats

    def _failure(self, table: str, error: BaseException) -> Failure | None:
        return self.runner.failure_of(table, error)
