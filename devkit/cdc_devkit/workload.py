"""A realistic, deterministic CDC workload: what Debezium would write for a busy database.

From a seed, for each configured entity: an initial snapshot (``op=r``), then inserts,
updates and deletes over a key space with a hot-key skew; a tombstone after each delete;
re-deliveries of earlier events (Debezium is at-least-once after a restart); a switch to
the newest value schema midway (schema evolution); and, at a configurable rate, poison
records (corrupt bytes, unknown schema, null key). Same seed, same bytes.

Rows are made from the entities' Avro schemas, so any entity with a Debezium envelope
schema can be generated, not only the examples.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, Protocol, TypeVar

from cdc_shared.avro import AvroEncoder, KnownSchema, SchemaRegistry, subject_name
from cdc_shared.clients.connect import make_admin, make_producer
from cdc_shared.clients.retry import retrying
from cdc_shared.clients.schemas import EntitySchemas, entity_schemas
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import EntityConfig
from confluent_kafka import KafkaError, KafkaException, Message
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from cdc_devkit.connect_json import JsonEncoder, JsonForm

log = logging.getLogger(__name__)

MessageKind = Literal["event", "tombstone", "redelivery", "poison"]
PoisonKind = Literal["corrupt", "unknown_schema", "null_key", "malformed_json", "wrong_type"]
#: The poison of an entity whose values are Avro, and of one whose values are JSON.
POISON_KINDS: tuple[PoisonKind, ...] = ("corrupt", "unknown_schema", "null_key")
JSON_POISON_KINDS: tuple[PoisonKind, ...] = ("malformed_json", "wrong_type", "null_key")


class Encoder(Protocol):
    """Writes records of one schema to bytes (Avro framing or Connect JSON)."""

    schema: KnownSchema

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """The record's bytes, as its topic carries them."""
        ...


_EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
_FIRST_LSN = 24_000_000
_WORDS = [
    "ada",
    "grace",
    "alan",
    "edsger",
    "barbara",
    "donald",
    "ken",
    "dennis",
    "margaret",
    "linus",
    "guido",
    "james",
    "frances",
    "john",
    "radia",
    "niklaus",
    "tony",
    "leslie",
    "butler",
    "shafi",
]


T = TypeVar("T")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. ``events`` counts change events after the snapshots."""

    events: int = 10_000
    keys: int = 1_000
    snapshot_rows: int | None = None  # default: half the key space
    seed: int = 42
    hot_keys: float = 0.01  # share of the key space that is hot
    hot_share: float = 0.3  # share of changes that hit a hot key
    delete_share: float = 0.1
    redelivery_share: float = 0.02
    poison_share: float = 0.001
    schema_change_at: float | None = 0.5  # share of events before the newest schema is used
    json_form: JsonForm = "mixed"  # entities with JSON values or keys: schemas.enable
    # Above 0: the first ``hot_tables`` entities get ``hot_tables_share`` of the changes,
    # the others the rest (a database whose load sits on a few tables); 0: even.
    hot_tables: int = 0
    hot_tables_share: float = 0.7

    def hot_of(self, entities: Sequence[T]) -> Sequence[T]:
        """The hot ones of ``entities`` (the first ``hot_tables``); none when the load is even.

        Even when ``hot_tables`` is 0 or takes every entity.
        """
        return entities[: self.hot_tables] if 0 < self.hot_tables < len(entities) else []


@dataclass(frozen=True)
class GeneratedMessage:
    """One Kafka record of the workload, in produce order."""

    entity: str
    topic: str
    key: bytes | None
    value: bytes | None
    kind: MessageKind
    poison_kind: PoisonKind | None = None


@dataclass
class EntityState:
    """What the generator believes the source table holds."""

    name: str
    topic: str
    schemas: EntitySchemas
    key_encoder: Encoder
    value_encoders: list[Encoder]
    json_values: bool = False
    live: dict[int, dict[str, Any]] = field(default_factory=dict)


class WorkloadGenerator:
    """Deterministic message stream for ``entities``; iterate :meth:`messages`."""

    def __init__(
        self, entities: Sequence[EntityConfig], registry: SchemaRegistry, spec: WorkloadSpec
    ) -> None:
        if not entities:
            raise ValueError("the workload needs at least one entity")
        self.spec = spec
        self.random = random.Random(spec.seed)
        self.lsn = _FIRST_LSN
        self.tx_id = 1000
        self.clock_ms = int(_EPOCH.timestamp() * 1000)
        self.entities = [self._state(e, registry) for e in entities]

    def _state(self, entity: EntityConfig, registry: SchemaRegistry) -> EntityState:
        schemas = entity_schemas(entity, registry)

        def encoder(schema: KnownSchema, json: bool) -> Encoder:
            if json:
                return JsonEncoder(schema, entity.decimal_handling, self.spec.json_form)
            return AvroEncoder(schema)

        return EntityState(
            name=entity.name,
            topic=entity.source_topic,
            schemas=schemas,
            key_encoder=encoder(schemas.key, entity.key_format == "json"),
            value_encoders=[encoder(v, entity.value_format == "json") for v in schemas.values],
            json_values=entity.value_format == "json",
        )

    # --- the stream ----------------------------------------------------------------

    def messages(self) -> Iterator[GeneratedMessage]:
        """Snapshots first, then the interleaved changes, re-deliveries and poison."""
        spec = self.spec
        history: list[GeneratedMessage] = []
        for state in self.entities:
            rows = spec.snapshot_rows if spec.snapshot_rows is not None else spec.keys // 2
            snapshot_lsn = self._next_lsn()
            chosen = sorted(self.random.sample(range(spec.keys), min(rows, spec.keys)))
            for n, k in enumerate(chosen):
                flag = "last" if n == len(chosen) - 1 else "true"
                message = self._change(
                    state, k, "r", encoder=state.value_encoders[0], lsn=snapshot_lsn, snapshot=flag
                )
                history.append(message)
                yield message
        switch_at = (
            int(spec.events * spec.schema_change_at)
            if spec.schema_change_at is not None
            else spec.events + 1
        )
        for index in range(spec.events):
            roll = self.random.random()
            if roll < spec.poison_share:
                yield self._poison(self.random.choice(self.entities))
                continue
            if roll < spec.poison_share + spec.redelivery_share and history:
                start = self.random.randrange(len(history))
                for old in history[start : start + self.random.randint(1, 5)]:
                    yield GeneratedMessage(old.entity, old.topic, old.key, old.value, "redelivery")
                continue
            state = self._changed_entity()
            encoder = state.value_encoders[-1 if index >= switch_at else 0]
            for message in self._next_change(state, encoder):
                history.append(message)
                yield message

    def _changed_entity(self) -> EntityState:
        """The entity the next change is on: any, or a hot one at ``hot_tables_share``."""
        hot = self.spec.hot_of(self.entities)
        if not hot:
            return self.random.choice(self.entities)
        on_hot = self.random.random() < self.spec.hot_tables_share
        return self.random.choice(hot if on_hot else self.entities[len(hot) :])

    def _next_change(self, state: EntityState, encoder: Encoder) -> list[GeneratedMessage]:
        spec = self.spec
        hot = max(1, int(spec.keys * spec.hot_keys))
        k = (
            self.random.randrange(hot)
            if self.random.random() < spec.hot_share
            else self.random.randrange(spec.keys)
        )
        if k not in state.live:
            return [self._change(state, k, "c", encoder=encoder)]
        if self.random.random() < spec.delete_share:
            delete = self._change(state, k, "d", encoder=encoder)
            tombstone = GeneratedMessage(state.name, state.topic, delete.key, None, "tombstone")
            return [delete, tombstone]
        return [self._change(state, k, "u", encoder=encoder)]

    # --- one event -------------------------------------------------------------------

    def _change(
        self,
        state: EntityState,
        k: int,
        op: str,
        *,
        encoder: Encoder,
        lsn: int | None = None,
        snapshot: str = "false",
    ) -> GeneratedMessage:
        row_schema = state.schemas.row_schema(encoder.schema)
        key = self._key(state, k)
        before = state.live.get(k)
        after: dict[str, Any] | None
        if op == "d":
            after = None
            state.live.pop(k)
        elif op == "u" and before is not None:
            after = self._updated(before, row_schema, key)
            state.live[k] = after
        else:
            after = self._row(row_schema, key)
            state.live[k] = after
        envelope = {
            "before": self._project(before, row_schema) if op in ("u", "d") else None,
            "after": self._project(after, row_schema),
            "source": self._source(state, lsn if lsn is not None else self._next_lsn(), snapshot),
            "transaction": None,
            "op": op,
            "ts_ms": self.clock_ms + 3,
        }
        return GeneratedMessage(
            state.name,
            state.topic,
            state.key_encoder.encode(key),
            encoder.encode(envelope),
            "event",
        )

    def _source(self, state: EntityState, lsn: int, snapshot: str) -> dict[str, Any]:
        self.clock_ms += self.random.randint(1, 20)
        self.tx_id += 1
        schema, table = (
            state.topic.split(".")[-2:] if state.topic.count(".") >= 2 else ("public", state.topic)
        )
        return {
            "version": "2.7.3.Final",
            "connector": "postgresql",
            "name": state.topic.split(".")[0],
            "ts_ms": self.clock_ms,
            "snapshot": snapshot,
            "db": "inventory",
            "sequence": f'["{lsn - 8}","{lsn}"]',
            "ts_us": self.clock_ms * 1000,
            "ts_ns": self.clock_ms * 1_000_000,
            "schema": schema,
            "table": table,
            "txId": self.tx_id,
            "lsn": lsn,
            "xmin": None,
        }

    def _next_lsn(self) -> int:
        self.lsn += self.random.randint(8, 400)
        return self.lsn

    def _poison(self, state: EntityState) -> GeneratedMessage:
        kind = self.random.choice(JSON_POISON_KINDS if state.json_values else POISON_KINDS)
        good = self._peek_valid(state)
        if kind == "null_key":
            return GeneratedMessage(state.name, state.topic, None, good.value, "poison", kind)
        if kind == "malformed_json":
            assert good.value is not None
            cut = good.value[: self.random.randint(1, len(good.value) - 1)]
            return GeneratedMessage(state.name, state.topic, good.key, cut, "poison", kind)
        if kind == "wrong_type":  # a JSON string where the envelope has a number
            assert good.value is not None
            document = json.loads(good.value)
            envelope = document.get("payload", document)
            envelope["ts_ms"] = f"at {envelope['ts_ms']}"
            wrong = json.dumps(document).encode()
            return GeneratedMessage(state.name, state.topic, good.key, wrong, "poison", kind)
        if kind == "unknown_schema":
            header = b"\xc3\x01" + self.random.randbytes(8)
            assert good.value is not None
            return GeneratedMessage(
                state.name, state.topic, good.key, header + good.value[10:], "poison", kind
            )
        header = state.value_encoders[0].schema.header
        garbage = bytes([0xFF]) + self.random.randbytes(self.random.randint(1, 40))
        return GeneratedMessage(state.name, state.topic, good.key, header + garbage, "poison", kind)

    def _peek_valid(self, state: EntityState) -> GeneratedMessage:
        """A well-formed message that changes nothing in the generator's state."""
        k = self.random.randrange(self.spec.keys)
        key = self._key(state, k)
        row_schema = state.schemas.row_schema(state.value_encoders[0].schema)
        envelope = {
            "before": None,
            "after": self._row(row_schema, key),
            "source": self._source(state, self._next_lsn(), "false"),
            "transaction": None,
            "op": "c",
            "ts_ms": self.clock_ms,
        }
        return GeneratedMessage(
            state.name,
            state.topic,
            state.key_encoder.encode(key),
            state.value_encoders[0].encode(envelope),
            "event",
        )

    # --- rows from schemas -----------------------------------------------------------

    def _key(self, state: EntityState, k: int) -> dict[str, Any]:
        key: dict[str, Any] = {}
        for position, key_field in enumerate(state.schemas.key.parsed["fields"]):
            number = k + 1 if position == 0 else k % 3 + 1
            key[key_field["name"]] = (
                str(number) if _base_type(key_field["type"]) == "string" else number
            )
        return key

    def _row(self, row_schema: dict[str, Any], key: dict[str, Any]) -> dict[str, Any]:
        row = {f["name"]: self._value(f) for f in row_schema["fields"]}
        row.update(key)
        return row

    def _updated(
        self, before: dict[str, Any], row_schema: dict[str, Any], key: dict[str, Any]
    ) -> dict[str, Any]:
        after = dict(before)
        changeable = [f for f in row_schema["fields"] if f["name"] not in key]
        for chosen in self.random.sample(
            changeable, min(len(changeable), self.random.randint(1, 2))
        ):
            after[chosen["name"]] = self._value(chosen)
        return after

    @staticmethod
    def _project(row: dict[str, Any] | None, row_schema: dict[str, Any]) -> dict[str, Any] | None:
        """The row as a given schema version sees it (older versions lack new columns)."""
        if row is None:
            return None
        return {f["name"]: row.get(f["name"], f.get("default")) for f in row_schema["fields"]}

    def _value(self, avro_field: dict[str, Any]) -> Any:
        schema = avro_field["type"]
        if isinstance(schema, list):
            if "null" in schema and self.random.random() < 0.25:
                return None
            schema = next(s for s in schema if s != "null")
        return self._value_of(avro_field["name"], schema)

    def _value_of(self, name: str, schema: Any) -> Any:
        kind = schema if isinstance(schema, str) else schema.get("type")
        logical = schema.get("logicalType") if isinstance(schema, dict) else None
        rnd = self.random
        if logical == "decimal":
            scale = int(schema.get("scale", 0))
            digits = int(schema.get("precision", 10)) - scale
            units = rnd.randrange(10 ** min(digits + scale, 9))
            return Decimal(units).scaleb(-scale)
        if logical in ("timestamp-millis", "timestamp-micros"):
            return _EPOCH - dt.timedelta(seconds=rnd.randrange(3 * 365 * 86400))
        if logical == "date":
            return (_EPOCH - dt.timedelta(days=rnd.randrange(3 * 365))).date()
        if isinstance(schema, dict) and "connect.parameters" in schema:
            allowed = schema["connect.parameters"].get("allowed")
            if allowed:
                return rnd.choice(allowed.split(","))
        if isinstance(schema, dict) and kind == "enum":
            return rnd.choice(schema["symbols"])
        if kind in ("int", "long"):
            return rnd.randrange(1, 100_000)
        if kind in ("float", "double"):
            return round(rnd.uniform(0, 1000), 3)
        if kind == "boolean":
            return rnd.random() < 0.5
        if kind == "string":
            return self._text(name)
        if kind == "bytes":
            return rnd.randbytes(8)
        raise ValueError(f"cannot generate a value for field {name!r} of type {schema!r}")

    def _text(self, name: str) -> str:
        """A string that looks like what a field so named holds (an email, a phone, a tier)."""
        rnd = self.random
        if "email" in name:
            return f"{rnd.choice(_WORDS)}.{rnd.randrange(10_000)}@example.com"
        if "phone" in name:
            return f"+1-555-{rnd.randrange(10_000):04d}"
        if "tier" in name:
            return rnd.choice(("bronze", "silver", "gold"))
        return f"{rnd.choice(_WORDS)}-{rnd.randrange(1000)}"


def _base_type(schema: Any) -> str:
    if isinstance(schema, list):
        schema = next(s for s in schema if s != "null")
    return schema if isinstance(schema, str) else str(schema.get("type"))


# --- producing ---------------------------------------------------------------------


@dataclass
class ProduceReport:
    """What went to Kafka, and where the poison records landed."""

    produced: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    poison: list[tuple[str, int, int, str]] = field(
        default_factory=list
    )  # topic, part, offset, kind
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Messages per second, produce call to last delivery."""
        return self.produced / self.seconds if self.seconds else 0.0

    def add(self, other: ProduceReport) -> None:
        """Count ``other`` (a later produce call) in this report too."""
        self.produced += other.produced
        self.seconds += other.seconds
        self.poison = sorted(self.poison + other.poison)
        for kind, count in other.by_kind.items():
            self.by_kind[kind] = self.by_kind.get(kind, 0) + count


#: How long :func:`ensure_topics` waits for a broker that is away (e.g. restarting).
BROKER_WAIT_ATTEMPTS = 8


def ensure_topics(kafka: KafkaConfig, topics: Sequence[str], partitions: int = 3) -> None:
    """Create the topics that do not exist yet (replication factor 1).

    A broker out of reach (the chaos run restarts it while slices are produced) is waited
    for with the project's retry policy, a few minutes at most.
    """
    admin = make_admin(kafka)
    listing = retrying(
        lambda error: isinstance(error, KafkaException),
        initial_s=1.0,
        max_s=30.0,
        attempts=BROKER_WAIT_ATTEMPTS,
        log=log,
        describe=lambda error, _: f"Kafka metadata not available ({error}); waiting",
    )
    existing = set(listing(lambda: admin.list_topics(timeout=30)).topics)
    missing = [NewTopic(t, partitions, 1) for t in topics if t not in existing]
    if not missing:
        return
    for topic, future in admin.create_topics(missing).items():
        try:
            future.result(30)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise RuntimeError(f"cannot create topic {topic}: {exc}") from exc


def produce(
    kafka: KafkaConfig,
    messages: Iterator[GeneratedMessage],
    *,
    rate: float | None = None,
    partitions: int = 3,
    progress: Callable[[int, float], None] | None = None,
) -> ProduceReport:
    """Produce ``messages`` in order with an idempotent producer, at most ``rate`` per second.

    Per-key order holds: the key picks the partition and idempotence keeps retries in
    order. ``progress(count, rate)`` is called about every two seconds.
    """
    producer = make_producer(
        kafka,
        **{
            "enable.idempotence": True,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
        },
    )
    report = ProduceReport()
    failures: list[str] = []
    started = last_progress = time.monotonic()
    topics_seen: set[str] = set()

    def delivered(error: KafkaError | None, message: Message, *, kind: str) -> None:
        if error is not None:
            failures.append(f"{message.topic()}: {error}")
        elif kind.startswith("poison:"):
            report.poison.append(
                (
                    str(message.topic()),
                    int(message.partition() or 0),
                    int(message.offset() or 0),
                    kind.removeprefix("poison:"),
                )
            )

    for message in messages:
        if message.topic not in topics_seen:
            ensure_topics(kafka, [message.topic], partitions)
            topics_seen.add(message.topic)
        tag = f"poison:{message.poison_kind}" if message.kind == "poison" else message.kind
        while True:
            try:
                producer.produce(
                    message.topic,
                    key=message.key,
                    value=message.value,
                    on_delivery=functools.partial(delivered, kind=tag),
                )
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        report.produced += 1
        report.by_kind[message.kind] = report.by_kind.get(message.kind, 0) + 1
        now = time.monotonic()
        if rate:
            ahead = report.produced / rate - (now - started)
            if ahead > 0:
                time.sleep(ahead)
        if progress is not None and now - last_progress >= 2:
            progress(report.produced, report.produced / (now - started))
            last_progress = now
    remaining = producer.flush(120)
    report.seconds = time.monotonic() - started
    if remaining or failures:
        raise RuntimeError(
            f"{remaining} messages undelivered, {len(failures)} failed; first: {failures[:3]}"
        )
    report.poison.sort()
    return report


def register_source_schemas(
    entities: Sequence[EntityConfig], registry: SchemaRegistry, files: SchemaRegistry
) -> list[str]:
    """Register the source topics' schema files under subjects the registry lacks.

    What a Debezium producer's Avro converter does on its first record, so that a
    generated load can go through an HTTP registry; subjects the registry already
    knows are left as they are. Returns the subjects registered.
    """
    registered = []
    for entity in entities:
        for is_key in (True, False):
            subject = subject_name(entity.source_topic, is_key)
            if registry.versions(subject):
                continue
            for known in files.versions(subject):
                registry.register(subject, known.definition)
            if files.versions(subject):
                registered.append(subject)
    return registered
