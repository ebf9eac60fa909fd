"""Benchmark: the ingestor draining N customer events, beside the seed-style baseline.

Needs the local servers (``make infra-up``). Produces N customer events (the generator,
0.1% poison) to a fresh 3-partition topic, then, each in its own process with ``--once``:

- ingestor: ``cdc-ingestor`` (JVM decoding of both framings, contract checks,
  quarantine, idempotent writes to the one bronze table and to the quarantine);
- baseline: Spark's Kafka source -> ``from_avro`` of the payload after the header with
  one fixed schema -> Delta append; no quarantine, no idempotence.

Prints events/s over the streaming time (sum of micro-batch durations) and over the
process wall time, and the peak RSS of each process tree (Python driver + JVM).

    .venv/bin/python tests/bench/bench_ingestor.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml
from cdc_devkit.processes import group_rss_bytes

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run_measured(command: list[str], log: Path) -> tuple[float, float]:
    """Run ``command`` in its own process group; wall seconds and peak RSS (MiB)."""
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, group_rss_bytes(process.pid) / 2**20)
        time.sleep(0.25)
    if process.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({process.returncode}); see {log}")
    return time.monotonic() - started, peak


def baseline(config_path: str) -> None:
    """The seed-style pipeline, run in a child process; prints rows and batch time."""
    from cdc_shared.clients.connect import spark_kafka_options
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.jvm.spark import build_spark_session
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    config = load_config(config_path)
    entity = config.entities[0]
    schema = (ROOT / "schemas/dbserver1.inventory.customers-value.avsc").read_text()
    spark = build_spark_session(config.spark, "bench-baseline")
    scratch = f"{config.storage_root.rstrip('/')}/baseline"
    query = (
        spark.readStream.format("kafka")
        .options(**spark_kafka_options(config.kafka))
        .option("subscribe", entity.source_topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", config.ingestor.max_offsets_per_trigger)
        .load()
        .select(
            "topic",
            "partition",
            "offset",
            "timestamp",
            from_avro(F.expr("substring(value, 11)"), schema, {"mode": "PERMISSIVE"}).alias("v"),
        )
        .select("topic", "partition", "offset", "timestamp", "v.*")
        .writeStream.format("delta")
        # The bench's own scratch table and checkpoint, not part of the pipeline's layout.
        .option("checkpointLocation", f"{scratch}/_checkpoints/{entity.name}")
        .trigger(availableNow=True)
        .start(f"{scratch}/{entity.name}")
    )
    query.awaitTermination()
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    millis = sum(p["batchDuration"] for p in query.recentProgress if p["numInputRows"])
    print(json.dumps({"rows": rows, "batch_ms": millis}))


def main() -> None:
    parser = argparse.ArgumentParser(description="ingestor vs baseline throughput")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--max-offsets-per-trigger", type=int, default=500_000)
    parser.add_argument("--baseline-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_of:
        baseline(args.baseline_of)
        return

    from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, produce
    from cdc_shared.clients.schemas import make_registry
    from cdc_shared.config.pipeline import load_config

    work = Path(tempfile.mkdtemp(prefix="bench-ingestor-"))
    topic = f"bench_{uuid.uuid4().hex[:8]}.inventory.customers"
    config_path = work / "pipeline.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "storage_root": str(work / "data"),
                "spark": {"master": "local[2]", "conf": {"spark.driver.memory": "2g"}},
                "kafka": {"bootstrap_servers": args.bootstrap},
                "schema_registry": {"dirs": [str(ROOT / "schemas")]},
                "ingestor": {
                    "metrics_port": 0,
                    "max_offsets_per_trigger": args.max_offsets_per_trigger,
                },
                "entities": [
                    {
                        "name": "customers",
                        "source_topic": topic,
                        "key": ["id"],
                        "sequence_by": ["source.lsn"],
                        "key_schema": str(ROOT / "schemas/dbserver1.inventory.customers-key.avsc"),
                        "value_schema": str(
                            ROOT / "schemas/dbserver1.inventory.customers-value.avsc"
                        ),
                    }
                ],
            }
        )
    )
    config = load_config(config_path)
    spec = WorkloadSpec(
        events=args.events,
        keys=max(1000, args.events // 10),
        redelivery_share=0,
        poison_share=0.001,
        schema_change_at=None,
        snapshot_rows=0,
    )
    print(f"producing {args.events:,} customer events to {topic} ...", flush=True)
    report = produce(
        config.kafka, WorkloadGenerator(config.entities, make_registry(config), spec).messages()
    )
    print(f"produced {report.produced:,} messages at {report.rate:,.0f}/s", flush=True)

    results = {}
    log = work / "ingestor.log"
    wall, rss = run_measured(
        [str(BIN / "cdc-ingestor"), "--config", str(config_path), "--once"], log
    )
    batches = [
        json.loads(line)
        for line in log.read_text().splitlines()
        if line.startswith("{") and '"msg": "batch"' in line
    ]
    results["ingestor"] = (
        sum(b["input_rows"] for b in batches),
        sum(b["duration_ms"] for b in batches),
        wall,
        rss,
    )
    log = work / "baseline.log"
    wall, rss = run_measured([sys.executable, __file__, "--baseline-of", str(config_path)], log)
    summary = json.loads(
        [line for line in log.read_text().splitlines() if line.startswith('{"rows"')][-1]
    )
    results["baseline"] = (summary["rows"], summary["batch_ms"], wall, rss)

    print(
        f"\n{'pipeline':<10}{'events':>11}{'events/s (batches)':>20}"
        f"{'events/s (wall)':>17}{'peak RSS MiB':>14}"
    )
    for name, (rows, millis, wall, rss) in results.items():
        print(
            f"{name:<10}{rows:>11,}{rows / (millis / 1000):>20,.0f}{rows / wall:>17,.0f}"
            f"{rss:>14,.0f}"
        )
    ours, base = results["ingestor"], results["baseline"]
    ratio = (ours[0] / ours[1]) / (base[0] / base[1])
    print(f"\ningestor / baseline throughput (batch time): {ratio:.2f}")
    print(f"work folder: {work}")


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
