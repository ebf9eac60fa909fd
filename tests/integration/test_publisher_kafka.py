"""publisher-kafka: silver's change feed -> change topics, exactly once for read_committed."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdc_devkit.workload import produce
from cdc_shared.config import KafkaConfig
from pyspark.sql import SparkSession
from support.ingestion import generate, ingest_once
from support.pipelines import Pipeline, PipelineFactory
from support.publishing import assert_change_topics_exactly_once, change_records, publish_once
from support.silver import merge_once

pytestmark = pytest.mark.integration


def _load(pipeline: Pipeline, kafka: KafkaConfig, spark: SparkSession, part: int = 0) -> None:
    """Produce one half of the workload (0: first, 1: second), ingest and merge it."""
    messages = generate(pipeline, events=3000, keys=200, delete_share=0.2, redelivery_share=0.05)
    half = len(messages) // 2
    produce(kafka, iter(messages[:half] if part == 0 else messages[half:]))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)


def _forget_last_checkpoint_commit(checkpoint: Path) -> int:
    """What a crash after the Kafka commit and before Spark's checkpoint commit leaves."""
    commits = checkpoint / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    return last


def test_change_topics_equal_silver_feed_and_oracle(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        merger={"max_files_per_trigger": 2, "metrics_port": 0},
        ingestor={"max_offsets_per_trigger": 1000, "metrics_port": 0},
        publisher_kafka={"max_files_per_trigger": 2, "metrics_port": 0, "include_before": True},
    )
    _load(pipeline, kafka_config, spark, part=0)
    publish_once(pipeline, spark)
    first = assert_change_topics_exactly_once(spark, pipeline, kafka_config)
    assert all(n > 0 for n in first.values())

    _load(pipeline, kafka_config, spark, part=1)  # more changes to the same keys
    publish_once(pipeline, spark)
    second = assert_change_topics_exactly_once(spark, pipeline, kafka_config)
    assert all(second[e] > first[e] for e in first)

    # A crash between the Kafka commit and the checkpoint commit: the batch is replayed
    # and must publish nothing.
    for entity in pipeline.config.entities:
        _forget_last_checkpoint_commit(
            Path(pipeline.config.checkpoint_path("publisher_kafka", entity.name))
        )
    publish_once(pipeline, spark)
    assert assert_change_topics_exactly_once(spark, pipeline, kafka_config) == second


def test_before_images_and_delete_tombstones(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        entities=("customers",),
        publisher_kafka={"metrics_port": 0, "include_before": True, "delete_tombstones": True},
    )
    _load(pipeline, kafka_config, spark, part=0)
    _load(pipeline, kafka_config, spark, part=1)
    publish_once(pipeline, spark)
    records = change_records(pipeline, kafka_config, "customers")
    last_after: dict[object, dict[str, object] | None] = {}
    deletes = 0
    for position, record in enumerate(records):
        key = record.key["id"]
        if record.event is None:  # a tombstone follows its delete at once
            previous = records[position - 1]
            assert previous.event is not None and previous.event["op"] == "d"
            assert previous.key == record.key
            continue
        op, before = record.event["op"], record.event["before"]
        if op == "c":
            assert before is None
        else:  # before is the row as this topic last showed it
            assert before == last_after[key]
        deletes += op == "d"
        last_after[key] = record.event["after"]
    assert deletes > 0
    assert sum(r.event is None for r in records) == deletes
