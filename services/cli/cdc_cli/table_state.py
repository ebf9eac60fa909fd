"""What ``cdc maintenance`` reads of the tables and checkpoints, and its Spark reader.

:class:`TableState` is what a maintenance run or dry run reads beyond a
:class:`cdc_cli.checkpoints.StateReader`; :class:`SparkTables` reads it through the
session a run holds anyway, :class:`cdc_cli.delta_log.DeltaLogState` without a JVM.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from cdc_cli.checkpoints import (
    SparkState,
    as_utc,
)
from cdc_cli.liveness import ActivityReader

if TYPE_CHECKING:  # a dry run reads without PySpark: it is imported where a session is used
    from pyspark.sql import SparkSession


_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_VACUUM_LOGGING = "spark.databricks.delta.vacuum.logging.enabled"


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
        listed = vacuum_table(self.spark, path, hours, hours < table_retention_hours, dry_run=True)
        return 0 if listed is None else listed


def vacuum_table(
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
