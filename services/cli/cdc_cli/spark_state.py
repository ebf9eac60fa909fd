"""The CLI's reads and writes through a SparkSession: Hadoop's file systems and Delta Lake.

:class:`SparkState` is a :class:`cdc_cli.checkpoints.StateReader` and :class:`SparkTables`
a :class:`cdc_cli.table_state.TableState` read through the session a command holds (the
services' own view of the tables); ``vacuum_table`` and ``compact`` are what
``cdc maintenance`` writes. Importing this module imports PySpark: the commands that read
without a JVM never do (:func:`cdc_cli.table_state.open_state`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from cdc_shared.jvm.bridge import HadoopFiles, delta_transaction_version, hadoop_path
from cdc_shared.streaming.tables import expire_tombstones, on_conflict_retry
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_cli.checkpoints import Commit, as_utc

_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_VACUUM_LOGGING = "spark.databricks.delta.vacuum.logging.enabled"


def is_delta_table(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` holds a Delta table."""
    return bool(DeltaTable.isDeltaTable(spark, path))


class SparkState(HadoopFiles):
    """A :class:`cdc_cli.checkpoints.StateReader` through Hadoop's file systems and Delta Lake.

    Timestamps are those of Delta Lake's history: the commit file's modification time,
    unless the table has in-commit timestamps.
    """

    def table_version(self, path: str) -> int | None:
        """The latest version of the Delta table at ``path``; None when there is no table."""
        if not is_delta_table(self.spark, path):
            return None
        row = DeltaTable.forPath(self.spark, path).history(1).select("version").head()
        return None if row is None else int(row["version"])

    def history(self, path: str, since: int = 0) -> dict[int, Commit]:
        """The versions at or after ``since`` still in the history of the table at ``path``."""
        rows = (
            DeltaTable.forPath(self.spark, path)
            .history()
            .where(f"version >= {int(since)}")
            .select("version", "timestamp", "operation")
            .collect()
        )
        return {
            int(r["version"]): Commit(
                int(r["version"]), as_utc(r["timestamp"]), str(r["operation"])
            )
            for r in rows
        }

    def count_by(self, path: str, column: str) -> dict[str, int] | None:
        """Rows per value of ``column`` in the table at ``path``; None when there is no table."""
        if not is_delta_table(self.spark, path):
            return None
        rows = self.spark.read.format("delta").load(path).groupBy(column).count().collect()
        return {str(r[column]): int(r["count"]) for r in rows}

    def transaction_version(self, path: str, app_id: str) -> int | None:
        """The version ``app_id`` last recorded in the table at ``path``, as Delta Lake reads it.

        From the table's latest snapshot (brought up to date first): its ``txn`` actions.
        """
        return delta_transaction_version(self.spark, path, app_id)


class SparkTables(SparkState):
    """What maintenance reads and writes through a SparkSession: Delta Lake's own answers.

    A :class:`cdc_cli.table_state.TableState` and :class:`cdc_cli.table_state.TableWrites`.
    """

    def table_properties(self, path: str) -> dict[str, str]:
        """The table properties of the Delta table at ``path``."""
        row = DeltaTable.forPath(self.spark, path).detail().select("properties").head()
        return dict((row["properties"] if row is not None else None) or {})

    def data_file_count(self, path: str) -> int:
        """The data files of the table's latest version (what OPTIMIZE would bin-pack)."""
        detail = DeltaTable.forPath(self.spark, path).detail().select("numFiles").head()
        return 0 if detail is None else int(detail["numFiles"])

    def newest_modification(self, folder: str) -> dt.datetime | None:
        """The newest modification time of an entry of ``folder``; None when it has none."""
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

    def count_before(
        self, path: str, column: str, moment: dt.datetime, where: Mapping[str, str] | None = None
    ) -> int:
        """Rows of the table at ``path`` whose timestamp ``column`` is before ``moment``."""
        rows = self.spark.read.format("delta").load(path).where(F.col(column) < F.lit(moment))
        for name, wanted in (where or {}).items():
            rows = rows.where(F.col(name) == F.lit(wanted))
        return int(rows.count())

    def vacuum_dry_run(self, path: str, hours: float, table_retention_hours: float) -> int:
        """How many paths Delta Lake's ``VACUUM ... RETAIN hours HOURS DRY RUN`` lists."""
        listed = vacuum_table(self.spark, path, hours, hours < table_retention_hours, dry_run=True)
        return 0 if listed is None else listed

    def vacuum(self, path: str, hours: float, below_minimum: bool) -> int | None:
        """VACUUM the table at ``path`` (:func:`vacuum_table`): the files deleted."""
        return vacuum_table(self.spark, path, hours, below_minimum)

    def compact(self, path: str) -> tuple[int, int]:
        """OPTIMIZE the table at ``path`` (:func:`compact`): (files removed, files added)."""
        return compact(self.spark, path)

    def expire_tombstones(self, path: str, cutoff: dt.datetime) -> int:
        """Expire the tombstones recorded before ``cutoff``, as the merger does: how many."""
        return expire_tombstones(self.spark, path, cutoff)

    def delete_rows(self, path: str, predicate: str, properties: Mapping[str, str]) -> int:
        """Delete the rows ``predicate`` holds from the log at ``path`` (see ``TableWrites``)."""
        settings = {**properties, "delta.appendOnly": "false"}
        listed = ", ".join(f"'{k}' = '{v}'" for k, v in settings.items())
        self.spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({listed})")
        return on_conflict_retry(_delete)(self.spark, path, predicate)


def vacuum_table(
    spark: SparkSession, path: str, hours: float, below_minimum: bool, dry_run: bool = False
) -> int | None:
    """VACUUM (``dry_run``: list what it would delete); the files deleted (or listed).

    Delta's own minimum check stays on unless a short retention was allowed.
    """
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


def compact(spark: SparkSession, path: str) -> tuple[int, int]:
    """OPTIMIZE (bin-packing) the table at ``path``: (files removed, files added).

    Safe beside a running merger: a compaction that loses a commit race is tried again.
    """
    return on_conflict_retry(_compact)(spark, path)


def _delete(spark: SparkSession, path: str, predicate: str) -> int:
    DeltaTable.forPath(spark, path).delete(predicate)
    last = DeltaTable.forPath(spark, path).history(1).select("operationMetrics").head()
    metrics = (last["operationMetrics"] if last is not None else None) or {}
    return int(metrics.get("numDeletedRows", 0))


def _compact(spark: SparkSession, path: str) -> tuple[int, int]:
    metrics = DeltaTable.forPath(spark, path).optimize().executeCompaction().head()
    if metrics is None:
        return 0, 0
    m = metrics["metrics"]
    return int(m["numFilesRemoved"]), int(m["numFilesAdded"])
