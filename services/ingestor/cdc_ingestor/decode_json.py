"""Decoding Debezium JSON (Kafka Connect's ``JsonConverter``) in the JVM.

A JSON record is read against the entity's Avro reader schema, so JSON and Avro records
of an entity land in the same bronze columns. Both forms of the converter are accepted,
record by record: ``schemas.enable=false`` (the plain envelope) and ``=true``
(``{"schema": ..., "payload": <envelope>}``). The embedded schema is not used: the
reader schema is the pinned or registered ``.avsc``, as for Avro.

Spark's ``from_json`` parses each record into the JSON shape of the reader schema (the
types Connect writes: dates as days, timestamps as epoch numbers, decimals and bytes as
strings) and ``JsonPart.decoded`` turns that into the types ``from_avro`` would give.
Decimals follow Debezium's ``decimal.handling.mode``: ``precise`` writes the base64 of
the unscaled big-endian two's-complement value (``"BOI="`` is 1250, 12.50 at scale 2);
``string`` and ``double`` write the number as text or as a JSON number.

A record that is not a JSON object (``malformed_json``), has a ``schema`` but no
``payload`` (``missing_payload``), or holds a value that does not parse as its field's
type or lacks a required field (``wrong_type``) goes to quarantine with a message naming
what is wrong; nothing stops the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fastavro
from cdc_shared.avro import KnownSchema
from cdc_shared.config.entities import DecimalHandling
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

CORRUPT_RECORD = "_corrupt_record"
#: The two fields of ``JsonConverter``'s ``schemas.enable=true`` form.
WRAPPER_FIELDS = ("schema", "payload")
#: Every ``error_kind`` a JSON record may get (besides ``truncated`` and ``null_key``).
JSON_ERROR_KINDS = ("malformed_json", "missing_payload", "wrong_type")


class UnsupportedJsonSchemaError(ValueError):
    """The reader schema has a type whose JSON form this decoder cannot read."""


@dataclass(frozen=True)
class Shape:
    """How one Avro type looks in Connect's JSON, and how to turn it into Spark's type.

    ``json_type`` is what ``from_json`` parses; ``convert`` maps a parsed column to the
    type ``from_avro`` gives (None: no change); ``required`` says the Avro type has no
    null branch; ``fields`` are a record's fields, in order.
    """

    json_type: T.DataType
    convert: Callable[[Column], Column] | None = None
    required: bool = True
    fields: tuple[tuple[str, Shape], ...] = field(default=())
    label: str = ""
    #: For arrays and maps: whether an element does not convert (given the parsed column).
    bad_element: Callable[[Column], Column] | None = None

    def converted(self, column: Column) -> Column:
        """``column`` (parsed JSON) as the Spark type ``from_avro`` gives."""
        if self.fields:
            members = [shape.converted(column[name]).alias(name) for name, shape in self.fields]
            return F.when(column.isNull(), F.lit(None)).otherwise(F.struct(*members))
        return column if self.convert is None else self.convert(column)

    def problems(
        self, parsed: Column, converted: Column, path: str, present: Column
    ) -> Iterator[tuple[Column, str]]:
        """(condition, message) for each way a parsed value can break the reader schema.

        ``present``: the value's parent is there, so a required value must be too.
        """
        if self.required:
            yield present & parsed.isNull(), f"{path} is required but missing or null"
        if self.bad_element is not None:
            yield self.bad_element(parsed), f"an element of {path} does not parse as {self.label}"
        elif self.convert is not None:
            yield (
                parsed.isNotNull() & converted.isNull(),
                f"{path} does not parse as {self.label}",
            )
        here = present & parsed.isNotNull()
        for name, shape in self.fields:
            yield from shape.problems(parsed[name], converted[name], f"{path}.{name}", here)


def shape_of(schema: KnownSchema, decimals: DecimalHandling) -> Shape:
    """The JSON shape of a reader schema (a record: the Debezium envelope or key)."""
    expanded = fastavro.parse_schema(dict(schema.definition), expand=True)
    shape = _shape(expanded, decimals)
    if not shape.fields:
        raise UnsupportedJsonSchemaError(f"{schema.full_name} is not a record")
    clashing = [name for name, _ in shape.fields if name in WRAPPER_FIELDS]
    if clashing:
        raise UnsupportedJsonSchemaError(
            f"{schema.full_name} has a top-level field named {clashing[0]!r}: a JSON record "
            "of it could not be told from JsonConverter's schemas.enable=true form"
        )
    return shape


def _shape(avro: Any, decimals: DecimalHandling) -> Shape:
    """The JSON shape of one Avro type (a union, record, array, map, logical or plain type)."""
    if isinstance(avro, list):
        return _union_shape(avro, decimals)
    kind = avro if isinstance(avro, str) else avro["type"]
    logical = avro.get("logicalType") if isinstance(avro, dict) else None
    if kind in ("record", "array", "map"):
        return _container_shape(avro, kind, decimals)
    if logical is not None:
        shape = _logical_shape(avro, kind, logical, decimals)
        if shape is not None:
            return shape
    if kind in ("bytes", "fixed"):
        return Shape(
            T.StringType(), lambda c: F.try_to_binary(c, F.lit("base64")), label="base64 bytes"
        )
    primitive = {
        "boolean": T.BooleanType(),
        "int": T.IntegerType(),
        "long": T.LongType(),
        "float": T.FloatType(),
        "double": T.DoubleType(),
        "string": T.StringType(),
        "enum": T.StringType(),
    }
    if kind in primitive:
        return Shape(primitive[kind], label=kind)
    raise UnsupportedJsonSchemaError(f"Avro type {avro!r} has no Connect JSON form here")


def _union_shape(avro: list[Any], decimals: DecimalHandling) -> Shape:
    """A union with one non-null branch: that branch's shape, nullable when null is a branch."""
    branches = [b for b in avro if b != "null"]
    if len(branches) != 1:
        raise UnsupportedJsonSchemaError(
            f"union {avro} has more than one non-null branch; Connect JSON has no such type"
        )
    inner = _shape(branches[0], decimals)
    return Shape(
        inner.json_type,
        inner.convert,
        len(branches) == len(avro),
        inner.fields,
        inner.label,
        inner.bad_element,
    )


def _container_shape(avro: Any, kind: str, decimals: DecimalHandling) -> Shape:
    """A record, array or map: its JSON type, and how its fields or elements convert."""
    if kind == "record":
        fields = tuple((f["name"], _shape(f["type"], decimals)) for f in avro["fields"])
        record = T.StructType([T.StructField(name, shape.json_type) for name, shape in fields])
        return Shape(record, fields=fields, label="a record")
    if kind == "array":
        items = _shape(avro["items"], decimals)
        if items.convert is None and not items.fields:
            return Shape(T.ArrayType(items.json_type), label=f"an array of {items.label}")
        return Shape(
            T.ArrayType(items.json_type),
            lambda c: F.transform(c, items.converted),
            label=items.label,
            bad_element=lambda c: F.exists(c, lambda x: _unconvertible(items, x)),
        )
    if kind == "map":
        values = _shape(avro["values"], decimals)
        mapping = T.MapType(T.StringType(), values.json_type)
        if values.convert is None and not values.fields:
            return Shape(mapping, label=f"a map of {values.label}")
        return Shape(
            mapping,
            lambda c: F.transform_values(c, lambda _, v: values.converted(v)),
            label=values.label,
            bad_element=lambda c: F.exists(F.map_values(c), lambda v: _unconvertible(values, v)),
        )
    raise AssertionError(kind)


def _logical_shape(avro: Any, kind: str, logical: str, decimals: DecimalHandling) -> Shape | None:
    """A decimal, date or timestamp as Connect JSON carries it; None for another logical type."""
    if logical == "decimal":
        precision, scale = int(avro["precision"]), int(avro.get("scale", 0))
        target = T.DecimalType(precision, scale)
        if decimals == "precise":
            return Shape(
                T.StringType(),
                lambda c: _unscaled(F.try_to_binary(c, F.lit("base64")), scale, target),
                label=f"a base64 decimal({precision},{scale}) (decimal.handling.mode=precise)",
            )
        return Shape(
            T.StringType(), lambda c: c.try_cast(target), label=f"decimal({precision},{scale})"
        )
    if logical == "date" and kind == "int":
        return Shape(T.IntegerType(), F.date_from_unix_date, label="a date (days since 1970)")
    if logical in ("timestamp-millis", "timestamp-micros") and kind == "long":
        to_timestamp = F.timestamp_millis if logical == "timestamp-millis" else F.timestamp_micros
        return Shape(T.LongType(), to_timestamp, label=f"a {logical} number")
    if logical in ("local-timestamp-millis", "local-timestamp-micros") and kind == "long":
        to_timestamp = (
            F.timestamp_millis if logical == "local-timestamp-millis" else F.timestamp_micros
        )
        return Shape(
            T.LongType(),
            lambda c: to_timestamp(c).cast(T.TimestampNTZType()),
            label=f"a {logical} number",
        )
    return None


def _unconvertible(element: Shape, parsed: Column) -> Column:
    """Whether one parsed element of an array or map does not convert (records: unchecked)."""
    return parsed.isNotNull() & element.converted(parsed).isNull()


def _unscaled(raw: Column, scale: int, target: T.DecimalType) -> Column:
    """Big-endian two's-complement bytes -> the decimal with that unscaled value.

    Byte by byte, the first one signed; a value too long for 38 digits becomes null.
    """
    unscaled = F.aggregate(
        F.sequence(F.lit(1), F.octet_length(raw)),
        F.lit(0).cast(T.DecimalType(38, 0)),
        lambda total, i: F.try_add(
            F.try_multiply(total, F.lit(256)),
            F.when((i == 1) & (_byte(raw, i) >= 128), _byte(raw, i) - 256).otherwise(_byte(raw, i)),
        ).cast(T.DecimalType(38, 0)),
    )
    fits = F.octet_length(raw).between(1, 16)
    scaled = F.try_multiply(unscaled, F.lit(f"1e-{scale}").cast(T.DecimalType(scale + 1, scale)))
    return F.when(fits, scaled.try_cast(target))


def _byte(raw: Column, position: Column) -> Column:
    """The unsigned value of the byte at ``position`` (1-based) of ``raw``."""
    return F.conv(F.hex(F.substring(raw, position, F.lit(1))), 16, 10).cast("int")


@dataclass(frozen=True)
class JsonPart:
    """The value or key of an entity's records, in Connect JSON."""

    shape: Shape
    what: str  # "value" or "key"

    @classmethod
    def of(cls, schema: KnownSchema, decimals: DecimalHandling, what: str) -> JsonPart:
        """The part read with ``schema`` as its reader."""
        return cls(shape_of(schema, decimals), what)

    def parsed(self, raw: Column) -> Column:
        """The record parsed in both of JsonConverter's forms at once, and the raw text.

        A struct of the envelope's fields, ``schema`` and ``payload`` (the wrapped form)
        and ``_corrupt_record`` (set when the text is not what the shape can read).
        """
        body = self.shape.json_type
        assert isinstance(body, T.StructType)
        wrapper = T.StructType(
            [
                *body.fields,
                T.StructField("schema", T.StringType()),
                T.StructField("payload", body),
                T.StructField(CORRUPT_RECORD, T.StringType()),
            ]
        )
        return F.from_json(
            raw.cast("string"),
            wrapper,
            {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_RECORD},
        )

    def body(self, parsed: Column) -> Column:
        """The envelope of a parsed record: ``payload`` in the wrapped form, else the record."""
        plain = F.struct(*[parsed[name].alias(name) for name, _ in self.shape.fields])
        return F.when(parsed["schema"].isNotNull(), parsed["payload"]).otherwise(plain)

    def decoded(self, body: Column) -> Column:
        """The envelope in the types ``from_avro`` gives."""
        return self.shape.converted(body)

    def errors(
        self, raw: Column, parsed: Column, body: Column, decoded: Column
    ) -> list[tuple[Column, str, Column]]:
        """(condition, error kind, message) of every way the record can be refused, in order."""
        what = self.what
        text = raw.cast("string")
        corrupt = parsed[CORRUPT_RECORD]
        checks: list[tuple[Column, str, Column]] = [
            (F.length(raw) == 0, "truncated", F.lit(f"{what} is empty (0 bytes)")),
            (
                F.get_json_object(text, "$").isNull(),
                "malformed_json",
                F.concat(F.lit(f"{what} is not JSON: "), F.substring(text, 1, 80)),
            ),
            (
                parsed.isNull() | ~F.ltrim(text).startswith("{"),
                "malformed_json",
                F.concat(F.lit(f"{what} is JSON but not an object: "), F.substring(text, 1, 80)),
            ),
            (
                parsed["schema"].isNotNull() & parsed["payload"].isNull() & corrupt.isNull(),
                "missing_payload",
                F.lit(
                    f"{what} has a 'schema' but no 'payload' (JsonConverter with "
                    "schemas.enable=true writes both)"
                ),
            ),
            (
                corrupt.isNotNull(),
                "wrong_type",
                F.lit(
                    f"{what} has a field whose JSON type does not fit the reader schema "
                    "(e.g. a string where a number belongs)"
                ),
            ),
        ]
        checks += [
            (condition, "wrong_type", F.lit(f"{what}: {message}"))
            for name, shape in self.shape.fields
            for condition, message in shape.problems(
                body[name], decoded[name], name, body.isNotNull()
            )
        ]
        return checks
