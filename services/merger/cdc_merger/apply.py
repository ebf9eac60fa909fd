"""Applying one micro-batch of bronze events to silver: the merger's core, as plain functions.

Per batch: keep the latest event per key by its ``sequence`` (compared element by
element), drop events not newer than the key's tombstone, then one MERGE into silver that
updates or deletes only when the event is newer than the row, and inserts only what is
absent. Deletes also record a tombstone (key + sequence) in a side table, so a late older
event cannot resurrect the row. Every step compares sequences, so applying the same batch
twice changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc_shared.silver import COMMIT_TS, OP, SEQUENCE, SOURCE_TS
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

APPLIED_OPS = ("c", "u", "r", "d")

SILVER_PROPERTIES = {
    "delta.enableChangeDataFeed": "true",
    "delta.enableDeletionVectors": "true",
}
TOMBSTONE_PROPERTIES = {"delta.enableDeletionVectors": "true"}


@dataclass(frozen=True)
class SilverLayout:
    """Where one entity's silver table and tombstones live, and its key columns."""

    silver_path: str
    tombstone_path: str
    key: list[str]


def silver_schema(bronze_schema: T.StructType, key: list[str]) -> T.StructType:
    """Silver's columns: the row (bronze ``after``), then the change metadata."""
    after = bronze_schema["after"].dataType
    assert isinstance(after, T.StructType)
    missing = [k for k in key if k not in after.fieldNames()]
    if missing:
        raise ValueError(f"key columns {missing} are not columns of the row {after.simpleString()}")
    return T.StructType(
        [T.StructField(f.name, f.dataType, f.name not in key) for f in after.fields]
        + [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
            T.StructField(OP, T.StringType(), False),
            T.StructField(SOURCE_TS, T.TimestampType(), True),
            T.StructField(COMMIT_TS, T.TimestampType(), False),
        ]
    )


def tombstone_schema(silver: T.StructType, key: list[str]) -> T.StructType:
    """Tombstones: the key, the delete's sequence, and when it was recorded."""
    return T.StructType(
        [T.StructField(k, silver[k].dataType, False) for k in key]
        + [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
            T.StructField("deleted_at", T.TimestampType(), False),
        ]
    )


def ensure_tables(spark: SparkSession, bronze_schema: T.StructType, layout: SilverLayout) -> None:
    """Create silver (Change Data Feed on) and its tombstones unless they exist."""
    from cdc_shared.tables import ensure_table

    silver = silver_schema(bronze_schema, layout.key)
    ensure_table(spark, layout.silver_path, silver, SILVER_PROPERTIES)
    ensure_table(
        spark, layout.tombstone_path, tombstone_schema(silver, layout.key), TOMBSTONE_PROPERTIES
    )


def latest_per_key(events: DataFrame, key: list[str]) -> DataFrame:
    """The newest applicable event per key (by sequence), as flat silver-shaped rows.

    Tombstone records and unknown ops are skipped; rows keep ``_cdc_op`` so a delete can
    be told from an upsert.
    """
    applicable = events.where(~F.col("is_tombstone") & F.col("op").isin(*APPLIED_OPS))
    row_fields = [f.name for f in applicable.schema["after"].dataType.fields]  # type: ignore[attr-defined]
    flat = applicable.select(
        *[F.col(f"key.{k}").alias(k) for k in key],
        *[F.col(f"after.{f}").alias(f) for f in row_fields if f not in key],
        F.col("sequence").alias(SEQUENCE),
        F.col("op").alias(OP),
        F.timestamp_millis(F.col("source.ts_ms")).alias(SOURCE_TS),
    )
    others = [c for c in flat.columns if c not in key]
    newest = F.max_by(F.struct(*others), F.col(SEQUENCE)).alias("newest")
    return flat.groupBy(*key).agg(newest).select(*key, "newest.*")


def _newer(left: str, right: str) -> Column:
    return F.expr(f"{left}.{SEQUENCE} > {right}.{SEQUENCE}")


@dataclass(frozen=True)
class ApplyResult:
    """What a batch offered to silver: keys with a newer event, and how many were deletes."""

    keys: int
    deletes: int


def apply_batch(spark: SparkSession, events: DataFrame, layout: SilverLayout) -> ApplyResult:
    """Apply one batch of bronze events to silver and the tombstones; idempotent."""
    key = layout.key
    latest = latest_per_key(events, key)
    tombstones = spark.read.format("delta").load(layout.tombstone_path)
    candidates = (
        latest.alias("e")
        .join(tombstones.alias("t"), on=key, how="left")
        .where(F.col(f"t.{SEQUENCE}").isNull() | _newer("e", "t"))
        .select("e.*")
        .withColumn(COMMIT_TS, F.current_timestamp())
    ).persist()
    try:
        counts = {r[OP]: int(r["count"]) for r in candidates.groupBy(OP).count().collect()}
        if counts:
            _merge_silver(spark, candidates, layout)
        if counts.get("d"):
            _record_tombstones(spark, candidates, layout)
    finally:
        candidates.unpersist()
    return ApplyResult(keys=sum(counts.values()), deletes=counts.get("d", 0))


def _on(key: list[str], target: str, source: str) -> str:
    return " AND ".join(f"{target}.`{k}` = {source}.`{k}`" for k in key)


def _merge_silver(spark: SparkSession, candidates: DataFrame, layout: SilverLayout) -> None:
    silver = DeltaTable.forPath(spark, layout.silver_path)
    columns = [c for c in candidates.columns if c != OP] + [OP]
    values: dict[str, str | Column] = {f"`{c}`": f"s.`{c}`" for c in columns}
    newer = f"s.{SEQUENCE} > t.{SEQUENCE}"
    (
        silver.alias("t")
        .merge(candidates.alias("s"), _on(layout.key, "t", "s"))
        .whenMatchedDelete(condition=f"s.{OP} = 'd' AND {newer}")
        .whenMatchedUpdate(condition=f"s.{OP} != 'd' AND {newer}", set=values)
        .whenNotMatchedInsert(condition=f"s.{OP} != 'd'", values=values)
        .withSchemaEvolution()
        .execute()
    )


def _record_tombstones(spark: SparkSession, candidates: DataFrame, layout: SilverLayout) -> None:
    deletes = candidates.where(F.col(OP) == "d").select(
        *layout.key, SEQUENCE, F.col(COMMIT_TS).alias("deleted_at")
    )
    (
        DeltaTable.forPath(spark, layout.tombstone_path)
        .alias("t")
        .merge(deletes.alias("s"), _on(layout.key, "t", "s"))
        .whenMatchedUpdateAll(condition=f"s.{SEQUENCE} > t.{SEQUENCE}")
        .whenNotMatchedInsertAll()
        .execute()
    )
