"""The merger's batch as it was before the lean path (commit 674eab8), kept to compare with.

Per batch: a pass to check and count the events, the newest event per key anti-joined
with the whole tombstones table, a local checkpoint and a count of it, the MERGE with
Delta's own copy of its source (``materializeSource=auto``), then the tombstones'
append. The checks, the newest-per-key and the MERGE's clauses are the merger's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import reduce

from cdc_merger.apply import DELETE, ERROR_KIND, TRUNCATE, latest_per_key, rejection, silver_merge
from cdc_merger.silver_tables import SilverLayout
from cdc_shared.contracts.silver import COMMIT_TS, OP, SEQUENCE
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F


@contextmanager
def delta_default_materialization(spark: SparkSession) -> Iterator[None]:
    """Delta's default copy of a MERGE's source (``auto``) inside the block."""
    key = "spark.databricks.delta.merge.materializeSource"
    previous = spark.conf.get(key)
    spark.conf.set(key, "auto")
    try:
        yield
    finally:
        spark.conf.set(key, previous)


def apply_batch_before(spark: SparkSession, events: DataFrame, layout: SilverLayout) -> None:
    """One batch the old way; rejected events and truncates are not expected here."""
    key = layout.key
    silver = DeltaTable.forPath(spark, layout.silver_path).toDF().schema
    kind, _ = rejection(events, key, silver)
    checked = events.withColumn(ERROR_KIND, F.when(~F.col("is_tombstone"), kind)).persist()
    summary = checked.agg(
        F.count(F.lit(1)).alias("events"),
        F.count(ERROR_KIND).alias("rejected"),
        F.max(F.when(F.col("op") == TRUNCATE, F.col("sequence"))).alias("truncate"),
    ).first()
    assert summary is not None and summary["rejected"] == 0 and summary["truncate"] is None
    valid = checked.where(F.col(ERROR_KIND).isNull()).drop(ERROR_KIND)
    latest = latest_per_key(valid, key, silver).alias("e")
    tombstones = spark.read.format("delta").load(layout.tombstone_path).alias("t")
    not_newer = F.col(f"t.{SEQUENCE}") >= F.col(f"e.{SEQUENCE}")
    same_key = [F.col(f"e.`{k}`") == F.col(f"t.`{k}`") for k in key]
    candidates = (
        latest.join(tombstones, on=reduce(Column.__and__, same_key, not_newer), how="left_anti")
        .withColumn(COMMIT_TS, F.current_timestamp())
        .localCheckpoint(eager=False)
    )
    counts = {r[OP]: int(r["count"]) for r in candidates.groupBy(OP).count().collect()}
    if counts:
        with delta_default_materialization(spark):
            silver_merge(DeltaTable.forPath(spark, layout.silver_path), candidates, key).execute()
    if counts.get(DELETE):
        deletes = candidates.where(F.col(OP) == DELETE).select(
            *key, SEQUENCE, F.col(COMMIT_TS).alias("deleted_at")
        )
        deletes.write.format("delta").mode("append").save(layout.tombstone_path)
    checked.unpersist()
