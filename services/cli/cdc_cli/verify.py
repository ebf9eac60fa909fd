"""``cdc verify``: reconcile silver with Elasticsearch and the change topics, key by key.

Silver is the truth. For each entity every target is reduced to a map key -> content
hash and compared with silver's:

- Elasticsearch: every document behind the alias ``es_index_name``; the key columns are
  read from ``_source`` (publisher-es indexes the whole silver row);
- the change topic: every committed event (``read_committed``), the last one per key in
  partition order (a key lives in one partition); keys whose last event is a delete are
  absent.

The hash covers the entity's own columns (no ``_cdc_*`` metadata), each value brought to
one canonical form by its silver column type first, so a timestamp read from JSON text,
an Avro ``timestamp-millis`` and a Spark timestamp hash alike. Differences are keys
missing from a target, extra in it, or with different content.

Targets that lag (see ``cdc status``) show as differences: verify a quiet pipeline.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from cdc_shared.avro import AvroDecoder, AvroSerdeError
from cdc_shared.changefeed import row_columns
from cdc_shared.clients import make_consumer, make_elasticsearch
from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.schemas import make_registry
from confluent_kafka import KafkaException, TopicPartition
from elasticsearch import ApiError, TransportError
from elasticsearch.helpers import scan
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_cli.checkpoints import is_delta_table

TARGETS = ("elasticsearch", "change_topic")
Key = tuple[Any, ...]
KAFKA_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TargetComparison:
    """One target of one entity against silver."""

    target: str  # "elasticsearch" or "change_topic"
    name: str  # the alias or topic
    rows: int = 0  # live keys in the target
    missing: int = 0  # in silver, not in the target
    extra: int = 0  # in the target, not in silver
    different: int = 0  # in both, content differs
    examples: dict[str, list[str]] = field(default_factory=dict)  # kind -> a few keys
    error: str | None = None  # the target could not be read

    @property
    def ok(self) -> bool:
        """No difference and no error."""
        return self.error is None and not (self.missing or self.extra or self.different)


@dataclass(frozen=True)
class EntityVerification:
    """Silver's row count and every target's comparison for one entity."""

    entity: str
    silver_rows: int | None  # None: silver does not exist
    targets: tuple[TargetComparison, ...]

    @property
    def ok(self) -> bool:
        """Silver exists and every target agrees."""
        return self.silver_rows is not None and all(t.ok for t in self.targets)


@dataclass(frozen=True)
class VerifyReport:
    """The result of ``cdc verify``."""

    entities: tuple[EntityVerification, ...]

    @property
    def ok(self) -> bool:
        """Every entity agrees everywhere."""
        return all(e.ok for e in self.entities)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``cdc verify --json``)."""
        return {"ok": self.ok, "entities": [asdict(e) for e in self.entities]}


# --- canonical values ------------------------------------------------------------------


def _micros(value: Any, zoned: bool) -> int:
    """Epoch microseconds of a timestamp from any side.

    Text without an offset is UTC (publisher-es writes UTC). A naive ``datetime`` of a
    zoned column comes from PySpark, which gives local time; of a TIMESTAMP_NTZ column it
    is wall-clock time, compared as if UTC.
    """
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.astimezone(dt.UTC) if zoned else value.replace(tzinfo=dt.UTC)
        delta: dt.timedelta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(value, int | float):
        return round(value) * 1000  # epoch milliseconds
    raise TypeError(f"not a timestamp: {value!r}")


def canonical(data_type: T.DataType, value: Any) -> Any:
    """``value`` in one JSON-able form per Spark type, whatever system it came from."""
    if value is None:
        return None
    if isinstance(data_type, T.TimestampType | T.TimestampNTZType):
        return _micros(value, zoned=isinstance(data_type, T.TimestampType))
    if isinstance(data_type, T.DateType):
        return value.isoformat() if isinstance(value, dt.date) else str(value)[:10]
    if isinstance(data_type, T.DecimalType):
        number = Decimal(str(value))
        return str(number.quantize(Decimal(1).scaleb(-data_type.scale)))
    if isinstance(data_type, T.BinaryType):
        if isinstance(value, bytes | bytearray):
            return base64.b64encode(bytes(value)).decode()
        return str(value)
    if isinstance(data_type, T.FloatType | T.DoubleType):
        real = float(value)
        return repr(real) if math.isfinite(real) else str(real)
    if isinstance(data_type, T.IntegralType):
        return int(value)
    if isinstance(data_type, T.BooleanType):
        return bool(value)
    if isinstance(data_type, T.StringType):
        return str(value)
    if isinstance(data_type, T.StructType):
        record = value.asDict() if isinstance(value, T.Row) else dict(value)
        return [canonical(f.dataType, record.get(f.name)) for f in data_type.fields]
    if isinstance(data_type, T.ArrayType):
        return [canonical(data_type.elementType, v) for v in value]
    if isinstance(data_type, T.MapType):
        items = value.items() if isinstance(value, dict) else value
        return sorted(
            [canonical(data_type.keyType, k), canonical(data_type.valueType, v)] for k, v in items
        )
    return str(value)


@dataclass(frozen=True)
class RowShape:
    """How to key and hash rows of one entity: the key fields and the content fields."""

    key: tuple[T.StructField, ...]
    fields: tuple[T.StructField, ...]

    @classmethod
    def of(cls, silver: T.StructType, entity: EntityConfig) -> RowShape:
        """From silver's schema: key columns, and every entity column (no metadata)."""
        columns = row_columns(silver)
        return cls(tuple(silver[k] for k in entity.key), tuple(silver[c] for c in columns))

    def key_of(self, row: dict[str, Any]) -> Key:
        """The canonical key of a row (dict-like)."""
        return tuple(canonical(f.dataType, row.get(f.name)) for f in self.key)

    def hash_of(self, row: dict[str, Any]) -> str:
        """SHA-256 of the canonical content."""
        values = [canonical(f.dataType, row.get(f.name)) for f in self.fields]
        text = json.dumps(values, separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def render(self, key: Key) -> str:
        """``id=5`` or ``order_id=7,line_no=2``."""
        return ",".join(f"{f.name}={v}" for f, v in zip(self.key, key, strict=True))


# --- reading each side --------------------------------------------------------------------


def silver_hashes(
    spark: SparkSession, path: str, entity: EntityConfig
) -> tuple[RowShape, dict[Key, str]]:
    """Silver's key -> hash, streamed to the driver partition by partition."""
    frame = spark.read.format("delta").load(path)
    shape = RowShape.of(frame.schema, entity)
    rows = frame.select(*[f"`{f.name}`" for f in shape.fields]).toLocalIterator()
    hashes = {}
    for row in rows:
        record = row.asDict(recursive=False)
        hashes[shape.key_of(record)] = shape.hash_of(record)
    return shape, hashes


def es_hashes(config: PipelineConfig, entity: EntityConfig, shape: RowShape) -> dict[Key, str]:
    """Every document behind the entity's alias: key from ``_source`` -> hash."""
    es = make_elasticsearch(config.elasticsearch)
    alias = entity.es_index_name
    try:
        if not es.indices.exists(index=alias):
            raise LookupError(
                f"index or alias {alias!r} does not exist (publisher-es not started?)"
            )
        es.indices.refresh(index=alias)
        hashes: dict[Key, str] = {}
        documents: Iterable[dict[str, Any]] = scan(
            es, index=alias, query={"query": {"match_all": {}}}, size=1000
        )
        for document in documents:
            source = document.get("_source") or {}
            hashes[shape.key_of(source)] = shape.hash_of(source)
        return hashes
    finally:
        es.close()


def change_topic_hashes(
    config: PipelineConfig, entity: EntityConfig, shape: RowShape
) -> dict[Key, str]:
    """The change topic's live keys (last event not a delete) -> hash of ``after``."""
    topic = entity.change_topic_name
    decoder = AvroDecoder(make_registry(config))
    consumer = make_consumer(
        config.kafka,
        group_id=f"cdc-verify-{uuid.uuid4().hex[:8]}",
        **{"isolation.level": "read_committed"},
    )
    last: dict[Key, dict[str, Any] | None] = {}
    try:
        metadata = consumer.list_topics(topic, timeout=KAFKA_TIMEOUT_S).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise LookupError(
                f"change topic {topic!r} does not exist (publisher-kafka not started?)"
            )
        partitions = sorted(metadata.partitions)
        ends = {
            p: consumer.get_watermark_offsets(
                TopicPartition(topic, p), timeout=KAFKA_TIMEOUT_S, cached=False
            )[1]
            for p in partitions
        }
        assigned = [TopicPartition(topic, p, 0) for p in partitions if ends[p] > 0]
        consumer.assign(assigned)
        deadline = time.monotonic() + 600
        while assigned:
            for message in consumer.consume(5000, timeout=0.5):
                if message.error() is not None:
                    raise LookupError(f"reading {topic}: {message.error()}")
                value = message.value()
                if value is None:
                    continue  # a compaction tombstone after a delete event
                try:
                    event = decoder.decode(value)
                except AvroSerdeError as exc:
                    raise LookupError(
                        f"{topic} partition {message.partition()} offset {message.offset()} "
                        f"does not decode: {exc}"
                    ) from None
                assert event is not None
                key = shape.key_of(event["key"])
                last[key] = None if event["op"] == "d" else event["after"]
            positions = consumer.position(assigned)
            # Transaction markers take offsets too: done once past each start-time end.
            if all(tp.offset >= ends[tp.partition] for tp in positions):
                break
            if time.monotonic() > deadline:
                raise LookupError(f"could not read {topic} to its end in 600 s")
    finally:
        consumer.close()
    return {key: shape.hash_of(after) for key, after in last.items() if after is not None}


# --- comparing -------------------------------------------------------------------------------


def compare(
    target: str,
    name: str,
    shape: RowShape,
    expected: dict[Key, str],
    got: dict[Key, str],
    examples: int = 5,
) -> TargetComparison:
    """Keys missing from ``got``, extra in it, and with different hashes."""
    missing = sorted((k for k in expected if k not in got), key=repr)
    extra = sorted((k for k in got if k not in expected), key=repr)
    different = sorted((k for k in expected if k in got and got[k] != expected[k]), key=repr)

    def few(keys: Iterable[Key]) -> list[str]:
        return [shape.render(k) for k in list(keys)[:examples]]

    shown = {
        kind: few(keys)
        for kind, keys in (("missing", missing), ("extra", extra), ("different", different))
        if keys
    }
    return TargetComparison(target, name, len(got), len(missing), len(extra), len(different), shown)


def verify(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    *,
    targets: tuple[str, ...] = TARGETS,
    examples: int = 5,
    spark: SparkSession | None = None,
) -> VerifyReport:
    """Compare silver with each target for the selected entities (default: all)."""
    from cdc_shared.spark import build_spark_session

    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {TARGETS}")
    entities = config.select_entities(entity_names)
    spark = spark or build_spark_session(config.spark, "cdc-verify")
    results = []
    for entity in entities:
        path = config.layout.silver(entity.name)
        if not is_delta_table(spark, path):
            results.append(EntityVerification(entity.name, None, ()))
            continue
        shape, expected = silver_hashes(spark, path, entity)
        comparisons = []
        for target in targets:
            name = entity.es_index_name if target == "elasticsearch" else entity.change_topic_name
            try:
                got = (
                    es_hashes(config, entity, shape)
                    if target == "elasticsearch"
                    else change_topic_hashes(config, entity, shape)
                )
            except (LookupError, KafkaException, ApiError, TransportError) as exc:
                comparisons.append(TargetComparison(target, name, error=str(exc)))
                continue
            comparisons.append(compare(target, name, shape, expected, got, examples))
        results.append(EntityVerification(entity.name, len(expected), tuple(comparisons)))
    return VerifyReport(tuple(results))


def render(report: VerifyReport) -> str:
    """Counts per entity and target, then the differences with example keys."""
    lines = []
    for entity in report.entities:
        if entity.silver_rows is None:
            lines.append(f"{entity.entity}: silver does not exist (merger not started?)")
            continue
        lines.append(f"{entity.entity}: silver {entity.silver_rows:,} rows")
        for t in entity.targets:
            label = f"  {t.target:<14} {t.name}"
            if t.error is not None:
                lines.append(f"{label}: ERROR {t.error}")
                continue
            verdict = "agrees" if t.ok else "DIFFERS"
            lines.append(
                f"{label}: {t.rows:,} keys, {verdict} "
                f"(missing {t.missing}, extra {t.extra}, different {t.different})"
            )
            for kind, keys in t.examples.items():
                lines.append(f"      {kind}: {'; '.join(keys)}")
    lines.append("all targets agree with silver" if report.ok else "differences found")
    return "\n".join(lines)
