"""Spike: ingest cost per changed table, a bronze table per entity vs one bronze for all.

The ingestor's batch, with every one of ``--tables`` tables changed in it, written two
ways from the same decoded records (``cdc_ingestor.decode``, the project's own):

- ``per-table``: each table's rows appended to a bronze table of its own (one Delta
  commit per changed table, the releases before one bronze: ``support.legacy``),
  ``--at-once`` tables side by side, as their ingestor's one query wrote them;
- ``one-bronze``: each table's rows projected as the ingestor writes them
  (``cdc_ingestor.projection.bronze_columns``: its entity, the Kafka coordinates, op,
  sequence, and the decoded key and envelope as one self-describing ``VARIANT``
  column), unioned, and appended to one table partitioned by entity: one commit per
  batch whatever the number of tables.

No servers: the records are the workload generator's Debezium-style Avro records,
framed for the file registry, handed to the decoding as Kafka-shaped rows. The two
layouts take turns batch by batch (after ``--warmup`` batches of each, not measured), so
the machine's drift falls on both alike. Prints the batch wall time p50 / p90 of each,
the time per changed table, and the ratio. Figures, not a test: run it alone on the
machine (docs/benchmarks.md).

    .venv/bin/python tests/bench/bench_bronze_layout.py [--tables 24] [--rows 20]
        [--batches 10] [--warmup 3] [--at-once 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from cdc_devkit.local_run import EXAMPLE_CONFIG, copied_entities
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec
from cdc_ingestor.decode import KAFKA_SCHEMA, decode
from cdc_ingestor.framing_headers import headers_by_topic
from cdc_ingestor.projection import bronze_columns
from cdc_ingestor.schema_learning import SchemaTracker
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.contracts.replay_origin import HEADERS_TYPE
from cdc_shared.jvm.spark import build_spark_session, cached_in_few_partitions, side_by_side
from cdc_shared.streaming.tables import idempotent_append
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, however this is run
from support.legacy import legacy_bronze_rows

ROOT = Path(__file__).resolve().parents[2]
KAFKA_ROWS = T.StructType([*KAFKA_SCHEMA.fields, T.StructField("headers", HEADERS_TYPE)])


def pipeline(workdir: Path, tables: int) -> PipelineConfig:
    """The example pipeline with ``tables`` copies of ``customers``, under ``workdir``."""
    document: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    document["storage_root"] = str(workdir / "store")
    document["schema_registry"] = {"dirs": [str(ROOT / "schemas")]}
    customers = next(e for e in document["entities"] if e["name"] == "customers")
    source = customers["source_topic"]
    customers = {
        **customers,
        "history": {"enabled": False},
        "key_schema": str(ROOT / "schemas" / f"{source}-key.avsc"),
        "value_schema": str(ROOT / "schemas" / f"{source}-value.avsc"),
    }
    document["entities"] = copied_entities([customers], tables)
    document["spark"]["conf"] = {"spark.sql.shuffle.partitions": "2"}
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return load_config(path)


def kafka_batches(config: PipelineConfig, rows: int, batches: int) -> list[list[tuple[Any, ...]]]:
    """``batches`` batches of Kafka-shaped records, ``rows`` per table in each."""
    spec = WorkloadSpec(
        events=rows * len(config.entities) * batches * 2,
        keys=2000,
        snapshot_rows=0,
        poison_share=0.0,
        redelivery_share=0.0,
        schema_change_at=None,
    )
    stream = WorkloadGenerator(config.entities, make_registry(config), spec).messages()
    by_topic: dict[str, list[Any]] = {}
    for message in stream:
        if message.value is not None:
            by_topic.setdefault(message.topic, []).append(message)
    now = dt.datetime.now(dt.UTC)
    offsets = dict.fromkeys(by_topic, 0)
    made: list[list[tuple[Any, ...]]] = []
    for number in range(batches):
        batch = []
        for topic, messages in by_topic.items():
            for message in messages[number * rows : (number + 1) * rows]:
                batch.append((message.key, message.value, topic, 0, offsets[topic], now, 0, []))
                offsets[topic] += 1
        made.append(batch)
    return made


class Layouts:
    """The two ways of writing a decoded batch, over the same tables' decoding."""

    def __init__(self, spark: SparkSession, config: PipelineConfig, at_once: int) -> None:
        self.spark, self.config, self.at_once = spark, config, at_once
        registry = make_registry(config)
        self.trackers = {
            e.source_topic: (e, SchemaTracker(spark, e, registry)) for e in config.entities
        }
        self.one_bronze = f"{config.storage_root}/bronze_all"

    def decoded(self, cached: DataFrame, topic: str, headers: Any) -> DataFrame:
        """The topic's records of the batch, decoded by the ingestor's own decoding."""
        entity, tracker = self.trackers[topic]
        rows = cached.where(F.col("topic") == topic)
        plan = tracker.update(rows, headers)
        return decode(self.spark, rows, plan, entity.sequence_by)

    def per_table(self, cached: DataFrame, headers: Any, batch_id: int) -> None:
        def write(topic: str) -> None:
            entity, _ = self.trackers[topic]
            path = self.config.layout.legacy_bronze(entity.name)
            frame = legacy_bronze_rows(self.decoded(cached, topic, headers[topic]))
            idempotent_append(frame, path, f"spike-{entity.name}", batch_id, merge_schema=True)

        calls = [functools.partial(write, topic) for topic in sorted(headers)]
        for start in range(0, len(calls), self.at_once):  # as the one query wrote them
            side_by_side(calls[start : start + self.at_once])

    def one(self, cached: DataFrame, headers: Any, batch_id: int, cores: int = 0) -> None:
        """The one-bronze append; ``cores``: coalesced to that many tasks (0: as unioned)."""
        parts = []
        for topic in sorted(headers):
            entity, _ = self.trackers[topic]
            decoded = self.decoded(cached, topic, headers[topic])
            envelope = decoded.schema["envelope"].dataType
            assert isinstance(envelope, T.StructType)
            good = decoded.where(F.col("error_kind").isNull())
            parts.append(good.select(*bronze_columns(entity.name, envelope)))
        union = functools.reduce(DataFrame.union, parts)
        if cores:
            union = union.coalesce(cores)
        (
            union.write.format("delta")
            .mode("append")
            .partitionBy("entity")
            .option("txnAppId", f"spike-all-{cores}")
            .option("txnVersion", batch_id)
            .save(self.one_bronze)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=24)
    parser.add_argument("--rows", type=int, default=20, help="records per table and batch")
    parser.add_argument("--batches", type=int, default=10, help="measured, per layout")
    parser.add_argument("--warmup", type=int, default=3, help="not measured, per layout")
    parser.add_argument("--at-once", type=int, default=4, help="per-table writes side by side")
    parser.add_argument(
        "--coalesced",
        action="store_true",
        help="compare one bronze as unioned (a task per table and core) with the union "
        "coalesced to the cores, as the ingestor writes it, instead of the per-table layout",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-bronze-"))
    try:
        config = pipeline(workdir, args.tables)
        rounds = args.warmup + args.batches
        batches = kafka_batches(config, args.rows, rounds * 2)
        spark = build_spark_session(config.spark, "bench-bronze-layout")
        layouts = Layouts(spark, config, args.at_once)
        cores = spark.sparkContext.defaultParallelism
        writers = (
            {"one-bronze": layouts.one, "coalesced": functools.partial(layouts.one, cores=cores)}
            if args.coalesced
            else {"per-table": layouts.per_table, "one-bronze": layouts.one}
        )
        times: dict[str, list[float]] = {name: [] for name in writers}
        order = itertools.cycle(list(writers))
        for number, rows in enumerate(batches):
            name = next(order)
            frame = spark.createDataFrame(rows, KAFKA_ROWS)
            started = time.monotonic()
            with cached_in_few_partitions(frame) as cached:
                headers = headers_by_topic(cached)
                writers[name](cached, headers, number)
            took = time.monotonic() - started
            if number >= 2 * args.warmup:
                times[name].append(took)
            print(f"batch {number:3d} {name:10s} {took:6.2f} s", file=sys.stderr, flush=True)
        print_figures(times, args)
        spark.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def print_figures(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Each layout's batch p50 / p90, per changed table, and the ratio to the first."""
    base = statistics.median(next(iter(times.values())))
    print(
        f"\n{args.tables} tables changed per batch, {args.rows} records each, "
        f"{args.batches} batches per layout after {args.warmup} of warm-up"
    )
    print(f"{'layout':12s} {'batch p50':>10s} {'p90':>8s} {'per table':>10s} {'ratio':>7s}")
    for name, values in times.items():
        p50 = statistics.median(values)
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"{name:12s} {p50:9.2f}s {p90:7.2f}s {p50 / args.tables:9.3f}s {p50 / base:6.2f}x")


if __name__ == "__main__":
    main()
