"""The workload on the real Kafka: the oracle reading the topics back agrees with the generator."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, produce
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.clients.schemas import entity_schemas
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import EntityConfig

pytestmark = pytest.mark.integration
SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_generated_topics_read_back_by_the_oracle(kafka_config: KafkaConfig) -> None:
    run = uuid.uuid4().hex[:8]
    entities = [
        EntityConfig(
            name="customers",
            source_topic=f"pytest_{run}.inventory.customers",
            key=["id"],
            sequence_by=["source.lsn"],
            key_schema=SCHEMAS / "dbserver1.inventory.customers-key.avsc",
            value_schema=SCHEMAS / "dbserver1.inventory.customers-value.v2.avsc",
        ),
        EntityConfig(
            name="orders",
            source_topic=f"pytest_{run}.inventory.orders",
            key=["order_id", "line_no"],
            sequence_by=["source.ts_ms", "source.lsn"],
            key_schema=SCHEMAS / "dbserver1.inventory.orders-key.avsc",
            value_schema=SCHEMAS / "dbserver1.inventory.orders-value.avsc",
        ),
    ]
    registry = FileSchemaRegistry([SCHEMAS])
    generator = WorkloadGenerator(
        entities, registry, WorkloadSpec(events=5000, keys=300, poison_share=0.01)
    )
    messages = list(generator.messages())
    report = produce(kafka_config, iter(messages), partitions=3)
    assert report.produced == len(messages)
    expected_poison = sorted(m.poison_kind or "" for m in messages if m.kind == "poison")
    assert sorted(kind for *_, kind in report.poison) == expected_poison

    fingerprints = load_fingerprints([SCHEMAS])
    for entity, state in zip(entities, generator.entities, strict=True):
        oracle = read_topic(
            kafka_config,
            EntityOracle(entity, entity_schemas(entity, registry).key_fields, fingerprints),
        )
        believed = {tuple(r[f] for f in entity.key) for r in state.live.values()}
        assert set(oracle.rows) == believed
        poison_here = sum(1 for t, *_ in report.poison if t == entity.source_topic)
        assert oracle.undecodable == poison_here
