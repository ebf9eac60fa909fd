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
  what that check costs (``--variants baseline,lean-off,lean``).

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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, bronze_rows, decode  # noqa: E402
from cdc_merger.apply import (  # noqa: E402
    DEFAULT_PLACEHOLDER,
    TRUNCATE_SCHEMA,
    MergeState,
    SilverLayout,
    apply_batch,
    ensure_tables,
    silver_schema,
    tombstone_schema,
)
from cdc_merger.unavailable import Placeholder  # noqa: E402
from cdc_shared.avro import FileSchemaRegistry  # noqa: E402
from cdc_shared.config import SparkConfig  # noqa: E402
from cdc_shared.schemas import entity_schemas  # noqa: E402
from cdc_shared.spark import build_spark_session, counting_jobs  # noqa: E402
from cdc_shared.tables import ensure_table  # noqa: E402
from delta.tables import DeltaTable  # noqa: E402
from jvm_cpu import cpu_by_kind, jvm_pid, shares, since  # noqa: E402
from merger_before import apply_batch_before, delta_default_materialization  # noqa: E402
from pyspark.sql import Column, DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402
from support.entities import CUSTOMERS, SCHEMAS  # noqa: E402

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


@dataclass
class Variant:
    """One way of merging, on its own silver table."""

    name: str
    merge: Merge
    silver_path: str
    batches: list[Batch] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # when -> files in silver
    jvm_cpu: dict[str, float] = field(default_factory=dict)  # 1k batches, by thread kind

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
) -> Variant:
    """A fresh silver as the merger creates it, merged by today's ``apply_batch``.

    ``placeholder``: the unavailable-value placeholder it looks for (None: the path
    without that check, for its cost).
    """
    layout = SilverLayout(
        str(root / "silver"), str(root / "tombstones"), str(root / "truncates"), ["id"]
    )
    ensure_tables(spark, bronze, layout)
    load_silver(spark, layout.silver_path, rows)
    state = MergeState(spark, layout)  # one per table, kept, as the merger

    def refuse(rejected: DataFrame) -> None:
        raise SystemExit(f"bench events rejected: {rejected.limit(3).collect()}")

    def merge(s: SparkSession, e: DataFrame) -> dict[str, int]:
        return apply_batch(s, e, layout, refuse, state, placeholder).step_ms

    return Variant(name, merge, layout.silver_path)


def unaware_variant(spark: SparkSession, root: Path, bronze: T.StructType, rows: int) -> Variant:
    """Today's path without the unavailable-value check (``placeholder=None``)."""
    return lean_variant(spark, root, bronze, rows, placeholder=None, name="lean-off")


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
    args = parser.parse_args()
    conf = {"spark.ui.enabled": "false", "spark.driver.memory": "4g"}
    conf.update(dict(item.split("=", 1) for item in args.conf))
    spark = build_spark_session(SparkConfig(master="local[2]", conf=conf), "bench-merger")
    registry = FileSchemaRegistry([SCHEMAS])
    decode_plan = DecodePlan.from_schemas(entity_schemas(CUSTOMERS, registry), registry)
    empty = spark.createDataFrame([], KAFKA_SCHEMA)
    bronze = bronze_rows(decode(spark, empty, decode_plan, CUSTOMERS.sequence_by)).schema
    plan = [10_000] * args.repeats + [100_000] * args.repeats
    workdir = Path(tempfile.mkdtemp(prefix="bench-merger-"))
    makers = {
        "baseline": baseline_variant,
        "before": before_variant,
        "lean": lean_variant,
        "lean-off": unaware_variant,
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
