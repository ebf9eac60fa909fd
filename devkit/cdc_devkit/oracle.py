"""The oracle: an independent, obviously-correct model of what silver must hold.

It applies source events per key in sequence order, one at a time, with no batching,
no Spark and no Delta: an event whose sequence is not greater than the last one applied
to its key (including that key's delete) changes nothing; a delete removes the key; a
truncate removes every row older than it. It decodes with fastavro directly, from its
own fingerprint table (JSON topics: with ``connect_json``), and shares no code with the
ingestor or the merger.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
from cdc_shared.avro import SchemaRegistry
from cdc_shared.clients.connect import make_consumer
from cdc_shared.clients.schemas import entity_schemas
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import EntityConfig
from confluent_kafka import TopicPartition
from fastavro.schema import fingerprint, to_parsing_canonical_form

from cdc_devkit.connect_json import decode_connect_json, expanded

Key = tuple[Any, ...]
Sequence_ = tuple[Any, ...]


def load_fingerprints(dirs: Iterable[Path]) -> dict[bytes, Any]:
    """Every ``.avsc`` under ``dirs``, by the 8-byte single-object fingerprint."""
    table: dict[bytes, Any] = {}
    for folder in dirs:
        for path in sorted(Path(folder).glob("*.avsc")):
            parsed = fastavro.parse_schema(json.loads(path.read_text()))
            table[bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))] = (
                parsed
            )
    return table


@dataclass(frozen=True)
class AppliedChange:
    """One event the oracle applied, in the order it applied them."""

    key: Key
    sequence: Sequence_
    op: str  # c, u, r, d
    row: dict[str, Any] | None


@dataclass
class EntityOracle:
    """Expected state of one entity, fed event by event in Kafka order per partition."""

    entity: EntityConfig
    key_fields: list[str]
    schemas: Mapping[bytes, Any]
    rows: dict[Key, dict[str, Any]] = field(default_factory=dict)
    last_sequence: dict[Key, Sequence_] = field(default_factory=dict)
    truncated_at: Sequence_ | None = None
    applied: list[AppliedChange] = field(default_factory=list)
    ignored: int = 0  # duplicates, late events and tombstones
    undecodable: int = 0  # poison: corrupt bytes, unknown schema, null key
    #: For an entity with JSON values or keys: the reader schemas ("key", "value").
    json_readers: Mapping[str, Any] | None = None
    _json: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of(
        cls, entity: EntityConfig, registry: SchemaRegistry, fingerprints: Mapping[bytes, Any]
    ) -> EntityOracle:
        """An empty oracle of ``entity``, with the reader schemas its JSON parts need."""
        schemas = entity_schemas(entity, registry)
        readers = {"key": schemas.key.definition, "value": schemas.value.definition}
        return cls(entity, list(entity.key), fingerprints, json_readers=readers)

    def __post_init__(self) -> None:
        formats = {"value": self.entity.value_format, "key": self.entity.key_format}
        json_parts = [part for part, kind in formats.items() if kind == "json"]
        readers = self.json_readers or {}
        if json_parts and not readers:
            raise ValueError(f"entity {self.entity.name} has JSON parts: give json_readers")
        self._json = {part: expanded(readers[part]) for part in json_parts}

    def _decode_part(self, data: bytes, part: str) -> Any:
        if part not in self._json:
            return self._decode(data)
        return decode_connect_json(data, self._json[part], self.entity.decimal_handling)

    def _decode(self, data: bytes) -> Any:
        if data[:2] != b"\xc3\x01" or len(data) < 10:
            raise ValueError("not single-object encoded")
        writer = self.schemas[bytes(data[2:10])]
        stream = io.BytesIO(data[10:])
        record = fastavro.schemaless_reader(stream, writer, None)
        if stream.read():
            raise ValueError("trailing bytes")
        return record

    def _selected(self, after: Mapping[str, Any]) -> dict[str, Any]:
        """The row image's columns the entity keeps (``columns`` / ``except_columns``)."""
        entity = self.entity
        if entity.columns is not None:
            kept = set(entity.columns) | set(entity.key)
            return {c: v for c, v in after.items() if c in kept}
        return {c: v for c, v in after.items() if c not in set(entity.except_columns or [])}

    def feed(self, key: bytes | None, value: bytes | None, partition: int, offset: int) -> None:
        """Apply one Kafka record of the entity's source topic."""
        if value is None:
            self.ignored += 1  # tombstone: the delete before it did the work
            return
        try:
            envelope = self._decode_part(value, "value")
            decoded_key = self._decode_part(key, "key") if key is not None else None
        except Exception:
            self.undecodable += 1
            return
        coordinates = {"kafka.partition": partition, "kafka.offset": offset}
        sequence = tuple(
            coordinates[p] if p in coordinates else _path(envelope, p)
            for p in self.entity.sequence_by
        )
        op = envelope["op"]
        if op == "t":
            if self.truncated_at is None or sequence > self.truncated_at:
                self.truncated_at = sequence
                for k in [k for k, s in self.last_sequence.items() if s < sequence]:
                    if k in self.rows:
                        self.applied.append(AppliedChange(k, sequence, "d", None))
                    self.rows.pop(k, None)
                    self.last_sequence[k] = sequence
            return
        if decoded_key is None:
            self.undecodable += 1
            return
        k = tuple(decoded_key[f] for f in self.key_fields)
        if self.truncated_at is not None and sequence <= self.truncated_at:
            self.ignored += 1
            return
        if k in self.last_sequence and sequence <= self.last_sequence[k]:
            self.ignored += 1
            return
        self.last_sequence[k] = sequence
        if op == "d":
            if k in self.rows:
                self.applied.append(AppliedChange(k, sequence, "d", None))
            self.rows.pop(k, None)
            return
        row = self._selected(envelope["after"])
        self.applied.append(AppliedChange(k, sequence, "u" if k in self.rows else "c", row))
        self.rows[k] = row

    @property
    def deleted_keys(self) -> set[Key]:
        """Keys seen at some point that must now be absent."""
        return set(self.last_sequence) - set(self.rows)


def _path(envelope: Mapping[str, Any], path: str) -> Any:
    value: Any = envelope
    for part in path.split("."):
        value = value[part]
    if value is None:
        raise ValueError(f"sequence column {path} is null")
    return value


def read_topic(
    kafka: KafkaConfig, oracle: EntityOracle, *, timeout_s: float = 60.0
) -> EntityOracle:
    """Feed ``oracle`` the whole source topic, partition by partition, up to its end now."""
    consumer = make_consumer(kafka, group_id=f"cdc-oracle-{oracle.entity.name}")
    topic = oracle.entity.source_topic
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        partitions = sorted(metadata.partitions)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            for p in partitions
        }
        records: list[tuple[int, int, bytes | None, bytes | None]] = []
        consumer.assign([TopicPartition(topic, p, ends[p][0]) for p in partitions])
        remaining = {p for p in partitions if ends[p][1] > ends[p][0]}
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(10_000, timeout=1.0):
                if message.error() is not None:
                    continue
                p, o = int(message.partition() or 0), int(message.offset() or 0)
                records.append((p, o, message.key(), message.value()))
                if o >= ends[p][1] - 1:
                    remaining.discard(p)
        if remaining:
            raise TimeoutError(f"oracle could not read {topic} to its end in {timeout_s} s")
    finally:
        consumer.close()
    # Order only matters per key, and a key lives in one partition.
    for p, o, key, value in sorted(records, key=lambda r: (r[0], r[1])):
        oracle.feed(key, value, p, o)
    return oracle


@dataclass(frozen=True)
class SourceEvent:
    """One source event as history sees it: a truncate (``t``) has no key and no row."""

    key: Key | None
    sequence: Sequence_
    op: str  # c, u, r, d, t
    row: Mapping[str, Any] | None = None
    ts_ms: int | None = None


@dataclass
class Version:
    """One version of a key in the expected history: its period and its row."""

    key: Key
    start: Sequence_
    row: dict[str, Any]
    start_ts_ms: int | None
    last: Sequence_  # the newest event folded into the version
    end: Sequence_ | None = None
    end_ts_ms: int | None = None


def history_versions(
    events: Iterable[SourceEvent], untracked: Iterable[str] = ()
) -> dict[Key, list[Version]]:
    """The SCD type 2 history the events make, whatever order they arrived in.

    Each key's events, one per sequence (re-deliveries are the same event), and every
    truncate (a delete of every key) are replayed in sequence order: an upsert whose
    tracked columns (all but ``untracked``) equal the open version's only updates it;
    any other upsert closes the open version and opens one; a delete or truncate closes
    the open version. An event older than a delete is history before that delete, never
    a row after it.
    """
    skip = set(untracked)
    truncates: dict[Sequence_, SourceEvent] = {}
    per_key: dict[Key, dict[Sequence_, SourceEvent]] = {}
    for event in events:
        if event.op == "t":
            truncates.setdefault(event.sequence, event)
        elif event.key is not None:
            per_key.setdefault(event.key, {}).setdefault(event.sequence, event)
    history: dict[Key, list[Version]] = {}
    for key, by_sequence in per_key.items():
        timeline = sorted({**truncates, **by_sequence}.items(), key=lambda item: item[0])
        versions: list[Version] = []
        current: Version | None = None
        for sequence, event in timeline:
            if event.op in ("d", "t"):
                if current is not None:
                    current.end, current.end_ts_ms = sequence, event.ts_ms
                current = None
                continue
            row = dict(event.row or {})
            tracked = {c: v for c, v in row.items() if c not in skip}
            if current is not None and tracked == {
                c: v for c, v in current.row.items() if c not in skip
            }:
                current.row, current.last = row, sequence
                continue
            if current is not None:
                current.end, current.end_ts_ms = sequence, event.ts_ms
            current = Version(key, sequence, row, event.ts_ms, sequence)
            versions.append(current)
        history[key] = versions
    return history
