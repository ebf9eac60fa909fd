"""A downstream team's consumer of the change topics: plain confluent-kafka and fastavro.

It imports nothing from this project on purpose: it proves the published contract is
enough to read the topics. It decodes Avro single-object messages with the .avsc files
the publisher wrote under ``<storage_root>/_schemas``.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka import Consumer, TopicPartition
from fastavro.schema import fingerprint, to_parsing_canonical_form


@dataclass(frozen=True)
class ChangeRecord:
    """One message of a change topic: where it is, its key, and its event (None: tombstone)."""

    partition: int
    offset: int
    key: dict[str, Any]
    event: dict[str, Any] | None


def _schemas_by_fingerprint(folder: Path) -> dict[bytes, Any]:
    table = {}
    for path in folder.glob("*.avsc"):
        parsed = fastavro.parse_schema(json.loads(path.read_text()))
        canonical = to_parsing_canonical_form(parsed)
        table[bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))] = parsed
    return table


def _decode(data: bytes, schemas: dict[bytes, Any], schema_dir: Path) -> dict[str, Any]:
    """Decode one message; a fingerprint not yet known reads the folder again.

    The publisher writes a new schema's file before its first message with it, so a
    schema that appeared while the topic was being read is there on the second look."""
    assert data[:2] == b"\xc3\x01", f"not Avro single-object encoding: {data[:10]!r}"
    if data[2:10] not in schemas:
        schemas.update(_schemas_by_fingerprint(schema_dir))
    schema = schemas[data[2:10]]
    record: dict[str, Any] = fastavro.schemaless_reader(io.BytesIO(data[10:]), schema, None)
    return record


def read_change_topic(
    bootstrap_servers: str,
    topic: str,
    schema_dir: Path,
    timeout_s: float = 60.0,
    security: dict[str, str] | None = None,
) -> list[ChangeRecord]:
    """Every committed message of ``topic`` (read_committed), partition by partition.

    ``security``: librdkafka's settings for a secured broker (SASL, TLS)."""
    schemas = _schemas_by_fingerprint(schema_dir)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            **(security or {}),
            "group.id": f"downstream-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    records: list[ChangeRecord] = []
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        }
        assigned = [TopicPartition(topic, p, 0) for p in partitions]
        consumer.assign(assigned)
        deadline = time.monotonic() + timeout_s
        while True:
            for message in consumer.consume(10_000, timeout=0.5):
                if message.error() is not None:
                    raise RuntimeError(str(message.error()))
                value = message.value()
                records.append(
                    ChangeRecord(
                        int(message.partition() or 0),
                        int(message.offset() or 0),
                        _decode(message.key() or b"", schemas, schema_dir),
                        None if value is None else _decode(value, schemas, schema_dir),
                    )
                )
            positions = consumer.position([TopicPartition(topic, p) for p in partitions])
            # Transaction markers take offsets too: done once past each start-time end.
            if all(tp.offset >= ends[tp.partition] for tp in positions if ends[tp.partition]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end in {timeout_s} s")
    finally:
        consumer.close()
    return sorted(records, key=lambda r: (r.partition, r.offset))
