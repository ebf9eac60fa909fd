"""Benchmark: the merger's in-memory tombstone index with 1,000,000 tombstones.

No servers needed. Writes N tombstones (integer keys, one-element sequences, as the
example ``customers`` entity has) to a Delta tombstones table beside an empty silver,
loads them into a ``TombstoneIndex`` as a merger does at start, and prints the load time,
the memory the index holds (Python allocations, ``tracemalloc``, and the process's RSS
growth), and what a batch pays to consult and update it: 1,000 and 100,000 upserts
checked, then recorded with 5% deletes. A second key shape (two columns, string and
integer, two-element sequences) shows the cost of composite keys.

    .venv/bin/python tests/bench/bench_tombstones.py [--tombstones 1000000]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from cdc_merger.guards import TombstoneIndex  # noqa: E402
from cdc_shared.config.services import SparkConfig  # noqa: E402
from cdc_shared.contracts.silver import SEQUENCE  # noqa: E402
from cdc_shared.jvm.spark import build_spark_session  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def write_tables(spark: SparkSession, root: Path, count: int, composite: bool) -> tuple[str, str]:
    """``count`` tombstones and an empty silver with the same key."""
    frame = spark.range(count)
    if composite:
        keys = [F.concat(F.lit("tenant-"), F.col("id") % 97).alias("tenant"), F.col("id")]
        sequence = F.array(F.floor(F.col("id") / 1000).cast("long"), F.col("id"))
    else:
        keys = [F.col("id").cast("int").alias("id")]
        sequence = F.array(F.col("id") + 1_000_000)
    tombstones = frame.select(
        *keys, sequence.alias(SEQUENCE), F.current_timestamp().alias("deleted_at")
    )
    tombstone_path, silver_path = str(root / "tombstones"), str(root / "silver")
    tombstones.write.format("delta").save(tombstone_path)
    tombstones.drop("deleted_at").limit(0).write.format("delta").save(silver_path)
    return tombstone_path, silver_path


def offered(count: int, total: int, composite: bool, start: int, newer_by: int) -> pa.Table:
    """``count`` keys spread over the index, with sequences newer than every tombstone
    loaded and than any recorded with a smaller ``newer_by``."""
    ids = [(start + i * (total // count)) % total for i in range(count)]
    columns: dict[str, pa.Array] = {}
    if composite:
        columns["tenant"] = pa.array([f"tenant-{i % 97}" for i in ids])
        columns["id"] = pa.array(ids, pa.int64())
        columns[SEQUENCE] = pa.array([[10**9 + newer_by, i] for i in ids], pa.list_(pa.int64()))
    else:
        columns["id"] = pa.array(ids, pa.int32())
        columns[SEQUENCE] = pa.array(
            [[10**9 * (1 + newer_by) + i] for i in ids], pa.list_(pa.int64())
        )
    return pa.table(columns)


def measure(spark: SparkSession, root: Path, count: int, composite: bool) -> None:
    shape = "two-column key, two-element sequence" if composite else "int key, one-element seq"
    tombstone_path, silver_path = write_tables(spark, root, count, composite)
    key = ["tenant", "id"] if composite else ["id"]
    index = TombstoneIndex.over(spark, tombstone_path, silver_path, key)
    gc.collect()
    rss_before = rss_mib()
    tracemalloc.start()
    started = time.perf_counter()
    loaded = len(index)
    load_s = time.perf_counter() - started
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    gc.collect()
    rss_growth = rss_mib() - rss_before
    print(f"\n{count:,} tombstones, {shape}")
    print(f"  load at start         {load_s:8.2f} s ({loaded:,} in the index)")
    print(f"  held (tracemalloc)    {held / 2**20:8.1f} MiB = {held / loaded:,.0f} bytes per key")
    print(f"  RSS growth            {rss_growth:8.1f} MiB (includes the Arrow read)")
    newer_by = 0  # each round's events are newer than the rounds before
    for size in (1_000, 100_000):
        checks, records = [], []
        for round_ in range(5):
            newer_by += 1
            upserts = offered(size, count, composite, round_ * 7, newer_by)
            deletes = offered(size // 20, count, composite, round_ * 7 + 3, newer_by)
            started = time.perf_counter()
            stale = index.stale_upserts(upserts)
            checks.append(time.perf_counter() - started)
            started = time.perf_counter()
            index.record(deletes, upserts)
            records.append(time.perf_counter() - started)
            assert not stale, "the offered upserts are newer than every tombstone"
        print(
            f"  batch of {size:>7,}     check {statistics.median(checks) * 1000:7.1f} ms, "
            f"record {statistics.median(records) * 1000:7.1f} ms (median of 5)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tombstones", type=int, default=1_000_000)
    args = parser.parse_args()
    conf = {"spark.ui.enabled": "false", "spark.driver.memory": "2g"}
    spark = build_spark_session(SparkConfig(master="local[2]", conf=conf), "bench-tombstones")
    workdir = Path(tempfile.mkdtemp(prefix="bench-tombstones-"))
    measure(spark, workdir / "int", args.tombstones, composite=False)
    measure(spark, workdir / "composite", args.tombstones, composite=True)


if __name__ == "__main__":
    main()
