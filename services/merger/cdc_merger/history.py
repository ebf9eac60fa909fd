"""An entity's SCD type 2 history: one row per version of a key, written beside silver.

A version is the period ``[__start_at, __end_at)`` in the entity's sequence (the one the
merger compares) during which a key's tracked columns held the same values; ``__end_at``
is null for the current version, and a delete or truncate closes it. A change to
untracked columns only updates the version in place (its ``_cdc_seq`` is then the newest
event folded into it).

Per batch, for the keys it touches, the history is rebuilt from events: the keys'
existing versions the batch can change (open, or ended at or after its oldest event:
``Reach``) read back as events (each folded event an upsert with its own values, the
end a delete), the batch's events, the keys' tombstones and every truncate as deletes.
Deduplicated by (key, sequence) and ordered by sequence, they give those versions again;
the keys whose versions changed have them replaced in one commit. Rebuilding
what the history already holds gives the same rows, so a replayed batch writes nothing,
and an event older than the newest version lands between the right two versions whatever
order the batches came in. A late event older than a delete becomes a version closed by
that delete: history never resurrects what silver keeps deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial, reduce

from cdc_shared.config.entities import HistoryConfig
from cdc_shared.contracts.silver import (
    COMMIT_TS,
    END,
    END_TS,
    OP,
    PERIOD,
    SEQUENCE,
    SOURCE_TS,
    START,
    START_TS,
)
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.jvm.spark import observed, side_by_side
from cdc_shared.streaming.tables import Progress, on_conflict_retry, record_progress
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window, WindowSpec
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_merger.guards import sequence_literal

log = logging.getLogger("cdc_merger")

#: Every event of the version (sequence, source time and its untracked columns' values as
#: JSON), so a late delete, truncate or tracked change between two of them splits the
#: version at the right event, and each part holds the values its own last event brought.
FOLDED = "__folded"
UNTRACKED = "untracked"  # the field of a folded event holding its untracked values
_FOLDED_TYPE = T.ArrayType(
    T.StructType(
        [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), True),
            T.StructField(SOURCE_TS, T.TimestampType(), True),
            T.StructField(UNTRACKED, T.StringType(), True),
        ]
    )
)
DELETE = "d"  # the op of a delete (a truncate is one for every key)
_PRIORITY = "_cdc_priority"  # which of the events of one (key, sequence) is kept
_DROP = "_cdc_drop"
_HELD = "_cdc_held"  # an event that began a version the history held
_LIFE = "_cdc_life"  # how many deletes of the key came up to an event (fills stay inside)
UNSENT = "_cdc_unsent"  # a batch event's columns the source did not send (history_events)


@dataclass(frozen=True)
class Reach:
    """How far into what the history holds a batch can reach (``write_history``).

    ``since``: the batch's oldest event (its truncates included). A version that ended
    before it cannot change: the events that made it are all older than the batch's, and
    the next version's first event, or the delete that ended it, is the same. Only the
    versions still open or ending at ``since`` or later are read, rebuilt and replaced,
    so a batch costs what it touches, not each key's whole past.

    ``tombstone_path``, ``truncate_path``: the side tables to read; None for one holding
    nothing newer than ``since``. A tombstone or truncate older than every event of the
    batch cannot change a version either: each one that ended a version is that
    version's end already, and one that ended none (a delete after a delete, or before
    any version) only would for an event older than it. The merger knows each table's
    newest sequence (``NewestSequence``), so an in-order batch reads neither; a late or
    replayed one reads them.
    """

    since: list[int]
    tombstone_path: str | None
    truncate_path: str | None


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


def history_events(
    rows: DataFrame, key: list[str], unsent: Mapping[str, Column] | None = None
) -> DataFrame:
    """The batch's upserts and deletes as flat events: key, row columns, sequence, op, time.

    ``rows`` are bronze events that can be applied (Kafka tombstones and truncates are
    left out here). ``unsent``: per column that an event may leave unsent, the condition
    (over ``rows``) that it did (the source's unavailable-value placeholder, or a null
    update of an ``ignore_null_updates`` column; ``apply.not_sent``); the names of those
    an event did not send are its ``UNSENT`` column, and the rebuild gives them the value
    the key's previous event held, as silver keeps its prior value.
    """
    after = rows.schema["after"].dataType
    assert isinstance(after, T.StructType)
    names = [F.when(condition, F.lit(name)) for name, condition in (unsent or {}).items()]
    not_sent = F.array_compact(F.array(*names)) if names else F.lit(None).cast("array<string>")
    return rows.where(~F.col("is_tombstone") & F.col("op").isin("c", "u", "r", DELETE)).select(
        *[F.col(f"key.`{k}`").alias(k) for k in key],
        *[F.col(f"after.`{f}`").alias(f) for f in after.fieldNames() if f not in key],
        F.col("sequence").alias(SEQUENCE),
        F.col("op").alias(OP),
        F.timestamp_millis(F.col("source.ts_ms")).alias(SOURCE_TS),
        not_sent.alias(UNSENT),
    )


def write_history(
    spark: SparkSession,
    table: HistoryTable,
    key: list[str],
    events: DataFrame | None,
    reach: Reach,
    truncates: list[tuple[list[int], object]],
    fillable: Sequence[str] = (),
    progress: Progress | None = None,
) -> None:
    """Bring the history up to date with one batch (idempotent).

    ``events`` are the batch's ``history_events`` (None when it has none); ``truncates``
    the batch's truncates (sequence and source time): the keys with a version open at
    one are rebuilt too, so each such version closes there. ``reach``: how far back the
    batch reaches (its versions since its oldest event; the side tables to read).
    ``fillable``: the columns an event may leave unsent (its ``UNSENT``), filled from the
    key's previous event. ``progress`` is recorded with the write (or alone when nothing
    changes): a batch run again under the same progress writes nothing twice.

    Each input is read once: the batch's events, the versions of the keys it touches it
    can reach and (when read) their tombstones are local checkpoints (small jobs), the
    rebuild is one shuffle by key, and its result, for the keys it changed, replaces
    those versions.
    """
    current = DeltaTable.forPath(spark, table.path).toDF()
    schema = current.schema
    batch: DataFrame | None = None
    if events is not None:
        batch = events.select(
            *[_typed(schema, c).alias(c) for c in events.columns if c not in _EVENT],
            *_EVENT,
        ).localCheckpoint(eager=True)
    touching: list[DataFrame] = [] if batch is None else [batch.select(*key)]
    if truncates:
        spanning = [
            (F.col(START) < sequence_literal(s))
            & (F.col(END).isNull() | (F.col(END) > sequence_literal(s)))
            for s, _ in truncates
        ]
        touching.append(current.where(reduce(lambda a, b: a | b, spanning)).select(*key))
    # One partition: the distinct keys of ~a batch need no shuffle.
    touched = reduce(DataFrame.unionByName, touching).coalesce(1).distinct()
    touched = touched.localCheckpoint(eager=True)
    reachable = current.where(F.expr(_reached(reach.since)))
    reading = [reachable.join(F.broadcast(touched), on=key, how="left_semi")]
    if reach.tombstone_path is not None:
        tombstones = spark.read.format("delta").load(reach.tombstone_path)
        reading.append(
            tombstones.join(F.broadcast(touched), on=key, how="left_semi").select(*key, SEQUENCE)
        )
    known, *earlier = _computed_side_by_side(*reading)

    versions = rebuilt_versions(
        spark,
        table,
        key,
        batch,
        known,
        touched,
        earlier[0] if earlier else None,
        reach.truncate_path,
        truncates,
        fillable,
    )
    rebuilt = versions.localCheckpoint(eager=True)  # read before the write changes its target
    changed = changed_versions(key, known, rebuilt)
    _replace_versions(table.path, key, reach.since, changed, known.columns, progress)


def _reached(since: list[int], table: str | None = None) -> str:
    """The versions a batch whose oldest event is at ``since`` can change (``Reach``).

    As SQL: the read filters on it, and the write's ``replaceOn`` condition names it
    (``table``: the alias the history's columns go by there).
    """
    end = f"`{END}`" if table is None else f"{table}.`{END}`"
    at = ", ".join(f"CAST({int(v)} AS BIGINT)" for v in since)
    return f"({end} IS NULL OR {end} >= array({at}))"


def _computed_side_by_side(*frames: DataFrame) -> list[DataFrame]:
    """Each of ``frames`` computed (a local checkpoint), all at once.

    Reading a Delta table for a few keys is mostly waiting on the driver (the table's
    snapshot, planning, small jobs), so two such reads overlap well.
    """
    computed = list(frames)

    def compute(number: int) -> None:
        computed[number] = frames[number].localCheckpoint(eager=True)

    side_by_side([partial(compute, n) for n in range(len(frames))])
    return computed


def _typed(schema: T.StructType, name: str) -> Column:
    """Column ``name`` cast to history's type of it (a column history lacks: as it is)."""
    column = F.col(f"`{name}`")
    return column.try_cast(schema[name].dataType) if name in schema.fieldNames() else column


def rebuilt_versions(
    spark: SparkSession,
    table: HistoryTable,
    key: list[str],
    batch: DataFrame | None,
    known: DataFrame,
    touched: DataFrame,
    tombstones: DataFrame | None,
    truncate_path: str | None,
    truncates: list[tuple[list[int], object]],
    fillable: Sequence[str] = (),
) -> DataFrame:
    """The ``touched`` keys' versions rebuilt, and the held ones now begun by none.

    Rebuilt from every event known of them; the rows to delete as ``_versions`` says.

    ``known`` are the rows the history holds of them, read back as events: each folded
    event an upsert with the version's tracked values and the event's own untracked ones,
    the version's end a delete. With them: the ``batch``'s events and ``truncates``, the
    keys' ``tombstones`` and every truncate remembered (at ``truncate_path``), each
    unless None (``Reach``).

    When two of these share a (key, sequence), the first by priority is kept: the batch's
    upserts, the history's, the history's ends, the batch's deletes and truncates, then
    tombstones and remembered truncates (their source time is unknown). An end the history
    holds wins over the batch's delete at the same sequence, so a replayed delete does not
    fill in a source time the first pass did not know: a replay changes nothing.
    """
    schema = known.schema
    row_columns = [] if batch is None else [c for c in batch.columns if c not in _EVENT]
    columns = list(
        dict.fromkeys([*[f.name for f in schema.fields if f.name not in _META], *row_columns])
    )
    untracked = table.config.untracked_columns(columns, key)
    types = {f.name: f.dataType for f in schema.fields}
    if batch is not None:
        types = {f.name: f.dataType for f in batch.schema.fields} | types
    values_type = T.StructType([T.StructField(c, types[c], True) for c in untracked])

    parts: list[DataFrame] = []
    if batch is not None:
        parts.append(
            batch.select("*", F.when(F.col(OP) == DELETE, 3).otherwise(0).alias(_PRIORITY))
        )

    def deletes(frame: DataFrame, priority: int) -> DataFrame:
        return frame.select(
            *key,
            SEQUENCE,
            F.lit(DELETE).alias(OP),
            F.col(SOURCE_TS).cast(T.TimestampType()).alias(SOURCE_TS),
            F.lit(priority).alias(_PRIORITY),
        )

    held = [c for c in known.columns if c not in _META]
    each = known.select(*held, START, F.explode(FOLDED).alias("_f")).select(
        *[F.col(f"`{c}`") for c in held if c not in untracked],
        F.from_json(F.col(f"_f.{UNTRACKED}"), values_type, _JSON).alias("_v"),
        F.col(f"_f.{SEQUENCE}").alias(SEQUENCE),
        F.lit("u").alias(OP),
        F.col(f"_f.{SOURCE_TS}").alias(SOURCE_TS),
        F.lit(1).alias(_PRIORITY),
        (F.col(f"_f.{SEQUENCE}") == F.col(START)).alias(_HELD),
    )
    parts.append(each.select("*", *[F.col(f"_v.`{c}`").alias(c) for c in untracked]).drop("_v"))
    ended = known.where(F.col(END).isNotNull())
    parts.append(
        deletes(ended.select(*key, F.col(END).alias(SEQUENCE), F.col(END_TS).alias(SOURCE_TS)), 2)
    )
    if truncates:
        closing = frame_from_rows(spark, [(s, at) for s, at in truncates], _TRUNCATES)
        parts.append(deletes(closing.crossJoin(touched), 3))
    earlier = [] if tombstones is None else [tombstones]
    if truncate_path is not None:
        remembered = spark.read.format("delta").load(truncate_path).select(SEQUENCE)
        earlier.append(remembered.crossJoin(touched))
    if earlier:
        unknown_time = F.lit(None).cast(T.TimestampType()).alias(SOURCE_TS)
        parts.append(deletes(reduce(DataFrame.unionByName, earlier).select("*", unknown_time), 4))
    every = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    return _versions(every, key, columns, untracked, fillable)


#: History's own columns (the period and the newest event folded into the version).
_META = (*PERIOD, SEQUENCE, SOURCE_TS, FOLDED)
#: An event's columns besides the row's.
_EVENT = (SEQUENCE, OP, SOURCE_TS, UNSENT)
#: Folded events' untracked values as JSON: timestamps to the microsecond (the default
#: keeps milliseconds), so a value read back is the value written.
_JSON = {
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
    "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
}
#: A batch's truncates: sequence and source time.
_TRUNCATES = T.StructType(
    [
        T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
        T.StructField(SOURCE_TS, T.TimestampType(), True),
    ]
)


def _versions(
    events: DataFrame,
    key: list[str],
    columns: list[str],
    untracked: list[str],
    fillable: Sequence[str] = (),
) -> DataFrame:
    """Versions from events: dedupe by (key, sequence), order, fold, ends from lead().

    One shuffle by key: every window and the grouping are within a key. A version's end
    is the event after its last upsert (the next version's first, or a delete). Besides
    the versions (``_cdc_drop`` false), the (key, ``__start_at``) of each version the
    history held that begins no version any more (``_cdc_drop`` true: an older event with
    the same tracked values moved its start), so its key's rows are replaced.
    """
    by_key = events.repartition(*key)
    at = Window.partitionBy(*key, SEQUENCE)
    same = at.orderBy(F.col(_PRIORITY), F.col(SOURCE_TS).desc_nulls_last())
    unique = (
        by_key.withColumn("_n", F.row_number().over(same))
        .withColumn(_HELD, F.max(F.coalesce(F.col(_HELD), F.lit(False))).over(at))
        .where(F.col("_n") == 1)
    )
    order = Window.partitionBy(*key).orderBy(SEQUENCE)
    running = order.rowsBetween(Window.unboundedPreceding, 0)
    unique = _with_prior_values(unique, key, order, [c for c in fillable if c in columns])
    tracked_names = [c for c in columns if c not in key and c not in untracked]
    types = {f.name: f.dataType for f in unique.schema.fields}
    tracked = (
        F.struct(*[_comparable(c, types[c]) for c in tracked_names])
        if tracked_names
        else F.lit(True)
    )
    is_delete = F.col(OP) == DELETE
    before = F.lag(OP).over(order)
    new_version = ~is_delete & (
        before.isNull() | (before == DELETE) | ~F.lag(tracked).over(order).eqNullSafe(tracked)
    )
    flagged = unique.select(
        "*",
        new_version.alias("_new"),
        F.lead(SEQUENCE).over(order).alias("_next"),
        F.lead(SOURCE_TS).over(order).alias("_next_ts"),
    )
    upserts = flagged.withColumn("_version", F.sum(F.col("_new").cast("int")).over(running)).where(
        ~is_delete
    )
    others = [c for c in columns if c not in key]
    newest = F.max_by(
        F.struct(*[F.col(f"`{c}`") for c in others], SEQUENCE, SOURCE_TS, "_next", "_next_ts"),
        F.col(SEQUENCE),
    )
    first = F.min_by(F.struct(SEQUENCE, SOURCE_TS), F.col(SEQUENCE))
    values = F.to_json(F.struct(*[F.col(f"`{c}`") for c in untracked]), _JSON)
    grouped = upserts.groupBy(*key, "_version").agg(
        first.alias("_first"),
        newest.alias("_newest"),
        F.array_sort(F.collect_list(F.struct(SEQUENCE, SOURCE_TS, values.alias(UNTRACKED)))).alias(
            FOLDED
        ),
    )
    gone = flagged.where(F.col(_HELD) & ~F.col("_new")).select(
        *key, F.col(SEQUENCE).alias(START), F.lit(True).alias(_DROP)
    )
    versions = grouped.select(
        *key,
        *[F.col(f"_newest.`{c}`").alias(c) for c in others],
        F.col(f"_first.{SEQUENCE}").alias(START),
        F.col("_newest._next").alias(END),
        F.col(f"_first.{SOURCE_TS}").alias(START_TS),
        F.col("_newest._next_ts").alias(END_TS),
        F.col(f"_newest.{SEQUENCE}").alias(SEQUENCE),
        F.col(f"_newest.{SOURCE_TS}").alias(SOURCE_TS),
        FOLDED,
        F.lit(False).alias(_DROP),
    )
    return versions.unionByName(gone, allowMissingColumns=True)


def _comparable(name: str, data_type: T.DataType) -> Column:
    """Column ``name`` in a form ``<=>`` can compare: a map as its entries sorted by key.

    Spark orders no map type, so two versions' maps are compared as sorted arrays.
    """
    column = F.col(f"`{name}`")
    if isinstance(data_type, T.MapType):
        return F.array_sort(F.map_entries(column)).alias(name)
    return column


def _with_prior_values(
    events: DataFrame, key: list[str], order: WindowSpec, columns: list[str]
) -> DataFrame:
    """Each column an event did not send (``UNSENT``) filled from the key's previous event.

    The previous upsert, in sequence order, that sent the column since the key's last
    delete; a null when there is none, as silver stores it (a deleted row holds nothing
    to keep). So a batch needs no version that a delete ended before its oldest event
    (``Reach``). Events read back from the history have no ``UNSENT``: their values were
    filled when they were first written.
    """
    if UNSENT not in events.columns:
        return events
    deletes_so_far = F.sum((F.col(OP) == DELETE).cast("int")).over(
        order.rowsBetween(Window.unboundedPreceding, 0)
    )
    events = events.withColumn(_LIFE, deletes_so_far)
    before = (
        Window.partitionBy(*key, _LIFE).orderBy(SEQUENCE).rowsBetween(Window.unboundedPreceding, -1)
    )
    sent_upsert = F.col(OP) != DELETE
    filled = {}
    for name in columns:
        unsent = F.coalesce(F.array_contains(F.col(UNSENT), name), F.lit(False))
        prior = F.last(
            F.when(sent_upsert & ~unsent, F.struct(F.col(f"`{name}`").alias("v"))),
            ignorenulls=True,
        ).over(before)
        filled[name] = F.when(unsent, prior["v"]).otherwise(F.col(f"`{name}`"))
    return events.withColumns(filled).drop(_LIFE)


def changed_versions(key: list[str], known: DataFrame, versions: DataFrame) -> DataFrame:
    """The versions of the keys whose versions changed: the rows to write for them.

    ``versions`` (``rebuilt_versions``, computed) also name the rows to delete
    (``_cdc_drop``): versions the history held that begin no version any more; ``known``:
    the rows the history held of the touched keys. A key changed when one of its versions
    is new, differs from the one ``known`` holds at the same (key, ``__start_at``), or is
    dropped; a key with a dropped version always keeps one (the older event that moved
    its start begins it). A replay changes no key, so this is empty.
    """
    columns = [c for c in versions.columns if c != _DROP]
    kept = versions.where(~F.col(_DROP)).select(*columns)
    if not set(columns) <= set(known.columns):
        return kept  # a new column: every touched key's rows gain it
    types = {f.name: f.dataType for f in versions.schema.fields}
    held = known.select(*[F.col(f"`{c}`").alias(f"_held_{c}") for c in columns])
    same_version = [F.col(f"`{c}`") == F.col(f"`_held_{c}`") for c in [*key, START]]
    differs = [
        ~_comparable(c, types[c]).eqNullSafe(_comparable(f"_held_{c}", types[c])) for c in columns
    ]
    changed_rows = kept.join(F.broadcast(held), same_version, "left").where(
        F.col(f"`_held_{START}`").isNull() | reduce(lambda a, b: a | b, differs)
    )
    changed = changed_rows.select(*key).unionByName(versions.where(F.col(_DROP)).select(*key))
    return kept.join(F.broadcast(changed), on=key, how="left_semi")


@on_conflict_retry
def _replace_versions(
    path: str,
    key: list[str],
    since: list[int],
    versions: DataFrame,
    order: list[str],
    progress: Progress | None = None,
) -> None:
    """Replace the rows a batch reached (``Reach``) of the keys in ``versions``, in one commit.

    Delta's ``replaceOn``: the rows of those keys open or ending at ``since`` or later,
    deleted (Delta reads the key and end columns of the history's files and marks them
    in deletion vectors), then ``versions`` appended, in one overwrite; the history's
    large files are read once and none is rewritten (a MERGE read them twice, whole).
    Nothing to write: no commit but ``progress``'s own. ``order``: the history's columns
    as read (a new column goes last).
    """
    counted, rows = Observation(), [F.count(F.lit(1)).alias("rows")]
    # Computed once: the delete and the append both read it.
    changed = versions.observe(counted, *rows).localCheckpoint(eager=True)
    spark = versions.sparkSession
    if not int(observed(counted, versions, rows)["rows"]):
        if progress is not None:
            record_progress(spark, path, progress)
        return
    columns = [c for c in order if c in versions.columns]
    writer = (
        changed.select(*columns, *[c for c in versions.columns if c not in columns])
        .alias("s")
        .write.format("delta")
        .mode("overwrite")
        .option("targetAlias", "t")
        .option("replaceOn", _replace_condition(key, since))
        .option("mergeSchema", "true")
    )
    if progress is not None:
        writer = writer.option("txnAppId", progress[0]).option("txnVersion", progress[1])
    writer.save(path)


def _replace_condition(key: list[str], since: list[int]) -> str:
    """The rows ``replaceOn`` deletes: the key's (``s``), reached by the batch (``Reach``)."""
    same_key = " AND ".join(f"t.`{k}` = s.`{k}`" for k in key)
    return f"{same_key} AND {_reached(since, 't')}"
