"""A replayed record keeps its change's sequence when ``sequence_by`` is Kafka coordinates.

``cdc quarantine replay`` produces a quarantined record again at a new, higher offset.
Ordered by the default ``sequence_by`` (``kafka.partition``, ``kafka.offset``), the
replayed old change must still order where it was first read, so it does not overwrite
a newer change of its key that silver already holds. Replays under a source sequence
(``source.lsn``) are checked in ``test_cli_ops.py``, whose pipeline orders by it.

The expected silver comes from the oracle fed every record of the topic at its own
coordinates, except those carrying a ``cdc.replay.of`` header: a replay stands for its
original (which the oracle, knowing every schema, decodes), a forged header for nothing.
"""

from __future__ import annotations

import io
import time
import uuid
from pathlib import Path
from typing import Any

import fastavro
import pytest
from cdc_devkit.oracle import EntityOracle, load_fingerprints
from cdc_devkit.workload import GeneratedMessage, produce
from cdc_ingestor.replay_origin import REPLAY_HEADER
from cdc_shared.clients import make_consumer, make_producer
from cdc_shared.config import KafkaConfig
from confluent_kafka import TopicPartition
from pyspark.sql import SparkSession
from support.ingestion import bronze, generate_across_schema_change, ingest_once, quarantine
from support.ops import cdc_json
from support.pipelines import PipelineFactory
from support.silver import assert_silver_equals, entity_oracle, merge_once

pytestmark = pytest.mark.integration

ENTITY = "customers"
KAFKA_COORDINATES = ["kafka.partition", "kafka.offset"]


def _first_reads(kafka: KafkaConfig, oracle: EntityOracle) -> EntityOracle:
    """Feed ``oracle`` every record of the topic without a replay header, in Kafka order."""
    topic = oracle.entity.source_topic
    consumer = make_consumer(kafka, group_id=f"first-reads-{uuid.uuid4().hex[:8]}")
    records: list[tuple[int, int, bytes | None, bytes | None]] = []
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        }
        assigned = [TopicPartition(topic, p, 0) for p in partitions if ends[p]]
        consumer.assign(assigned)
        deadline = time.monotonic() + 60
        while not all(tp.offset >= ends[tp.partition] for tp in consumer.position(assigned)):
            assert time.monotonic() < deadline, f"could not read {topic} to its end"
            for message in consumer.consume(1000, timeout=0.5):
                assert message.error() is None, message.error()
                if any(k == REPLAY_HEADER for k, _ in message.headers() or []):
                    continue
                p, o = int(message.partition() or 0), int(message.offset() or 0)
                records.append((p, o, message.key(), message.value()))
    finally:
        consumer.close()
    for p, o, key, value in sorted(records, key=lambda r: (r[0], r[1])):
        oracle.feed(key, value, p, o)
    return oracle


def _decoded(data: bytes | None, fingerprints: dict[bytes, Any]) -> Any:
    """A single-object encoded Avro datum, decoded with its writer schema."""
    assert data is not None
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), fingerprints[data[2:10]], None)


def _forge(kafka: KafkaConfig, topic: str, message: GeneratedMessage) -> dict[str, str]:
    """``message`` produced once per bad ``cdc.replay.of`` header to partition 0.

    Returns the error message each should be quarantined with (a part of it), by header.
    """
    cases: dict[str, tuple[list[tuple[str, bytes | None]], str]] = {
        "nonsense": ([(REPLAY_HEADER, b"not-coordinates")], "'not-coordinates' is not <topic>/"),
        "no value": ([(REPLAY_HEADER, None)], "header without a value is not"),
        "another topic": ([(REPLAY_HEADER, b"elsewhere/0/0")], "names another topic"),
        "another partition": ([(REPLAY_HEADER, f"{topic}/1/0".encode())], "another partition"),
        "a later offset": (
            [(REPLAY_HEADER, f"{topic}/0/{10**12}".encode())],
            "names an offset not before the record's own",
        ),
        "twice": ([(REPLAY_HEADER, f"{topic}/0/0".encode())] * 2, "has 2 cdc.replay.of headers"),
    }
    producer = make_producer(kafka, **{"enable.idempotence": True})
    for headers, _ in cases.values():
        producer.produce(topic, key=message.key, value=message.value, partition=0, headers=headers)
    assert producer.flush(30) == 0
    return {name: expected for name, (_, expected) in cases.items()}


def test_a_replayed_change_does_not_overwrite_a_newer_one_under_kafka_coordinates(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = make_pipeline(
        ("customers",),
        {"sequence_by": KAFKA_COORDINATES},
        ingestor={"metrics_port": 0},
        merger={"metrics_port": 0},
    )
    config = pipeline.config
    topic = config.entity(ENTITY).source_topic
    messages, switch = generate_across_schema_change(
        pipeline,
        ENTITY,
        tmp_path,
        events=60,
        keys=8,
        poison_share=0,
        redelivery_share=0,
        delete_share=0,
        schema_change_at=0.5,
    )
    later = messages[switch:]  # written with value schema v2, which the pipeline lacks yet
    # K's first v2 change, which fails (unknown schema); later changes of K follow it.
    stale = next(m for i, m in enumerate(later) if any(n.key == m.key for n in later[i + 1 :]))
    newer = [m for m in later if m is not stale]
    last_of_key = {m.key: m for m in messages}
    victim = next(m for m in reversed(newer) if m.key != stale.key and last_of_key[m.key] is m)

    produce(kafka_config, iter([*messages[:switch], stale]))
    ingest_once(pipeline, spark)
    (unknown,) = quarantine(spark, pipeline).collect()
    assert unknown.error_kind == "unknown_schema"

    # The fix is deployed; K's newer changes arrive and are applied.
    pipeline.add_schema_version(ENTITY, 2)
    produce(kafka_config, iter(newer))
    forged = _forge(kafka_config, topic, victim)  # the same bytes as the last change of a key
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)

    replayed = cdc_json(
        "quarantine",
        "replay",
        "--config",
        str(pipeline.path),
        "--entity",
        ENTITY,
        "--where",
        "error_kind = 'unknown_schema'",
    )
    assert (replayed["selected"], replayed["produced"]) == (1, 1)
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)

    fingerprints = load_fingerprints([pipeline.schema_dir])
    oracle = _first_reads(
        kafka_config, entity_oracle(pipeline, config.entity(ENTITY), fingerprints)
    )
    key = tuple(_decoded(stale.key, fingerprints)[k] for k in config.entity(ENTITY).key)
    assert _decoded(stale.value, fingerprints)["after"] != oracle.rows[key]  # a stale change
    assert_silver_equals(spark, pipeline, oracle)

    # Bronze logs where the replay was read, and orders it where its change was first read.
    (ledger,) = spark.read.format("delta").load(config.layout.replay_ledger()).collect()
    assert (ledger.kafka_partition, ledger.kafka_offset) == (
        unknown.kafka_partition,
        unknown.kafka_offset,
    )
    (row,) = (
        bronze(spark, pipeline, ENTITY)
        .where(
            f"kafka_partition = {ledger.replayed_partition} "
            f"AND kafka_offset = {ledger.replayed_offset}"
        )
        .collect()
    )
    assert ledger.replayed_offset > unknown.kafka_offset
    assert row.sequence == [unknown.kafka_partition, unknown.kafka_offset]

    # A header that does not name an earlier record of the same topic and partition.
    bad = quarantine(spark, pipeline).where("error_kind = 'bad_replay_header'").collect()
    messages_seen = sorted(r.error_message for r in bad)
    assert len(bad) == len(forged), messages_seen
    for name, expected in forged.items():
        assert sum(expected in m for m in messages_seen) == 1, (name, messages_seen)
