"""How the CLI reads the tables and checkpoints: what it reads, and the two engines.

:class:`TableState` is what ``cdc maintenance`` reads beyond a
:class:`cdc_cli.checkpoints.StateReader` (what ``cdc status`` reads). Two engines read
both: ``delta-rs`` (:class:`cdc_cli.delta_log.DeltaLogState`, no JVM: the default of every
read-only command) and ``spark`` (:class:`cdc_cli.spark_state.SparkTables`, through the
session a maintenance run holds anyway). :func:`open_state` chooses one.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from cdc_shared.config.pipeline import PipelineConfig

from cdc_cli.delta_log import DeltaLogState
from cdc_cli.liveness import ActivityReader

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: How a command reads tables and checkpoints: ``--engine``.
DELTA_RS = "delta-rs"
SPARK = "spark"
ENGINES = (DELTA_RS, SPARK)


class TableState(ActivityReader, Protocol):
    """What maintenance reads of the tables and checkpoints, beyond a :class:`StateReader`.

    Two of them: ``SparkTables`` (Delta Lake through the session a run holds anyway) and
    :class:`cdc_cli.delta_log.DeltaLogState` (no JVM: a dry run's).
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

    def count_before(
        self, path: str, column: str, moment: dt.datetime, where: Mapping[str, str] | None = None
    ) -> int:
        """Rows of the table at ``path`` whose timestamp ``column`` is before ``moment``.

        ``where``: only the rows whose columns hold these values.
        """
        ...

    def vacuum_dry_run(self, path: str, hours: float, table_retention_hours: float) -> int:
        """How many paths ``VACUUM ... RETAIN hours HOURS DRY RUN`` lists for the table.

        ``table_retention_hours``: the table's ``delta.deletedFileRetentionDuration``.
        """
        ...


class TableWrites(Protocol):
    """What a maintenance run (not a dry run) writes: through Delta Lake, on a session."""

    def vacuum(self, path: str, hours: float, below_minimum: bool) -> int | None:
        """VACUUM with a retention of ``hours``: the files deleted (None: not reported).

        ``below_minimum``: the retention is below the table's and was allowed (Delta's
        own minimum check off for this VACUUM).
        """
        ...

    def compact(self, path: str) -> tuple[int, int]:
        """OPTIMIZE (bin-packing): (files removed, files added)."""
        ...

    def expire_tombstones(self, path: str, cutoff: dt.datetime) -> int:
        """Expire the tombstones recorded before ``cutoff``, as the merger does: how many."""
        ...

    def delete_rows(self, path: str, predicate: str, properties: Mapping[str, str]) -> int:
        """Delete the rows of the append-only log at ``path`` that ``predicate`` (SQL) holds.

        First ``properties`` and ``delta.appendOnly=false`` in one commit; then the DELETE
        (retried when it loses a commit race). How many rows went.
        """
        ...


def open_state(
    config: PipelineConfig, engine: str, app_name: str, spark: SparkSession | None = None
) -> tuple[TableState, TableWrites | None]:
    """The reader for ``engine`` (one of :data:`ENGINES`), and what writes through it.

    The Spark engine reads and writes through ``spark``, or a session named ``app_name``
    built from the configuration; the delta-rs engine reads only (no writes: None).
    """
    if engine == DELTA_RS:
        return DeltaLogState(config), None
    if engine != SPARK:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    # Optional modules: the Spark engine's. The delta-rs engine never imports PySpark.
    from cdc_shared.jvm.spark import build_spark_session  # noqa: PLC0415

    from cdc_cli.spark_state import SparkTables  # noqa: PLC0415

    tables = SparkTables(spark or build_spark_session(config.spark, app_name))
    return tables, tables
