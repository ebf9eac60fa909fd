"""DataFrames of the driver's rows (``frame_from_rows``): the schema exactly, the values as
``createDataFrame`` reads them, and no Python in what executors run.

The cluster test (``test_spark_cluster.py``) runs the services with no Python for
executors at all; here the RDD lineage shows why: Arrow batches decoded in the JVM, where
``createDataFrame`` of Python rows has a ``PythonRDD`` (pyspark's worker).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from decimal import Decimal

import pytest
from cdc_shared.jvm.driver_frames import frame_from_rows
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

pytestmark = pytest.mark.integration

SCHEMA = T.StructType(
    [
        T.StructField("name", T.StringType(), False),
        T.StructField("at", T.TimestampType(), True),
        T.StructField("raw", T.BinaryType(), True),
        T.StructField("sequence", T.ArrayType(T.LongType(), False), False),
        T.StructField("day", T.DateType(), True),
        T.StructField("amount", T.DecimalType(10, 2), True),
        T.StructField("partition", T.IntegerType(), True),
    ]
)
NEW_YORK_WINTER = dt.timezone(dt.timedelta(hours=-5))


@pytest.fixture
def new_york_local_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test process's local time zone is New York's (naive datetimes are local)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _lineage(frame: DataFrame) -> str:
    """The RDDs that compute ``frame`` (what its tasks run)."""
    return str(frame._jdf.queryExecution().toRdd().toDebugString())


def _rows() -> list[tuple[object, ...] | dict[str, object]]:
    return [
        (
            "aware",
            dt.datetime(2024, 3, 1, 7, 30, 15, 123456, tzinfo=NEW_YORK_WINTER),
            b"\x00\xff",
            [1, 2],
            dt.date(2024, 1, 2),
            Decimal("1.25"),
            7,
        ),
        {
            "name": "naive, by name",
            "at": dt.datetime(2024, 3, 1, 7, 30),  # noqa: DTZ001 - local time, on purpose
            "sequence": [],
        },
    ]


@pytest.mark.usefixtures("new_york_local_time")
def test_the_schema_exactly_and_the_values_as_create_data_frame_reads_them(
    spark: SparkSession,
) -> None:
    frame = frame_from_rows(spark, _rows(), SCHEMA)
    assert frame.select("*").schema == SCHEMA  # the JVM's schema, nullability included
    assert frame.collect() == spark.createDataFrame(_rows(), SCHEMA).collect()
    utc = frame.select(F.date_format("at", "HH:mm:ss.SSSSSS").alias("at")).collect()
    assert [r.at for r in utc] == ["12:30:15.123456", "12:30:00.000000"]  # naive: local
    first = frame.where(F.col("name") == "aware").first()
    assert first is not None and first.raw == bytearray(b"\x00\xff")


def test_executors_decode_arrow_in_the_jvm_not_in_pysparks_python_worker(
    spark: SparkSession,
) -> None:
    rows = _rows()
    assert "PythonRDD" in _lineage(spark.createDataFrame(rows, SCHEMA))
    local = frame_from_rows(spark, rows, SCHEMA)  # a local relation: small data
    assert "PythonRDD" not in _lineage(local)
    threshold = "spark.sql.execution.arrow.localRelationThreshold"
    spark.conf.set(threshold, "0")  # Arrow batches as tasks, as for large data
    try:
        tasks = frame_from_rows(spark, rows, SCHEMA)
        assert "arrow" in _lineage(tasks) and "PythonRDD" not in _lineage(tasks)
        assert tasks.collect() == local.collect()
    finally:
        spark.conf.unset(threshold)


def test_an_empty_frame_has_the_schema_and_no_rows(spark: SparkSession) -> None:
    empty = frame_from_rows(spark, [], SCHEMA)
    assert empty.select("*").schema == SCHEMA
    assert empty.count() == 0
    assert "PythonRDD" not in _lineage(empty)


def test_nulls_where_the_schema_allows_none_and_rows_of_another_width_are_refused(
    spark: SparkSession,
) -> None:
    with pytest.raises(ValueError, match="non-nullable columns \\['sequence'\\]"):
        frame_from_rows(spark, [{"name": "no sequence"}], SCHEMA)
    with pytest.raises(ValueError, match="a row of 2 values for 7 columns"):
        frame_from_rows(spark, [("short", None)], SCHEMA)
