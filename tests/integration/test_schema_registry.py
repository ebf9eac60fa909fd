"""The HTTP registry path on a real registry (Apicurio's Confluent-compatible API).

Producers write Confluent-framed Avro (schema ids from the registry); the ingestor
resolves the ids over HTTP; publisher-kafka registers the change-event schemas under
TopicNameStrategy and frames its events with their ids; a downstream consumer reads them
with confluent-kafka's own ``AvroDeserializer``, knowing nothing of this project.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from cdc_devkit.oracle import EntityOracle, load_fingerprints
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, produce
from cdc_shared.avro import ConfluentSchemaRegistry, FileSchemaRegistry, subject_name
from cdc_shared.config.connections import KafkaConfig
from confluent_kafka import DeserializingConsumer, KafkaError, TopicPartition
from confluent_kafka.error import ConsumeError
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from pyspark.sql import SparkSession
from support.ingestion import assert_bronze_exactly_once, ingest_once, quarantine
from support.pipelines import Pipeline, PipelineFactory
from support.publishing import publish_once
from support.silver import assert_silver_equals, merge_once

pytestmark = pytest.mark.integration

OPS = {"insert": "c", "update_postimage": "u", "delete": "d"}


def _register_source_schemas(pipeline: Pipeline, client: SchemaRegistryClient) -> None:
    """What a Debezium producer's serializer does on its first record: register v1."""
    for entity in pipeline.config.entities:
        for is_key in (True, False):
            subject = subject_name(entity.source_topic, is_key)
            text = (pipeline.schema_dir / f"{subject}.avsc").read_text()
            client.register_schema(subject, Schema(text, "AVRO"))


def _change_events(kafka: KafkaConfig, topic: str, url: str) -> list[tuple[Any, Any]]:
    """(key, value) of every committed message, decoded by confluent-kafka alone."""
    client = SchemaRegistryClient({"url": url})
    consumer = DeserializingConsumer(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": f"downstream-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "key.deserializer": AvroDeserializer(client),
            "value.deserializer": AvroDeserializer(client),
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        events: list[tuple[Any, Any]] = []
        at_end: set[int] = set()
        while at_end != set(partitions):  # the last offsets are transaction markers
            try:
                message = consumer.poll(10)
            except ConsumeError as error:  # DeserializingConsumer reports partition ends so
                assert error.code == KafkaError._PARTITION_EOF, error
                assert error.kafka_message is not None
                at_end.add(error.kafka_message.partition())
                continue
            assert message is not None, f"{topic}: no end of partitions {set(partitions) - at_end}"
            events.append((message.key(), message.value()))
        return events
    finally:
        consumer.close()


def test_confluent_framing_through_a_real_registry_end_to_end(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    registry_url: str,
) -> None:
    pipeline = make_pipeline(
        schema_registry={"url": registry_url},
        publisher_kafka={"metrics_port": 0, "include_before": True},
    )
    client = SchemaRegistryClient({"url": registry_url})
    _register_source_schemas(pipeline, client)
    spec = WorkloadSpec(events=2000, keys=200, poison_share=0.01, schema_change_at=None)
    framed = list(
        WorkloadGenerator(
            pipeline.config.entities, ConfluentSchemaRegistry(registry_url), spec
        ).messages()
    )
    assert all(m.value is None or m.value[:1] == b"\x00" for m in framed if m.kind != "poison")
    report = produce(kafka_config, iter(framed), partitions=3)

    ingest_once(pipeline, spark)
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    assert {r.error_kind for r in quarantine(spark, pipeline).collect()} <= {
        "corrupt",
        "unknown_schema",
        "null_key",
    }
    merge_once(pipeline, spark)
    # The oracle reads the same workload in single-object framing (same seed, same data).
    twins = list(
        WorkloadGenerator(
            pipeline.config.entities, FileSchemaRegistry([pipeline.schema_dir]), spec
        ).messages()
    )
    fingerprints = load_fingerprints([pipeline.schema_dir])
    for entity in pipeline.config.entities:
        oracle = EntityOracle(entity, list(entity.key), fingerprints)
        for offset, message in enumerate(m for m in twins if m.entity == entity.name):
            oracle.feed(message.key, message.value, 0, offset)
        assert oracle.rows
        assert_silver_equals(spark, pipeline, oracle)

    publish_once(pipeline, spark)
    subjects = set(client.get_subjects())
    for entity in pipeline.config.entities:
        topic = entity.change_topic_name
        assert {f"{topic}-key", f"{topic}-value"} <= subjects
        value_schema = json.loads(client.get_latest_version(f"{topic}-value").schema.schema_str)
        assert value_schema["namespace"] == entity.change_event_namespace != topic
        events = _change_events(kafka_config, topic, registry_url)
        got = sorted(
            (tuple(k[c] for c in entity.key), v["commit_version"], v["op"])
            for k, v in events
            if v is not None
        )
        feed = (
            spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load(pipeline.config.layout.silver(entity.name))
            .where("_change_type != 'update_preimage'")
            .collect()
        )
        expected = sorted(
            (tuple(r[c] for c in entity.key), r["_commit_version"], OPS[r["_change_type"]])
            for r in feed
        )
        assert got == expected, f"{topic} is not silver's change feed exactly once"
