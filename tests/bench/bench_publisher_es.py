"""Benchmark: publisher-es throughput beside a plain ``helpers.bulk`` loop, and its delay.

Needs a running Elasticsearch (``make infra-up``, or the test servers: ``--es-url``).

Silver's commits are recorded in ``silver/_versions`` as the merger records them
(``cdc_merger.stream.SilverVersions``): how the publisher learns that silver moved.

1. Throughput: a silver-shaped Delta table (Change Data Feed on) of N customer inserts in
   10 commits; then, each in its own process and on a fresh index with the same mapping:

   - publisher: ``cdc-publisher-es --once`` (silver's change feed by version, ids,
     external versions, retries, per-document outcomes, progress in its index);
   - baseline: a Spark batch read of the same change feed -> ``row.asDict()`` ->
     ``elasticsearch.helpers.bulk`` with the same chunk size, no versioning, no outcomes.

   Prints documents/s over the indexing time (publisher: the sum of its micro-batch
   durations; baseline: read + bulk) and over the process wall time, per round, then
   medians and the ratio publisher / baseline.

2. Delay: the publisher runs continuously (trigger 250 ms) while this process commits
   ``--rate`` changes per second to silver (one commit per second, or as fast as it can
   when a commit takes longer; the time taken is printed), after ``--warmup-seconds`` of
   the same load that are not measured; a poller thread counts each commit's documents
   every 100 ms. The delay of a commit is from its Delta commit timestamp to all its
   documents being searchable (refresh_interval 1 s). Prints p50, p99 and max.

    .venv/bin/python tests/bench/bench_publisher_es.py [--changes 1000000] [--rounds 3]
        [--rate 2000] [--seconds 60] [--es-url http://127.0.0.1:9200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOPIC = "dbserver1.inventory.customers"  # the example schemas in schemas/ name the mapping
ENTITY = "customers"
COMMITS = 10


def write_config(work: Path, es_url: str, index: str, **publisher: object) -> Path:
    path = work / f"pipeline-{index}.yaml"
    document = {
        "storage_root": str(work / "data"),
        "spark": {
            "master": "local[2]",
            "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"},
        },
        "elasticsearch": {"hosts": [es_url]},
        "schema_registry": {"dirs": [str(ROOT / "schemas")]},
        "entities": [
            {
                "name": "customers",
                "source_topic": TOPIC,
                "key": ["id"],
                "sequence_by": ["source.lsn"],
                "es_index": index,
            }
        ],
        "publisher_es": {"metrics_port": 0, **publisher},
    }
    path.write_text(yaml.safe_dump(document))
    return path


def silver_rows(spark: Any, start: int, count: int) -> Any:
    """``count`` customer rows with ids from ``start``, shaped like silver."""
    from pyspark.sql import functions as F

    return spark.range(start, start + count).select(
        F.col("id").cast("int").alias("id"),
        F.concat(F.lit("first-"), F.col("id") % 1000).alias("first_name"),
        F.concat(F.lit("last-"), F.col("id") % 997).alias("last_name"),
        F.concat(F.lit("c"), F.col("id"), F.lit("@example.com")).alias("email"),
        F.when(F.col("id") % 4 == 0, F.lit(None))
        .otherwise(F.concat(F.lit("+1-555-"), F.col("id") % 10000))
        .alias("phone"),
        F.timestamp_seconds(F.lit(1_700_000_000) + F.col("id")).alias("created_at"),
        F.array(F.col("id") * 10 + 1).alias("_cdc_seq"),
        F.lit("c").alias("_cdc_op"),
        F.current_timestamp().alias("_cdc_source_ts"),
        F.current_timestamp().alias("_cdc_commit_ts"),
    )


def create_silver(spark: Any, path: str) -> None:
    silver_rows(spark, 0, 0).write.format("delta").option(
        "delta.enableChangeDataFeed", "true"
    ).save(path)


def append(rows: Any, path: str, versions: Any) -> None:
    """Append ``rows`` to silver, then record its new version as the merger does
    (``versions``: a started ``cdc_merger.stream.SilverVersions``)."""
    rows.write.format("delta").mode("append").save(path)
    versions.note(ENTITY)
    versions.flush()


def make_silver(config_path: str, changes: int) -> None:
    """Child process: silver/customers with ``changes`` inserts in COMMITS commits."""
    from cdc_merger.stream import SilverVersions
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.jvm.spark import build_spark_session

    config = load_config(config_path)
    spark = build_spark_session(config.spark, "bench-make-silver")
    path = config.layout.silver(ENTITY)
    create_silver(spark, path)
    versions = SilverVersions(spark, config)
    versions.start()
    per_commit = changes // COMMITS
    for k in range(COMMITS):
        append(silver_rows(spark, 1 + k * per_commit, per_commit), path, versions)
    versions.stop()


def baseline(config_path: str, index: str) -> None:
    """Child process: the plain loop. Prints documents and seconds (read + bulk)."""
    from cdc_publisher_es.mapping import (
        ensure_index,
        entity_properties,
        index_mappings,
    )
    from cdc_shared.clients.connect import make_elasticsearch
    from cdc_shared.clients.schemas import entity_schemas, make_registry
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.jvm.spark import build_spark_session
    from cdc_shared.streaming.changefeed import row_columns
    from elasticsearch import helpers
    from pyspark.sql import types as T

    config = load_config(config_path)
    entity = config.entities[0]
    spark = build_spark_session(config.spark, "bench-baseline")
    es = make_elasticsearch(config.elasticsearch)
    path = config.layout.silver(ENTITY)
    feed = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 0)
        .load(path)
    )
    columns = row_columns(feed.schema)
    row_schema = entity_schemas(entity, make_registry(config)).row_schema()
    properties = entity_properties(
        row_schema, T.StructType([feed.schema[c] for c in columns]), config.publisher_es
    )
    ensure_index(es, index, config.publisher_es, index_mappings(entity, properties, "none"))
    started = time.monotonic()
    rows = feed.where("_change_type IN ('insert', 'update_postimage')").select(*columns)
    actions = (
        {"_index": index, "_id": str(r["id"]), "_source": r.asDict(recursive=True)}
        for r in rows.toLocalIterator(prefetchPartitions=True)
    )
    indexed, _errors = helpers.bulk(
        es,
        actions,
        chunk_size=config.publisher_es.chunk_size,
        max_chunk_bytes=config.publisher_es.max_chunk_bytes,
        stats_only=True,
    )
    print(json.dumps({"docs": indexed, "seconds": time.monotonic() - started}))


def run_process(command: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    started = time.monotonic()
    with log.open("ab") as out:
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise SystemExit(f"{command[0]} failed ({code}); see {log}")
    return time.monotonic() - started


def publisher_round(config: Path, work: Path, tag: str) -> dict[str, float]:
    log = work / f"publisher-{tag}.log"
    wall = run_process([str(BIN / "cdc-publisher-es"), "--config", str(config), "--once"], log)
    batches = [
        json.loads(line)
        for line in log.read_text().splitlines()
        if line.startswith("{") and '"msg": "batch"' in line
    ]
    docs = sum(b.get("indexed", 0) + b.get("already_applied", 0) for b in batches)
    seconds = sum(b["duration_ms"] for b in batches) / 1000
    return {"docs": docs, "seconds": seconds, "wall": wall}


def baseline_round(config: Path, work: Path, index: str, tag: str) -> dict[str, float]:
    log = work / f"baseline-{tag}.log"
    wall = run_process(
        [sys.executable, __file__, "--baseline-of", str(config), "--index", index], log
    )
    result = next(
        json.loads(line)
        for line in reversed(log.read_text().splitlines())
        if line.startswith('{"docs"')
    )
    return {"docs": result["docs"], "seconds": result["seconds"], "wall": wall}


def delete_index(es_url: str, alias: str) -> None:
    from elasticsearch import Elasticsearch

    es = Elasticsearch(es_url)
    for index in list(es.indices.get_alias(name=alias, ignore_unavailable=True).body):
        es.indices.delete(index=index, ignore_unavailable=True)
    es.indices.delete(index=alias, ignore_unavailable=True)


def throughput(args: argparse.Namespace, work: Path) -> None:
    from cdc_shared.config.entities import DEFAULT_GROUP
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.contracts.layout import PUBLISHER_ES

    run = uuid.uuid4().hex[:6]
    shared = write_config(work, args.es_url, f"bench_{run}_silver")
    print(f"making silver: {args.changes:,} inserts in {COMMITS} commits ...", flush=True)
    run_process(
        [sys.executable, __file__, "--make-silver", str(shared), "--changes", str(args.changes)],
        work / "make-silver.log",
    )
    ours: list[dict[str, float]] = []
    base: list[dict[str, float]] = []
    for r in range(args.rounds):
        index = f"bench_{run}_ours_{r}"
        config = write_config(work, args.es_url, index)
        # Same silver for every run: a fresh checkpoint per round (and a fresh index, so
        # no progress in the progress index).
        checkpoint = load_config(config).layout.checkpoint(PUBLISHER_ES, DEFAULT_GROUP)
        shutil.rmtree(checkpoint, ignore_errors=True)
        ours.append(publisher_round(config, work, str(r)))
        delete_index(args.es_url, index)
        index = f"bench_{run}_base_{r}"
        base.append(baseline_round(shared, work, index, str(r)))
        delete_index(args.es_url, index)
        for name, m in (("publisher-es", ours[-1]), ("baseline", base[-1])):
            print(
                f"round {r}  {name:13s} docs={int(m['docs']):>9,}  "
                f"{m['docs'] / m['seconds']:>9,.0f} docs/s indexing "
                f"({m['seconds']:.1f} s)  {m['docs'] / m['wall']:>9,.0f} docs/s wall "
                f"({m['wall']:.1f} s)",
                flush=True,
            )
    ours_rate = statistics.median(m["docs"] / m["seconds"] for m in ours)
    base_rate = statistics.median(m["docs"] / m["seconds"] for m in base)
    ours_wall = statistics.median(m["docs"] / m["wall"] for m in ours)
    base_wall = statistics.median(m["docs"] / m["wall"] for m in base)
    print(
        f"median indexing docs/s: publisher-es {ours_rate:,.0f}  baseline {base_rate:,.0f}  "
        f"ratio {ours_rate / base_rate:.2f}x (goal >= 0.8x)"
    )
    print(
        f"median wall docs/s:     publisher-es {ours_wall:,.0f}  baseline {base_wall:,.0f}  "
        f"ratio {ours_wall / base_wall:.2f}x"
    )


def commit_timestamp_s(table: Path, version: int) -> float:
    log = table / "_delta_log" / f"{version:020d}.json"
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if "commitInfo" in entry:
            return float(entry["commitInfo"]["timestamp"]) / 1000
    raise RuntimeError(f"no commitInfo in {log}")


def delay(args: argparse.Namespace, work: Path) -> None:
    from cdc_merger.stream import SilverVersions
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.jvm.spark import build_spark_session
    from elasticsearch import Elasticsearch

    index = f"bench_{uuid.uuid4().hex[:6]}_delay"
    root = work / "delay"
    root.mkdir()
    config_path = write_config(root, args.es_url, index, trigger_interval="250 milliseconds")
    config = load_config(config_path)
    spark = build_spark_session(config.spark, "bench-silver-writer")
    table = Path(config.layout.silver(ENTITY))
    create_silver(spark, str(table))
    versions = SilverVersions(spark, config)
    versions.start()
    process = subprocess.Popen(
        [str(BIN / "cdc-publisher-es"), "--config", str(config_path)],
        stdout=subprocess.DEVNULL,
        stderr=(root / "publisher.log").open("wb"),
        start_new_session=True,
    )
    es = Elasticsearch(args.es_url)
    per_commit = args.rate
    committed: dict[int, float] = {}  # commit number -> Delta commit timestamp
    visible: dict[int, float] = {}
    lock = threading.Lock()
    stop = threading.Event()
    polling = threading.Thread(
        target=poll_every_100ms,
        args=(stop, lock, es, index, per_commit, committed, visible),
        daemon=True,
    )
    try:
        while not es.indices.exists_alias(name=index):  # the publisher is up
            time.sleep(0.5)
        # Steady state: --warmup-seconds of the same load (negative ids, not measured) must
        # be searchable first, so the JVM's first jobs and bulk requests are not counted.
        warmup = max(1, args.warmup_seconds)
        for w in range(warmup):
            append(silver_rows(spark, -(w + 1) * per_commit, per_commit), str(table), versions)
            time.sleep(1.0)
        while es.count(index=index, query={"range": {"id": {"lt": 0}}})["count"] < (
            warmup * per_commit
        ):
            time.sleep(0.2)
        polling.start()
        started = next_commit = time.monotonic()
        for k in range(args.seconds):
            append(silver_rows(spark, 1 + k * per_commit, per_commit), str(table), versions)
            with lock:
                committed[k] = commit_timestamp_s(table, k + 1 + warmup)  # 0: creation
            next_commit += 1.0
            time.sleep(max(0.0, next_commit - time.monotonic()))
        writing_s = time.monotonic() - started
        deadline = time.monotonic() + 120
        while len(visible) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        if polling.is_alive():
            polling.join()
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(120)
        versions.stop()
    print_delays(args, warmup, writing_s, committed, visible)


def print_delays(
    args: argparse.Namespace,
    warmup: int,
    writing_s: float,
    committed: dict[int, float],
    visible: dict[int, float],
) -> None:
    """Each commit's delay to searchable: p50, p99 and max."""
    delays = sorted(visible[k] - committed[k] for k in visible)
    missing = len(committed) - len(visible)
    p50 = statistics.median(delays)
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
    print(
        f"delay at {args.rate:,} changes/s for {args.seconds} s after {warmup} s of warm-up "
        f"({len(committed)} commits in "
        f"{writing_s:.0f} s, {missing} never visible): p50 {p50:.2f} s  p99 {p99:.2f} s  "
        f"max {delays[-1]:.2f} s (goal p99 < 5 s)"
    )


def poll_every_100ms(
    stop: threading.Event,
    lock: threading.Lock,
    es: Any,
    index: str,
    per_commit: int,
    committed: dict[int, float],
    visible: dict[int, float],
) -> None:
    """Poll until ``stop``, whatever the writer does (a slow commit must not pause it)."""
    while not stop.is_set():
        with lock:
            known = dict(committed)
        poll(es, index, per_commit, known, visible)
        time.sleep(0.1)


def poll(
    es: Any, index: str, per_commit: int, committed: dict[int, float], visible: dict[int, float]
) -> None:
    """Record when each commit's documents are all searchable (one histogram query)."""
    pending = [k for k in committed if k not in visible]
    if not pending:
        return
    now = time.time()
    result = es.search(
        index=index,
        size=0,
        query={"range": {"id": {"gte": 1 + min(pending) * per_commit}}},
        aggs={"commit": {"histogram": {"field": "id", "interval": per_commit, "offset": 1}}},
    )
    for bucket in result["aggregations"]["commit"]["buckets"]:
        k = int((bucket["key"] - 1) // per_commit)
        if k in committed and k not in visible and bucket["doc_count"] >= per_commit:
            visible[k] = now


def main() -> None:
    parser = argparse.ArgumentParser(description="publisher-es vs helpers.bulk; delay")
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument(
        "--warmup-seconds",
        type=int,
        default=15,
        help="seconds of the same load before the measured ones (the publisher's JIT warm-up)",
    )
    parser.add_argument("--es-url", default="http://127.0.0.1:9200")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-delay", action="store_true")
    parser.add_argument("--make-silver", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-of", help=argparse.SUPPRESS)
    parser.add_argument("--index", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_silver:
        make_silver(args.make_silver, args.changes)
        return
    if args.baseline_of:
        baseline(args.baseline_of, args.index)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-publisher-es-"))
    print(f"work folder: {work}", flush=True)
    if not args.skip_throughput:
        throughput(args, work)
    if not args.skip_delay:
        delay(args, work)


if __name__ == "__main__":
    main()
