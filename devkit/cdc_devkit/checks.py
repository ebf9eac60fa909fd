"""What each output of the pipeline holds, per key, compared with the oracle's final state.

Three readers, each independent of the service that wrote the output: silver read with
Spark, the change topics read with a plain read_committed consumer, and the index read
with a scroll. Each returns ``{key: row}``; :func:`compare` says where two such maps differ.
Values are compared by meaning, not by representation (``Decimal("1.50")`` equals the
Elasticsearch string ``"1.50"``; a date equals its ISO string).
"""

from __future__ import annotations

import datetime as dt
import io
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import fastavro
from cdc_shared.avro import SchemaRegistry, read_header
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.bronze import ENTITY, entity_changes, read_payload_types
from cdc_shared.contracts.layout import INGESTOR
from cdc_shared.streaming.tables import has_commits
from confluent_kafka import TopicPartition
from elasticsearch import NotFoundError
from elasticsearch.helpers import scan
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

Key = tuple[Any, ...]
Rows = dict[Key, dict[str, Any]]


@dataclass
class Difference:
    """How an output differs from the expected rows (empty lists: it agrees)."""

    output: str
    missing: list[Key] = field(default_factory=list)
    extra: list[Key] = field(default_factory=list)
    different: list[Key] = field(default_factory=list)
    compared: int = 0

    @property
    def agrees(self) -> bool:
        """No key missing, extra or different."""
        return not (self.missing or self.extra or self.different)

    def describe(self, examples: int = 3) -> str:
        """One line: agreement, or the counts with a few example keys."""
        if self.agrees:
            return f"{self.output}: {self.compared} keys agree"
        parts = [
            f"{label} {len(keys)} (e.g. {keys[:examples]})"
            for label, keys in (
                ("missing", self.missing),
                ("extra", self.extra),
                ("different", self.different),
            )
            if keys
        ]
        return f"{self.output}: " + ", ".join(parts)


def same_value(expected: Any, got: Any) -> bool:
    """Equal in meaning across Avro, Spark, and JSON representations."""
    if expected is None or got is None:
        return expected is got
    if isinstance(expected, bool) or isinstance(got, bool):
        return bool(expected == got)
    if isinstance(expected, dt.datetime) or isinstance(got, dt.datetime):
        return _instant(expected) == _instant(got)
    if isinstance(expected, dt.date):
        return expected.isoformat() == str(got)[:10]
    if isinstance(expected, int | float | Decimal):
        try:
            return Decimal(str(expected)) == Decimal(str(got))
        except InvalidOperation:
            return False
    return bool(expected == got)


def _instant(value: Any) -> dt.datetime | None:
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    elif isinstance(value, int | float):
        value = dt.datetime.fromtimestamp(value / 1000, dt.UTC)
    if not isinstance(value, dt.datetime):
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def compare(output: str, expected: Rows, got: Rows) -> Difference:
    """Where ``got`` differs from ``expected`` (the expected row's columns are compared)."""
    difference = Difference(output, compared=len(expected))
    difference.missing = sorted(k for k in expected if k not in got)
    difference.extra = sorted(k for k in got if k not in expected)
    difference.different = sorted(
        k
        for k, row in expected.items()
        if k in got and not all(same_value(v, got[k].get(c)) for c, v in row.items())
    )
    return difference


def bronze_changes(
    spark: SparkSession, config: PipelineConfig, entity: EntityConfig
) -> DataFrame | None:
    """The entity's rows in the one bronze table, typed.

    (``cdc_shared.contracts.bronze.entity_changes``.)

    None before the ingestor wrote a row of the entity (no bronze yet, or no payload
    type recorded for it).
    """
    path = config.layout.bronze()
    if not has_commits(spark, path) or entity.name not in read_payload_types(spark, path):
        return None
    return entity_changes(spark, path, entity.name)


def bronze_row_count(spark: SparkSession, config: PipelineConfig, entity: EntityConfig) -> int:
    """How many rows of the entity the one bronze table holds (0 before it has any)."""
    path = config.layout.bronze()
    if not has_commits(spark, path):
        return 0
    rows = spark.read.format("delta").load(path)
    return int(rows.where(F.col(ENTITY) == F.lit(entity.name)).count())


def bronze_label(entity: EntityConfig) -> str:
    """The summaries' name for the entity's rows in the one bronze table (``bronze/_all``)."""
    return f"bronze/_all, entity {entity.name}"


def silver_rows(spark: SparkSession, config: PipelineConfig, entity: EntityConfig) -> Rows:
    """Silver's rows by key (metadata columns left out); empty before the merger made it."""
    path = config.layout.silver(entity.name)
    if not has_commits(spark, path):
        return {}
    silver = spark.read.format("delta").load(path)
    columns = [c for c in silver.columns if not c.startswith("_cdc_")]
    return {
        tuple(r[k] for k in entity.key): {c: r[c] for c in columns}
        for r in silver.select(*columns).collect()
    }


@dataclass
class ChangeTopicState:
    """A change topic read to its end: events per op, and the state its last events imply."""

    events: dict[str, int]
    rows: Rows
    publish_times: dict[tuple[Key, tuple[int, ...]], float]  # (key, sequence) -> epoch s
    # (key, sequence, op) seen more than once: a change published twice. Not (key,
    # sequence): a delete carries the sequence of the row it removed (docs/guarantees.md, limits).
    duplicates: list[tuple[Key, tuple[int, ...], str]] = field(default_factory=list)


def change_topic_state(
    config: PipelineConfig, entity: EntityConfig, timeout_s: float = 60.0
) -> ChangeTopicState:
    """Read the entity's change topic (read_committed) and replay it into a state.

    Reads either framing publisher-kafka writes: Confluent ids (with an HTTP registry) or
    single-object fingerprints (schema files), through the pipeline's own registry.
    """
    registry = make_registry(config)
    topic = entity.change_topic_name
    consumer = make_consumer(
        config.kafka, f"cdc-check-{uuid.uuid4().hex[:8]}", **{"isolation.level": "read_committed"}
    )
    events = {"c": 0, "u": 0, "d": 0}
    rows: Rows = {}
    times: dict[tuple[Key, tuple[int, ...]], float] = {}
    duplicates: list[tuple[Key, tuple[int, ...], str]] = []
    seen: set[tuple[Key, tuple[int, ...], str]] = set()
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return ChangeTopicState(events, rows, times)
        partitions = sorted(metadata.partitions)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        }
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + timeout_s
        while True:
            for message in consumer.consume(10_000, timeout=0.5):
                value = message.value()
                if message.error() is not None or value is None:
                    continue  # tombstones after deletes carry no event
                event = _decode(value, registry)
                key = tuple(event["key"][k] for k in entity.key)
                events[event["op"]] += 1
                if event["op"] == "d":
                    rows.pop(key, None)
                else:
                    rows[key] = dict(event["after"])
                sequence = tuple(event["source_sequence"])
                change = (key, sequence, event["op"])
                if change in seen:
                    duplicates.append(change)
                seen.add(change)
                times[(key, sequence)] = message.timestamp()[1] / 1000
            positions = consumer.position([TopicPartition(topic, p) for p in partitions])
            if all(tp.offset >= ends[tp.partition] for tp in positions if ends[tp.partition]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end in {timeout_s} s")
    finally:
        consumer.close()
    return ChangeTopicState(events, rows, times, duplicates)


def _decode(data: bytes, registry: SchemaRegistry) -> dict[str, Any]:
    header = read_header(data)
    writer = registry.resolve(header).parsed
    record = fastavro.schemaless_reader(io.BytesIO(data[header.size :]), writer, None)
    assert isinstance(record, dict)
    return record


def index_rows(config: PipelineConfig, entity: EntityConfig) -> Rows:
    """The index's documents by key (the key columns are fields of every document)."""
    client = make_elasticsearch(config.elasticsearch)
    alias = entity.es_index_name
    try:
        client.indices.refresh(index=alias)
        hits = scan(client, index=alias, query={"query": {"match_all": {}}}, size=2000)
        return {tuple(h["_source"][k] for k in entity.key): h["_source"] for h in hits}
    except NotFoundError:
        return {}
    finally:
        client.close()


@dataclass
class SourceCoverage:
    """How bronze and the ingestor's quarantine together cover a source topic's records."""

    topic: str
    records: int  # what the broker holds, from its watermarks
    missing: list[tuple[int, int]] = field(default_factory=list)  # (partition, offset)
    duplicated: list[tuple[int, int]] = field(default_factory=list)
    unknown: list[tuple[int, int]] = field(default_factory=list)  # not on the broker

    @property
    def agrees(self) -> bool:
        """Every record exactly once, nothing else."""
        return not (self.missing or self.duplicated or self.unknown)

    def describe(self) -> str:
        """One line for the summary."""
        if self.agrees:
            return f"bronze + quarantine cover {self.topic}: {self.records} records, each once"
        return (
            f"bronze + quarantine vs {self.topic}: missing {len(self.missing)} "
            f"{self.missing[:3]}, duplicated {len(self.duplicated)} {self.duplicated[:3]}, "
            f"unknown {len(self.unknown)} {self.unknown[:3]}"
        )


def topic_offsets(config: PipelineConfig, topic: str) -> set[tuple[int, int]]:
    """Every (partition, offset) the topic holds, from the broker's watermarks."""
    consumer = make_consumer(config.kafka, f"cdc-check-{uuid.uuid4().hex[:8]}")
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        offsets: set[tuple[int, int]] = set()
        for p in metadata.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            offsets.update((p, o) for o in range(low, high))
        return offsets
    finally:
        consumer.close()


def _coordinates(spark: SparkSession, path: str, where: Column) -> list[tuple[int, int]]:
    """(partition, offset) of the rows of the Delta table at ``path`` that ``where`` selects."""
    if not has_commits(spark, path):
        return []
    rows = spark.read.format("delta").load(path).where(where)
    return [(r[0], r[1]) for r in rows.select("kafka_partition", "kafka_offset").collect()]


def source_coverage(
    spark: SparkSession, config: PipelineConfig, entity: EntityConfig
) -> SourceCoverage:
    """Whether every record of the entity's source topic landed once in bronze or quarantine."""
    topic = entity.source_topic
    on_broker = topic_offsets(config, topic)
    landed = _coordinates(spark, config.layout.bronze(), F.col(ENTITY) == F.lit(entity.name))
    landed += _coordinates(
        spark, config.layout.quarantine(INGESTOR), F.col("kafka_topic") == F.lit(topic)
    )
    seen: set[tuple[int, int]] = set()
    coverage = SourceCoverage(topic, len(on_broker))
    for coordinate in landed:
        if coordinate in seen:
            coverage.duplicated.append(coordinate)
        seen.add(coordinate)
    coverage.missing = sorted(on_broker - seen)
    coverage.unknown = sorted(seen - on_broker)
    return coverage


@dataclass
class PoisonCheck:
    """Whether the ingestor's quarantine holds exactly the injected poison records."""

    injected: int
    missing: list[tuple[str, int, int, str]] = field(default_factory=list)
    wrong_kind: list[tuple[str, int, int, str]] = field(default_factory=list)
    duplicated: list[tuple[str, int, int]] = field(default_factory=list)
    unexpected: list[tuple[str, int, int, str]] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        """Each poison record once, with its reason; no valid record quarantined."""
        return not (self.missing or self.wrong_kind or self.duplicated or self.unexpected)

    def describe(self) -> str:
        """One line for the summary."""
        if self.agrees:
            return f"quarantine/ingestor: the {self.injected} poison records, each once"
        return (
            f"quarantine/ingestor vs {self.injected} poison records: "
            f"missing {len(self.missing)} {self.missing[:3]}, wrong kind "
            f"{len(self.wrong_kind)} {self.wrong_kind[:3]}, duplicated "
            f"{len(self.duplicated)} {self.duplicated[:3]}, valid records quarantined "
            f"{len(self.unexpected)} {self.unexpected[:3]}"
        )


def quarantined_poison(
    spark: SparkSession, config: PipelineConfig, poison: list[tuple[str, int, int, str]]
) -> PoisonCheck:
    """Compare the ingestor's quarantine with the poison records the producer confirmed.

    ``poison`` holds (topic, partition, offset, kind); the generator names its poison
    kinds after the ingestor's error kinds.
    """
    check = PoisonCheck(len(poison))
    path = config.layout.quarantine(INGESTOR)
    rows = []
    if has_commits(spark, path):
        frame = spark.read.format("delta").load(path)
        columns = ("kafka_topic", "kafka_partition", "kafka_offset", "error_kind")
        rows = frame.select(*columns).collect()
    found: dict[tuple[str, int, int], str] = {}
    for topic, partition, offset, kind in rows:
        coordinate = (str(topic), int(partition), int(offset))
        if coordinate in found:
            check.duplicated.append(coordinate)
        found[coordinate] = str(kind)
    expected = {(t, p, o): k for t, p, o, k in poison}
    for coordinate, kind in expected.items():
        if coordinate not in found:
            check.missing.append((*coordinate, kind))
        elif found[coordinate] != kind:
            check.wrong_kind.append((*coordinate, found[coordinate]))
    check.unexpected = sorted((*c, k) for c, k in found.items() if c not in expected)
    return check
