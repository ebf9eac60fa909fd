"""The real local Kafka broker: plain produce/consume and single-node transactions."""

from __future__ import annotations

import pytest
from cdc_shared.clients.connect import make_consumer, make_producer
from cdc_shared.config.connections import KafkaConfig

pytestmark = pytest.mark.integration


def consume_all(config: KafkaConfig, topic: str, expected: int, **overrides: object) -> list[bytes]:
    consumer = make_consumer(
        config, group_id=f"{topic}-reader", **{"auto.offset.reset": "earliest", **overrides}
    )
    consumer.subscribe([topic])
    values: list[bytes] = []
    try:
        for _ in range(60):
            for message in consumer.consume(num_messages=1000, timeout=1.0):
                assert message.error() is None, message.error()
                values.append(message.value())
            if len(values) >= expected:
                # One more poll proves nothing beyond `expected` was waiting.
                values.extend(m.value() for m in consumer.consume(1000, timeout=1.0))
                break
    finally:
        consumer.close()
    return values


def test_produce_and_consume(kafka_config: KafkaConfig, topic: str) -> None:
    producer = make_producer(kafka_config, **{"enable.idempotence": True})
    sent = [f"value-{i}".encode() for i in range(500)]
    for i, value in enumerate(sent):
        producer.produce(topic, key=str(i % 7).encode(), value=value)
    assert producer.flush(30) == 0
    assert sorted(consume_all(kafka_config, topic, len(sent))) == sorted(sent)


def test_transactions_work_on_one_node(kafka_config: KafkaConfig, topic: str) -> None:
    producer = make_producer(kafka_config, **{"transactional.id": f"{topic}-tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"aborted")
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"committed")
    producer.commit_transaction(30)

    committed = consume_all(kafka_config, topic, 1, **{"isolation.level": "read_committed"})
    assert committed == [b"committed"]
