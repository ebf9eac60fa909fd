"""Benchmark: building one table's decoding on the driver, by how many schemas are listed.

A folder of schema files lists every table's schemas and every change topic's. For a
folder holding the example's schemas plus those of N other tables' change topics, prints
the time to build one table's decoding (``decode``, then its bronze rows as the ingestor
projects them, ``bronze_columns``, up to Spark's analysis of the plan, on an empty
batch: what every batch pays per table before its first job), median of several rounds:
with the plan of every listed schema (how a table decodes when its batch's headers are
not known), and beside it the plan narrowed to the one writer a batch of the table uses
(``DecodePlan.narrowed``, as the ingestor decodes a table's records of a batch).

    .venv/bin/python tests/bench/bench_decode_plan.py [--tables 2,24,100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, decode
from cdc_ingestor.projection import bronze_columns
from cdc_ingestor.schema_learning import SchemaTracker
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.jvm.spark import build_spark_session
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
CUSTOMERS = EntityConfig(name="customers", source_topic="dbserver1.inventory.customers", key=["id"])


def write_change_schemas(folder: Path, tables: int) -> None:
    """Each table's change-topic key and value schemas, as publisher-kafka writes them."""
    for n in range(tables):
        for part in ("key", "value"):
            path = SCHEMAS / "changes" / f"cdc.inventory.customers-{part}.avsc"
            definition = {**json.loads(path.read_text()), "name": f"Table{n}Change"}
            (folder / f"cdc.inventory.table{n}-{part}.avsc").write_text(json.dumps(definition))


def build_seconds(spark: SparkSession, plan: DecodePlan, rounds: int) -> float:
    """Median time to build and analyse one table's bronze rows from an empty batch."""
    raw = frame_from_rows(spark, [], KAFKA_SCHEMA)
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        decoded = decode(spark, raw, plan, ["source.lsn"])
        envelope = decoded.schema["envelope"].dataType
        assert isinstance(envelope, T.StructType)
        good = decoded.where(F.col("error_kind").isNull())
        _ = good.select(*bronze_columns(CUSTOMERS.name, envelope)).schema
        took.append(time.perf_counter() - started)
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", default="2,24,100")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    spark = build_spark_session(SparkConfig(), "bench-decode-plan")
    counts = [int(n) for n in args.tables.split(",")]
    rows = []
    for tables in [counts[0], *counts]:  # the first size once more, as the warm-up
        with tempfile.TemporaryDirectory() as folder:
            write_change_schemas(Path(folder), tables)
            registry = FileSchemaRegistry([SCHEMAS, Path(folder)])
            tracker = SchemaTracker(spark, CUSTOMERS, registry)
            listed = tracker.update(frame_from_rows(spark, [], KAFKA_SCHEMA))
            narrowed = listed.narrowed(({listed.value_reader.header}, {listed.key_reader.header}))
            rows.append(
                (
                    tables,
                    len(listed.value_writers),
                    build_seconds(spark, listed, args.rounds),
                    build_seconds(spark, narrowed, args.rounds),
                )
            )
    print("| tables | value writers listed | every listed writer (s) | narrowed to 1 (s) |")
    print("|---:|---:|---:|---:|")
    for tables, writers, whole, narrow in rows[1:]:
        print(f"| {tables} | {writers} | {whole:.3f} | {narrow:.3f} |")


if __name__ == "__main__":
    main()
