"""Benchmark: the merger's and the ingestor's writes on local disk vs S3, local vs cluster.

Four setups, one after another, each in its own process (a process holds one
SparkContext), all on this machine:

- ``local-disk``: ``local[2]``, tables on local disk (the baseline: how tests and the
  demo run);
- ``local-s3``: ``local[2]``, tables on the S3-compatible server (``cdc infra``'s S3Proxy);
- ``cluster-disk``: a Spark standalone cluster (``cdc infra``'s master and one worker,
  2 cores), tables on local disk;
- ``cluster-s3``: the cluster, tables on S3: the production shape.

Each setup makes a silver table as the merger does (``ensure_tables``) with ``--rows``
rows, merges ``--warmup`` uncounted 1,000-change batches, then ``--batches`` counted ones
with the merger's own ``apply_batch``; then it appends ``--batches`` bronze batches of
1,000 rows to a bronze table made as the ingestor makes it (``cdc_shared.contracts.bronze``: one
table, partitioned by ``entity``, the payload a VARIANT), each one append with the
ingestor's idempotent-write options (its checkpoint's two small files per batch are not
included). Per batch: wall time, and on S3 the requests the
driver's S3A file system made, by kind (its IOStatistics). In ``local-s3`` the executors
run in the driver's JVM and share that file system, so the counts are every request of
the batch; on the cluster they are the driver's part only (Delta's log reads, listings,
commits), the executors' Parquet reads and writes come on top.

    .venv/bin/python tests/bench/bench_storage.py [--rows 200000] [--batches 15]
        [--warmup 5] [--setups local-disk,local-s3,cluster-disk,cluster-s3]

Starts the S3 server and the cluster through ``cdc infra`` (ports ``CDC_INFRA_*``) when
they do not run, and stops what it started.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from bench_merger import Workload, bronze_batch, load_silver, p  # noqa: E402
from cdc_devkit import infra  # noqa: E402
from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, decode  # noqa: E402
from cdc_merger.apply import MergeState, apply_batch  # noqa: E402
from cdc_merger.silver_tables import SilverLayout, ensure_tables  # noqa: E402
from cdc_shared.avro import FileSchemaRegistry  # noqa: E402
from cdc_shared.clients.schemas import entity_schemas  # noqa: E402
from cdc_shared.config.connections import ObjectStorageConfig  # noqa: E402
from cdc_shared.config.services import SparkConfig  # noqa: E402
from cdc_shared.contracts import bronze as bronze_table  # noqa: E402
from cdc_shared.jvm.spark import build_spark_session  # noqa: E402
from cdc_shared.streaming.tables import ensure_table  # noqa: E402
from pydantic import SecretStr  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from support.entities import CUSTOMERS, SCHEMAS  # noqa: E402
from support.ingestion import typed_bronze_rows  # noqa: E402

SETUPS = ("local-disk", "local-s3", "cluster-disk", "cluster-s3")


#: S3A's IOStatistics counters of the requests it made, by HTTP kind. ``store_io_request``
#: counts every request (``total``), including kinds not broken out here.
REQUEST_COUNTERS = {
    "total": ("store_io_request",),
    "GET": ("action_http_get_request",),
    "HEAD": ("action_http_head_request",),
    "LIST": ("object_list_request",),
    "PUT": ("object_put_request",),
    "DELETE": ("object_delete_request", "object_bulk_delete_request"),
}


def s3_requests(spark: SparkSession, root: str) -> Counter[str]:
    """The S3 requests the driver's S3A file system of ``root`` made so far, by kind."""
    jvm: Any = spark.sparkContext._jvm  # type: ignore[attr-defined]
    conf = spark.sparkContext._jsc.hadoopConfiguration()  # type: ignore[union-attr]
    fs = jvm.org.apache.hadoop.fs.Path(root).getFileSystem(conf)
    counters = fs.getIOStatistics().counters()
    return Counter(
        {
            kind: sum(int(counters.get(name) or 0) for name in names)
            for kind, names in REQUEST_COUNTERS.items()
        }
    )


def child(setup: str, rows: int, batches: int, warmup: int, master: str, s3: str) -> None:
    """Run one setup's batches; print one JSON line per batch and one for the setup."""
    on_s3, on_cluster = setup.endswith("-s3"), setup.startswith("cluster")
    conf = {
        "spark.ui.enabled": "false",
        "spark.driver.memory": "2g",
        "spark.sql.shuffle.partitions": "4",
        "spark.databricks.delta.snapshotPartitions": "4",
    }
    if on_cluster:
        conf |= {
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "1500m",
            "spark.cores.max": "2",
        }
    root = (
        f"s3a://{infra.S3_BUCKET}/bench-{uuid.uuid4().hex[:8]}"
        if on_s3
        else tempfile.mkdtemp(prefix="bench-storage-")
    )
    if on_s3:
        storage = ObjectStorageConfig(
            endpoint=s3,
            path_style_access=True,
            region=infra.S3_REGION,
            access_key=SecretStr(infra.S3_ACCESS_KEY),
            secret_key=SecretStr(infra.S3_SECRET_KEY),
        )
        hadoop = storage.hadoop_options(infra.S3_BUCKET)
        conf |= {f"spark.hadoop.{name}": value for name, value in hadoop.items()}
    spark_config = SparkConfig(master=master if on_cluster else "local[2]", conf=conf)
    spark = build_spark_session(spark_config, f"bench-storage-{setup}")

    registry = FileSchemaRegistry([SCHEMAS])
    plan = DecodePlan.from_schemas(entity_schemas(CUSTOMERS, registry), registry)
    empty = spark.createDataFrame([], KAFKA_SCHEMA)
    bronze = typed_bronze_rows(decode(spark, empty, plan, CUSTOMERS.sequence_by)).schema
    layout = SilverLayout(f"{root}/silver", f"{root}/tombstones", f"{root}/truncates", ["id"])
    ensure_tables(spark, bronze, layout)
    load_silver(spark, layout.silver_path, rows)
    state = MergeState(spark, layout)
    workload = Workload(next_id=rows)

    def refuse(rejected: DataFrame) -> None:
        raise SystemExit(f"bench events rejected: {rejected.limit(3).collect()}")

    def merge(events: DataFrame) -> None:
        apply_batch(spark, events, layout, refuse, state)

    bronze_path = f"{root}/bronze/_all"
    ensure_table(
        spark, bronze_path, bronze_table.SCHEMA, bronze_table.PROPERTIES, [bronze_table.ENTITY]
    )
    appended = iter(range(1_000_000))

    def append(events: DataFrame) -> None:
        (
            as_bronze_rows(events)
            .write.format("delta")
            .mode("append")
            .option("txnAppId", "bench-storage")
            .option("txnVersion", next(appended))
            .save(bronze_path)
        )

    steps: dict[str, Callable[[DataFrame], None]] = {"merge": merge, "append": append}
    for step, write in steps.items():
        for number in range(-warmup, batches):
            events = bronze_batch(spark, bronze, workload, 1_000, seed=number + warmup)
            events = events.localCheckpoint(eager=True)  # as a micro-batch: computed rows
            before = s3_requests(spark, root) if on_s3 else Counter[str]()
            started = time.perf_counter()
            write(events)
            seconds = time.perf_counter() - started
            requests = (s3_requests(spark, root) - before) if on_s3 else Counter[str]()
            if number >= 0:
                line = {"setup": setup, "step": step, "seconds": seconds, "requests": requests}
                print(json.dumps(line), flush=True)
    spark.stop()


def as_bronze_rows(events: DataFrame) -> DataFrame:
    """Typed bronze rows (``cdc_shared.contracts.bronze.typed``'s columns) as the ingestor writes
    them: the key and the envelope's fields in the ``payload`` VARIANT."""
    shared = set(bronze_table.SHARED_COLUMNS)
    payload = F.struct(*[F.col(f"`{c}`") for c in events.columns if c not in shared])
    return events.select(
        F.lit(CUSTOMERS.name).alias(bronze_table.ENTITY),
        *bronze_table.SHARED_COLUMNS,
        F.to_variant_object(payload).alias(bronze_table.PAYLOAD),
    )


def run_setup(setup: str, args: argparse.Namespace, master: str, s3: str) -> list[dict[str, Any]]:
    """One setup in its own process; its batch lines."""
    command = [sys.executable, __file__, "--child", setup, "--rows", str(args.rows)]
    command += ["--batches", str(args.batches), "--warmup", str(args.warmup)]
    command += ["--master", master, "--s3", s3]
    print(f"--- {setup}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0:
        raise SystemExit(f"{setup} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return lines


def report(results: dict[str, list[dict[str, Any]]], rows: int) -> None:
    """Per setup and step: p50/p95 seconds, the ratio to the baseline, S3 requests."""
    print(f"\nsilver of {rows:,} rows; 1,000-change merger batches and 1,000-row bronze appends")
    for step in ("merge", "append"):
        first = next(iter(results.values()))
        base = statistics.median(r["seconds"] for r in first if r["step"] == step)
        print(f"\n{step}: {'setup':<14}{'p50 s':>8}{'p95 s':>8}{'x base':>8}  S3 requests p50")
        for setup, lines in results.items():
            mine = [r for r in lines if r["step"] == step]
            seconds = [r["seconds"] for r in mine]
            requests = {
                kind: statistics.median(r["requests"].get(kind, 0) for r in mine)
                for kind in REQUEST_COUNTERS
            }
            shown = ", ".join(f"{k} {v:g}" for k, v in requests.items() if k != "total" and v)
            print(
                f"{'':<7}{setup:<14}{statistics.median(seconds):>8.2f}{p(seconds, 0.95):>8.2f}"
                f"{statistics.median(seconds) / base:>8.2f}  "
                + (f"{requests['total']:g} ({shown})" if mine[0]["requests"] else "-")
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batches", type=int, default=15, help="counted batches per step")
    parser.add_argument("--warmup", type=int, default=5, help="uncounted batches first")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated")
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="", help=argparse.SUPPRESS)
    parser.add_argument("--s3", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.batches, args.warmup, args.master, args.s3)
        return

    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or not setups:
        raise SystemExit(f"unknown setups {unknown}; choose among {', '.join(SETUPS)}")
    settings = infra.InfraSettings()
    running = infra.running(settings)
    started: list[str] = []
    s3 = master = ""
    if any(s.endswith("-s3") for s in setups):
        started += [] if running["s3"] else ["s3"]
        s3 = infra.start_s3(settings)
    if any(s.startswith("cluster") for s in setups):
        started += [] if running["spark-master"] else [infra.SPARK_WORKERS, "spark-master"]
        master = infra.start_spark_cluster(settings)
    try:
        results = {setup: run_setup(setup, args, master, s3) for setup in setups}
    finally:
        for server in started:
            infra.stop(settings, server)
    report(results, args.rows)


if __name__ == "__main__":
    main()
