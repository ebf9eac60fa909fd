"""Decoding a micro-batch of Kafka records in the JVM: each record's key, envelope and outcome.

Each record's framing header (Confluent id or single-object fingerprint) picks its writer
schema; Spark's ``from_avro`` decodes the payload after the header with that writer schema
and resolves it to the reader schema (``avroSchema``), in PERMISSIVE mode so a malformed
payload yields null instead of failing the batch. A record that cannot be decoded, or
breaks the contract, gets an ``error_kind`` and goes to quarantine with its raw bytes
(``projection``: bronze rows and quarantine rows).

Writer schemas the reader cannot resolve (``compatibility``: Avro's own check, in the JVM
that decodes) are not decoded at all: their records are quarantined as ``incompatible_schema``
with the reason, and a subject's newer version that cannot read the older ones never
becomes the reader (it would make every older record unreadable and bronze unmergeable).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from cdc_shared.avro import KnownSchema, SchemaRegistry
from cdc_shared.avro.framing import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC
from cdc_shared.clients.schemas import EntitySchemas
from cdc_shared.config.entities import DecimalHandling, EntityConfig, Format
from cdc_shared.contracts.replay_origin import BAD_REPLAY_HEADER, HEADERS_TYPE, replay_origin
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import from_avro

from cdc_ingestor.compatibility import incompatibility
from cdc_ingestor.decode_json import JSON_ERROR_KINDS, JsonPart, UnsupportedJsonSchemaError
from cdc_ingestor.framing_headers import (
    BatchHeaders,
    header,
    text_by_header,
    writer_label,
    writer_labels,
    writers_by_header,
)

KAFKA_SCHEMA = T.StructType(
    [
        T.StructField("key", T.BinaryType()),
        T.StructField("value", T.BinaryType()),
        T.StructField("topic", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("offset", T.LongType()),
        T.StructField("timestamp", T.TimestampType()),
        T.StructField("timestampType", T.IntegerType()),
    ]
)
#: ``sequence_by`` paths that are Kafka coordinates -> the column of where the change was
#: first read (a replayed record's original coordinates; see ``replay_origin``).
KAFKA_SEQUENCE_COLUMNS = {"kafka.partition": "_first_partition", "kafka.offset": "_first_offset"}
#: Schema fingerprint -> the Spark type ``from_avro`` gives for it.
_AVRO_TYPES: dict[bytes, T.DataType] = {}
#: (reader fingerprint, decimal handling, part) -> its checked JSON decoding.
_JSON_PARTS: dict[tuple[bytes, str, str], JsonPart] = {}


@dataclass(frozen=True)
class DecodePlan:
    """The writer schemas a batch may use (by framing header) and the reader schemas."""

    value_writers: Mapping[bytes, KnownSchema]
    key_writers: Mapping[bytes, KnownSchema]
    value_reader: KnownSchema
    key_reader: KnownSchema
    value_format: Format = "avro"
    key_format: Format = "avro"
    decimals: DecimalHandling = "precise"  # JSON decimals (decode_json)

    @classmethod
    def from_schemas(
        cls,
        schemas: EntitySchemas,
        registry: SchemaRegistry,
        value_reader: KnownSchema | None = None,
        entity: EntityConfig | None = None,
    ) -> DecodePlan:
        """Every known version of the entity's schemas, under each framing it may arrive in.

        The value reader is ``value_reader``, else the newest version; the formats are the
        entity's (Avro when no entity is given).
        """
        plan = cls(
            value_writers=writers_by_header(schemas.values),
            key_writers=writers_by_header((schemas.key,)),
            value_reader=value_reader or schemas.value,
            key_reader=schemas.key,
        )
        if entity is None:
            return plan
        return replace(
            plan,
            value_format=entity.value_format,
            key_format=entity.key_format,
            decimals=entity.decimal_handling,
        )

    @property
    def uses_avro(self) -> bool:
        """Whether the value or the key is Avro: only then do framing headers matter."""
        return "avro" in (self.value_format, self.key_format)

    def with_writers(self, value: list[KnownSchema], key: list[KnownSchema]) -> DecodePlan:
        """A copy of the plan with writer schemas found later in the registry."""
        return replace(
            self,
            value_writers={**self.value_writers, **writers_by_header(value)},
            key_writers={**self.key_writers, **writers_by_header(key)},
        )

    def narrowed(self, headers: BatchHeaders) -> DecodePlan:
        """A copy of the plan with only the writers whose headers a batch uses.

        A record's outcome depends on its own header's writer alone, so the batch decodes
        as with the whole plan; but the decoding expression, built and analysed on the
        driver for every batch, then grows with the schemas the batch uses rather than with
        every schema the registry lists (a file registry lists every table's).
        """
        values, keys = headers
        return replace(
            self,
            value_writers={h: s for h, s in self.value_writers.items() if h in values},
            key_writers={h: s for h, s in self.key_writers.items() if h in keys},
        )

    def incompatible(self, spark: SparkSession, part: Literal["value", "key"]) -> dict[bytes, str]:
        """Header -> why its writer cannot be read as the reader, for ``part`` (value, key)."""
        writers, reader = (
            (self.value_writers, self.value_reader)
            if part == "value"
            else (self.key_writers, self.key_reader)
        )
        reasons: dict[bytes, str] = {}
        for prefix, writer in writers.items():
            why = incompatibility(spark, reader, writer)
            if why is not None:
                version = f" v{reader.version}" if reader.version else ""
                reasons[prefix] = (
                    f"writer schema {writer_label(prefix, writer)} ({writer.full_name}) cannot be "
                    f"resolved to the reader schema fingerprint:{reader.fingerprint.hex()} "
                    f"({reader.full_name}{version}): {why}"
                )
        return reasons


def _decoded(
    column: Column,
    head: Column,
    writers: Mapping[bytes, KnownSchema],
    reader: KnownSchema,
    reader_type: T.DataType,
    incompatible: Mapping[bytes, str],
) -> Column:
    options = {"mode": "PERMISSIVE", "avroSchema": reader.json()}
    decoded: Column | None = None
    for prefix, writer in writers.items():
        if prefix in incompatible:
            continue  # quarantined with the reason; from_avro would only say null
        payload = column.substr(F.lit(len(prefix) + 1), F.length(column))
        branch = from_avro(payload, writer.json(), options)
        decoded = (
            F.when(head == F.lit(prefix), branch)
            if decoded is None
            else decoded.when(head == F.lit(prefix), branch)
        )
    return decoded if decoded is not None else F.lit(None).cast(reader_type)


def avro_type(spark: SparkSession, schema: KnownSchema) -> T.DataType:
    """The Spark type ``from_avro`` gives for ``schema`` (asked once per schema).

    Asking means analysing a plan on the driver: every batch decodes, so it is cached.
    """
    if schema.fingerprint not in _AVRO_TYPES:
        probe = spark.range(0).select(
            from_avro(F.lit(None).cast("binary"), schema.json()).alias("v")
        )
        _AVRO_TYPES[schema.fingerprint] = probe.schema["v"].dataType
    return _AVRO_TYPES[schema.fingerprint]


def json_part(
    spark: SparkSession, reader: KnownSchema, decimals: DecimalHandling, part: str
) -> JsonPart:
    """The JSON decoding of ``part`` with ``reader``, checked once to give Avro's types.

    UnsupportedJsonSchemaError when JSON would decode to other types than ``from_avro``.
    """
    key = (reader.fingerprint, decimals, part)
    if key not in _JSON_PARTS:
        json = JsonPart.of(reader, decimals, part)
        nothing = F.lit(None).cast("binary")
        probe = spark.range(0).select(json.decoded(json.body(json.parsed(nothing))).alias("v"))
        decoded_type, reader_type = probe.schema["v"].dataType, avro_type(spark, reader)
        if _nullable(decoded_type) != _nullable(reader_type):
            raise UnsupportedJsonSchemaError(
                f"{reader.full_name}: JSON decodes to {decoded_type.simpleString()}, not to "
                f"{reader_type.simpleString()} as Avro does"
            )
        _JSON_PARTS[key] = json
    return _JSON_PARTS[key]


def _decoded_ok(decoded: Column, decoded_type: T.DataType) -> Column:
    """Whether a datum decoded: set, with every field its schema requires set.

    ``from_avro`` in PERMISSIVE mode turns a malformed datum into a struct of nulls.
    """
    required = (
        [f.name for f in decoded_type.fields if not f.nullable]
        if isinstance(decoded_type, T.StructType)
        else []
    )
    ok = decoded.isNotNull()
    for name in required:
        ok = ok & decoded[name].isNotNull()
    return ok


#: Every ``error_kind`` that ``decode`` gives a record that does not go to bronze.
ERROR_KINDS = (
    "truncated",
    "unknown_framing",
    "unknown_schema",
    "incompatible_schema",
    "corrupt",
    "null_key",
    *JSON_ERROR_KINDS,
    BAD_REPLAY_HEADER,
)


def _framing_errors(
    column: Column,
    head: Column,
    writer: Column,
    incompatible: Column,
    decoded_ok: Column,
    what: str,
) -> list[tuple[Column, str, Column]]:
    framed = (F.substring(column, 1, 1) == F.lit(CONFLUENT_MAGIC)) | (
        F.substring(column, 1, 2) == F.lit(SINGLE_OBJECT_MAGIC)
    )
    return [
        (F.length(column) == 0, "truncated", F.lit(f"{what} is empty (0 bytes)")),
        (
            head.isNull() & framed,
            "truncated",
            F.concat(
                F.lit(f"{what} of "),
                F.length(column).cast("string"),
                F.lit(" bytes is shorter than its framing header"),
            ),
        ),
        (
            head.isNull(),
            "unknown_framing",
            F.concat(
                F.lit(f"{what} starts with "),
                F.hex(F.substring(column, 1, 2)),
                F.lit(": neither Confluent (00) nor Avro single-object (C301) framing"),
            ),
        ),
        (
            writer.isNull(),
            "unknown_schema",
            F.concat(F.lit(f"no writer schema is known for the {what} header "), F.hex(head)),
        ),
        (
            incompatible.isNotNull(),
            "incompatible_schema",
            F.concat(F.lit(f"{what} "), incompatible),
        ),
        (
            ~decoded_ok,
            "corrupt",
            F.concat(
                F.lit(f"{what} payload is not a valid datum of its writer schema ("),
                writer,
                F.lit("); from_avro returned null"),
            ),
        ),
    ]


#: The columns ``decode`` gives each part: (decoded, framing header, writer schema label).
_PART_COLUMNS = {
    "value": ("envelope", "value_header", "writer_schema"),
    "key": ("decoded_key", "key_header", "key_writer_schema"),
}
Check = tuple[Column, str, Column]  # (condition, error kind, message)


def decode(
    spark: SparkSession, raw: DataFrame, plan: DecodePlan, sequence_by: list[str]
) -> DataFrame:
    """Kafka records -> coordinates, raw bytes, decoded key and envelope, sequence, error.

    Each part (value, key) is decoded in its own format (Avro or JSON) into the types of
    its reader schema, so bronze looks the same whatever the topic carries. The Kafka
    coordinates in the sequence are where the change was first read: a replayed record's
    come from its ``cdc.replay.of`` header (``replay_origin``). ``raw`` without a
    ``headers`` column (``includeHeaders`` off) holds no replays.

    The decoding's columns are built once per plan (:func:`decoding`) and applied to each
    batch as a few selects: built anew, they cost a thousand Py4J calls per table and
    batch (docs/benchmarks.md).
    """
    for columns in decoding(spark, plan, tuple(sequence_by), "headers" in raw.columns):
        raw = raw.select(*columns)
    return raw


#: The decodings built so far, by what they depend on (see ``decoding``).
_DECODINGS: dict[tuple[object, ...], tuple[tuple[Column, ...], ...]] = {}


def decoding(
    spark: SparkSession, plan: DecodePlan, sequence_by: tuple[str, ...], with_headers: bool
) -> tuple[tuple[Column, ...], ...]:
    """The selects that decode a batch of Kafka records under ``plan`` (built once).

    Each select's columns name only the Kafka source's columns and those of the selects
    before it, so they apply to any batch: each batch only analyses them again.
    """
    key = (
        frozenset(plan.value_writers),
        frozenset(plan.key_writers),
        plan.value_reader.fingerprint,
        plan.key_reader.fingerprint,
        plan.value_format,
        plan.key_format,
        plan.decimals,
        sequence_by,
        with_headers,
    )
    if key not in _DECODINGS:
        _DECODINGS[key] = _build_decoding(spark, plan, list(sequence_by), with_headers)
    return _DECODINGS[key]


def _build_decoding(
    spark: SparkSession, plan: DecodePlan, sequence_by: list[str], with_headers: bool
) -> tuple[tuple[Column, ...], ...]:
    headers = F.col("headers") if with_headers else F.lit(None).cast(HEADERS_TYPE)
    steps = _Steps(
        [
            F.col("topic").alias("kafka_topic"),
            F.col("partition").alias("kafka_partition"),
            F.col("offset").alias("kafka_offset"),
            F.col("timestamp").alias("kafka_timestamp"),
            F.col("key").alias("raw_key"),
            F.col("value").alias("raw_value"),
            headers.alias("_headers"),
        ],
        [
            "kafka_topic",
            "kafka_partition",
            "kafka_offset",
            "kafka_timestamp",
            "raw_key",
            "raw_value",
            "_headers",
        ],
    )
    origin = replay_origin(
        F.col("_headers"), F.col("kafka_topic"), F.col("kafka_partition"), F.col("kafka_offset")
    )
    steps.add({"_first_partition": origin.partition, "_first_offset": origin.offset})
    value_checks, _ = _decode_part(spark, steps, plan, "value")
    key_checks, key_type = _decode_part(spark, steps, plan, "key")
    value, key = F.col("raw_value"), F.col("raw_key")
    checks = [
        (value.isNotNull() & condition, kind, message) for condition, kind, message in value_checks
    ]
    is_truncate = F.coalesce(F.col("envelope.op") == F.lit("t"), F.lit(False))
    checks.append(
        (
            key.isNull() & ~is_truncate,
            "null_key",
            F.lit("message has no key; only truncate events may omit it"),
        )
    )
    checks += [
        (key.isNotNull() & condition, kind, message) for condition, kind, message in key_checks
    ]
    assert isinstance(key_type, T.StructType)
    for field in key_type.fields:
        checks.append(
            (
                key.isNotNull() & F.col(f"decoded_key.{field.name}").isNull(),
                "null_key",
                F.lit(f"key field {field.name} is null"),
            )
        )
    # Last: a replayed record that still fails is quarantined for that, to be replayed again.
    checks += origin.checks
    kind: Column | None = None
    message: Column | None = None
    for condition, name, text in checks:
        kind = F.when(condition, F.lit(name)) if kind is None else kind.when(condition, F.lit(name))
        message = F.when(condition, text) if message is None else message.when(condition, text)
    assert kind is not None and message is not None
    sequence = F.array(
        *[
            F.col(KAFKA_SEQUENCE_COLUMNS[path]).cast("long")
            if path in KAFKA_SEQUENCE_COLUMNS
            else F.col(f"envelope.{path}").cast("long")
            for path in sequence_by
        ]
    )
    kept = [c for c in steps.names if not c.startswith("_")]
    final = [*kept, "error_kind", "error_message", "sequence"]
    steps.stages.append(
        (
            *[F.col(c) for c in kept],
            kind.alias("error_kind"),
            message.alias("error_message"),
            sequence.alias("sequence"),
        )
    )
    # Decode once per row and pass: the optimizer would otherwise inline the decoding into
    # both a filter and the projection above it. A generator is a barrier it keeps.
    row = F.explode(F.array(F.struct(*[F.col(c) for c in final]))).alias("_row")
    steps.stages.append((row,))
    steps.stages.append((F.col("_row.*"),))
    return tuple(steps.stages)


class _Steps:
    """The selects of a decoding, built one after the other, and the columns they give."""

    def __init__(self, first: list[Column], names: list[str]) -> None:
        self.stages: list[tuple[Column, ...]] = [tuple(first)]
        self.names = list(names)

    def add(self, columns: Mapping[str, Column]) -> None:
        """A select keeping every column so far and adding ``columns`` (new names)."""
        self.stages.append((F.col("*"), *[c.alias(n) for n, c in columns.items()]))
        self.names += list(columns)


def _nullable(data_type: T.DataType) -> T.DataType:
    """``data_type`` with every field, element and value nullable (to compare shapes)."""
    if isinstance(data_type, T.StructType):
        return T.StructType([T.StructField(f.name, _nullable(f.dataType)) for f in data_type])
    if isinstance(data_type, T.ArrayType):
        return T.ArrayType(_nullable(data_type.elementType))
    if isinstance(data_type, T.MapType):
        return T.MapType(data_type.keyType, _nullable(data_type.valueType))
    return data_type


def _decode_part(
    spark: SparkSession, steps: _Steps, plan: DecodePlan, part: Literal["value", "key"]
) -> tuple[list[Check], T.DataType]:
    """Add the part's decoded, header and writer columns to ``steps``; its checks, its type.

    Helper columns start with ``_``; ``decode`` drops them.
    """
    decoded_name, header_name, writer_name = _PART_COLUMNS[part]
    raw = F.col(f"raw_{part}")
    reader = plan.value_reader if part == "value" else plan.key_reader
    reader_type = avro_type(spark, reader)
    if (plan.value_format if part == "value" else plan.key_format) == "json":
        json = json_part(spark, reader, plan.decimals, part)
        parsed_name, body_name = f"_{part}_parsed", f"_{part}_body"
        steps.add({parsed_name: json.parsed(raw)})
        steps.add({body_name: json.body(F.col(parsed_name))})
        steps.add(
            {
                decoded_name: json.decoded(F.col(body_name)),
                header_name: F.lit(None).cast("binary"),
                writer_name: F.lit("json"),
            }
        )
        checks = json.errors(raw, F.col(parsed_name), F.col(body_name), F.col(decoded_name))
        return checks, reader_type
    writers = plan.value_writers if part == "value" else plan.key_writers
    incompatible = plan.incompatible(spark, part)
    head = header(raw)
    steps.add(
        {
            header_name: head,
            writer_name: writer_labels(head, writers),
            decoded_name: _decoded(raw, head, writers, reader, reader_type, incompatible),
        }
    )
    checks = _framing_errors(
        raw,
        F.col(header_name),
        F.col(writer_name),
        text_by_header(F.col(header_name), incompatible),
        _decoded_ok(F.col(decoded_name), reader_type),
        part,
    )
    return checks, reader_type


def check_sequence_paths(spark: SparkSession, entity: EntityConfig, plan: DecodePlan) -> None:
    """Fail at start, naming the entity, when a ``sequence_by`` path is not an integer column."""
    value_type = avro_type(spark, plan.value_reader)
    for path in entity.sequence_by:
        if path in KAFKA_SEQUENCE_COLUMNS:
            continue
        current: T.DataType = value_type
        for part in path.split("."):
            if not isinstance(current, T.StructType) or part not in current.fieldNames():
                raise ValueError(
                    f"entity {entity.name!r}: sequence_by path {path!r} is not a field of "
                    f"{plan.value_reader.full_name}"
                )
            current = current[part].dataType
        if not isinstance(current, T.IntegralType):
            raise ValueError(
                f"entity {entity.name!r}: sequence_by path {path!r} is {current.simpleString()}, "
                "but sequences must be integers (e.g. source.lsn, source.ts_ms)"
            )
