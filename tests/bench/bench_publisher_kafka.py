"""Benchmark: publisher-kafka draining a silver change feed, beside the seed-style baseline.

Needs the local servers (``make infra-up``). Builds a customers silver table (Change Data
Feed on) holding N inserts in 10 commits, each recorded in ``silver/_versions`` as the
merger records its commits (``cdc_merger.stream.SilverVersions``: how the publisher
learns that silver moved), then, each in its own process:

- publisher: ``cdc-publisher-kafka --once`` (JVM Avro encoding, one Kafka transaction per
  micro-batch with its progress: exactly-once for read_committed consumers);
- baseline: the same change feed -> ``to_avro`` -> Spark's own Kafka sink (at-least-once).

Prints changes/s over the process wall time and over the streaming time (sum of
micro-batch durations), and peak RSS. Then the delay at a steady load: a writer appends
``--rate`` changes/s to silver (one commit a second) while the publisher runs; a
read_committed consumer takes each event's delay from its silver commit timestamp to the
moment it reads it, after one warm-up commit read back (not measured). Prints p50 / p95 /
p99.

    .venv/bin/python tests/bench/bench_publisher_kafka.py [--changes 1000000] [--rate 2000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import fastavro
import yaml
from bench_ingestor import run_measured
from cdc_devkit.oracle import load_fingerprints
from cdc_merger.stream import SilverVersions
from cdc_shared.config.pipeline import load_config
from cdc_shared.jvm.spark import build_spark_session
from cdc_shared.streaming.tables import ensure_table
from confluent_kafka import Consumer, TopicPartition
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENTITY = "customers"
SILVER_COLUMNS = (
    "id int not null, first_name string, last_name string, email string, phone string, "
    "created_at timestamp, _cdc_seq array<bigint> not null, _cdc_op string not null, "
    "_cdc_source_ts timestamp, _cdc_commit_ts timestamp not null"
)


def silver_rows(spark: SparkSession, start: int, count: int) -> DataFrame:
    return spark.range(start, start + count).select(
        F.col("id").cast("int").alias("id"),
        F.concat(F.lit("first"), F.col("id")).alias("first_name"),
        F.concat(F.lit("last"), F.col("id")).alias("last_name"),
        F.concat(F.col("id"), F.lit("@example.com")).alias("email"),
        F.lit(None).cast("string").alias("phone"),
        F.current_timestamp().alias("created_at"),
        F.array(F.col("id") * 10).alias("_cdc_seq"),
        F.lit("c").alias("_cdc_op"),
        F.current_timestamp().alias("_cdc_source_ts"),
        F.current_timestamp().alias("_cdc_commit_ts"),
    )


def write_config(workdir: Path, bootstrap: str, run: str) -> Path:
    document = {
        "storage_root": str(workdir / "store"),
        "spark": {
            "master": "local[2]",
            "conf": {"spark.ui.enabled": "false", "spark.driver.memory": "2g"},
        },
        "kafka": {"bootstrap_servers": bootstrap},
        "schema_registry": {"dirs": [str(ROOT / "schemas")]},
        "entities": [
            {
                "name": "customers",
                "source_topic": "dbserver1.inventory.customers",
                "key": ["id"],
                "sequence_by": ["source.lsn"],
                "change_topic": f"bench{run}.customers",
            }
        ],
        "publisher_kafka": {"trigger_interval": "200 milliseconds", "metrics_port": 0},
    }
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


BASELINE = """
import sys, json
from cdc_shared.config.pipeline import load_config
from cdc_shared.jvm.spark import build_spark_session
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import to_avro
config = load_config(sys.argv[1])
spark = build_spark_session(config.spark, "baseline")
entity = config.entities[0]
feed = (spark.readStream.format("delta").option("readChangeFeed", "true")
        .option("startingVersion", 0).load(config.layout.silver(entity.name))
        .where("_change_type != 'update_preimage'"))
row = F.struct(*[c for c in feed.columns if not c.startswith("_")])
out = feed.select(
    to_avro(F.struct("id")).alias("key"),
    to_avro(F.struct(F.col("_change_type").alias("op"), row.alias("after"),
                     F.col("_commit_version").alias("commit_version"))).alias("value"))
query = (out.writeStream.format("kafka")
         .option("kafka.bootstrap.servers", config.kafka.bootstrap_servers)
         .option("topic", sys.argv[2])
         .option("checkpointLocation", config.storage_root + "/baseline/_checkpoint")
         .trigger(availableNow=True).start())
query.awaitTermination()
print(json.dumps({"batch_ms": sum(p["batchDuration"] for p in query.recentProgress)}))
"""


def batch_ms(log: Path) -> float:
    total = 0.0
    for line in log.read_text(errors="replace").splitlines():
        if '"msg": "batch"' in line:
            total += json.loads(line)["duration_ms"]
        elif line.startswith('{"batch_ms"'):
            total += json.loads(line)["batch_ms"]
    return total


def topic_size(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-size"})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return sum(
            high - low
            for low, high in (
                consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
                for p in partitions
            )
        )
    finally:
        consumer.close()


def append(rows: DataFrame, silver: str, versions: SilverVersions) -> None:
    """Append ``rows`` to silver, then record its new version as the merger does."""
    rows.write.format("delta").mode("append").save(silver)
    versions.note(ENTITY)
    versions.flush()


def steady_delays(
    spark: SparkSession,
    config_path: Path,
    silver: str,
    topic: str,
    rate: int,
    seconds: int,
    versions: SilverVersions,
) -> list[float]:
    """Run the publisher while appending ``rate`` changes/s; delays in ms as read."""
    config = load_config(config_path)
    schemas = load_fingerprints([Path(config.storage_root) / "_schemas"])
    delays: list[float] = []
    stop = threading.Event()

    def consume() -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": config.kafka.bootstrap_servers,
                "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                "isolation.level": "read_committed",
                "auto.offset.reset": "latest",
            }
        )
        consumer.subscribe([topic])
        while not stop.is_set():
            for message in consumer.consume(1000, timeout=0.2):
                value = message.value()
                if message.error() is not None or value is None:
                    continue
                now = time.time()
                event = fastavro.schemaless_reader(
                    io.BytesIO(value[10:]), schemas[value[2:10]], None
                )
                committed = event["commit_timestamp"].timestamp()
                delays.append((now - committed) * 1000)
        consumer.close()

    log = config_path.parent / "steady.log"
    publisher = subprocess.Popen(
        [str(BIN / "cdc-publisher-kafka"), "--config", str(config_path)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    time.sleep(25)  # start-up and catch-up on what the throughput run left
    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    time.sleep(5)
    # Warm-up, not measured: one commit must be read back first, so the publisher's own
    # start (its first batches take seconds) does not count as steady-state delay.
    append(silver_rows(spark, 9_000_000, rate), silver, versions)
    deadline = time.monotonic() + 180
    while len(delays) < rate and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"warm-up: {len(delays):,} of {rate:,} events read back", flush=True)
    time.sleep(2)
    delays.clear()
    next_id = 10_000_000
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        tick = time.monotonic()
        append(silver_rows(spark, next_id, rate), silver, versions)
        next_id += rate
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    time.sleep(10)
    stop.set()
    reader.join(10)
    publisher.terminate()
    publisher.wait(120)
    return delays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    args = parser.parse_args()
    run = uuid.uuid4().hex[:6]
    workdir = Path(tempfile.mkdtemp(prefix="bench-publisher-kafka-"))
    config_path = write_config(workdir, args.bootstrap, run)
    config = load_config(config_path)
    silver = config.layout.silver(ENTITY)
    spark = build_spark_session(config.spark, "bench-setup")
    versions = SilverVersions(spark, config)
    versions.start()
    ensure_table(
        spark,
        silver,
        spark.createDataFrame([], SILVER_COLUMNS).schema,
        {"delta.enableChangeDataFeed": "true"},
    )
    per_commit = args.changes // 10
    for commit in range(10):
        append(silver_rows(spark, commit * per_commit, per_commit), silver, versions)
    print(f"silver: {args.changes:,} inserts in 10 commits at {silver}", flush=True)

    ours_log, base_log = workdir / "publisher.log", workdir / "baseline.log"
    ours_wall, ours_rss = run_measured(
        [str(BIN / "cdc-publisher-kafka"), "--config", str(config_path), "--once"], ours_log
    )
    ours_topic = config.entities[0].change_topic_name
    base_topic = f"bench{run}.baseline"
    base_wall, base_rss = run_measured(
        [sys.executable, "-c", BASELINE, str(config_path), base_topic], base_log
    )
    ours_n = topic_size(args.bootstrap, ours_topic)
    base_n = topic_size(args.bootstrap, base_topic)
    rows = [
        ("publisher (exactly-once)", ours_n, ours_wall, batch_ms(ours_log), ours_rss),
        ("baseline (Spark Kafka sink)", base_n, base_wall, batch_ms(base_log), base_rss),
    ]
    print(f"\n{'':30} {'records':>10} {'wall s':>8} {'/s wall':>9} {'/s batch':>9} {'RSS MiB':>8}")
    for name, n, wall, ms, rss in rows:
        per_batch = n / (ms / 1000) if ms else float("nan")
        print(f"{name:30} {n:>10,} {wall:>8.1f} {n / wall:>9,.0f} {per_batch:>9,.0f} {rss:>8,.0f}")
    print(f"ratio publisher/baseline (wall): {(ours_n / ours_wall) / (base_n / base_wall):.2f}")
    if ours_n != args.changes:  # offsets, so one transaction marker per batch counts too
        print(f"note: the change topic spans {ours_n:,} offsets for {args.changes:,} changes")

    delays = steady_delays(
        spark, config_path, silver, ours_topic, args.rate, args.seconds, versions
    )
    versions.stop()
    if len(delays) > 2:
        cuts = statistics.quantiles(delays, n=100)
        print(
            f"\nsteady {args.rate:,} changes/s for {args.seconds} s: {len(delays):,} events read; "
            f"delay silver commit -> readable: p50 {cuts[49]:,.0f} ms, p95 {cuts[94]:,.0f} ms, "
            f"p99 {cuts[98]:,.0f} ms"
        )
    print(f"(logs in {workdir}; {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC)")


if __name__ == "__main__":
    main()
