"""Helpers for ingestor tests: generate load, run once, read tables, check exactly-once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from cdc_devkit.workload import GeneratedMessage, ProduceReport, WorkloadGenerator, WorkloadSpec
from cdc_ingestor.main import start
from cdc_ingestor.projection import bronze_columns, payload_type
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.clients.connect import make_consumer
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import DEFAULT_GROUP
from cdc_shared.contracts.bronze import entity_changes, typed
from confluent_kafka import TopicPartition
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from support.pipelines import SCHEMAS, Pipeline

INGESTOR = str(Path(sys.executable).with_name("cdc-ingestor"))


def generate(
    pipeline: Pipeline, registry: FileSchemaRegistry | None = None, **spec: object
) -> list[GeneratedMessage]:
    config = pipeline.config
    registry = registry or FileSchemaRegistry([pipeline.schema_dir])
    return list(WorkloadGenerator(config.entities, registry, WorkloadSpec(**spec)).messages())


def generate_across_schema_change(
    pipeline: Pipeline, entity: str, folder: Path, **spec: object
) -> tuple[list[GeneratedMessage], int]:
    """Load whose producer knows value schema v2 from the start (the pipeline learns it
    later); returns the messages and the index of the first one written with v2."""
    producer_dir = folder / "producer-schemas"
    producer_dir.mkdir()
    topic = pipeline.topic(entity)
    source = f"dbserver1.inventory.{entity}-value.v2.avsc"
    shutil.copy(SCHEMAS / source, producer_dir / f"{topic}-value.v2.avsc")
    messages = generate(pipeline, FileSchemaRegistry([pipeline.schema_dir, producer_dir]), **spec)
    v2 = FileSchemaRegistry([producer_dir]).latest(f"{topic}-value").fingerprint
    switch = next(i for i, m in enumerate(messages) if m.value and m.value[2:10] == v2)
    return messages, switch


def launch_ingestor(
    pipeline: Pipeline, log: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``cdc-ingestor`` in its own process group, so a kill takes its JVM with it.

    ``env`` adds settings (``CDC_INGESTOR__...``) for this process only.
    """
    return subprocess.Popen(
        [INGESTOR, "--config", str(pipeline.path), *extra],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def ingest_once(pipeline: Pipeline, spark: SparkSession, max_offsets: int | None = None) -> None:
    """The ingestor ``--once`` in this process; ``max_offsets`` per batch instead of the
    pipeline's (a drain of a large backlog in a few batches rather than many)."""
    config = pipeline.config
    if max_offsets is not None:
        ingestor = config.ingestor.model_copy(update={"max_offsets_per_trigger": max_offsets})
        config = config.model_copy(update={"ingestor": ingestor})
    start(config, once=True, spark=spark).run()


def bronze(spark: SparkSession, pipeline: Pipeline, entity: str) -> DataFrame:
    """``entity``'s rows of bronze, typed (``cdc_shared.contracts.bronze.entity_changes``)."""
    return entity_changes(spark, pipeline.config.layout.bronze(), entity)


def typed_bronze_rows(decoded: DataFrame) -> DataFrame:
    """A decoded batch's records that decoded, as bronze holds them and gives them back.

    Projected as the ingestor writes them (``bronze_columns``: the payload one VARIANT),
    then typed again as ``cdc_shared.contracts.bronze.entity_changes`` reads one entity's rows.
    """
    envelope = decoded.schema["envelope"].dataType
    assert isinstance(envelope, T.StructType)
    written = decoded.where(F.col("error_kind").isNull()).select(
        *bronze_columns("entity", envelope)
    )
    return typed(written, payload_type(decoded.schema["decoded_key"].dataType, envelope))


def quarantine(spark: SparkSession, pipeline: Pipeline) -> DataFrame:
    return spark.read.format("delta").load(pipeline.config.layout.quarantine("ingestor"))


def topic_offsets(kafka: KafkaConfig, topic: str) -> set[tuple[int, int]]:
    """Every (partition, offset) the topic holds, from the broker's watermarks."""
    consumer = make_consumer(kafka, group_id=f"offsets-{topic}")
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        offsets = set()
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            offsets.update((p, o) for o in range(low, high))
        return offsets
    finally:
        consumer.close()


def assert_quarantine_exactly_once(
    spark: SparkSession, pipeline: Pipeline, report: ProduceReport
) -> None:
    """The ingestor's quarantine holds each poison record of the report once, and nothing else."""
    rows = quarantine(spark, pipeline).select("kafka_topic", "kafka_partition", "kafka_offset")
    held = [(r.kafka_topic, r.kafka_partition, r.kafka_offset) for r in rows.collect()]
    assert len(held) == len(set(held)), "duplicate records in quarantine"
    assert set(held) == {(t, p, o) for t, p, o, _ in report.poison}


def assert_bronze_exactly_once(
    spark: SparkSession,
    pipeline: Pipeline,
    kafka: KafkaConfig,
    report: ProduceReport,
    entities: list[str] | None = None,
) -> None:
    """Bronze + quarantine hold each Kafka record once: no duplicate, no gap (for every
    entity of the pipeline, or the ones named)."""
    for entity in pipeline.config.entities:
        if entities is not None and entity.name not in entities:
            continue
        rows = bronze(spark, pipeline, entity.name).select("kafka_partition", "kafka_offset")
        landed = [(r.kafka_partition, r.kafka_offset) for r in rows.collect()]
        poisoned = {(p, o) for t, p, o, _ in report.poison if t == entity.source_topic}
        assert len(landed) == len(set(landed)), "duplicate offsets in bronze"
        assert set(landed) | poisoned == topic_offsets(kafka, entity.source_topic)
        assert not set(landed) & poisoned


def ingestor_checkpoint(pipeline: Pipeline, group: str = DEFAULT_GROUP) -> Path:
    """The checkpoint of the ingestor's query of ``group`` (``_streams/ingestor/<group>``)."""
    return Path(pipeline.config.layout.checkpoint("ingestor", group))


def checkpoints_aside(pipeline: Pipeline, group: str = DEFAULT_GROUP) -> list[Path]:
    """The group query's old checkpoints, moved aside when it started on a new one
    (``_streams/ingestor/<group>.<time>``)."""
    checkpoint = ingestor_checkpoint(pipeline, group)
    return sorted(p for p in checkpoint.parent.glob(f"{checkpoint.name}.*") if p.is_dir())
