"""Applying one micro-batch of bronze events to silver: the merger's core, as plain functions.

Per batch: set aside events that cannot be applied (for quarantine), apply a truncate
(``op=t``) by deleting every row older than it, keep the latest event per key by its
``sequence`` (compared element by element), drop upserts not newer than the key's
tombstone or the last truncate (both kept in memory, ``MergeState``), then one MERGE into
silver that updates or deletes only when the event is newer than the row, and inserts
only what is absent (into an empty silver, an append of the same inserts). Deletes also
record a tombstone (key + sequence) in a side table, so a late older event cannot
resurrect the row after a restart. Every step compares sequences, so applying the same
batch twice changes nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from cdc_shared.contracts.silver import COMMIT_TS, DELETED_AT, OP, SEQUENCE, SOURCE_TS
from cdc_shared.contracts.silver_side_tables import TRUNCATE_SCHEMA
from cdc_shared.contracts.unavailable import DEBEZIUM_PLACEHOLDER, UNAVAILABLE, Placeholder
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.jvm.spark import clock, observed
from cdc_shared.streaming.observability import Stopwatch
from cdc_shared.streaming.tables import (
    Progress,
    holds_no_rows,
    idempotent_append,
    idempotent_dml,
    on_conflict_retry,
    record_progress,
)
from delta.tables import DeltaMergeBuilder, DeltaTable
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_merger.guards import NewestSequence, TombstoneIndex, key_values, sequence_literal
from cdc_merger.history import (
    Reach,
    history_events,
    write_history,
)
from cdc_merger.silver_tables import SilverLayout

log = logging.getLogger("cdc_merger")

UPSERT_OPS = ("c", "u", "r")  # r: a snapshot read, applied like an insert
DELETE = "d"
TRUNCATE = "t"
ERROR_KIND = "_cdc_error_kind"
ERROR_MESSAGE = "_cdc_error_message"
#: Every delete sequence of the key in the batch (``latest_per_key(every_delete=True)``).
DELETES = "_cdc_deletes"

#: The placeholder a batch recognises unless told otherwise (Debezium's default).
DEFAULT_PLACEHOLDER = Placeholder.of(DEBEZIUM_PLACEHOLDER)


def without_columns(events: DataFrame, dropped: Sequence[str]) -> DataFrame:
    """Bronze events whose row images (``after``) lack the ``dropped`` columns.

    The entity's column selection (``columns`` / ``except_columns``): silver, and the
    change topic and index made from it, never see those columns; bronze keeps them.
    A delete's null ``after`` stays null.
    """
    if not dropped:
        return events
    return events.withColumn("after", F.col("after").dropFields(*dropped))


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


def latest_per_key(
    events: DataFrame,
    key: list[str],
    silver: T.StructType,
    placeholder: Placeholder | None = None,
    null_updates: Collection[str] = (),
    every_delete: bool = False,
) -> DataFrame:
    """The newest upsert or delete per key (by sequence), as flat silver-shaped rows.

    Values are cast to silver's column types (the events were checked castable); rows keep
    ``_cdc_op`` so a delete can be told from an upsert. A column whose newest value the
    source did not send (with a ``placeholder``: the source's unavailable-value
    placeholder; for the ``null_updates`` columns: a null in an update) takes the newest
    value an earlier event of the key in this batch did send; where none did, the value
    is null and the column is named in ``_cdc_unavailable`` (silver's value is then kept
    by the MERGE, see :func:`silver_merge`). With ``every_delete``, ``_cdc_deletes``
    holds the sequence of every delete of the key in the batch (a history needs each).
    """
    after = events.schema["after"].dataType
    assert isinstance(after, T.StructType)
    row_fields = [f.name for f in after.fields]
    spotted = unavailable_columns(after, key, placeholder, null_updates)

    def value(name: str) -> Column:
        column = F.col(f"after.{name}")
        return column.try_cast(silver[name].dataType) if name in silver.fieldNames() else column

    # Per spotted column: the event's sequence where it sends a value, else null.
    seen = {name: f"_cdc_seen_{i}" for i, name in enumerate(spotted)}
    real: list[Column] = []
    for name in spotted:
        unsent = not_sent(F.col(f"after.{name}"), after[name], placeholder, null_updates)
        carries = (F.col("op") != DELETE) & ~F.coalesce(unsent, F.lit(False))
        real.append(F.when(carries, F.col("sequence")).alias(seen[name]))

    applicable = ~F.col("is_tombstone") & F.col("op").isin(*UPSERT_OPS, DELETE)
    flat = events.where(applicable).select(
        *[F.col(f"key.{k}").try_cast(silver[k].dataType).alias(k) for k in key],
        *[value(f).alias(f) for f in row_fields if f not in key],
        F.col("sequence").alias(SEQUENCE),
        F.col("op").alias(OP),
        F.timestamp_millis(F.col("source.ts_ms")).alias(SOURCE_TS),
        *real,
    )
    others = [c for c in flat.columns if c not in key]
    newest = F.max_by(F.struct(*others), F.col(SEQUENCE)).alias("newest")
    carried = [
        agg
        for name in spotted
        for agg in (
            F.max_by(F.col(f"`{name}`"), F.col(seen[name])).alias(f"{seen[name]}_value"),
            F.max(F.col(seen[name])).alias(f"{seen[name]}_max"),
        )
    ]
    deleted = F.collect_list(F.when(F.col(OP) == DELETE, F.col(SEQUENCE))).alias(DELETES)
    grouped = flat.groupBy(*key).agg(newest, *carried, *([deleted] if every_delete else []))
    deletes = [DELETES] if every_delete else []
    if not spotted:
        return grouped.select(*key, "newest.*", *deletes)

    def missing(name: str) -> Column:
        return F.col(f"newest.{seen[name]}").isNull() & (F.col(f"newest.{OP}") != DELETE)

    def resolved(name: str) -> Column:
        return F.when(missing(name), F.col(f"{seen[name]}_value")).otherwise(
            F.col(f"newest.`{name}`")
        )

    still_missing = [
        F.when(missing(name) & F.col(f"{seen[name]}_max").isNull(), F.lit(name)) for name in spotted
    ]
    return grouped.select(
        *key,
        *[
            resolved(c).alias(c) if c in seen else F.col(f"newest.`{c}`").alias(c)
            for c in others
            if c not in seen.values()
        ],
        F.filter(F.array(*still_missing), lambda name: name.isNotNull()).alias(UNAVAILABLE),
        *deletes,
    )


def unavailable_columns(
    after: T.StructType,
    key: list[str],
    placeholder: Placeholder | None,
    null_updates: Collection[str] = (),
) -> list[str]:
    """The row's non-key columns an event may leave unsent (none when both are off).

    Those of a type that can carry the placeholder, and those named in ``null_updates``.
    """
    return [
        f.name
        for f in after.fields
        if f.name not in key
        and (f.name in null_updates or (placeholder is not None and placeholder.spots(f.dataType)))
    ]


def not_sent(
    value: Column,
    field: T.StructField,
    placeholder: Placeholder | None,
    null_updates: Collection[str],
) -> Column:
    """True where an event did not send the column's value, so its prior value is kept.

    The two ways a column keeps its prior value, side by side: the source's
    unavailable-value placeholder (a TOASTed PostgreSQL value left alone), and, for the
    entity's ``ignore_null_updates`` columns, a null in an update (a source that sends
    only changed fields). Inserts and snapshot reads always send their values.
    """
    unsent: Column = F.lit(False)
    is_placeholder = None if placeholder is None else placeholder.matches(value, field.dataType)
    if is_placeholder is not None:
        unsent = unsent | F.coalesce(is_placeholder, F.lit(False))
    if field.name in null_updates:
        unsent = unsent | ((F.col("op") == "u") & value.isNull())
    return unsent


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
    #: Per column: values the source did not send that no earlier event nor silver held
    #: (stored null).
    unavailable: dict[str, int] = dataclass_field(default_factory=dict)


class MergeState:
    """What a long-lived merger keeps from batch to batch for one entity.

    The in-memory guards (the truncate floor and the tombstone index), the newest
    tombstone (for the history), and silver's schema: the merger is silver's only
    writer, so the schema changes only when a batch brings a column silver lacks (the
    MERGE then adds it), and is read again then.
    """

    def __init__(self, spark: SparkSession, layout: SilverLayout) -> None:
        self._spark = spark
        self._silver_path = layout.silver_path
        self.truncates = NewestSequence(spark, layout.truncate_path)
        self.tombstones = TombstoneIndex.over(
            spark, layout.tombstone_path, layout.silver_path, layout.key
        )
        self.newest_delete = NewestSequence(spark, layout.tombstone_path)
        #: Whether this process wrote silver yet: until then silver may be empty (read).
        self.silver_written = False
        self._schema: T.StructType | None = None

    def silver_schema(self, events: DataFrame) -> T.StructType:
        """Silver's schema, read again when the events carry a column silver lacks."""
        after = events.schema["after"].dataType
        assert isinstance(after, T.StructType)
        if self._schema is None or not set(after.fieldNames()) <= set(self._schema.fieldNames()):
            self._schema = DeltaTable.forPath(self._spark, self._silver_path).toDF().schema
        return self._schema


#: The error condition of a job that reads a local checkpoint whose blocks went with a
#: lost executor.
LOST_CHECKPOINT = "CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND"


def lost_local_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` is the loss of a batch's MERGE source with an executor.

    The source is a local checkpoint, held by executors; bronze still holds the batch, so
    applying it again is safe.
    """
    return LOST_CHECKPOINT in str(error)


def apply_batch(
    spark: SparkSession,
    events: DataFrame,
    layout: SilverLayout,
    quarantine: Callable[[DataFrame], None],
    state: MergeState | None = None,
    placeholder: Placeholder | None = DEFAULT_PLACEHOLDER,
    dropped: Sequence[str] = (),
    null_updates: Collection[str] = (),
    progress: Progress | None = None,
) -> ApplyResult:
    """Apply one batch of bronze events to silver; idempotent.

    Events that cannot be applied are handed to ``quarantine`` (bronze rows plus
    ``_cdc_error_kind`` and ``_cdc_error_message``) and the rest is applied. A long-lived
    caller passes the same ``state`` every batch; without it the side tables are read.
    A column carrying ``placeholder`` (the source's unavailable value) keeps its prior
    value (``cdc_shared.contracts.unavailable``); None stores every value as sent. So does a
    ``null_updates`` column whose update brings a null (``ignore_null_updates``). The
    ``dropped`` columns of the rows (the entity's column selection) are left out of
    silver; the quarantine keeps whole bronze rows. ``progress`` (an app id and the
    source version the events reach) is recorded in silver's log with the MERGE (Delta's
    idempotent writes), or alone when the batch merges nothing: a batch run again under
    the same progress writes nothing twice. The entity's history is written apart
    (:func:`apply_history`), after this step has committed.

    Spark jobs: one computes the newest event per key and the batch's counts (observed
    metrics, no extra pass); a second brings the offered keys and sequences to the driver
    (the tombstone index is consulted and updated there); then the tombstones' append,
    then the MERGE.
    """
    key = layout.key
    state = state or MergeState(spark, layout)
    lap = Stopwatch()
    silver = state.silver_schema(without_columns(events, dropped))
    kind, message = rejection(events, key, silver)
    # Kafka tombstones (a null value after a delete) carry nothing to apply.
    checked = events.withColumn(ERROR_KIND, F.when(~F.col("is_tombstone"), kind))
    batch, metrics = Observation(), _batch_metrics()  # a unique name: batches run at once
    valid = checked.observe(batch, *metrics).where(F.col(ERROR_KIND).isNull()).drop(ERROR_KIND)
    rows = without_columns(valid, dropped)
    every_delete = layout.history is not None  # a history needs each delete's tombstone
    latest = latest_per_key(rows, key, silver, placeholder, null_updates, every_delete)
    # A local checkpoint: the MERGE (which reads its source twice) and the tombstones'
    # append then read computed rows instead of planning bronze's read again.
    newest = latest.withColumn(COMMIT_TS, clock()).localCheckpoint(eager=True)
    candidates = _newer_than(newest, state.truncates.get())
    summary = observed(batch, checked, metrics)
    lap("prepare")
    rejected = int(summary["rejected"])
    if rejected:
        quarantine(checked.where(F.col(ERROR_KIND).isNotNull()).withColumn(ERROR_MESSAGE, message))
        lap("quarantine")
    truncate = summary["truncate"]
    if truncate is not None:
        truncate = [int(v) for v in truncate]
        _truncate(spark, layout, truncate, [list(t[0]) for t in summary["truncates"]])
        state.truncates.raise_to(truncate)
        candidates = _newer_than(candidates, truncate)
        lap("truncate")
    offered = Offered.of(candidates, key) if int(summary["applicable"]) else Offered.none()
    stale = state.tombstones.stale_upserts(offered.upserts) if offered.upserts.num_rows else []
    if stale:
        candidates = _without_keys(spark, candidates, key, stale)
        offered = offered.without(stale, key)
    lap("guard")
    unavailable: dict[str, int] = {}
    if offered.unavailable:
        unavailable = _unavailable_without_prior(spark, candidates, layout)
        lap("unavailable")
    tombstones = _tombstones(newest, candidates, layout.key, every_delete, summary, offered)
    after = rows.schema["after"].dataType
    assert isinstance(after, T.StructType)
    kept = unavailable_columns(after, key, placeholder, null_updates)
    kept = [c for c in kept if c in silver.fieldNames()]
    merged = candidates if offered.keys else None
    _write_silver(spark, merged, tombstones, layout, kept, progress, not state.silver_written)
    state.silver_written = state.silver_written or merged is not None
    if offered.keys:  # (``Offered.none()`` has no key columns to read)
        state.tombstones.record(offered.deletes, offered.upserts)
    lap("merge")
    return ApplyResult(
        events=int(summary["events"]),
        rejected=rejected,
        keys=offered.keys,
        deletes=offered.deletes.num_rows,
        truncated=truncate is not None,
        ingested_until=summary["ingested_until"],
        step_ms=lap.laps,
        unavailable=unavailable,
    )


def _newer_than(candidates: DataFrame, sequence: list[int] | None) -> DataFrame:
    """The ``candidates`` newer than ``sequence`` (a truncate's); all when it is None."""
    if sequence is None:
        return candidates
    return candidates.where(F.col(SEQUENCE) > sequence_literal(sequence))


def _tombstones(
    newest: DataFrame,
    candidates: DataFrame,
    key: list[str],
    every_delete: bool,
    summary: dict[str, Any],
    offered: Offered,
) -> DataFrame | None:
    """The tombstones the batch records (key, sequence, time), None when it has none.

    Silver needs each key's newest delete it applies (the ``candidates``' deletes). An
    entity with a history needs every delete of the batch (``newest``, read before
    truncates and tombstones filtered it): a delete that ended no version yet ends the
    one a later-arriving older event begins. Silver records them for both, so the two
    steps of a batch do not both append to the tombstones.
    """
    if every_delete:
        if not int(summary["deletes"]):
            return None
        sequence = F.explode(DELETES).alias(SEQUENCE)
        return newest.select(*key, sequence, F.col(COMMIT_TS).alias(DELETED_AT))
    if not offered.deletes.num_rows:
        return None
    deletes = candidates.where(F.col(OP) == DELETE)
    return deletes.select(*key, SEQUENCE, F.col(COMMIT_TS).alias(DELETED_AT))


def _history_reach(layout: SilverLayout, state: MergeState, summary: dict[str, Any]) -> Reach:
    """How far into the history the batch reaches (``Reach``).

    Its oldest event, and the side tables holding something newer than it. Then the
    newest tombstone is raised to the batch's deletes (silver's step records them,
    beside this step).
    """
    since = [int(v) for v in summary["oldest"]]

    def holds_newer(table: NewestSequence) -> bool:
        newest = table.get()
        return newest is not None and since <= newest

    tombstones, truncates = holds_newer(state.newest_delete), holds_newer(state.truncates)
    if summary["newest_delete"] is not None:
        state.newest_delete.raise_to([int(v) for v in summary["newest_delete"]])
    return Reach(
        since=since,
        tombstone_path=layout.tombstone_path if tombstones else None,
        truncate_path=layout.truncate_path if truncates else None,
    )


def apply_history(
    spark: SparkSession,
    events: DataFrame,
    layout: SilverLayout,
    state: MergeState,
    placeholder: Placeholder | None = DEFAULT_PLACEHOLDER,
    dropped: Sequence[str] = (),
    null_updates: Collection[str] = (),
    progress: Progress | None = None,
) -> int:
    """Bring the entity's history up to ``events``, which silver's step applied; idempotent.

    Run after silver's step of the same events has committed (``apply_batch``): the
    history is rebuilt from the events (their deletes included), the history's rows, the
    tombstones (silver's step records every delete of an entity with a history) and the
    truncates. A column an event did not send (its ``placeholder``, or a null update of a
    ``null_updates`` column) takes the key's prior value in the history, as in silver.
    ``progress`` is recorded with the history's write, or alone when the events change
    nothing there. Returns how many events were applicable.
    """
    history = layout.history
    assert history is not None
    key = layout.key
    silver = state.silver_schema(without_columns(events, dropped))
    kind, _ = rejection(events, key, silver)
    checked = events.withColumn(ERROR_KIND, F.when(~F.col("is_tombstone"), kind))
    row = checked.agg(*_batch_metrics()).first()
    assert row is not None  # an aggregate without grouping has one row
    summary = row.asDict(recursive=False)
    rows = without_columns(checked.where(F.col(ERROR_KIND).isNull()).drop(ERROR_KIND), dropped)
    after = rows.schema["after"].dataType
    assert isinstance(after, T.StructType)
    unsent = {
        name: not_sent(F.col(f"after.`{name}`"), after[name], placeholder, null_updates)
        for name in unavailable_columns(after, key, placeholder, null_updates)
    }
    applicable = int(summary["applicable"])
    history_rows = history_events(rows, key, unsent) if applicable else None
    if history_rows is None and not summary["truncates"]:
        if progress is not None:
            record_progress(spark, history.path, progress)
        return applicable
    closing = sorted(([int(v) for v in sequence], at) for sequence, at in summary["truncates"])
    reach = _history_reach(layout, state, summary)
    write_history(spark, history, key, history_rows, reach, closing, list(unsent), progress)
    return applicable


def _batch_metrics() -> list[Column]:
    """Counted while the batch is read: events, rejected, applicable, truncate, ingest time.

    ``truncates``: every truncate's sequence and source time (history closes at each).
    """
    error = F.col(ERROR_KIND)
    op = F.col("op")
    applicable = error.isNull() & ~F.col("is_tombstone") & op.isin(*UPSERT_OPS, DELETE)
    return [
        F.count(F.lit(1)).alias("events"),
        F.count(error).alias("rejected"),
        F.count(F.when(applicable, 1)).alias("applicable"),
        F.count(F.when(applicable & (op == DELETE), 1)).alias("deletes"),
        F.max(F.when((op == TRUNCATE) & error.isNull(), F.col("sequence"))).alias("truncate"),
        F.min(F.when(applicable | ((op == TRUNCATE) & error.isNull()), F.col("sequence"))).alias(
            "oldest"
        ),
        F.max(F.when(applicable & (op == DELETE), F.col("sequence"))).alias("newest_delete"),
        F.collect_set(
            F.when(
                (op == TRUNCATE) & error.isNull(),
                F.struct(F.col("sequence"), F.timestamp_millis(F.col("source.ts_ms"))),
            )
        ).alias("truncates"),
        F.max("ingested_at").alias("ingested_until"),
    ]


@dataclass(frozen=True)
class Offered:
    """The keys and sequences a batch offers silver, on the driver, split by kind."""

    upserts: pa.Table
    deletes: pa.Table
    #: Upserts with a value neither the batch nor the event carries (silver may hold it).
    unavailable: int = 0

    @classmethod
    def of(cls, candidates: DataFrame, key: list[str]) -> Offered:
        """Collect the candidates' keys, sequences and ops (one small Spark job)."""
        pending = UNAVAILABLE in candidates.columns
        table = candidates.select(
            *[F.col(f"`{k}`") for k in key],
            SEQUENCE,
            OP,
            *([(F.size(UNAVAILABLE) > 0).alias(UNAVAILABLE)] if pending else []),
        ).toArrow()
        unavailable = 0
        if pending:
            unavailable = int(pc.sum(table.column(UNAVAILABLE).cast(pa.int64())).as_py() or 0)
            table = table.drop_columns([UNAVAILABLE])
        is_delete = pc.equal(table.column(OP), DELETE)
        return cls(table.filter(pc.invert(is_delete)), table.filter(is_delete), unavailable)

    @classmethod
    def none(cls) -> Offered:
        """Nothing offered (every event was rejected, a truncate or a Kafka tombstone)."""
        empty = pa.table({SEQUENCE: pa.array([], pa.list_(pa.int64()))})
        return cls(empty, empty)

    @property
    def keys(self) -> int:
        """How many keys the batch offers silver."""
        return int(self.upserts.num_rows + self.deletes.num_rows)

    def without(self, stale: list[Hashable], key: list[str]) -> Offered:
        """The same without the given upserts' keys."""
        drop = set(stale)
        keep = [k not in drop for k in key_values(self.upserts, key)]
        return Offered(
            self.upserts.filter(pa.array(keep, pa.bool_())), self.deletes, self.unavailable
        )


def _without_keys(
    spark: SparkSession, candidates: DataFrame, key: list[str], keys: list[Hashable]
) -> DataFrame:
    """``candidates`` without the rows of ``keys`` (a broadcast anti-join on the key)."""
    schema = T.StructType([candidates.schema[k] for k in key])
    rows = [k if isinstance(k, tuple) else (k,) for k in keys]
    return candidates.join(
        F.broadcast(frame_from_rows(spark, rows, schema)), on=key, how="left_anti"
    )


def _on(key: list[str], target: str, source: str) -> str:
    return " AND ".join(f"{target}.`{k}` = {source}.`{k}`" for k in key)


@on_conflict_retry
def _truncate(
    spark: SparkSession, layout: SilverLayout, sequence: list[int], every: list[list[int]]
) -> None:
    """Delete every row older than the truncate, then remember it (late events stay out).

    ``sequence`` is the batch's newest truncate; ``every`` one of the batch is remembered
    (the entity's history closes its versions at each).

    In this order a crash in between replays the delete, which then finds nothing.
    """
    DeltaTable.forPath(spark, layout.silver_path).delete(
        F.col(SEQUENCE) < sequence_literal(sequence)
    )
    now = dt.datetime.now(dt.UTC)
    marker = frame_from_rows(spark, [([int(v) for v in s], now) for s in every], TRUNCATE_SCHEMA)
    marker.write.format("delta").mode("append").save(layout.truncate_path)
    log.info("truncate at sequence %s applied to %s", sequence, layout.silver_path)


def _unavailable_without_prior(
    spark: SparkSession, candidates: DataFrame, layout: SilverLayout
) -> dict[str, int]:
    """Per column, the candidates' unavailable values whose key silver does not hold.

    Silver keeps its value for the others; these become null (one job, reading silver's
    key columns).
    """
    pending = candidates.where(F.size(UNAVAILABLE) > 0)
    held = DeltaTable.forPath(spark, layout.silver_path).toDF().select(*layout.key)
    counted = (
        pending.join(held, on=layout.key, how="left_anti")
        .select(F.explode(UNAVAILABLE).alias("column"))
        .groupBy("column")
        .count()
        .collect()
    )
    return {row["column"]: int(row["count"]) for row in counted}


def _write_silver(
    spark: SparkSession,
    candidates: DataFrame | None,
    tombstones: DataFrame | None,
    layout: SilverLayout,
    kept: list[str],
    progress: Progress | None,
    may_be_empty: bool = True,
) -> None:
    """The ``tombstones``' append, then the MERGE of ``candidates`` recording ``progress``.

    In this order: the MERGE's commit records the batch's progress, so once it is there
    the batch is done, its tombstones with it (a repeat of them, after a crash before the
    MERGE, is harmless: the newest per key counts). A batch merging nothing records its
    progress in a commit of its own.
    ``may_be_empty``: this process has not written silver yet, so its log is looked at
    for an empty silver (later writes skip that listing of the log).
    """
    if tombstones is not None:
        _record_tombstones(tombstones, layout.tombstone_path)
    if candidates is not None:
        _merge_silver(spark, candidates, layout, kept, progress, may_be_empty)
    elif progress is not None:
        record_progress(spark, layout.silver_path, progress)


@on_conflict_retry
def _merge_silver(
    spark: SparkSession,
    candidates: DataFrame,
    layout: SilverLayout,
    kept: list[str],
    progress: Progress | None,
    may_be_empty: bool,
) -> None:
    """Silver's MERGE, or its append into an empty silver (looked at until a first write)."""
    if may_be_empty and holds_no_rows(spark, layout.silver_path):
        _insert_into_empty(candidates, layout.silver_path, progress)
        return
    silver = DeltaTable.forPath(spark, layout.silver_path)
    with idempotent_dml(spark, progress):
        silver_merge(silver, candidates, layout.key, kept).execute()


def _insert_into_empty(candidates: DataFrame, path: str, progress: Progress | None) -> None:
    """Silver's MERGE into an empty silver: the upserts appended, as the MERGE inserts them.

    With no row to match, the MERGE would only insert; an append does the same in one
    job instead of the MERGE's many (a first start writes every table so). The merger is
    silver's only writer, so silver is still empty when the append commits.
    """
    rows = candidates.where(F.col(OP) != DELETE).select(*_silver_columns(candidates))
    if progress is None:
        rows.write.format("delta").mode("append").option("mergeSchema", "true").save(path)
    else:
        idempotent_append(rows, path, *progress, merge_schema=True)


def _silver_columns(candidates: DataFrame) -> list[str]:
    """The candidates' columns silver holds (the op last, as the MERGE writes it)."""
    return [c for c in candidates.columns if c not in (OP, UNAVAILABLE, DELETES)] + [OP]


def silver_merge(
    silver: DeltaTable, candidates: DataFrame, key: list[str], kept: list[str] | None = None
) -> DeltaMergeBuilder:
    """Silver's MERGE: update or delete only when newer, insert what is absent.

    An update keeps silver's value of each column in ``kept`` (columns silver has) that
    the row names in ``_cdc_unavailable``: the source did not send it.
    """
    columns = _silver_columns(candidates)
    inserted: dict[str, str | Column] = {f"`{c}`": f"s.`{c}`" for c in columns}
    updated: dict[str, str | Column] = {
        **inserted,
        **{
            f"`{c}`": f"CASE WHEN array_contains(s.{UNAVAILABLE}, '{c}') THEN t.`{c}` "
            f"ELSE s.`{c}` END"
            for c in (kept or [])
        },
    }
    newer = f"s.{SEQUENCE} > t.{SEQUENCE}"
    return (
        silver.alias("t")
        .merge(candidates.alias("s"), _on(key, "t", "s"))
        .whenMatchedDelete(condition=f"s.{OP} = '{DELETE}' AND {newer}")
        .whenMatchedUpdate(condition=f"s.{OP} != '{DELETE}' AND {newer}", set=updated)
        .whenNotMatchedInsert(condition=f"s.{OP} != '{DELETE}'", values=inserted)
        .withSchemaEvolution()
    )


@on_conflict_retry
def _record_tombstones(tombstones: DataFrame, path: str) -> None:
    """Append the batch's tombstones: a repeat is harmless, so a replay is too."""
    tombstones.coalesce(1).write.format("delta").mode("append").save(path)
