"""An entity's SCD type 2 history: one row per version of a key, written beside silver.

A version is the period ``[__start_at, __end_at)`` in the entity's sequence (the one the
merger compares) during which a key's tracked columns held the same values; ``__end_at``
is null for the current version, and a delete or truncate closes it. A change to
untracked columns only updates the version in place (its ``_cdc_seq`` is then the newest
event folded into it).

Per batch, for the keys it touches, the history is rebuilt from events: the keys'
existing versions read back as events (an upsert at ``__start_at``, one at ``_cdc_seq``
and a delete at ``__end_at``), the batch's events, the keys' tombstones and every
truncate as deletes. Deduplicated by (key, sequence) and ordered by sequence, they give
the versions again, which replace the keys' rows in one MERGE. Rebuilding what the
history already holds gives the same rows, so a replayed batch changes nothing, and an
event older than the newest version lands between the right two versions whatever order
the batches came in. A late event older than a delete becomes a version closed by that
delete: history never resurrects what silver keeps deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import reduce

from cdc_shared.config import HistoryConfig
from cdc_shared.driver_frames import frame_from_rows
from cdc_shared.silver import COMMIT_TS, OP, SEQUENCE, SOURCE_TS
from cdc_shared.tables import on_conflict_retry
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_merger.guards import sequence_literal

log = logging.getLogger("cdc_merger")

START = "__start_at"  # array<long>: the sequence of the event that began the version
END = "__end_at"  # array<long>: the sequence of the event that ended it; null: current
START_TS = "__start_ts"  # the source's commit time of the event that began the version
END_TS = "__end_ts"  # the source's commit time of the event that ended it (when known)
PERIOD = (START, END, START_TS, END_TS)
#: Every event folded into the version (sequence and source time), so a late delete,
#: truncate or tracked change between two of them splits the version at the right event.
FOLDED = "__folded"
_FOLDED_TYPE = T.ArrayType(
    T.StructType(
        [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), True),
            T.StructField(SOURCE_TS, T.TimestampType(), True),
        ]
    )
)
DELETE = "d"  # the op of a delete (a truncate is one for every key)
_PRIORITY = "_cdc_priority"  # which of the events of one (key, sequence) is kept
_DROP = "_cdc_drop"


@dataclass(frozen=True)
class HistoryTable:
    """Where an entity's history lives and which columns it tracks."""

    path: str
    config: HistoryConfig


def history_schema(silver: T.StructType) -> T.StructType:
    """History's columns: silver's row columns, the version's period, ``_cdc_seq``, source time."""
    row = [f for f in silver.fields if f.name not in (SEQUENCE, OP, SOURCE_TS, COMMIT_TS)]
    return T.StructType(
        [
            *row,
            T.StructField(START, T.ArrayType(T.LongType()), False),
            T.StructField(END, T.ArrayType(T.LongType()), True),
            T.StructField(START_TS, T.TimestampType(), True),
            T.StructField(END_TS, T.TimestampType(), True),
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
            T.StructField(SOURCE_TS, T.TimestampType(), True),
            T.StructField(FOLDED, _FOLDED_TYPE, True),
        ]
    )


def history_events(rows: DataFrame, key: list[str]) -> DataFrame:
    """The batch's upserts and deletes as flat events: key, row columns, sequence, op, time.

    ``rows`` are bronze events that can be applied (Kafka tombstones and truncates are
    left out here).
    """
    after = rows.schema["after"].dataType
    assert isinstance(after, T.StructType)
    return rows.where(~F.col("is_tombstone") & F.col("op").isin("c", "u", "r", DELETE)).select(
        *[F.col(f"key.`{k}`").alias(k) for k in key],
        *[F.col(f"after.`{f}`").alias(f) for f in after.fieldNames() if f not in key],
        F.col("sequence").alias(SEQUENCE),
        F.col("op").alias(OP),
        F.timestamp_millis(F.col("source.ts_ms")).alias(SOURCE_TS),
    )


def write_history(
    spark: SparkSession,
    table: HistoryTable,
    key: list[str],
    events: DataFrame | None,
    tombstone_path: str,
    truncate_path: str,
    truncates: list[tuple[list[int], object]],
) -> None:
    """Bring the history up to date with one batch (idempotent).

    ``events`` are the batch's ``history_events`` (None when it has none); ``truncates``
    the batch's truncates (sequence and source time): the keys with a version open at
    one are rebuilt too, so each such version closes there.
    """
    if events is not None:
        _remember_deletes(spark, events, key, tombstone_path)
    known, versions = rebuilt_versions(
        spark, table, key, events, tombstone_path, truncate_path, truncates
    )
    _replace_versions(spark, table.path, key, known, versions)


@on_conflict_retry
def _remember_deletes(
    spark: SparkSession, events: DataFrame, key: list[str], tombstone_path: str
) -> None:
    """Record every delete of the batch as a tombstone, not only each key's newest.

    Silver needs only the newest; history needs each, since a delete that ended no
    version yet ends the one a later-arriving older event begins. Older tombstones change
    nothing for silver (the newest per key counts); one already recorded is not repeated.
    """
    tombstones = spark.read.format("delta").load(tombstone_path)
    schema = tombstones.schema
    deletes = events.where(F.col(OP) == DELETE).select(
        *[F.col(f"`{k}`").try_cast(schema[k].dataType).alias(k) for k in key],
        SEQUENCE,
        F.current_timestamp().alias("deleted_at"),
    )
    new = deletes.join(tombstones.select(*key, SEQUENCE), on=[*key, SEQUENCE], how="left_anti")
    new.coalesce(1).write.format("delta").mode("append").save(tombstone_path)


def rebuilt_versions(
    spark: SparkSession,
    table: HistoryTable,
    key: list[str],
    events: DataFrame | None,
    tombstone_path: str,
    truncate_path: str,
    truncates: list[tuple[list[int], object]],
) -> tuple[DataFrame, DataFrame]:
    """The rows the history holds of the keys the batch touches, and their versions rebuilt.

    Touched: the keys of ``events`` and those with a version open at one of ``truncates``.
    Rebuilt from every event known of them: the rows read back as events, the batch's
    events and truncates, the keys' tombstones and every truncate remembered.
    """
    current = DeltaTable.forPath(spark, table.path).toDF()
    schema = current.schema
    row_columns = [] if events is None else [c for c in events.columns if c not in _EVENT]
    columns = list(
        dict.fromkeys([*[f.name for f in schema.fields if f.name not in _META], *row_columns])
    )

    def typed(name: str) -> Column:
        column = F.col(f"`{name}`")
        return column.try_cast(schema[name].dataType) if name in schema.fieldNames() else column

    parts: list[DataFrame] = []
    touching: list[DataFrame] = []
    if events is not None:
        batch = events.select(
            *[typed(c).alias(c) for c in row_columns],
            SEQUENCE,
            OP,
            SOURCE_TS,
            F.when(F.col(OP) == DELETE, 2).otherwise(0).alias(_PRIORITY),
        )
        parts.append(batch)
        touching.append(batch.select(*key))
    if truncates:
        spanning = [
            (F.col(START) < sequence_literal(s))
            & (F.col(END).isNull() | (F.col(END) > sequence_literal(s)))
            for s, _ in truncates
        ]
        touching.append(current.where(reduce(lambda a, b: a | b, spanning)).select(*key))
    touched = reduce(DataFrame.unionByName, touching).distinct()
    known = current.join(touched, on=key, how="left_semi")
    values = [c for c in known.columns if c not in _META]

    def upsert(sequence: str, at: str) -> list[Column]:
        return [
            *[F.col(f"`{c}`") for c in values],
            F.col(sequence).alias(SEQUENCE),
            F.lit("u").alias(OP),
            F.col(at).alias(SOURCE_TS),
            F.lit(1).alias(_PRIORITY),
        ]

    def deletes(frame: DataFrame, priority: int) -> DataFrame:
        return frame.select(
            *key,
            SEQUENCE,
            F.lit(DELETE).alias(OP),
            F.col(SOURCE_TS).cast(T.TimestampType()).alias(SOURCE_TS),
            F.lit(priority).alias(_PRIORITY),
        )

    parts.append(known.select(*upsert(START, START_TS)))
    parts.append(known.where(F.col(SEQUENCE) != F.col(START)).select(*upsert(SEQUENCE, SOURCE_TS)))
    each = known.select("*", F.explode(FOLDED).alias("_folded"))
    parts.append(each.select(*upsert("_folded." + SEQUENCE, "_folded." + SOURCE_TS)))
    ended = known.where(F.col(END).isNotNull())
    parts.append(
        deletes(ended.select(*key, F.col(END).alias(SEQUENCE), F.col(END_TS).alias(SOURCE_TS)), 3)
    )
    if truncates:
        closing = frame_from_rows(spark, [(s, at) for s, at in truncates], _TRUNCATES)
        parts.append(deletes(closing.crossJoin(touched), 3))
    tombstones = (
        spark.read.format("delta")
        .load(tombstone_path)
        .join(touched, on=key, how="left_semi")
        .select(*key, SEQUENCE)
    )
    remembered = spark.read.format("delta").load(truncate_path).select(SEQUENCE)
    unknown_time = F.lit(None).cast(T.TimestampType()).alias(SOURCE_TS)
    parts.append(
        deletes(tombstones.unionByName(remembered.crossJoin(touched)).select("*", unknown_time), 4)
    )
    every = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    untracked = table.config.untracked_columns(columns, key)
    return known, _versions(every, key, columns, untracked)


#: History's own columns (the period and the newest event folded into the version).
_META = (*PERIOD, SEQUENCE, SOURCE_TS, FOLDED)
#: An event's columns besides the row's.
_EVENT = (SEQUENCE, OP, SOURCE_TS)
#: A batch's truncates: sequence and source time.
_TRUNCATES = T.StructType(
    [
        T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
        T.StructField(SOURCE_TS, T.TimestampType(), True),
    ]
)


def _versions(
    events: DataFrame, key: list[str], columns: list[str], untracked: list[str]
) -> DataFrame:
    """Versions from events: dedupe by (key, sequence), order, fold, intervals from lead()."""
    same = Window.partitionBy(*key, SEQUENCE).orderBy(
        F.col(_PRIORITY), F.col(SOURCE_TS).desc_nulls_last()
    )
    unique = events.withColumn("_n", F.row_number().over(same)).where(F.col("_n") == 1)
    order = Window.partitionBy(*key).orderBy(SEQUENCE)
    tracked_names = [c for c in columns if c not in key and c not in untracked]
    tracked = F.struct(*[F.col(f"`{c}`") for c in tracked_names]) if tracked_names else F.lit(True)
    is_delete = F.col(OP) == DELETE
    before = F.lag(OP).over(order)
    new_version = ~is_delete & (
        before.isNull() | (before == DELETE) | ~F.lag(tracked).over(order).eqNullSafe(tracked)
    )
    flagged = unique.withColumn("_new", new_version)
    boundaries = flagged.where(F.col("_new") | is_delete).select(
        *key,
        F.col("_new"),
        F.col(SEQUENCE).alias(START),
        F.lead(SEQUENCE).over(order).alias(END),
        F.col(SOURCE_TS).alias(START_TS),
        F.lead(SOURCE_TS).over(order).alias(END_TS),
    )
    periods = boundaries.where(F.col("_new")).drop("_new")
    running = Window.partitionBy(*key).orderBy(SEQUENCE).rowsBetween(Window.unboundedPreceding, 0)
    upserts = flagged.withColumn("_version", F.sum(F.col("_new").cast("int")).over(running)).where(
        ~is_delete
    )
    others = [c for c in columns if c not in key]
    newest = F.max_by(
        F.struct(*[F.col(f"`{c}`") for c in others], SEQUENCE, SOURCE_TS), F.col(SEQUENCE)
    )
    grouped = upserts.groupBy(*key, "_version").agg(
        F.min(SEQUENCE).alias(START),
        newest.alias("_newest"),
        F.array_sort(F.collect_list(F.struct(SEQUENCE, SOURCE_TS))).alias(FOLDED),
    )
    return grouped.join(periods, on=[*key, START]).select(
        *key,
        *[F.col(f"_newest.`{c}`").alias(c) for c in others],
        *PERIOD,
        F.col(f"_newest.{SEQUENCE}").alias(SEQUENCE),
        F.col(f"_newest.{SOURCE_TS}").alias(SOURCE_TS),
        F.filter(FOLDED, lambda e: e[SEQUENCE] != F.col(START)).alias(FOLDED),
    )


@on_conflict_retry
def _replace_versions(
    spark: SparkSession, path: str, key: list[str], known: DataFrame, versions: DataFrame
) -> None:
    """Replace the touched keys' rows by ``versions`` in one MERGE on (key, ``__start_at``).

    ``known`` are the rows the history held of those keys: the ones the rebuild no longer
    has (an older event with the same tracked values moves a version's start) are
    deleted. Unchanged rows are left alone, so a replay changes no row.
    """
    history = DeltaTable.forPath(spark, path)
    on = [*key, START]
    gone = known.select(*on).join(versions.select(*on), on=on, how="left_anti")
    source = (
        versions.withColumn(_DROP, F.lit(False))
        .unionByName(gone.withColumn(_DROP, F.lit(True)), allowMissingColumns=True)
        .localCheckpoint(eager=True)  # read before the MERGE changes its target
    )
    columns = list(versions.columns)
    existing = set(known.columns)
    if set(columns) <= existing:
        changed = " OR ".join(f"NOT (t.`{c}` <=> s.`{c}`)" for c in columns)
    else:
        changed = "true"  # a new column: every touched row gains it
    assignments: dict[str, str | Column] = {f"`{c}`": f"s.`{c}`" for c in columns}
    condition = " AND ".join(f"t.`{c}` = s.`{c}`" for c in on)
    (
        history.alias("t")
        .merge(source.alias("s"), condition)
        .whenMatchedDelete(condition=f"s.{_DROP}")
        .whenMatchedUpdate(condition=f"NOT s.{_DROP} AND ({changed})", set=assignments)
        .whenNotMatchedInsert(condition=f"NOT s.{_DROP}", values=assignments)
        .withSchemaEvolution()
        .execute()
    )
