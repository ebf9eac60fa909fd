"""Benchmark: the merger's MERGE into a 1,000,000-row silver table, beside the seed-style one.

No servers needed: one local Spark session applies generated bronze batches (the real
bronze schema of the example ``customers`` entity) straight to silver, the way the
merger's foreachBatch does. Three variants, each on its own fresh silver table:

- baseline: the seed-style merge: dedup per key, then a plain MERGE (update all / insert /
  delete, no sequence checks, no tombstones) into a table without deletion vectors;
- merger, no DVs: the merger's ``apply_batch`` (sequence checks, tombstones, truncates,
  quarantine checks) on a silver table without deletion vectors (the layout before);
- merger: ``apply_batch`` on silver as the merger creates it (deletion vectors on).

Each variant loads N rows, then merges batches of 10,000 and 100,000 changes (70%
updates, 20% inserts, 10% deletes; updated and deleted keys skewed toward the newest
keys) and seven 1,000-change batches. Prints changes/s (median per batch size), bytes the
MERGE wrote and removed per batch, and the p50 wall time of the 1,000-change batches.

    .venv/bin/python tests/bench/bench_merger.py [--rows 1000000] [--repeats 3]
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

from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, bronze_rows, decode  # noqa: E402
from cdc_merger.apply import (  # noqa: E402
    SILVER_PROPERTIES,
    SilverLayout,
    TruncateFloor,
    apply_batch,
    ensure_tables,
    silver_schema,
)
from cdc_shared.avro import FileSchemaRegistry  # noqa: E402
from cdc_shared.config import SparkConfig  # noqa: E402
from cdc_shared.schemas import entity_schemas  # noqa: E402
from cdc_shared.spark import build_spark_session  # noqa: E402
from cdc_shared.tables import ensure_table  # noqa: E402
from delta.tables import DeltaTable  # noqa: E402
from pyspark.sql import Column, DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402
from support.entities import CUSTOMERS, SCHEMAS  # noqa: E402

UPDATE_SHARE, INSERT_SHARE = 0.7, 0.2  # the rest are deletes


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
    """``changes`` bronze events: 70% updates, 20% inserts, 10% deletes (skewed keys)."""
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
    (
        silver.alias("t")
        .merge(latest.alias("s"), "t.id = s.id")
        .whenMatchedDelete(condition="s._cdc_op = 'd'")
        .whenMatchedUpdateAll(condition="s._cdc_op != 'd'")
        .whenNotMatchedInsertAll(condition="s._cdc_op != 'd'")
        .execute()
    )


@dataclass
class Variant:
    """One way of merging, on its own silver table."""

    name: str
    merge: Callable[[SparkSession, DataFrame], dict[str, int] | None]
    silver_path: str
    seconds: dict[int, list[float]] = field(default_factory=dict)
    bytes_added: dict[int, list[int]] = field(default_factory=dict)
    bytes_removed: dict[int, list[int]] = field(default_factory=dict)


def last_merge_metrics(spark: SparkSession, path: str) -> dict[str, str]:
    """operationMetrics of the newest MERGE in the table's history."""
    history = DeltaTable.forPath(spark, path).history(5).where("operation = 'MERGE'")
    row = history.orderBy(F.col("version").desc()).select("operationMetrics").first()
    return dict(row[0]) if row and row[0] else {}


def run_variant(
    spark: SparkSession,
    variant: Variant,
    bronze: T.StructType,
    rows: int,
    plan: list[int],
) -> None:
    load_silver(spark, variant.silver_path, rows)
    workload = Workload(next_id=rows)
    for number, changes in enumerate(plan):
        events = bronze_batch(spark, bronze, workload, changes, seed=number).persist()
        events.count()
        started = time.perf_counter()
        steps = variant.merge(spark, events)
        elapsed = time.perf_counter() - started
        events.unpersist()
        metrics = last_merge_metrics(spark, variant.silver_path)
        variant.seconds.setdefault(changes, []).append(elapsed)
        variant.bytes_added.setdefault(changes, []).append(
            int(metrics.get("numTargetBytesAdded", 0))
        )
        variant.bytes_removed.setdefault(changes, []).append(
            int(metrics.get("numTargetBytesRemoved", 0))
        )
        print(
            json.dumps(
                {
                    "variant": variant.name,
                    "changes": changes,
                    "seconds": round(elapsed, 2),
                    "bytes_added": metrics.get("numTargetBytesAdded"),
                    "bytes_removed": metrics.get("numTargetBytesRemoved"),
                    "files_added": metrics.get("numTargetFilesAdded"),
                    "files_removed": metrics.get("numTargetFilesRemoved"),
                    "dvs_added": metrics.get("numTargetDeletionVectorsAdded"),
                    "step_ms": steps,
                }
            ),
            flush=True,
        )


def mib(values: list[int]) -> str:
    return f"{statistics.median(values) / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="batches per size (10k, 100k)")
    parser.add_argument("--small", type=int, default=7, help="1,000-change batches")
    parser.add_argument(
        "--conf", action="append", default=[], help="extra Spark setting KEY=VALUE (repeatable)"
    )
    parser.add_argument(
        "--merger-only", action="store_true", help="skip the baseline and no-DV variants"
    )
    args = parser.parse_args()
    conf = {"spark.ui.enabled": "false", "spark.driver.memory": "4g"}
    conf.update(dict(item.split("=", 1) for item in args.conf))
    spark = build_spark_session(SparkConfig(master="local[2]", conf=conf), "bench-merger")
    registry = FileSchemaRegistry([SCHEMAS])
    decode_plan = DecodePlan.from_schemas(entity_schemas(CUSTOMERS, registry), registry)
    empty = spark.createDataFrame([], KAFKA_SCHEMA)
    bronze = bronze_rows(decode(spark, empty, decode_plan, CUSTOMERS.sequence_by)).schema
    plan = [10_000] * args.repeats + [100_000] * args.repeats + [1_000] * args.small

    workdir = Path(tempfile.mkdtemp(prefix="bench-merger-"))
    silver = silver_schema(bronze, CUSTOMERS.key)
    variants: list[Variant] = []

    baseline_path = str(workdir / "baseline")
    ensure_table(spark, baseline_path, silver, {"delta.enableChangeDataFeed": "true"})
    variants.append(
        Variant("baseline", lambda s, e: seed_style_merge(s, e, baseline_path), baseline_path)
    )
    for name, properties in (
        ("merger, no DVs", {**SILVER_PROPERTIES, "delta.enableDeletionVectors": "false"}),
        ("merger", SILVER_PROPERTIES),
    ):
        root = workdir / name.replace(", ", "-").replace(" ", "-")
        layout = SilverLayout(
            str(root / "silver"), str(root / "tombstones"), str(root / "truncates"), ["id"]
        )
        ensure_table(spark, layout.silver_path, silver, properties)
        ensure_tables(spark, bronze, layout)  # tombstones and truncates; silver exists

        truncates = TruncateFloor(spark, layout.truncate_path)  # one per variant, as the merger

        def merge(
            s: SparkSession,
            e: DataFrame,
            layout: SilverLayout = layout,
            truncates: TruncateFloor = truncates,
        ) -> dict[str, int]:
            def refuse(rejected: DataFrame) -> None:
                raise SystemExit(f"bench events rejected: {rejected.limit(3).collect()}")

            return apply_batch(s, e, layout, refuse, truncates).step_ms

        variants.append(Variant(name, merge, layout.silver_path))

    if args.merger_only:
        variants = variants[-1:]
    for variant in variants:
        run_variant(spark, variant, bronze, args.rows, plan)

    base = variants[0]
    print(f"\nsilver of {args.rows:,} rows; medians over the batches of each size")
    header = f"{'variant':<16}{'size':>9}{'changes/s':>12}{'x base':>8}{'MiB added':>11}"
    print(header + f"{'MiB removed':>13}")
    for size in (10_000, 100_000):
        base_rate = size / statistics.median(base.seconds[size])
        for variant in variants:
            rate = size / statistics.median(variant.seconds[size])
            print(
                f"{variant.name:<16}{size:>9,}{rate:>12,.0f}{rate / base_rate:>8.2f}"
                f"{mib(variant.bytes_added[size]):>11}{mib(variant.bytes_removed[size]):>13}"
            )
    print("\np50 wall time of a 1,000-change batch")
    for variant in variants:
        print(f"{variant.name:<16}{statistics.median(variant.seconds[1_000]):>8.2f} s")


if __name__ == "__main__":
    main()
