"""Benchmark: ``cdc verify``'s comparison of one table, by key buckets or as whole maps.

No servers needed. Writes ``--rows`` rows to a silver Delta table through Spark (an
integer key and five columns: text, a decimal, a timestamp, a boolean), and the same
rows as the documents a target holds, written by Spark as JSON lines (what
``helpers.scan`` hands back as ``_source``: timestamps as text, decimals as numbers), with
seeded differences: 10 keys missing, 10 extra, 10 different. The target is this
synthetic file reader rather than a change topic or an index: producing, or indexing, 10M
rows on this two-core machine takes longer than the comparison measured, and the
comparison is the same whichever target the records come from (``TargetRecord``).

Each approach then runs in a process of its own, which prints the time of the verify
step (its Spark session started before the clock) and the process's peak RSS:

- ``buckets``: ``cdc verify``'s path (``spill_silver`` + ``compare_target``): both sides
  spilled into key buckets in local files, digests compared, differing buckets drilled;
- ``whole-map``: the path before issue #39: silver and the target each reduced to a
  dict key -> hash in the process, then compared.

Both must report the same differences (exit 1 otherwise).

    .venv/bin/python tests/bench/bench_verify.py [--rows 1000000] [--buckets N]
        [--approaches buckets,whole-map] [--folder DIR]

``--folder`` keeps the tables there and reuses them in a later run with the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cdc_cli.verify import (
    RowShape,
    TargetRecord,
    compare_target,
    silver_hashes,
    spill_silver,
)
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm.spark import build_spark_session
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

ENTITY = EntityConfig(name="bench", source_topic="bench", key=["id"])
SEEDED = 10  # keys missing, extra and different in the target


def spark_session() -> SparkSession:
    conf = {"spark.ui.enabled": "false", "spark.driver.memory": "2g"}
    return build_spark_session(SparkConfig(master="local[2]", conf=conf), "bench-verify")


def write_tables(spark: SparkSession, folder: Path, rows: int) -> None:
    """Silver (Delta) and the target's documents (JSON lines) with the seeded differences."""
    frame = spark.range(rows).select(
        F.col("id"),
        F.concat(F.lit("customer-"), F.col("id").cast("string")).alias("name"),
        F.concat(F.col("id").cast("string"), F.lit("@example.com")).alias("email"),
        (F.col("id") % 100_000 / 100).cast("decimal(12,2)").alias("balance"),
        F.timestamp_seconds(F.lit(1_767_225_600) + F.col("id") % 86_400).alias("updated_at"),
        (F.col("id") % 3 == 0).alias("active"),
        F.array(F.col("id")).alias("_cdc_seq"),
    )
    frame.write.format("delta").mode("overwrite").save(str(folder / "silver"))
    step = rows // (3 * SEEDED)
    missing = [i * step for i in range(SEEDED)]
    different = [i * step + 1 for i in range(SEEDED)]
    documents = (
        frame.drop("_cdc_seq")
        .where(~F.col("id").isin(missing))
        .withColumn(
            "name",
            F.when(F.col("id").isin(different), F.lit("changed")).otherwise(F.col("name")),
        )
        .unionByName(
            frame.drop("_cdc_seq").limit(SEEDED).withColumn("id", F.col("id") + rows)  # extra
        )
    )
    documents.write.mode("overwrite").json(str(folder / "target"))
    (folder / "rows").write_text(str(rows))


def target_records(folder: Path) -> Iterator[TargetRecord]:
    """The target's documents, as ``es_records`` hands them over."""
    position = 0
    for part in sorted((folder / "target").glob("part-*.json")):
        with part.open(encoding="utf-8") as lines:
            for line in lines:
                document = json.loads(line)
                yield TargetRecord(document, document, position)
                position += 1


def run_buckets(spark: SparkSession, folder: Path, buckets: int | None) -> dict[str, Any]:
    """``cdc verify``'s path for one target."""
    spill_folder = Path(tempfile.mkdtemp(prefix="bench-verify-spill-"))
    try:
        shape, silver = spill_silver(
            spark, str(folder / "silver"), ENTITY, spill_folder / "silver", buckets
        )
        result = compare_target("target", "bench", shape, silver, target_records(folder))
    finally:
        shutil.rmtree(spill_folder, ignore_errors=True)
    return {
        "counts": [result.missing, result.extra, result.different],
        "examples": result.examples,
        "buckets": [result.buckets, result.buckets_differing],
    }


def run_whole_map(spark: SparkSession, folder: Path) -> dict[str, Any]:
    """The path before issue #39: both sides as dicts in this process."""
    shape, expected = silver_hashes(spark, str(folder / "silver"), ENTITY)
    got = {shape.key_of(r.key): shape.hash_of(r.content or {}) for r in target_records(folder)}
    kinds = {
        "missing": sorted((k for k in expected if k not in got), key=repr),
        "extra": sorted((k for k in got if k not in expected), key=repr),
        "different": sorted((k for k in expected if k in got and got[k] != expected[k]), key=repr),
    }
    return {
        "counts": [len(keys) for keys in kinds.values()],
        "examples": {kind: _render(shape, keys[:5]) for kind, keys in kinds.items() if keys},
    }


def _render(shape: RowShape, keys: list[tuple[Any, ...]]) -> list[str]:
    return [shape.render(k) for k in keys]


def child(approach: str, folder: Path, buckets: int | None) -> None:
    """Run one approach in this process and print its figures as JSON."""
    spark = spark_session()
    started = time.monotonic()
    result = (
        run_buckets(spark, folder, buckets)
        if approach == "buckets"
        else run_whole_map(spark, folder)
    )
    result["seconds"] = time.monotonic() - started
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--buckets", type=int, default=None)
    parser.add_argument("--approaches", default="buckets,whole-map")
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.folder, args.buckets)
        return

    temporary = args.folder is None
    folder = Path(tempfile.mkdtemp(prefix="bench-verify-")) if temporary else args.folder
    folder.mkdir(parents=True, exist_ok=True)
    try:
        rows_file = folder / "rows"
        if not rows_file.exists() or int(rows_file.read_text()) != args.rows:
            started = time.monotonic()
            spark = spark_session()
            write_tables(spark, folder, args.rows)
            spark.stop()
            print(f"{args.rows:,} rows written in {time.monotonic() - started:.0f} s: {folder}")
        results = {}
        for approach in args.approaches.split(","):
            command = [sys.executable, __file__, "--child", approach, "--folder", str(folder)]
            if args.buckets:
                command += ["--buckets", str(args.buckets)]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            results[approach] = json.loads(done.stdout.strip().splitlines()[-1])
            figures = results[approach]
            print(
                f"{approach:<10} {figures['seconds']:8.1f} s  peak RSS "
                f"{figures['peak_rss_mib']:7.0f} MiB  missing/extra/different "
                f"{figures['counts']}  buckets compared/differing {figures.get('buckets', '-')}"
            )
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
        found = {a: (r["counts"], r["examples"]) for a, r in results.items()}
        first, *others = found.values()
        same = all(f == first for f in others) and first[0] == [SEEDED] * 3
        print(f"every approach found the seeded differences: {same}")
        if not same:
            print(json.dumps(found, indent=2))
            raise SystemExit(1)
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
