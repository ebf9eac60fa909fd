"""Benchmark: the merger's batch into a 1,000,000-row silver table, beside two others.

No servers needed: one local Spark session applies generated bronze batches (the real
bronze schema of the example ``customers`` entity) straight to silver, the way the
merger's foreachBatch does. Three variants, each on its own fresh silver table:

- baseline: the seed-style merge: dedup per key, then a plain MERGE (update all / insert /
  delete, no sequence checks, no tombstones) into a table with CDF, no deletion vectors;
- before: the merger's batch before the lean path (``merger_before.py``), on silver as
  the merger creates it (CDF and deletion vectors on);
- lean: the merger's ``apply_batch`` today, on the same kind of silver;
- lean-off: the same with the unavailable-value check off (``placeholder=None``), for
  what that check costs (``--variants baseline,lean-off,lean``);
- lean-cow: the same on a silver whose ``delta.enableDeletionVectors`` is false, so its
  MERGEs rewrite the files they touch (``--variants lean,lean-cow``; interleaved with
  lean, which is better: ``--copy-on-write``, and with ``--history`` both keep a history).

Each variant loads N rows, then merges ``--warmup`` 1,000-change batches it does not count
(the JVM needs many batches to reach its speed here), ``--small`` 1,000-change batches,
then ``--repeats`` batches of 10,000 and of 100,000 changes (80% updates, 15% inserts,
5% deletes; updated and deleted keys skewed toward the newest). Per batch it records the
wall time, the JVM's CPU seconds (by kind of thread: tasks, driver, JIT compiler,
garbage collector; ``jvm_cpu.py``), the Spark jobs the batch ran, the MERGE's own
``executionTimeMs`` (Delta's commit metrics) and the files in silver afterwards. Then a
drift run: ``--drift`` more 1,000-change batches with the lean path into a fresh 1M-row
silver, no maintenance; it prints the p50 of the first and last 20 batches, the slowest
batches and the files left.

    .venv/bin/python tests/bench/bench_merger.py [--rows 1000000] [--small 20]
        [--repeats 3] [--drift 200] [--conf KEY=VALUE ...]

``--history`` runs only the history comparison: the lean path with the entity's SCD
type 2 history off and on (every column tracked, the default), each on its own fresh
silver of ``--rows`` rows; for history on, the history table holds one current version
per silver row, written straight in the merger's history schema (``history_schema``
via ``ensure_tables``) and checked on a sample against the merger's own rebuild
(``rebuilt_versions``). Then ``--warmup`` + ``--small`` 1,000-change batches, each
applied to both as the merger applies a table's batch, the order flipping every batch:
silver's step (``apply_batch``), then, with history on, the history's step
(``apply_history``), run once silver's has committed (the merger queues it as a write of
its own; it reads the batch from bronze again there, here both steps read the same
computed batch). Side by side (p50): batch seconds (both steps) and p95, on/off, each
step's seconds, ``apply_batch``'s laps, the silver MERGE and the history step's parts
(reading and the rebuild; its replacing write, with Delta's ``operationMetrics``), Spark
jobs, and the files and MiB each batch's scans read per table (from Spark's status
store). At the end it
checks history on gained a write per batch and one current version per silver row,
history off has no history table, and the two silvers agree. The full run, alone on
the machine (about 15 minutes)::

    .venv/bin/python tests/bench/bench_merger.py --history --rows 1000000 --warmup 8 --small 20

A smoke run: ``--history --rows 20000 --warmup 1 --small 3``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, decode  # noqa: E402
from cdc_merger import apply as merger_apply  # noqa: E402
from cdc_merger import history as merger_history  # noqa: E402
from cdc_merger.apply import DEFAULT_PLACEHOLDER, MergeState, apply_batch  # noqa: E402
from cdc_merger.history import (  # noqa: E402
    FOLDED,
    UNSENT,
    UNTRACKED,
    HistoryTable,
    rebuilt_versions,
)
from cdc_merger.silver_tables import (  # noqa: E402
    SilverLayout,
    ensure_tables,
    silver_schema,
    tombstone_schema,
)
from cdc_shared.avro import FileSchemaRegistry  # noqa: E402
from cdc_shared.clients.schemas import entity_schemas  # noqa: E402
from cdc_shared.config.entities import HistoryConfig  # noqa: E402
from cdc_shared.config.services import SparkConfig  # noqa: E402
from cdc_shared.contracts.silver import (  # noqa: E402
    END,
    END_TS,
    OP,
    PERIOD,
    SEQUENCE,
    SOURCE_TS,
    START,
    START_TS,
)
from cdc_shared.contracts.silver_side_tables import TRUNCATE_SCHEMA  # noqa: E402
from cdc_shared.contracts.unavailable import Placeholder  # noqa: E402
from cdc_shared.jvm.spark import build_spark_session, counting_jobs  # noqa: E402
from cdc_shared.streaming.tables import ensure_table  # noqa: E402
from delta.tables import DeltaTable  # noqa: E402
from jvm_cpu import cpu_by_kind, jvm_pid, shares, since  # noqa: E402
from merger_before import apply_batch_before, delta_default_materialization  # noqa: E402
from pyspark.sql import Column, DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402
from support.entities import CUSTOMERS, SCHEMAS  # noqa: E402
from support.ingestion import typed_bronze_rows  # noqa: E402

UPDATE_SHARE, INSERT_SHARE = 0.8, 0.15  # the rest are deletes


@dataclass
class Workload:
    """Key space and sequence counter shared by the batches of one variant."""

    next_id: int
    next_sequence: int = 1

    def take(self, count: int) -> tuple[int, int]:
        """Reserve ``count`` sequence numbers; returns the first and the next free id."""
        first = self.next_sequence
        self.next_sequence += count
        return first, self.next_id


def fill(struct: T.StructType, values: dict[str, Column]) -> Column:
    """A struct of type ``struct``: the given fields, null for the others."""
    return F.struct(
        *[
            (values[f.name] if f.name in values else F.lit(None)).cast(f.dataType).alias(f.name)
            for f in struct.fields
        ]
    )


def bronze_batch(
    spark: SparkSession, bronze: T.StructType, workload: Workload, changes: int, seed: int
) -> DataFrame:
    """``changes`` bronze events: 80% updates, 15% inserts, 5% deletes (skewed keys)."""
    first_sequence, next_id = workload.take(changes)
    inserts = int(changes * INSERT_SHARE)
    workload.next_id += inserts
    after_type, source_type = bronze["after"].dataType, bronze["source"].dataType
    assert isinstance(after_type, T.StructType) and isinstance(source_type, T.StructType)
    position = F.rand(seed)
    kind = (
        F.when(position < UPDATE_SHARE, F.lit("u"))
        .when(position < UPDATE_SHARE + INSERT_SHARE, F.lit("c"))
        .otherwise(F.lit("d"))
    )
    # Updated and deleted keys: most changes hit the newest keys (pow(rand, 3) near 0).
    skewed = (F.lit(next_id - 1) - F.floor(F.pow(F.rand(seed + 1), 3) * next_id)).cast("int")
    rows = spark.range(changes).select(
        F.col("id").alias("n"), kind.alias("op"), (F.col("id") + first_sequence).alias("seq")
    )
    rows = rows.withColumn(
        "key_id",
        F.when(
            F.col("op") == "c", (F.lit(next_id) + F.col("n") % max(inserts, 1)).cast("int")
        ).otherwise(skewed),
    )
    after = fill(
        after_type,
        {
            "id": F.col("key_id"),
            "first_name": F.concat(F.lit("first"), F.col("seq")),
            "last_name": F.lit("last"),
            "email": F.concat(F.col("key_id"), F.lit("@example.com")),
            "created_at": F.current_timestamp(),
        },
    )
    return rows.select(
        F.lit(CUSTOMERS.source_topic).alias("kafka_topic"),
        F.lit(0).alias("kafka_partition"),
        F.col("seq").alias("kafka_offset"),
        F.current_timestamp().alias("kafka_timestamp"),
        F.struct(F.col("key_id").alias("id")).cast(bronze["key"].dataType).alias("key"),
        F.lit(None).cast(after_type).alias("before"),
        F.when(F.col("op") != "d", after).alias("after"),
        fill(source_type, {"ts_ms": F.col("seq"), "lsn": F.col("seq")}).alias("source"),
        *[
            F.lit(None).cast(f.dataType).alias(f.name)
            for f in bronze.fields
            if f.name in ("transaction", "ts_ms", "ts_us", "ts_ns")
        ],
        F.col("op"),
        F.lit(False).alias("is_tombstone"),
        F.array(F.col("seq")).alias("sequence"),
        F.lit("bench").alias("writer_schema"),
        F.current_timestamp().alias("ingested_at"),
    ).select(*[F.col(f.name).cast(f.dataType) for f in bronze.fields])


def load_silver(spark: SparkSession, path: str, rows: int) -> None:
    """Append ``rows`` current rows (ids 0..rows-1) to the silver table at ``path``."""
    schema = DeltaTable.forPath(spark, path).toDF().schema
    values = {
        "id": F.col("id").cast("int"),
        "first_name": F.concat(F.lit("first"), F.col("id")),
        "last_name": F.lit("last"),
        "email": F.concat(F.col("id"), F.lit("@example.com")),
        "created_at": F.current_timestamp(),
        "_cdc_seq": F.array(F.lit(0).cast("long")),
        "_cdc_op": F.lit("r"),
        "_cdc_source_ts": F.current_timestamp(),
        "_cdc_commit_ts": F.current_timestamp(),
    }
    frame = spark.range(rows).select(
        *[(values.get(f.name, F.lit(None))).cast(f.dataType).alias(f.name) for f in schema.fields]
    )
    frame.write.format("delta").mode("append").save(path)


def seed_style_merge(spark: SparkSession, events: DataFrame, path: str) -> None:
    """The baseline: latest event per key, then a plain MERGE without sequence checks."""
    silver = DeltaTable.forPath(spark, path)
    columns = [f.name for f in silver.toDF().schema.fields]
    row_columns = [c for c in columns if not c.startswith("_cdc_") and c != "id"]
    flat = events.select(
        F.col("key.id").alias("id"),
        *[F.col(f"after.{c}").alias(c) for c in row_columns],
        F.col("sequence").alias("_cdc_seq"),
        F.col("op").alias("_cdc_op"),
        F.timestamp_millis(F.col("source.ts_ms")).alias("_cdc_source_ts"),
        F.current_timestamp().alias("_cdc_commit_ts"),
    )
    latest = flat.groupBy("id").agg(
        F.max_by(F.struct(*[c for c in columns if c != "id"]), F.col("_cdc_seq")).alias("n")
    )
    latest = latest.select("id", "n.*")
    with delta_default_materialization(spark):
        (
            silver.alias("t")
            .merge(latest.alias("s"), "t.id = s.id")
            .whenMatchedDelete(condition="s._cdc_op = 'd'")
            .whenMatchedUpdateAll(condition="s._cdc_op != 'd'")
            .whenNotMatchedInsertAll(condition="s._cdc_op != 'd'")
            .execute()
        )


Merge = Callable[[SparkSession, DataFrame], dict[str, int] | None]


@dataclass
class Batch:
    """What one batch cost."""

    changes: int
    seconds: float
    jobs: int
    merge_ms: int
    compacted: bool
    jvm_cpu_s: float
    steps: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)  # the history comparison's


@dataclass
class Variant:
    """One way of merging, on its own silver table."""

    name: str
    merge: Merge
    silver_path: str
    batches: list[Batch] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # when -> files in silver
    jvm_cpu: dict[str, float] = field(default_factory=dict)  # 1k batches, by thread kind
    tables: dict[str, str] = field(default_factory=dict)  # label -> path, of lean variants

    def of_size(self, changes: int) -> list[Batch]:
        return [b for b in self.batches if b.changes == changes]


def last_commits(spark: SparkSession, path: str) -> tuple[int, bool]:
    """The newest MERGE's own ``executionTimeMs`` (Delta's commit metrics), and whether
    an OPTIMIZE (auto compaction) committed after it."""
    history = DeltaTable.forPath(spark, path).history(3).orderBy(F.col("version").desc())
    rows = history.select("operation", "operationMetrics").collect()
    merges = [dict(r[1] or {}) for r in rows if r[0] == "MERGE"]
    compacted = bool(rows) and rows[0][0] == "OPTIMIZE"
    return (int(merges[0].get("executionTimeMs", 0)) if merges else 0), compacted


def file_count(spark: SparkSession, path: str) -> int:
    return int(DeltaTable.forPath(spark, path).detail().first()["numFiles"])  # type: ignore[index]


def run_batches(
    spark: SparkSession,
    variant: Variant,
    bronze: T.StructType,
    workload: Workload,
    plan: list[int],
    warmup: int = 0,
) -> None:
    """Merge ``plan``'s batches in order; the first ``warmup`` are not recorded."""
    pid = jvm_pid(spark)
    for number, changes in enumerate(plan):
        events = bronze_batch(spark, bronze, workload, changes, seed=len(variant.batches) + number)
        events = events.localCheckpoint(eager=True)  # as a micro-batch: computed rows
        cpu_before = cpu_by_kind(pid)
        started = time.perf_counter()
        with counting_jobs(spark) as jobs:
            steps = variant.merge(spark, events)
        elapsed = time.perf_counter() - started
        cpu = since(cpu_before, cpu_by_kind(pid))
        time.sleep(0.2)  # let the listener bus record the last job
        merge_ms, compacted = last_commits(spark, variant.silver_path)
        batch = Batch(changes, elapsed, jobs(), merge_ms, compacted, sum(cpu.values()), steps or {})
        if number >= warmup:
            variant.batches.append(batch)
            if changes == 1_000:
                for kind, seconds in cpu.items():
                    variant.jvm_cpu[kind] = variant.jvm_cpu.get(kind, 0.0) + seconds
        print(json.dumps({"variant": variant.name, **batch.__dict__}), flush=True)


def lean_variant(
    spark: SparkSession,
    root: Path,
    bronze: T.StructType,
    rows: int,
    placeholder: Placeholder | None = DEFAULT_PLACEHOLDER,
    name: str = "lean",
    history: HistoryConfig | None = None,
) -> Variant:
    """A fresh silver as the merger creates it, merged by today's ``apply_batch``.

    ``placeholder``: the unavailable-value placeholder it looks for (None: the path
    without that check, for its cost). ``history``: the entity's history; its table
    (``<root>/history``) is loaded with the silver rows' versions (``load_history``) and
    each batch's history step (``apply_history``) runs after silver's. The laps returned:
    ``apply_batch``'s, and each step's wall time (``silver_ms``, ``history_ms``).
    """
    table = None if history is None else HistoryTable(str(root / "history"), history)
    layout = SilverLayout(
        str(root / "silver"), str(root / "tombstones"), str(root / "truncates"), ["id"], table
    )
    ensure_tables(spark, bronze, layout)
    load_silver(spark, layout.silver_path, rows)
    if table is not None:
        load_history(spark, layout)
        check_history(spark, layout)
    state = MergeState(spark, layout)  # one per table, kept, as the merger

    def refuse(rejected: DataFrame) -> None:
        raise SystemExit(f"bench events rejected: {rejected.limit(3).collect()}")

    def merge(s: SparkSession, e: DataFrame) -> dict[str, int]:
        lap = time.perf_counter()
        steps = dict(apply_batch(s, e, layout, refuse, state, placeholder).step_ms)
        steps["silver_ms"] = round((time.perf_counter() - lap) * 1000)
        if table is not None:
            lap = time.perf_counter()
            # Looked up in the module: HistoryProbe times it.
            merger_apply.apply_history(s, e, layout, state, placeholder)
            steps["history_ms"] = round((time.perf_counter() - lap) * 1000)
        return steps

    tables = {"silver": layout.silver_path, "tombstones": layout.tombstone_path}
    tables |= {"truncates": layout.truncate_path} | ({"history": table.path} if table else {})
    return Variant(name, merge, layout.silver_path, tables=tables)


def unaware_variant(spark: SparkSession, root: Path, bronze: T.StructType, rows: int) -> Variant:
    """Today's path without the unavailable-value check (``placeholder=None``)."""
    return lean_variant(spark, root, bronze, rows, placeholder=None, name="lean-off")


def copy_on_write_variant(
    spark: SparkSession,
    root: Path,
    bronze: T.StructType,
    rows: int,
    history: HistoryConfig | None = None,
) -> Variant:
    """Today's path on a silver whose MERGEs rewrite files (no deletion vectors).

    A ``history`` keeps its deletion vectors, as the merger's do (its write needs them).
    """
    variant = lean_variant(spark, root, bronze, rows, name="lean-cow", history=history)
    spark.sql(
        f"ALTER TABLE delta.`{variant.silver_path}` "
        "SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'false')"
    )
    return variant


def before_variant(spark: SparkSession, root: Path, bronze: T.StructType, rows: int) -> Variant:
    """Silver and its side tables as they were made before (no auto compaction)."""
    layout = SilverLayout(
        str(root / "silver"), str(root / "tombstones"), str(root / "truncates"), ["id"]
    )
    silver = silver_schema(bronze, layout.key)
    dvs = {"delta.enableDeletionVectors": "true"}
    ensure_table(spark, layout.silver_path, silver, {"delta.enableChangeDataFeed": "true", **dvs})
    ensure_table(spark, layout.tombstone_path, tombstone_schema(silver, layout.key), dvs)
    ensure_table(spark, layout.truncate_path, TRUNCATE_SCHEMA, dvs)
    load_silver(spark, layout.silver_path, rows)
    return Variant("before", lambda s, e: apply_batch_before(s, e, layout), layout.silver_path)


def baseline_variant(spark: SparkSession, root: Path, bronze: T.StructType, rows: int) -> Variant:
    path = str(root / "silver")
    properties = {"delta.enableChangeDataFeed": "true"}  # no deletion vectors, no compaction
    ensure_table(spark, path, silver_schema(bronze, CUSTOMERS.key), properties)
    load_silver(spark, path, rows)
    return Variant("baseline", lambda s, e: seed_style_merge(s, e, path), path)


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(variants: list[Variant], rows: int) -> None:
    base = variants[0]
    print(f"\nsilver of {rows:,} rows; 1,000-change batches (after the warm-up batches)")
    print(
        f"{'variant':<10}{'p50 s':>8}{'p95 s':>8}{'x base':>8}{'MERGE p50 s':>13}"
        f"{'other p50 s':>13}{'jobs p50':>10}{'files':>7}{'JVM CPU p50 s':>15}"
    )
    base_p50 = statistics.median(b.seconds for b in base.of_size(1_000))
    for variant in variants:
        small = variant.of_size(1_000)
        seconds = [b.seconds for b in small]
        other = [b.seconds - b.merge_ms / 1000 for b in small]
        print(
            f"{variant.name:<10}{statistics.median(seconds):>8.2f}{p(seconds, 0.95):>8.2f}"
            f"{base_p50 / statistics.median(seconds):>8.2f}"
            f"{statistics.median(b.merge_ms for b in small) / 1000:>13.2f}"
            f"{statistics.median(other):>13.2f}"
            f"{statistics.median(b.jobs for b in small):>10.0f}{variant.files['after 1k']:>7}"
            f"{statistics.median(b.jvm_cpu_s for b in small):>15.2f}"
        )
    print("JVM CPU of those batches by thread:")
    for variant in variants:
        print(f"  {variant.name}: {shares(variant.jvm_cpu)}")
    for size in (10_000, 100_000):
        if not base.of_size(size):
            continue
        print(f"\n{size:,}-change batches: medians")
        print(f"{'variant':<10}{'changes/s':>11}{'x base':>8}{'MERGE s':>9}{'jobs':>6}")
        base_rate = size / statistics.median(b.seconds for b in base.of_size(size))
        for variant in variants:
            batches = variant.of_size(size)
            rate = size / statistics.median(b.seconds for b in batches)
            print(
                f"{variant.name:<10}{rate:>11,.0f}{rate / base_rate:>8.2f}"
                f"{statistics.median(b.merge_ms for b in batches) / 1000:>9.2f}"
                f"{statistics.median(b.jobs for b in batches):>6.0f}"
            )


def report_drift(drift: Variant) -> None:
    seconds = [b.seconds for b in drift.batches]
    first, last = statistics.median(seconds[:20]), statistics.median(seconds[-20:])
    slowest = sorted(range(len(seconds)), key=lambda i: -seconds[i])[:5]
    print(f"\ndrift: {len(seconds)} 1,000-change batches, lean path, no maintenance")
    print(f"  p50 first 20 {first:.2f} s, last 20 {last:.2f} s: {last / first:.2f}x")
    print(f"  p50 {statistics.median(seconds):.2f} s, p95 {p(seconds, 0.95):.2f} s")
    print("  slowest: " + ", ".join(f"#{i} {seconds[i]:.2f} s" for i in slowest))
    print(f"  files in silver: {drift.files['at start']} at start, {drift.files['at end']} at end")
    compacted = [i for i, b in enumerate(drift.batches) if b.compacted]
    print(f"  auto compactions after batches {compacted}")


# --- History on vs off (``--history``) -------------------------------------------------

HISTORY_OWN = (*PERIOD, SEQUENCE, SOURCE_TS, FOLDED)  # history's columns besides the row's


def load_history(spark: SparkSession, layout: SilverLayout) -> None:
    """The history silver's rows would have made: one current version per row.

    As if each row came in as one snapshot event (its ``_cdc_seq``): a version begun at
    that sequence and source time, open (no end), folding that one event. Written
    straight in history's schema (the table ``ensure_tables`` made), not rebuilt by the
    merger's per-key windows over a million keys; ``check_history`` compares a sample
    with what the merger's own rebuild makes of the same rows.
    """
    assert layout.history is not None
    schema = DeltaTable.forPath(spark, layout.history.path).toDF().schema
    row = [f.name for f in schema.fields if f.name not in HISTORY_OWN]
    untracked = layout.history.config.untracked_columns(row, layout.key)
    values = F.to_json(F.struct(*[F.col(f"`{c}`") for c in untracked]), merger_history._JSON)
    event = F.struct(F.col(SEQUENCE), F.col(SOURCE_TS), values.alias(UNTRACKED))
    own = {
        START: F.col(SEQUENCE),
        END: F.lit(None),
        START_TS: F.col(SOURCE_TS),
        END_TS: F.lit(None),
        FOLDED: F.array(event),
    }
    silver = spark.read.format("delta").load(layout.silver_path)
    frame = silver.select(
        *[own.get(f.name, F.col(f"`{f.name}`")).cast(f.dataType).alias(f.name) for f in schema]
    )
    frame.write.format("delta").mode("append").save(layout.history.path)


def check_history(spark: SparkSession, layout: SilverLayout, every: int = 1_000) -> None:
    """Every ``every``-th key's loaded versions must be what the merger's rebuild
    (``rebuilt_versions``, as ``write_history`` runs it) makes of its silver row as a
    snapshot event, with no history, tombstones or truncates before it."""
    assert layout.history is not None
    history = spark.read.format("delta").load(layout.history.path)
    sample = spark.read.format("delta").load(layout.silver_path).where(F.col("id") % every == 0)
    row = [c for c in history.columns if c not in HISTORY_OWN]
    events = sample.select(
        *row,
        SEQUENCE,
        F.lit("r").alias(OP),
        SOURCE_TS,
        F.lit(None).cast("array<string>").alias(UNSENT),
    )
    touched = events.select(*layout.key)
    tombstones = (
        spark.read.format("delta").load(layout.tombstone_path).select(*layout.key, SEQUENCE)
    )
    rebuilt = rebuilt_versions(
        spark,
        layout.history,
        layout.key,
        events,
        history.limit(0),
        touched,
        tombstones,
        layout.truncate_path,
        [],
    )
    expected = rebuilt.where(~F.col(merger_history._DROP)).select(*history.columns)
    loaded = history.join(touched, on=layout.key, how="left_semi")
    extra, missing = loaded.exceptAll(expected).count(), expected.exceptAll(loaded).count()
    if extra or missing or not loaded.count():
        raise SystemExit(
            f"loaded history differs from the merger's rebuild: {extra} rows not rebuilt, "
            f"{missing} rebuilt rows not loaded, e.g. {loaded.exceptAll(expected).take(1)} "
            f"vs {expected.exceptAll(loaded).take(1)}"
        )


@contextmanager
def tagging(spark: SparkSession) -> Iterator[str]:
    """A new job tag on the Spark jobs run inside the block (and by threads it starts)."""
    tag = f"bench-{uuid.uuid4().hex}"
    spark.sparkContext.addJobTag(tag)
    try:
        yield tag
    finally:
        spark.sparkContext.removeJobTag(tag)


LOCATION = re.compile(r"Location: \w+\(\d+ paths?\)\[([^,\]\s]+)")
BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass
class Reads:
    """Spark jobs, and the files their queries' scans read per table (count and bytes)."""

    jobs: int = 0
    files: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


class ScanStats:
    """Files read by each SQL execution's file scans, per table, from Spark's status stores.

    The stores are kept with the UI off. Per tagged job its SQL execution; in the
    execution's plan each file scan's location and its "number of files read" / "size of
    files read" (the files the scan kept after Delta's file skipping, and their size on
    disk: the columns actually read are fewer). ``tables``: label -> path; a location in a
    ``_delta_log`` is "log", an unknown one "other".
    """

    def __init__(self, spark: SparkSession, tables: dict[str, str]) -> None:
        self._context = spark.sparkContext._jsc.sc()  # no public handle on the stores
        self._sql = spark._jsparkSession.sharedState().statusStore()
        self._tables = tables
        self._executions: dict[int, list[tuple[str, int, int]]] = {}

    def reads(self, tag: str) -> Reads:
        """The jobs tagged ``tag`` and what their executions' scans read."""
        jobs = list(self._context.statusTracker().getJobIdsForTag(tag))
        executions = set()
        for job in jobs:
            execution = self._context.statusStore().jobWithAssociatedSql(job)._2()
            if execution.isDefined():
                executions.add(int(execution.get()))
        reads = Reads(jobs=len(jobs))
        for execution in sorted(executions):
            for label, files, size in self._scans(execution):
                reads.files[label] = reads.files.get(label, 0) + files
                reads.bytes[label] = reads.bytes.get(label, 0) + size
        return reads

    def _scans(self, execution: int) -> list[tuple[str, int, int]]:
        if execution not in self._executions:
            values = self._sql.executionMetrics(execution)
            scans = []
            nodes = self._sql.planGraph(execution).allNodes().iterator()
            while nodes.hasNext():
                node = nodes.next()
                found = LOCATION.search(node.desc()) if node.name().startswith("Scan") else None
                if found is None:
                    continue
                metrics, read = node.metrics().iterator(), {}
                while metrics.hasNext():
                    metric = metrics.next()
                    value = values.get(metric.accumulatorId())
                    if value.isDefined():
                        read[metric.name()] = str(value.get())
                files = int(read.get("number of files read", "0").replace(",", ""))
                scans.append((self._label(found[1]), files, _bytes(read.get("size of files read"))))
            self._executions[execution] = scans
        return self._executions[execution]

    def _label(self, location: str) -> str:
        path = "/" + re.sub(r"^file:/*", "", location).rstrip("/")
        if "/_delta_log" in path:
            return "log"
        return next((k for k, v in self._tables.items() if path.startswith(v)), "other")


def _bytes(text: str | None) -> int:
    """Bytes of a size metric as Spark prints it (``"6.0 KiB"``)."""
    if not text:
        return 0
    number, _, unit = text.strip().partition(" ")
    return int(float(number.replace(",", "")) * BYTE_UNITS.get(unit, 1))


class HistoryProbe:
    """Times the parts of the merger's history step, and tags its Spark jobs.

    Wraps ``apply_history`` (the step; ``lean_variant`` looks it up in its module) and the
    function it comes to that writes, ``_replace_versions`` (the changed keys' versions
    replacing their rows in one overwrite). The same code runs; only the wall time around
    it is taken. What ``apply_history`` spends outside it is reading (the batch's counts,
    its events, the touched keys, their rows in history and their tombstones: local
    checkpoints) and the rebuild (the versions' local checkpoint).
    """

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self.seconds: dict[str, float] = {}
        self.tag = ""
        self._wrap(merger_apply, "apply_history", "history", tagged=True)
        self._wrap(merger_history, "_replace_versions", "replace")

    def reset(self) -> None:
        self.seconds, self.tag = {}, ""

    def _wrap(self, module: object, name: str, part: str, tagged: bool = False) -> None:
        original = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                if not tagged:
                    return original(*args, **kwargs)
                with tagging(self.spark) as tag:
                    self.tag = tag
                    return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds[part] = self.seconds.get(part, 0.0) + elapsed

        setattr(module, name, timed)


def merge_commit(
    spark: SparkSession, path: str, operation: str = "MERGE"
) -> tuple[dict[str, int], bool]:
    """The newest ``operation``'s ``operationMetrics``, and whether an OPTIMIZE followed it."""
    history = DeltaTable.forPath(spark, path).history(3).orderBy(F.col("version").desc())
    rows = history.select("operation", "operationMetrics").collect()
    merges = [dict(r[1] or {}) for r in rows if r[0] == operation]
    metrics = {k: int(v) for k, v in (merges[0] if merges else {}).items() if v.isdigit()}
    return metrics, bool(rows) and rows[0][0] == "OPTIMIZE"


def run_interleaved(
    spark: SparkSession,
    variants: list[Variant],
    bronze: T.StructType,
    workload: Workload,
    count: int,
    warmup: int,
    probe: HistoryProbe,
) -> None:
    """``warmup`` + ``count`` 1,000-change batches, each applied to every variant in turn.

    The same events go to each (their silvers stay equal), in an order that flips every
    batch (ABBA), so drift and what one batch leaves the next (garbage, caches) fall on
    both alike. The first ``warmup`` are not recorded.
    """
    pid = jvm_pid(spark)
    for number in range(warmup + count):
        events = bronze_batch(spark, bronze, workload, 1_000, seed=number)
        events = events.localCheckpoint(eager=True)  # as a micro-batch: computed rows
        for variant in variants if number % 2 == 0 else variants[::-1]:
            probe.reset()
            cpu_before = cpu_by_kind(pid)
            with tagging(spark) as tag:
                started = time.perf_counter()
                steps = variant.merge(spark, events)
                elapsed = time.perf_counter() - started
            cpu = sum(since(cpu_before, cpu_by_kind(pid)).values())
            time.sleep(0.2)  # let the listener bus record the last job
            scans = ScanStats(spark, variant.tables)
            whole = scans.reads(tag)
            silver_merge, compacted = merge_commit(spark, variant.silver_path)
            detail: dict[str, Any] = {"reads": whole.__dict__, "silver_merge": silver_merge}
            if "history" in variant.tables:
                history_merge, history_compacted = merge_commit(
                    spark, variant.tables["history"], "WRITE"
                )
                detail |= {
                    "history_s": probe.seconds,
                    "history_reads": scans.reads(probe.tag).__dict__ if probe.tag else {},
                    "history_merge": history_merge,
                    "history_compacted": history_compacted,
                    "history_files": file_count(spark, variant.tables["history"]),
                }
            merge_ms = silver_merge.get("executionTimeMs", 0)
            batch = Batch(1_000, elapsed, whole.jobs, merge_ms, compacted, cpu, steps or {}, detail)
            if number >= warmup:
                variant.batches.append(batch)
            print(json.dumps({"variant": variant.name, **batch.__dict__}), flush=True)


def check_history_run(spark: SparkSession, off: Variant, on: Variant, batches: int) -> None:
    """Both variants really ran: history on gained a write per batch and holds one
    current version per silver row; history off has no history table; silvers equal."""
    # Each load stamps its own times: keys, sequences, ops and a changed value compared.
    same = ["id", SEQUENCE, OP, "first_name"]
    silver_off = spark.read.format("delta").load(off.silver_path).select(*same)
    silver_on = spark.read.format("delta").load(on.silver_path).select(*same)
    assert silver_off.count() == silver_on.count(), "the two silvers differ"
    assert silver_off.exceptAll(silver_on).isEmpty(), "the two silvers differ"
    assert not Path(off.silver_path).with_name("history").exists(), "history off wrote history"
    assert "history" not in off.tables
    history = DeltaTable.forPath(spark, on.tables["history"])
    replacing = F.col("operationParameters").getItem("replaceOnCond").isNotNull()
    writes = history.history().where((F.col("operation") == "WRITE") & replacing).count()
    assert writes == batches, f"history on: {writes} writes into history for {batches} batches"
    current = history.toDF().where(F.col(END).isNull()).count()
    assert current == silver_on.count(), f"{current} current versions, {silver_on.count()} rows"


Metric = Callable[[Batch], float]


def step_s(name: str) -> Metric:
    """A lap of a batch (``apply_batch``'s ``step_ms``, or a step's) in seconds."""
    return lambda b: b.steps.get(f"{name}_ms", 0) / 1000


def merge_metric(table: str, metric: str, scale: float = 1.0) -> Metric:
    """A number of the batch's commit into ``table`` (silver's MERGE, history's write)."""
    return lambda b: b.detail.get(f"{table}_merge", {}).get(metric, 0) / scale


def history_s(part: str) -> Metric:
    """Seconds of a part of the history step (``HistoryProbe``)."""
    return lambda b: b.detail.get("history_s", {}).get(part, 0.0)


def read_metric(scope: str, kind: str, label: str, scale: float = 1.0) -> Metric:
    """Files or bytes (``kind``) a batch's scans read of a table, in ``scope``."""
    return lambda b: b.detail.get(scope, {}).get(kind, {}).get(label, 0) / scale


def history_read_s(b: Batch) -> float:
    """The history step's reading and rebuild: its time outside the replacing write."""
    return history_s("history")(b) - history_s("replace")(b)


HISTORY_LINES: tuple[tuple[str, Metric], ...] = (
    ("  silver step (apply_batch)", step_s("silver")),
    ("    prepare (lap)", step_s("prepare")),
    ("    guard (lap)", step_s("guard")),
    ("    MERGE + tombstones (with history: every delete)", step_s("merge")),
    ("      silver MERGE executionTimeMs", merge_metric("silver", "executionTimeMs", 1000)),
    ("  history step (apply_history, after silver's)", step_s("history")),
    ("    read counts, batch, keys, rows, tombs; rebuild", history_read_s),
    ("    replace: delete (DVs) + append", history_s("replace")),
    ("history table's files after the batch", lambda b: b.detail.get("history_files", 0)),
    ("JVM CPU s", lambda b: b.jvm_cpu_s),
    ("Spark jobs", lambda b: b.jobs),
    ("  in the history step", lambda b: b.detail.get("history_reads", {}).get("jobs", 0)),
)
JOB_LINES = ("Spark jobs", "  in the history step", "history table's files after the batch")
#: Delta's ``replaceOn`` metrics. ``numOutputRows`` and ``numFiles`` include the files it
#: re-adds with a new deletion vector (their live rows are ``numCopiedRows``, though no
#: byte of them is rewritten), so the rows the write appends are the difference.
HISTORY_WRITE_COUNTS = (
    "numDeletedRows",
    "numOutputRows",
    "numCopiedRows",
    "numFiles",
    "numRemovedFiles",
)


def report_history(off: Variant, on: Variant, rows: int, warmup: int) -> None:
    """Side by side: batch time, the silver step, the history step's parts, jobs, reads."""

    def line(label: str, get: Metric, digits: int = 2) -> None:
        a, b = (statistics.median(get(x) for x in v.batches) for v in (off, on))
        shown = f"{a:>9.{digits}f}" if a else f"{'-':>9}"
        print(f"{label:<52}{shown}{b:>9.{digits}f}" + (f"{b / a:>8.2f}" if a else ""))

    seconds = [[b.seconds for b in v.batches] for v in (off, on)]
    print(
        f"\nhistory off vs on: silver of {rows:,} rows, {len(on.batches)} 1,000-change "
        f"batches each (after {warmup} warm-up), interleaved; p50 unless said"
    )
    print(f"{'':<52}{'off':>9}{'on':>9}{'on/off':>8}")
    line("batch s", lambda b: b.seconds)
    p95 = [p(s, 0.95) for s in seconds]
    print(f"{'batch p95 s':<52}{p95[0]:>9.2f}{p95[1]:>9.2f}{p95[1] / p95[0]:>8.2f}")
    for label, get in HISTORY_LINES:
        line(label, get, 1 if label in JOB_LINES else 2)
    everything = [*off.batches, *on.batches]
    for scope, name in (("reads", "whole batch"), ("history_reads", "history step")):
        for table in sorted(
            {t for b in everything for t in b.detail.get(scope, {}).get("files", {})}
        ):
            line(f"files read, {name}: {table}", read_metric(scope, "files", table), 0)
            line(f"MiB read, {name}: {table}", read_metric(scope, "bytes", table, 2**20), 1)
    counts = [
        f"{m} {statistics.median(merge_metric('history', m)(b) for b in on.batches):.0f}"
        for m in HISTORY_WRITE_COUNTS
    ]
    output, copied = (merge_metric("history", m) for m in ("numOutputRows", "numCopiedRows"))
    appended = statistics.median(output(b) - copied(b) for b in on.batches)
    print("history's replacing write:", ", ".join(counts), f"(appended {appended:.0f})")
    compacted = [i for i, b in enumerate(on.batches) if b.detail.get("history_compacted")]
    print(f"history auto compactions after measured batches {compacted}")
    ratio = statistics.median(seconds[1]) / statistics.median(seconds[0])
    verdict = "within" if ratio <= 1.5 else "over"
    print(f"history on costs {ratio:.2f}x the batch time off (p50): {verdict} the 1.5x target")


def run_history(
    spark: SparkSession, bronze: T.StructType, workdir: Path, rows: int, warmup: int, count: int
) -> None:
    """Two fresh silvers of ``rows`` rows, history off and on, fed the same batches."""
    off = lean_variant(spark, workdir / "history-off", bronze, rows, name="history-off")
    on = lean_variant(
        spark,
        workdir / "history-on",
        bronze,
        rows,
        name="history-on",
        history=HistoryConfig(enabled=True),  # every column tracked
    )
    probe = HistoryProbe(spark)
    workload = Workload(next_id=rows)
    run_interleaved(spark, [off, on], bronze, workload, count, warmup, probe)
    for variant in (off, on):
        variant.files["at end"] = file_count(spark, variant.silver_path)
    check_history_run(spark, off, on, warmup + count)
    history = DeltaTable.forPath(spark, on.tables["history"]).detail().first()
    assert history is not None
    print(
        f"\nchecked: silvers equal; history on: a write per batch, one current version per "
        f"silver row; history off: no history table. History at end: {history['numFiles']} "
        f"files, {history['sizeInBytes'] / 2**20:.1f} MiB; silver {on.files['at end']} files"
    )
    if count:
        report_history(off, on, rows, warmup)


def run_copy_on_write(
    spark: SparkSession,
    bronze: T.StructType,
    workdir: Path,
    rows: int,
    warmup: int,
    count: int,
    history: HistoryConfig | None = None,
) -> None:
    """Two fresh silvers of ``rows`` rows, deletion vectors and rewriting, the same batches.

    With ``history``, each has its history (deletion vectors in both).
    """
    vectors = lean_variant(
        spark, workdir / "vectors", bronze, rows, name="deletion-vectors", history=history
    )
    rewrite = copy_on_write_variant(spark, workdir / "rewrite", bronze, rows, history)
    workload = Workload(next_id=rows)
    run_interleaved(spark, [vectors, rewrite], bronze, workload, count, warmup, HistoryProbe(spark))
    print(
        f"\nsilver of {rows:,} rows, {count} 1,000-change batches each (after {warmup} "
        "warm-up), interleaved"
    )
    print(
        f"{'variant':<18}{'p50 s':>8}{'p95 s':>8}{'MERGE p50 s':>13}{'jobs p50':>10}"
        f"{'files':>7}{'MiB':>7}"
    )
    for variant in (vectors, rewrite):
        seconds = [b.seconds for b in variant.batches]
        detail = DeltaTable.forPath(spark, variant.silver_path).detail().first()
        assert detail is not None
        print(
            f"{variant.name:<18}{statistics.median(seconds):>8.2f}{p(seconds, 0.95):>8.2f}"
            f"{statistics.median(b.merge_ms for b in variant.batches) / 1000:>13.2f}"
            f"{statistics.median(b.jobs for b in variant.batches):>10.0f}"
            f"{detail['numFiles']:>7}{detail['sizeInBytes'] / 2**20:>7.1f}"
        )
    ratio = statistics.median(b.seconds for b in rewrite.batches) / statistics.median(
        b.seconds for b in vectors.batches
    )
    print(f"rewriting files takes {ratio:.2f}x the batch time of deletion vectors (p50)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=20, help="1,000-change batches")
    parser.add_argument(
        "--warmup", type=int, default=8, help="1,000-change batches first, not counted"
    )
    parser.add_argument("--repeats", type=int, default=3, help="batches of 10k and of 100k")
    parser.add_argument("--drift", type=int, default=200, help="batches of the drift run")
    parser.add_argument(
        "--variants", default="baseline,before,lean", help="comma-separated, baseline first"
    )
    parser.add_argument(
        "--conf", action="append", default=[], help="extra Spark setting KEY=VALUE (repeatable)"
    )
    parser.add_argument(
        "--history",
        action="store_true",
        help="only history off vs on: --warmup, then --small batches each, interleaved",
    )
    parser.add_argument(
        "--copy-on-write",
        action="store_true",
        help="only deletion vectors vs rewriting files: --warmup, --small batches, interleaved",
    )
    args = parser.parse_args()
    conf = {"spark.ui.enabled": "false", "spark.driver.memory": "4g"}
    conf.update(dict(item.split("=", 1) for item in args.conf))
    spark = build_spark_session(SparkConfig(master="local[2]", conf=conf), "bench-merger")
    registry = FileSchemaRegistry([SCHEMAS])
    decode_plan = DecodePlan.from_schemas(entity_schemas(CUSTOMERS, registry), registry)
    empty = spark.createDataFrame([], KAFKA_SCHEMA)
    bronze = typed_bronze_rows(decode(spark, empty, decode_plan, CUSTOMERS.sequence_by)).schema
    plan = [10_000] * args.repeats + [100_000] * args.repeats
    workdir = Path(tempfile.mkdtemp(prefix="bench-merger-"))
    if args.copy_on_write:  # with --history: both variants keep a history
        history = HistoryConfig(enabled=True) if args.history else None
        run_copy_on_write(spark, bronze, workdir, args.rows, args.warmup, args.small, history)
        return
    if args.history:
        run_history(spark, bronze, workdir, args.rows, args.warmup, args.small)
        return
    makers = {
        "baseline": baseline_variant,
        "before": before_variant,
        "lean": lean_variant,
        "lean-off": unaware_variant,
        "lean-cow": copy_on_write_variant,
    }

    variants = []
    for name in args.variants.split(","):
        variant = makers[name](spark, workdir / name, bronze, args.rows)
        workload = Workload(next_id=args.rows)  # one key space and sequence per table
        warmup = [1_000] * args.warmup
        run_batches(spark, variant, bronze, workload, warmup, warmup=len(warmup))
        run_batches(spark, variant, bronze, workload, [1_000] * args.small)
        variant.files["after 1k"] = file_count(spark, variant.silver_path)
        run_batches(spark, variant, bronze, workload, plan)
        variant.files["at end"] = file_count(spark, variant.silver_path)
        variants.append(variant)
    drift = None
    if args.drift:
        drift = lean_variant(spark, workdir / "drift", bronze, args.rows)
        drift.files["at start"] = file_count(spark, drift.silver_path)
        run_batches(spark, drift, bronze, Workload(next_id=args.rows), [1_000] * args.drift)
        drift.files["at end"] = file_count(spark, drift.silver_path)
    if args.small:
        report(variants, args.rows)
    if drift is not None:
        report_drift(drift)


if __name__ == "__main__":
    main()
