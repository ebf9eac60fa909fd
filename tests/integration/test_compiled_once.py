"""A query run every micro-batch compiles its code once, not once per batch.

Spark writes long and timestamp literals into the code it generates, and keeps compiled
classes in a cache keyed by that code: a per-batch value in a query (a batch id, the
current time) costs a compilation per batch. The services read the time with
``cdc_shared.jvm.spark.clock`` instead; these tests hold that to account, beside the Spark
behaviour that makes it necessary (so the counter is shown to see a compilation).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable

import pytest
from cdc_shared.jvm.spark import clock
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

pytestmark = pytest.mark.integration


def compilations(spark: SparkSession) -> int:
    """Classes Spark has compiled in this JVM so far (its own codegen metric)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return int(
        jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount()
    )


def compiled_by_repeats(spark: SparkSession, query: Callable[[int], DataFrame]) -> list[int]:
    """How many classes each of three later runs of ``query(batch)`` compiled."""
    query(0).collect()  # the first run compiles what it needs
    counts = []
    for batch in (1, 2, 3):
        time.sleep(0.01)  # a new millisecond: a time literal would differ
        before = compilations(spark)
        query(batch).collect()
        counts.append(compilations(spark) - before)
    return counts


def rows(spark: SparkSession) -> DataFrame:
    return spark.range(200).withColumn("name", F.concat(F.lit("n"), F.col("id").cast("string")))


def test_the_clock_column_compiles_once_and_reads_the_time(spark: SparkSession) -> None:
    repeats = compiled_by_repeats(spark, lambda _: rows(spark).select("id", clock().alias("at")))
    assert repeats == [0, 0, 0]
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    stamped = rows(spark).select(clock().alias("at")).agg(F.min("at"), F.max("at")).first()
    after = dt.datetime.now(dt.UTC)
    assert stamped is not None
    earliest, latest = (v.replace(tzinfo=dt.UTC) for v in stamped)
    assert before - dt.timedelta(seconds=1) <= earliest <= latest <= after


@pytest.mark.parametrize(
    "per_batch",
    [
        pytest.param(lambda batch: F.lit(batch).cast("long"), id="batch-id-literal"),
        pytest.param(lambda _: F.current_timestamp(), id="current-timestamp"),
    ],
)
def test_a_per_batch_literal_compiles_every_batch(
    spark: SparkSession, per_batch: Callable[[int], Column]
) -> None:
    counts = compiled_by_repeats(
        spark, lambda batch: rows(spark).select("id", per_batch(batch).alias("v"))
    )
    assert all(n > 0 for n in counts), counts
