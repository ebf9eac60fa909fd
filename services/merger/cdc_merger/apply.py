"""Applying one micro-batch of bronze events to silver: the merger's core, as plain functions.

Per batch: set aside events that cannot be applied (for quarantine), apply a truncate
(``op=t``) by deleting every row older than it, keep the latest event per key by its
``sequence`` (compared element by element), drop events not newer than the key's
tombstone or the last truncate, then one MERGE into silver that updates or deletes only
when the event is newer than the row, and inserts only what is absent. Deletes also record
a tombstone (key + sequence) in a side table, so a late older event cannot resurrect the
row. Every step compares sequences, so applying the same batch twice changes nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import reduce

from cdc_shared.observability import Stopwatch
from cdc_shared.silver import COMMIT_TS, OP, SEQUENCE, SOURCE_TS
from cdc_shared.tables import on_conflict_retry
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

log = logging.getLogger("cdc_merger")

UPSERT_OPS = ("c", "u", "r")  # r: a snapshot read, applied like an insert
DELETE = "d"
TRUNCATE = "t"
ERROR_KIND = "_cdc_error_kind"
ERROR_MESSAGE = "_cdc_error_message"

SILVER_PROPERTIES = {
    "delta.enableChangeDataFeed": "true",
    "delta.enableDeletionVectors": "true",
}
TOMBSTONE_PROPERTIES = {"delta.enableDeletionVectors": "true"}
TRUNCATE_SCHEMA = T.StructType(
    [
        T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
        T.StructField("truncated_at", T.TimestampType(), False),
    ]
)


@dataclass(frozen=True)
class SilverLayout:
    """Where one entity's silver table and its side tables live, and its key columns."""

    silver_path: str
    tombstone_path: str
    truncate_path: str
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
    """Tombstones: the key, the delete's sequence, and when it was recorded.

    Appended, never updated: a key deleted twice has two, and the newest decides.
    """
    return T.StructType(
        [T.StructField(k, silver[k].dataType, False) for k in key]
        + [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
            T.StructField("deleted_at", T.TimestampType(), False),
        ]
    )


def ensure_tables(spark: SparkSession, bronze_schema: T.StructType, layout: SilverLayout) -> None:
    """Create silver (Change Data Feed on), its tombstones and truncates unless they exist."""
    from cdc_shared.tables import ensure_table

    silver = silver_schema(bronze_schema, layout.key)
    ensure_table(spark, layout.silver_path, silver, SILVER_PROPERTIES)
    ensure_table(
        spark, layout.tombstone_path, tombstone_schema(silver, layout.key), TOMBSTONE_PROPERTIES
    )
    ensure_table(spark, layout.truncate_path, TRUNCATE_SCHEMA, TOMBSTONE_PROPERTIES)


def rejection(events: DataFrame, key: list[str], silver: T.StructType) -> tuple[Column, Column]:
    """Why an event cannot be applied (error kind and message columns), null when it can.

    Checked: a known op, a complete key (truncates have none), a complete sequence, a row
    image on upserts, and every row value castable to the type silver holds for it.
    """
    op, sequence = F.col("op"), F.col("sequence")
    after = events.schema["after"].dataType
    assert isinstance(after, T.StructType)
    checks: list[tuple[Column, str, Column]] = [
        (
            op.isNull() | ~op.isin(*UPSERT_OPS, DELETE, TRUNCATE),
            "unknown_op",
            F.concat(F.lit("op "), F.coalesce(op, F.lit("null")), F.lit(" is not c, u, r, d or t")),
        ),
        *[
            (
                (op != TRUNCATE) & F.col(f"key.{k}").isNull(),
                "null_key",
                F.lit(f"key column {k} is null"),
            )
            for k in key
        ],
        (
            sequence.isNull() | F.exists(sequence, lambda v: v.isNull()),
            "null_sequence",
            F.lit("the event's sequence (sequence_by) has a null element"),
        ),
        (
            op.isin(*UPSERT_OPS) & F.col("after").isNull(),
            "missing_after",
            F.concat(F.lit("op "), op, F.lit(" without an 'after' row image")),
        ),
    ]
    for field in after.fields:
        if field.name in silver.fieldNames() and silver[field.name].dataType != field.dataType:
            value = F.col(f"after.{field.name}")
            target = silver[field.name].dataType
            checks.append(
                (
                    value.isNotNull() & value.try_cast(target).isNull(),
                    "type_mismatch",
                    F.lit(
                        f"column {field.name}: {field.dataType.simpleString()} value does not "
                        f"cast to silver's {target.simpleString()}"
                    ),
                )
            )
    kind: Column = F.lit(None).cast("string")
    message: Column = F.lit(None).cast("string")
    for condition, name, text in reversed(checks):  # the first failing check wins
        kind = F.when(condition, F.lit(name)).otherwise(kind)
        message = F.when(condition, text).otherwise(message)
    return kind, message


def latest_per_key(events: DataFrame, key: list[str], silver: T.StructType) -> DataFrame:
    """The newest upsert or delete per key (by sequence), as flat silver-shaped rows.

    Values are cast to silver's column types (the events were checked castable); rows keep
    ``_cdc_op`` so a delete can be told from an upsert.
    """
    row_fields = [f.name for f in events.schema["after"].dataType.fields]  # type: ignore[attr-defined]

    def value(name: str) -> Column:
        column = F.col(f"after.{name}")
        return column.try_cast(silver[name].dataType) if name in silver.fieldNames() else column

    applicable = ~F.col("is_tombstone") & F.col("op").isin(*UPSERT_OPS, DELETE)
    flat = events.where(applicable).select(
        *[F.col(f"key.{k}").try_cast(silver[k].dataType).alias(k) for k in key],
        *[value(f).alias(f) for f in row_fields if f not in key],
        F.col("sequence").alias(SEQUENCE),
        F.col("op").alias(OP),
        F.timestamp_millis(F.col("source.ts_ms")).alias(SOURCE_TS),
    )
    others = [c for c in flat.columns if c not in key]
    newest = F.max_by(F.struct(*others), F.col(SEQUENCE)).alias("newest")
    return flat.groupBy(*key).agg(newest).select(*key, "newest.*")


class TruncateFloor:
    """The newest truncate applied to one entity: events not newer than it are dropped.

    Read from the truncates table on first use, then kept up to date in memory: the
    merger is the table's only writer, and re-reading it would cost every batch a scan.
    """

    def __init__(self, spark: SparkSession, truncate_path: str) -> None:
        self._spark = spark
        self._path = truncate_path
        self._sequence: list[int] | None = None
        self._loaded = False

    def get(self) -> list[int] | None:
        """The newest truncate's sequence, or None when the entity was never truncated."""
        if not self._loaded:
            row = self._spark.read.format("delta").load(self._path).agg(F.max(SEQUENCE)).first()
            newest = None if row is None else row[0]
            self._sequence = None if newest is None else [int(v) for v in newest]
            self._loaded = True
        return self._sequence

    def raise_to(self, sequence: list[int]) -> None:
        """Remember a truncate just recorded (the floor never goes down)."""
        current = self.get()
        if current is None or sequence > current:
            self._sequence = list(sequence)


@dataclass(frozen=True)
class BatchSummary:
    """One pass over a batch: events, rejected, the newest truncate, the latest ingest time."""

    events: int
    rejected: int
    truncate: list[int] | None
    ingested_until: dt.datetime | None


@dataclass(frozen=True)
class ApplyResult:
    """What a batch did: events read, rejected, keys offered to silver, deletes, truncates.

    ``ingested_until`` is the latest bronze ingest time in the batch (tombstone expiry).
    """

    events: int
    rejected: int
    keys: int
    deletes: int
    truncated: bool
    ingested_until: dt.datetime | None
    step_ms: dict[str, int] = dataclass_field(default_factory=dict)


def apply_batch(
    spark: SparkSession,
    events: DataFrame,
    layout: SilverLayout,
    quarantine: Callable[[DataFrame], None],
    truncates: TruncateFloor | None = None,
) -> ApplyResult:
    """Apply one batch of bronze events to silver; idempotent.

    ``events`` should be persisted (it is read several times). Events that cannot be
    applied are handed to ``quarantine`` (bronze rows plus ``_cdc_error_kind`` and
    ``_cdc_error_message``) and the rest is applied. A long-lived caller passes the same
    ``truncates`` every batch; without it the truncates table is read.
    """
    key = layout.key
    truncates = truncates or TruncateFloor(spark, layout.truncate_path)
    lap = Stopwatch()
    silver = DeltaTable.forPath(spark, layout.silver_path).toDF().schema
    kind, message = rejection(events, key, silver)
    # Kafka tombstones (a null value after a delete) carry nothing to apply.
    checked = events.withColumn(ERROR_KIND, F.when(~F.col("is_tombstone"), kind))
    summary = _summarise(checked)
    lap("check")
    if summary.rejected:
        quarantine(checked.where(F.col(ERROR_KIND).isNotNull()).withColumn(ERROR_MESSAGE, message))
        lap("quarantine")
    valid = checked.where(F.col(ERROR_KIND).isNull()).drop(ERROR_KIND)
    if summary.truncate is not None:
        _truncate(spark, layout, summary.truncate)
        truncates.raise_to(summary.truncate)
        lap("truncate")
    # A local checkpoint cuts the lineage: the writes below then plan against the
    # computed rows instead of re-planning the reads of bronze and the tombstones.
    latest = latest_per_key(valid, key, silver)
    candidates = _candidates(spark, latest, layout, truncates.get()).localCheckpoint(eager=False)
    counts = {r[OP]: int(r["count"]) for r in candidates.groupBy(OP).count().collect()}
    lap("candidates")
    if counts:
        _merge_silver(spark, candidates, layout)
        lap("merge")
    if counts.get(DELETE):
        _record_tombstones(spark, candidates, layout)
        lap("tombstones")
    return ApplyResult(
        events=summary.events,
        rejected=summary.rejected,
        keys=sum(counts.values()),
        deletes=counts.get(DELETE, 0),
        truncated=summary.truncate is not None,
        ingested_until=summary.ingested_until,
        step_ms=lap.laps,
    )


def _summarise(checked: DataFrame) -> BatchSummary:
    valid_truncate = (F.col("op") == TRUNCATE) & F.col(ERROR_KIND).isNull()
    row = checked.agg(
        F.count(F.lit(1)).alias("events"),
        F.count(ERROR_KIND).alias("rejected"),
        F.max(F.when(valid_truncate, F.col("sequence"))).alias("truncate"),
        F.max("ingested_at").alias("ingested_until"),
    ).first()
    assert row is not None
    truncate = None if row["truncate"] is None else [int(v) for v in row["truncate"]]
    return BatchSummary(int(row["events"]), int(row["rejected"]), truncate, row["ingested_until"])


def _candidates(
    spark: SparkSession, latest: DataFrame, layout: SilverLayout, truncated: list[int] | None
) -> DataFrame:
    """Events newer than every tombstone of their key and than the newest truncate."""
    tombstones = spark.read.format("delta").load(layout.tombstone_path).alias("t")
    not_newer = F.col(f"t.{SEQUENCE}") >= F.col(f"e.{SEQUENCE}")
    same_key = [F.col(f"e.`{k}`") == F.col(f"t.`{k}`") for k in layout.key]
    candidates = latest.alias("e").join(
        tombstones, on=reduce(Column.__and__, same_key, not_newer), how="left_anti"
    )
    if truncated is not None:
        candidates = candidates.where(F.col(SEQUENCE) > _sequence_literal(truncated))
    return candidates.withColumn(COMMIT_TS, F.current_timestamp())


def _on(key: list[str], target: str, source: str) -> str:
    return " AND ".join(f"{target}.`{k}` = {source}.`{k}`" for k in key)


def _sequence_literal(sequence: list[int]) -> Column:
    return F.array(*[F.lit(v).cast("long") for v in sequence])


@on_conflict_retry
def _truncate(spark: SparkSession, layout: SilverLayout, sequence: list[int]) -> None:
    """Delete every row older than the truncate, then remember it (late events stay out).

    In this order a crash in between replays the delete, which then finds nothing.
    """
    DeltaTable.forPath(spark, layout.silver_path).delete(
        F.col(SEQUENCE) < _sequence_literal(sequence)
    )
    spark.createDataFrame([(sequence, dt.datetime.now(dt.UTC))], TRUNCATE_SCHEMA).write.format(
        "delta"
    ).mode("append").save(layout.truncate_path)
    log.info("truncate at sequence %s applied to %s", sequence, layout.silver_path)


@on_conflict_retry
def _merge_silver(spark: SparkSession, candidates: DataFrame, layout: SilverLayout) -> None:
    silver = DeltaTable.forPath(spark, layout.silver_path)
    columns = [c for c in candidates.columns if c != OP] + [OP]
    values: dict[str, str | Column] = {f"`{c}`": f"s.`{c}`" for c in columns}
    newer = f"s.{SEQUENCE} > t.{SEQUENCE}"
    (
        silver.alias("t")
        .merge(candidates.alias("s"), _on(layout.key, "t", "s"))
        .whenMatchedDelete(condition=f"s.{OP} = '{DELETE}' AND {newer}")
        .whenMatchedUpdate(condition=f"s.{OP} != '{DELETE}' AND {newer}", set=values)
        .whenNotMatchedInsert(condition=f"s.{OP} != '{DELETE}'", values=values)
        .withSchemaEvolution()
        .execute()
    )


@on_conflict_retry
def _record_tombstones(spark: SparkSession, candidates: DataFrame, layout: SilverLayout) -> None:
    """Append the deletes' tombstones: the newest per key counts, so a replay is harmless."""
    deletes = candidates.where(F.col(OP) == DELETE).select(
        *layout.key, SEQUENCE, F.col(COMMIT_TS).alias("deleted_at")
    )
    deletes.write.format("delta").mode("append").save(layout.tombstone_path)


@on_conflict_retry
def expire_tombstones(spark: SparkSession, tombstone_path: str, older_than: dt.datetime) -> int:
    """Delete tombstones recorded before ``older_than``; returns how many went."""
    table = DeltaTable.forPath(spark, tombstone_path)
    expired = F.col("deleted_at") < F.lit(older_than)
    count = table.toDF().where(expired).count()
    if count:
        table.delete(expired)
    return count
