"""Retention of bronze and the quarantine (``retention``, ``cdc maintenance``).

Against a real broker, Spark and Delta: rows past their retention are deleted, never a
bronze row the merger has not merged; the merger reads on across the delete from its
checkpoint and silver still equals the topics' oracle; a silver rebuilt from bronze
after the delete is refused, naming why, while the other table goes on.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from cdc_cli.maintenance import run_maintenance
from cdc_devkit.oracle import load_fingerprints, read_topic
from cdc_devkit.workload import produce
from cdc_merger.main import start as start_merger
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.contracts import bronze
from cdc_shared.streaming.runner import StreamFailedError
from cdc_shared.streaming.tables import table_properties
from pyspark.sql import SparkSession
from support.ingestion import generate, ingest_once, quarantine
from support.pipelines import PipelineFactory
from support.silver import (
    assert_silver_equals,
    assert_silver_equals_oracle,
    entity_oracle,
    merge_once,
)

pytestmark = pytest.mark.integration

#: Short enough that the rows of a step a few seconds old are past it.
RETENTION_HOURS = 0.0005  # 1.8 s


def coordinates(spark: SparkSession, path: str) -> set[tuple[str, int, int]]:
    rows = spark.read.format("delta").load(path).select(*bronze.KAFKA_COLUMNS[:3]).collect()
    return {(r.kafka_topic, r.kafka_partition, r.kafka_offset) for r in rows}


def test_retention_deletes_merged_rows_only_and_the_merger_reads_on(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        entities=("customers", "orders"),
        retention={"bronze_hours": RETENTION_HOURS, "quarantine_hours": RETENTION_HOURS},
        ingestor={"metrics_port": 0},
        merger={"metrics_port": 0},
    )
    config = pipeline.config
    path = config.layout.bronze()
    load = generate(pipeline, events=300, keys=60, poison_share=0.03, delete_share=0.1)
    half = len(load) // 2

    produce(kafka_config, iter(load[:half]))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    merged = coordinates(spark, path)
    time.sleep(3 * RETENTION_HOURS * 3600)  # the merged rows are past their retention now
    produce(kafka_config, iter(load[half:]))
    ingest_once(pipeline, spark)  # ingested, not merged: the merger still has to read these
    pending = coordinates(spark, path) - merged
    assert merged and pending
    quarantined = quarantine(spark, pipeline).count()
    assert quarantined > 0
    time.sleep(3 * RETENTION_HOURS * 3600)  # every row is past its retention now

    dry = run_maintenance(config, dry_run=True, optimize=False, vacuum_hours=None)
    would = {t.table: t.retention_deleted for t in dry.tables if t.retention_deleted is not None}
    assert would["bronze"] == len(merged), dry
    assert coordinates(spark, path) == merged | pending, "a dry run deleted"

    report = run_maintenance(config, spark=spark, optimize=False, vacuum_hours=None)
    done = {t.table: t for t in report.tables if t.retention_deleted is not None}
    assert done["bronze"].retention_deleted == len(merged), report
    assert coordinates(spark, path) == pending, "deleted a row not merged, or kept a merged one"
    assert done["quarantine/ingestor"].retention_deleted == quarantined, report
    assert quarantine(spark, pipeline).count() == 0
    marks = bronze.retention_marks(table_properties(spark, path))
    assert set(marks) == {"customers", "orders"}, marks

    # The merger's stream goes on from its checkpoint across the delete's commit.
    merge_once(pipeline, spark)
    assert_silver_equals_oracle(spark, pipeline, kafka_config)

    # Silver lost (its folder deleted): the merger finds the table behind and would rebuild
    # it from bronze, missing the deleted rows, so that table is held with why; orders go on.
    shutil.rmtree(Path(config.layout.silver("customers")))
    with pytest.raises(StreamFailedError) as held:
        start_merger(config, once=True, spark=spark).run()
    message = str(held.value)
    assert "'customers'" in message and "bronze's retention deleted its rows" in message, message
    assert "'orders'" not in message, message
    assert not Path(config.layout.silver("customers"), "_delta_log").exists()
    fingerprints = load_fingerprints([pipeline.schema_dir])
    orders = entity_oracle(pipeline, config.entity("orders"), fingerprints)
    assert_silver_equals(spark, pipeline, read_topic(kafka_config, orders))
