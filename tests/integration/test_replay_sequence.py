"""A replayed record keeps its change's sequence: it never overwrites a newer change.

``cdc quarantine replay`` produces a quarantined record again at a new, higher offset.
Ordered by the default ``sequence_by`` (``kafka.partition``, ``kafka.offset``) the
replayed old change must still order where it was first read; ordered by a source field
(``source.lsn``) it orders by its payload, which replay keeps. One pipeline holds both:
customers by Kafka coordinates, orders by ``source.lsn``. A change of each is quarantined
(written with a value schema v2 the pipeline does not know yet), the key's newer changes
(written with v1) are applied, v2 is deployed and the change replayed.

The expected silver comes from the oracle fed every record of the topic at its own
coordinates, except those carrying a ``cdc.replay.of`` header: a replay stands for its
original (which the oracle, knowing every schema, decodes), a forged header for nothing.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import shutil
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import fastavro
import pytest
import yaml
from cdc_cli.quarantine import LEDGER_SCHEMA, Replay
from cdc_devkit.oracle import EntityOracle, load_fingerprints
from cdc_devkit.workload import GeneratedMessage, produce
from cdc_shared.avro import AvroEncoder, FileSchemaRegistry
from cdc_shared.clients.connect import make_consumer, make_producer
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.contracts.replay_origin import REPLAY_HEADER
from cdc_shared.jvm.driver_frames import frame_from_rows
from confluent_kafka import TopicPartition
from pyspark.sql import SparkSession
from support.ingestion import bronze, generate, ingest_once, quarantine
from support.ops import cdc_json
from support.pipelines import SCHEMAS, Pipeline, PipelineFactory
from support.silver import assert_silver_equals, entity_oracle, merge_once

pytestmark = pytest.mark.integration

SEQUENCE_BY = {"customers": ["kafka.partition", "kafka.offset"], "orders": ["source.lsn"]}


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


def _in_v1(message: GeneratedMessage, v1: AvroEncoder, fingerprints: dict[bytes, Any]) -> bytes:
    """``message``'s value written with value schema v1 (its row images cut to v1's fields)."""
    envelope = _decoded(message.value, fingerprints)
    row = v1.schema.definition["fields"][0]["type"][1]
    names = {f["name"] for f in row["fields"]}
    for image in ("before", "after"):
        if envelope[image] is not None:
            envelope[image] = {k: v for k, v in envelope[image].items() if k in names}
    return v1.encode(envelope)


def _pipeline(make_pipeline: PipelineFactory) -> Pipeline:
    """Both entities, each ordered by its ``SEQUENCE_BY``."""
    pipeline = make_pipeline(ingestor={"metrics_port": 0}, merger={"metrics_port": 0})
    document = yaml.safe_load(pipeline.path.read_text())
    for entity in document["entities"]:
        entity["sequence_by"] = SEQUENCE_BY[entity["name"]]
    pipeline.path.write_text(yaml.safe_dump(document))
    return pipeline


def _producer_schemas(pipeline: Pipeline, folder: Path) -> Path:
    """A value schema v2 of each entity that only the producer knows, until deployed."""
    folder.mkdir()
    shutil.copy(
        SCHEMAS / "dbserver1.inventory.customers-value.v2.avsc",
        folder / f"{pipeline.topic('customers')}-value.v2.avsc",
    )
    orders = json.loads((SCHEMAS / "dbserver1.inventory.orders-value.avsc").read_text())
    row = orders["fields"][0]["type"][1]
    assert row["name"] == "Value"
    row["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    (folder / f"{pipeline.topic('orders')}-value.v2.avsc").write_text(json.dumps(orders))
    return folder


def _forge(kafka: KafkaConfig, topic: str, message: GeneratedMessage) -> dict[str, str]:
    """``message`` produced once per bad ``cdc.replay.of`` header to partition 0.

    Returns a part of the error message each should be quarantined with, by case.
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


def test_a_replayed_change_does_not_overwrite_a_newer_one(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = _pipeline(make_pipeline)
    config = pipeline.config
    producer_schemas = _producer_schemas(pipeline, tmp_path / "producer-schemas")
    messages = generate(
        pipeline,
        FileSchemaRegistry([pipeline.schema_dir, producer_schemas]),
        events=60,
        keys=8,
        poison_share=0,
        redelivery_share=0,
        delete_share=0,
        schema_change_at=0.5,
    )
    v2 = {
        FileSchemaRegistry([producer_schemas]).latest(f"{pipeline.topic(name)}-value").fingerprint
        for name in SEQUENCE_BY
    }
    switch = next(i for i, m in enumerate(messages) if m.value and m.value[2:10] in v2)
    later = messages[switch:]  # written with the v2 schemas, which the pipeline lacks yet
    assert all(m.value and m.value[2:10] in v2 for m in later)
    # Per entity: its first v2 change of a key that changes again later; it fails.
    stale = {
        name: next(
            m
            for i, m in enumerate(later)
            if m.entity == name and any(n.key == m.key for n in later[i + 1 :] if n.entity == name)
        )
        for name in SEQUENCE_BY
    }
    # The keys' newer changes come written with v1, which the pipeline reads.
    fingerprints = load_fingerprints([pipeline.schema_dir, producer_schemas])
    registry = FileSchemaRegistry([pipeline.schema_dir])
    v1 = {n: AvroEncoder(registry.latest(f"{pipeline.topic(n)}-value")) for n in SEQUENCE_BY}
    newer = [
        replace(m, value=_in_v1(m, v1[m.entity], fingerprints))
        for m in later
        if all(m is not s for s in stale.values())
    ]
    customers = config.entity("customers").source_topic
    last_of_key = {(m.topic, m.key): m for m in [*messages[:switch], *newer]}
    victim = next(
        m
        for m in reversed(newer)
        if m.topic == customers and m.key != stale["customers"].key
        if last_of_key[(m.topic, m.key)] is m
    )

    produce(kafka_config, iter([*messages[:switch], *stale.values(), *newer]))
    forged = _forge(kafka_config, customers, victim)  # the bytes of the last change of a key
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    unknown = {
        r.entity: r
        for r in quarantine(spark, pipeline).where("error_kind != 'bad_replay_header'").collect()
    }
    assert {e: r.error_kind for e, r in unknown.items()} == dict.fromkeys(
        SEQUENCE_BY, "unknown_schema"
    )

    # The fix is deployed: v2 is known; the quarantined changes are replayed.
    for schema in producer_schemas.iterdir():
        shutil.copy(schema, pipeline.schema_dir / schema.name)

    for name in SEQUENCE_BY:
        replayed = cdc_json(
            "quarantine",
            "replay",
            "--config",
            str(pipeline.path),
            "--entity",
            name,
            "--where",
            "error_kind = 'unknown_schema'",
        )
        assert (replayed["selected"], replayed["produced"]) == (1, 1)
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)

    ledger = spark.read.format("delta").load(config.layout.replay_ledger())
    for name, message in stale.items():
        entity = config.entity(name)
        oracle = _first_reads(kafka_config, entity_oracle(pipeline, entity, fingerprints))
        key = tuple(_decoded(message.key, fingerprints)[k] for k in entity.key)
        envelope = _decoded(message.value, fingerprints)
        expected = oracle.rows[key]
        assert {c: envelope["after"][c] for c in expected} != expected  # a stale change
        assert_silver_equals(spark, pipeline, oracle)

        # Bronze logs where the replay was read, ordered where its change was first read.
        original = unknown[name]
        (replay,) = ledger.where(f"entity = '{name}'").collect()
        assert (replay.kafka_partition, replay.kafka_offset) == (
            original.kafka_partition,
            original.kafka_offset,
        )
        assert replay.replayed_offset > original.kafka_offset
        (row,) = (
            bronze(spark, pipeline, name)
            .where(
                f"kafka_partition = {replay.replayed_partition} "
                f"AND kafka_offset = {replay.replayed_offset}"
            )
            .collect()
        )
        first_read = {
            "kafka.partition": original.kafka_partition,
            "kafka.offset": original.kafka_offset,
        }
        assert row.sequence == [
            first_read[p] if p in first_read else envelope["source"]["lsn"]
            for p in entity.sequence_by
        ]

    # A header that does not name one earlier record of the same topic and partition.
    bad = quarantine(spark, pipeline).where("error_kind = 'bad_replay_header'").collect()
    seen = sorted(r.error_message for r in bad)
    assert len(bad) == len(forged), seen
    for case, expected in forged.items():
        assert sum(expected in m for m in seen) == 1, (case, seen)


def test_a_replay_of_a_replay_names_where_the_change_was_first_read(
    spark: SparkSession, make_pipeline: PipelineFactory
) -> None:
    """A replayed record that failed again is quarantined at its new offset; replayed once
    more, its header still names the first read: the ledger leads back to it."""
    config = make_pipeline(("customers",)).config
    replay = Replay(config, "customers", spark)
    replay.ensure_ledger()
    now = dt.datetime.now(dt.UTC)

    def row(topic: str, origin: tuple[int, int], landed: tuple[int, int] | None) -> tuple[Any, ...]:
        state, at = ("pending", None) if landed is None else ("done", now)
        place = landed or (None, None)
        return ("ingestor", "customers", topic, *origin, "r", state, "{}", now, *place, at)

    rows = [
        row(replay.topic, (1, 5), (1, 40)),  # replayed to 40, which failed again ...
        row(replay.topic, (1, 40), (1, 90)),  # ... and was replayed to 90
        row(replay.topic, (1, 90), None),  # which is being replayed now
        row(replay.topic, (2, 7), (2, 8)),
        row("another.topic", (1, 3), (1, 90)),  # another topic's offsets say nothing here
    ]
    frame_from_rows(spark, rows, LEDGER_SCHEMA).write.format("delta").mode("append").save(
        replay.ledger_path
    )
    asked = {(1, 90), (1, 40), (2, 8), (2, 9)}
    assert replay.first_read(asked) == {(1, 90): 5, (1, 40): 5, (2, 8): 7, (2, 9): 9}
