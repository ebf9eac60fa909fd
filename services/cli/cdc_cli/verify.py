"""``cdc verify``: reconcile silver with Elasticsearch, the change topics and the history.

Silver is the truth. For each entity every side is read once and reduced to records
key -> content hash:

- silver: every row, read through Spark and streamed to this process one partition at a
  time;
- Elasticsearch: every document behind the alias ``es_index_name`` (``helpers.scan``);
  the key columns are read from ``_source`` (publisher-es indexes the whole silver row);
- the change topic: every committed event (``read_committed``), the last one per key in
  partition order (a key lives in one partition; the later offset wins); keys whose last
  event is a delete are absent;
- the history (entities with ``history.enabled``): its current versions (``__end_at``
  null), read through Spark as silver is, on silver's columns the history carries
  (``current_versions``). A key deleted in silver has none; a key with two is different.
  Asked for by name (``--target history``), it is reported as skipped, not compared, for
  an entity with history off.

A run that compared nothing (every target asked for skipped) is not an agreement: it fails.

The hash covers the entity's own columns (no ``_cdc_*`` metadata), each value brought to
one canonical form by its silver column type first, so a timestamp read from JSON text,
an Avro ``timestamp-millis`` and a Spark timestamp hash alike. Differences are keys
missing from a target, extra in it, or with different content.

At table scale the records are not held in memory: each side is spilled into N key
buckets in local files, a digest per bucket is compared, and only the buckets whose
digests differ are compared key by key (``cdc_cli.verify_buckets``). N is silver's row
count over ``ROWS_PER_BUCKET`` (or ``--buckets``). Memory bound of this process: a
16 MiB write buffer, N digests, and while comparing one bucket of silver and one of the
target (about ``ROWS_PER_BUCKET`` keys each, a few MiB), whatever the table's size; plus
the rows pyspark hands over from the partition being read (silver is repartitioned into
``ROWS_PER_TRANSFER`` rows a partition, so the driver JVM collects no more at a time).
Disk: about 100 bytes per row and side under ``$TMPDIR``, removed at the end.

Rows are hashed here, not in Spark: the executors run no Python (docs/operations.md),
and the canonical forms (Python's float ``repr``, its JSON text) have no exact Spark SQL
twin; a second implementation of the hash would make false differences.

Targets that lag (see ``cdc status``) show as differences: verify a quiet pipeline.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import math
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from functools import reduce
from pathlib import Path
from typing import Any, NamedTuple

from cdc_shared.avro import AvroDecoder, AvroSerdeError
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.silver import END
from cdc_shared.contracts.unavailable import Placeholder
from cdc_shared.jvm.spark import build_spark_session
from cdc_shared.streaming.changefeed import row_columns
from confluent_kafka import KafkaException, TopicPartition
from elasticsearch import ApiError, TransportError
from elasticsearch.helpers import scan
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_cli.spark_state import is_delta_table
from cdc_cli.verify_buckets import (
    BucketComparison,
    BucketSpill,
    bucket_count,
    compare_spills,
    key_text,
)

TARGETS = ("elasticsearch", "change_topic", "history")
Key = tuple[Any, ...]
Canonical = Callable[[Any], Any]  # a value -> its canonical form
KAFKA_TIMEOUT_S = 30.0
ROWS_PER_TRANSFER = 100_000  # silver rows per partition handed to this process
STALL_S = 600.0  # reading a change topic fails after this long without a message


@dataclass(frozen=True)
class TargetComparison:
    """One target of one entity against silver."""

    target: str  # "elasticsearch", "change_topic" or "history"
    name: str  # the alias, topic or history table
    rows: int = 0  # live keys in the target
    missing: int = 0  # in silver, not in the target
    extra: int = 0  # in the target, not in silver
    different: int = 0  # in both, content differs
    examples: dict[str, list[str]] = field(default_factory=dict)  # kind -> a few keys
    error: str | None = None  # the target could not be read
    buckets: int = 0  # key buckets compared
    buckets_differing: int = 0  # buckets whose digests differed: compared key by key
    skipped: str | None = None  # why the target was not compared (it agrees with nothing)

    @property
    def ok(self) -> bool:
        """No difference and no error (also true of a skipped target: see ``compared``)."""
        return self.error is None and not (self.missing or self.extra or self.different)

    @property
    def compared(self) -> bool:
        """The target was compared with silver (not skipped)."""
        return self.skipped is None


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
    def compared(self) -> int:
        """How many targets were compared with silver (skipped ones are not)."""
        return sum(t.compared for e in self.entities for t in e.targets)

    @property
    def skipped(self) -> int:
        """How many targets asked for were not compared (``TargetComparison.skipped``)."""
        return sum(not t.compared for e in self.entities for t in e.targets)

    @property
    def ok(self) -> bool:
        """Every entity agrees everywhere, and not every target asked for was skipped."""
        return all(e.ok for e in self.entities) and (self.compared > 0 or not self.skipped)

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
    return converter(data_type)(value)


def converter(data_type: T.DataType) -> Canonical:
    """The function that brings values of ``data_type`` to their canonical form.

    Chosen once per column: verify applies it to every value of every row, where a
    choice by type per value costs as much as the conversion.
    """
    convert = _non_null(data_type)
    return lambda value: None if value is None else convert(value)


def _non_null(data_type: T.DataType) -> Canonical:
    """``converter`` for values known not to be None."""
    if isinstance(data_type, T.TimestampType | T.TimestampNTZType):
        zoned = isinstance(data_type, T.TimestampType)
        return lambda value: _micros(value, zoned)
    if isinstance(data_type, T.DateType):
        return lambda value: value.isoformat() if isinstance(value, dt.date) else str(value)[:10]
    if isinstance(data_type, T.DecimalType):
        quantum = Decimal(1).scaleb(-data_type.scale)
        return lambda value: str(Decimal(str(value)).quantize(quantum))
    if isinstance(data_type, T.BinaryType):
        return _binary
    if isinstance(data_type, T.FloatType | T.DoubleType):
        return _real
    if isinstance(data_type, T.IntegralType):
        return int
    if isinstance(data_type, T.BooleanType):
        return bool
    if isinstance(data_type, T.StringType):
        return str
    if isinstance(data_type, T.StructType):
        fields = [(f.name, converter(f.dataType)) for f in data_type.fields]

        def struct(value: Any) -> list[Any]:
            record = value.asDict() if isinstance(value, T.Row) else dict(value)
            return [convert(record.get(name)) for name, convert in fields]

        return struct
    if isinstance(data_type, T.ArrayType):
        element = converter(data_type.elementType)
        return lambda value: [element(v) for v in value]
    if isinstance(data_type, T.MapType):
        key, item = converter(data_type.keyType), converter(data_type.valueType)

        def entries(value: Any) -> list[list[Any]]:
            pairs = value.items() if isinstance(value, dict) else value
            return sorted([key(k), item(v)] for k, v in pairs)

        return entries
    return str


def _binary(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    return str(value)


def _real(value: Any) -> str:
    real = float(value)
    return repr(real) if math.isfinite(real) else str(real)


#: The JSON text hashed: compact, keys sorted (one encoder: ``json.dumps`` makes one a call).
_CONTENT_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class RowShape:
    """How to key and hash rows of one entity: the key fields and the content fields."""

    key: tuple[T.StructField, ...]
    fields: tuple[T.StructField, ...]
    _key: tuple[tuple[str, Canonical], ...] = field(init=False, repr=False, compare=False)
    _content: tuple[tuple[str, Canonical], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, fields in (("_key", self.key), ("_content", self.fields)):
            converters = tuple((f.name, converter(f.dataType)) for f in fields)
            object.__setattr__(self, name, converters)

    @classmethod
    def of(
        cls, silver: T.StructType, entity: EntityConfig, within: Collection[str] | None = None
    ) -> RowShape:
        """From silver's schema: key columns, and every entity column (no metadata).

        ``within``: only the columns it names (the key always).
        """
        columns = row_columns(silver)
        shape = cls(tuple(silver[k] for k in entity.key), tuple(silver[c] for c in columns))
        return shape if within is None else shape.within(within)

    def within(self, columns: Collection[str]) -> RowShape:
        """The shape on the ``columns`` it names only (the key always)."""
        key = {f.name for f in self.key}
        return RowShape(
            self.key, tuple(f for f in self.fields if f.name in columns or f.name in key)
        )

    def key_of(self, row: dict[str, Any]) -> Key:
        """The canonical key of a row (dict-like)."""
        return tuple(convert(row.get(name)) for name, convert in self._key)

    def hash_of(self, row: dict[str, Any]) -> str:
        """SHA-256 of the canonical content."""
        values = [convert(row.get(name)) for name, convert in self._content]
        return hashlib.sha256(_CONTENT_JSON.encode(values).encode()).hexdigest()

    def render(self, key: Key) -> str:
        """``id=5`` or ``order_id=7,line_no=2``."""
        return ",".join(f"{f.name}={v}" for f, v in zip(self.key, key, strict=True))


# --- reading each side --------------------------------------------------------------------


class TargetRecord(NamedTuple):
    """One record read from a target, in the target's own form."""

    key: dict[str, Any]  # the key fields (a document's ``_source``, an event's ``key``)
    content: dict[str, Any] | None  # the row; None: the key was deleted
    position: int  # orders one key's records: the later wins (a topic's offset)


def spill_silver(
    spark: SparkSession,
    path: str,
    entity: EntityConfig,
    folder: Path,
    buckets: int | None,
    within: Collection[str] | None = None,
) -> tuple[RowShape, BucketSpill]:
    """Silver's rows as (key, hash) in ``buckets`` buckets (default: from its row count).

    The rows are streamed to this process one partition at a time and hashed here (see
    the module docstring for why not in Spark). ``within``: hash only those columns.
    """
    shape, frame = _silver(spark, path, entity, within)
    rows = frame.count()
    spill = BucketSpill(folder, buckets or bucket_count(rows))
    for position, record in enumerate(local_rows(frame, rows)):
        spill.add(key_text(shape.key_of(record)), shape.hash_of(record), position)
    return shape, spill


def local_rows(frame: DataFrame, rows: int) -> Iterator[dict[str, Any]]:
    """The frame's rows (about ``rows``) in this process, one small partition at a time.

    toLocalIterator collects one partition at a time in the driver: a table's files make
    partitions of millions of rows, too big to collect; these hold ``ROWS_PER_TRANSFER``.
    """
    small = frame.repartition(max(1, math.ceil(rows / ROWS_PER_TRANSFER)))
    for row in small.toLocalIterator():
        yield row.asDict(recursive=False)


def silver_hashes(
    spark: SparkSession, path: str, entity: EntityConfig
) -> tuple[RowShape, dict[Key, str]]:
    """Silver's key -> hash held in memory, for tables known to be small.

    The chaos run's fingerprint of silver uses it; ``verify`` spills to buckets instead.
    """
    shape, frame = _silver(spark, path, entity)
    hashes = {}
    for row in frame.toLocalIterator():
        record = row.asDict(recursive=False)
        hashes[shape.key_of(record)] = shape.hash_of(record)
    return shape, hashes


def _silver(
    spark: SparkSession, path: str, entity: EntityConfig, within: Collection[str] | None = None
) -> tuple[RowShape, DataFrame]:
    """Silver's shape, and its entity columns (no metadata; only those ``within`` names)."""
    frame = spark.read.format("delta").load(path)
    shape = RowShape.of(frame.schema, entity, within)
    return shape, frame.select(*[f"`{f.name}`" for f in shape.fields])


def spill_target(
    records: Iterable[TargetRecord],
    shape: RowShape,
    folder: Path,
    buckets: int,
    one_per_key: bool = False,
) -> BucketSpill:
    """A target's records as (key, hash or None, position) in ``buckets`` buckets.

    ``one_per_key``: the target must hold one record per key (``BucketSpill``).
    """
    spill = BucketSpill(folder, buckets, one_per_key)
    for record in records:
        content = None if record.content is None else shape.hash_of(record.content)
        spill.add(key_text(shape.key_of(record.key)), content, record.position)
    return spill


def es_records(config: PipelineConfig, entity: EntityConfig) -> Iterator[TargetRecord]:
    """Every document behind the entity's alias (``helpers.scan``), keyed by ``_source``."""
    es = make_elasticsearch(config.elasticsearch)
    alias = entity.es_index_name
    try:
        if not es.indices.exists(index=alias):
            raise LookupError(
                f"index or alias {alias!r} does not exist (publisher-es not started?)"
            )
        es.indices.refresh(index=alias)
        documents: Iterable[dict[str, Any]] = scan(
            es, index=alias, query={"query": {"match_all": {}}}, size=1000
        )
        for position, document in enumerate(documents):
            source = document.get("_source") or {}
            yield TargetRecord(source, source, position)
    finally:
        es.close()


def change_topic_records(config: PipelineConfig, entity: EntityConfig) -> Iterator[TargetRecord]:
    """Every committed event of the change topic (``read_committed``), read once to its end.

    The position is the offset: a key lives in one partition, so its later offset wins.
    A delete event is a record without content; compaction tombstones are skipped.
    """
    topic = entity.change_topic_name
    decoder = AvroDecoder(make_registry(config))
    consumer = make_consumer(
        config.kafka,
        group_id=f"cdc-verify-{uuid.uuid4().hex[:8]}",
        **{"isolation.level": "read_committed"},
    )
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
        deadline = time.monotonic() + STALL_S
        while assigned:
            messages = consumer.consume(5000, timeout=0.5)
            if messages:
                deadline = time.monotonic() + STALL_S  # a big topic takes long; a stall fails
            for message in messages:
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
                after = None if event["op"] == "d" else event["after"]
                yield TargetRecord(event["key"], after, message.offset() or 0)
            positions = consumer.position(assigned)
            # Transaction markers take offsets too: done once past each start-time end.
            if all(tp.offset >= ends[tp.partition] for tp in positions):
                break
            if time.monotonic() > deadline:
                raise LookupError(
                    f"could not read {topic} to its end: nothing read in {STALL_S:.0f} s "
                    "(a transaction left open?)"
                )
    finally:
        consumer.close()


def current_versions(
    history: DataFrame,
    silver: DataFrame,
    shape: RowShape,
    placeholder: Placeholder | None,
    null_updates: Collection[str],
) -> DataFrame:
    """The history's current versions (``__end_at`` null), on ``shape``'s columns.

    A current version holds its key's newest event's values, tracked and untracked alike
    (a change to untracked columns updates it in place; ``cdc_merger.history``), so it
    equals silver's row, but where that event did not send a value: the history stores
    the source's unavailable-value ``placeholder`` (for a type that can carry it) or an
    update's null in a ``null_updates`` column as sent, where silver keeps the prior value
    (docs/configuration.md, "History"). Such a value is replaced by silver's, so only
    what must hold is compared: every value the source sent. Only the rows holding one
    are joined with ``silver`` (any frame of silver's rows, by key).
    """
    key = [f.name for f in shape.key]
    current = history.where(F.col(END).isNull()).select(*[f"`{f.name}`" for f in shape.fields])
    unsent: dict[str, Column] = {}
    for f in shape.fields:
        if f.name in key:
            continue
        column = F.col(f"`{f.name}`")
        conditions = [] if f.name not in null_updates else [column.isNull()]
        spotted = None if placeholder is None else placeholder.matches(column, f.dataType)
        if spotted is not None:
            conditions.append(F.coalesce(spotted, F.lit(False)))
        if conditions:
            unsent[f.name] = reduce(Column.__or__, conditions)
    if not unsent:
        return current
    holds_one = reduce(Column.__or__, unsent.values())
    kept = {name: f"_cdc_silver_{i}" for i, name in enumerate(unsent)}
    prior = silver.select(
        *[f"`{k}`" for k in key], *[F.col(f"`{c}`").alias(a) for c, a in kept.items()]
    )
    filled = (
        current.where(holds_one)
        .join(prior, on=key, how="left")
        .select(
            *[
                F.when(unsent[f.name], F.col(kept[f.name]))
                .otherwise(F.col(f"`{f.name}`"))
                .alias(f.name)
                if f.name in unsent
                else F.col(f"`{f.name}`")
                for f in shape.fields
            ]
        )
    )
    return current.where(~holds_one).unionByName(filled)


def null_update_columns(entity: EntityConfig, columns: Iterable[str]) -> list[str]:
    """The ``columns`` whose null in an update the merger does not store (ignore_null_updates).

    ``EntityConfig.null_update_columns`` without its check of the names against the
    source's columns (done by the merger at start): silver may lack a named column.
    """
    listed = entity.ignore_null_updates
    return [c for c in columns if c not in entity.key and (listed is True or c in (listed or []))]


def compare_history(
    spark: SparkSession,
    config: PipelineConfig,
    entity: EntityConfig,
    shape: RowShape,
    silver: BucketSpill,
    examples: int = 5,
) -> TargetComparison:
    """The entity's history's current versions against silver (spilled as ``shape``).

    Compared on silver's columns the history carries (silver is spilled again on those
    when the history lacks some: a column the selection dropped after silver had it).
    One current version per key: a key with two is different, one silver lacks extra.
    """
    path = config.layout.history(entity.name)
    if not is_delta_table(spark, path):
        return TargetComparison(
            "history",
            path,
            error=f"history table {path} does not exist (merger not started with history on?)",
        )
    history = spark.read.format("delta").load(path)
    silver_path = config.layout.silver(entity.name)
    carried = shape.within(history.columns)
    folder = silver.folder.with_name("silver-history")
    try:
        if carried != shape:
            _, silver = spill_silver(
                spark, silver_path, entity, folder, silver.buckets, history.columns
            )
        current = current_versions(
            history,
            spark.read.format("delta").load(silver_path),
            carried,
            Placeholder.of(config.merger.unavailable_value_placeholder),
            null_update_columns(entity, [f.name for f in carried.fields]),
        )
        records = (
            TargetRecord(row, row, position)
            for position, row in enumerate(local_rows(current, silver.records))
        )
        return compare_target("history", path, carried, silver, records, examples, True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def history_off(config: PipelineConfig, entity: EntityConfig) -> TargetComparison:
    """The history target of an entity without history: skipped, nothing compared."""
    return TargetComparison(
        "history",
        config.layout.history(entity.name),
        skipped="history is off for this entity (entities[].history.enabled), nothing compared",
    )


# --- comparing -------------------------------------------------------------------------------


def compare_target(
    target: str,
    name: str,
    shape: RowShape,
    silver: BucketSpill,
    records: Iterable[TargetRecord],
    examples: int = 5,
    one_per_key: bool = False,
) -> TargetComparison:
    """Spill a target's records beside silver's and compare them bucket by bucket."""
    folder = silver.folder.with_name(target)
    try:
        spill = spill_target(records, shape, folder, silver.buckets, one_per_key)
        return _comparison(target, name, shape, compare_spills(silver, spill, examples))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def compare(
    target: str,
    name: str,
    shape: RowShape,
    expected: dict[Key, str],
    got: dict[Key, str],
    examples: int = 5,
    buckets: int | None = None,
) -> TargetComparison:
    """Keys missing from ``got``, extra in it, and with different hashes (maps in memory).

    The same bucket comparison as ``verify``, for maps small enough to hold.
    """
    with tempfile.TemporaryDirectory(prefix="cdc-verify-") as folder:
        count = buckets or bucket_count(len(expected))
        silver, spill = (
            BucketSpill(Path(folder) / "silver", count),
            BucketSpill(Path(folder) / target, count),
        )
        for side, hashes in ((silver, expected), (spill, got)):
            for position, (key, content) in enumerate(hashes.items()):
                side.add(key_text(key), content, position)
        return _comparison(target, name, shape, compare_spills(silver, spill, examples))


def _comparison(
    target: str, name: str, shape: RowShape, result: BucketComparison
) -> TargetComparison:
    """The report's form of a bucket comparison: example keys rendered."""
    shown = {kind: [shape.render(k) for k in keys] for kind, keys in result.examples.items()}
    return TargetComparison(
        target,
        name,
        result.rows,
        result.counts["missing"],
        result.counts["extra"],
        result.counts["different"],
        examples=shown,
        buckets=result.buckets,
        buckets_differing=result.buckets_differing,
    )


def verify(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    *,
    targets: tuple[str, ...] | None = None,
    examples: int = 5,
    buckets: int | None = None,
    spark: SparkSession | None = None,
) -> VerifyReport:
    """Compare silver with each target for the selected entities (default: all).

    ``targets``: those to compare (default: every target each entity has). ``history``
    is a target of the entities with ``history.enabled`` only: asked for by name, it is
    skipped for the others, and reported so (``TargetComparison.skipped``).

    ``buckets``: N key buckets per entity; by default one per ``ROWS_PER_BUCKET`` rows
    of silver.
    """
    asked = targets is not None
    targets = TARGETS if targets is None else targets
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {TARGETS}")
    if buckets is not None and buckets < 1:
        raise ValueError(f"buckets must be 1 or more, not {buckets}")
    entities = config.select_entities(entity_names)
    spark = spark or build_spark_session(config.spark, "cdc-verify")
    results = []
    for entity in entities:
        path = config.layout.silver(entity.name)
        if not is_delta_table(spark, path):
            results.append(EntityVerification(entity.name, None, ()))
            continue
        with tempfile.TemporaryDirectory(prefix=f"cdc-verify-{entity.name}-") as folder:
            shape, silver = spill_silver(spark, path, entity, Path(folder) / "silver", buckets)
            comparisons = []
            for target in targets:
                if target == "history":
                    if entity.history.enabled:
                        comparisons.append(
                            compare_history(spark, config, entity, shape, silver, examples)
                        )
                    elif asked:
                        comparisons.append(history_off(config, entity))
                    continue
                if target == "elasticsearch":
                    name, records = entity.es_index_name, es_records(config, entity)
                else:
                    name, records = entity.change_topic_name, change_topic_records(config, entity)
                try:
                    comparison = compare_target(target, name, shape, silver, records, examples)
                except (LookupError, KafkaException, ApiError, TransportError) as exc:
                    comparison = TargetComparison(target, name, error=str(exc))
                comparisons.append(comparison)
        results.append(EntityVerification(entity.name, silver.records, tuple(comparisons)))
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
            if t.skipped is not None:
                lines.append(f"{label}: SKIPPED, {t.skipped}")
                continue
            verdict = "agrees" if t.ok else "DIFFERS"
            lines.append(
                f"{label}: {t.rows:,} keys, {verdict} "
                f"(missing {t.missing}, extra {t.extra}, different {t.different}; "
                f"{t.buckets_differing:,} of {t.buckets:,} buckets differ)"
            )
            for kind, keys in t.examples.items():
                lines.append(f"      {kind}: {'; '.join(keys)}")
    lines.append(_verdict(report))
    return "\n".join(lines)


def _verdict(report: VerifyReport) -> str:
    """The report's last line: agreement only of what was compared."""
    if not all(e.ok for e in report.entities):
        return "differences found"
    if report.skipped and not report.compared:
        return "nothing compared: every target asked for was skipped"
    if report.skipped:
        return f"all compared targets agree with silver ({report.skipped} skipped, not compared)"
    return "all targets agree with silver"
