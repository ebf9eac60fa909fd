"""Debezium records as Kafka Connect's ``JsonConverter`` writes them, and back.

The workload generator writes JSON topics with :class:`JsonEncoder`; the oracle reads
them with :func:`decode_connect_json`. Both follow the converter, not the ingestor:
dates as days since 1970, timestamps as epoch milliseconds or microseconds, bytes as
base64, and decimals per Debezium's ``decimal.handling.mode`` (``precise``: base64 of
the unscaled big-endian two's-complement value; ``string``: the number as text;
``double``: a JSON number). With ``schemas.enable=true`` a record is
``{"schema": <Connect schema>, "payload": <value>}``.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Literal

import fastavro
from cdc_shared.avro import KnownSchema
from cdc_shared.config.entities import DecimalHandling

#: ``plain``: schemas.enable=false; ``schemas``: =true; ``mixed``: alternately, per record.
JsonForm = Literal["plain", "schemas", "mixed"]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_CONNECT_TYPES = {
    "int": "int32",
    "long": "int64",
    "float": "float",
    "double": "double",
    "boolean": "boolean",
    "string": "string",
    "bytes": "bytes",
    "fixed": "bytes",
    "enum": "string",
}


def expanded(schema: KnownSchema | Mapping[str, Any]) -> Any:
    """The schema with every named type written out where it is used."""
    definition = schema.definition if isinstance(schema, KnownSchema) else schema
    return fastavro.parse_schema(dict(definition), expand=True)


def _typed(avro: Any) -> tuple[Any, str, str | None, bool]:
    """(the type, its kind, its logical type, whether null was allowed) of an Avro type.

    A union is read as its one non-null branch (Connect JSON has no other unions).
    """
    optional = isinstance(avro, list) and "null" in avro
    if isinstance(avro, list):
        avro = next(b for b in avro if b != "null")
    kind = avro if isinstance(avro, str) else avro["type"]
    logical = avro.get("logicalType") if isinstance(avro, dict) else None
    return avro, kind, logical, optional


def to_connect(datum: Any, avro: Any, decimals: DecimalHandling) -> Any:
    """A datum fastavro would write with ``avro``, as JSON-ready Connect values."""
    if datum is None:
        return None
    avro, kind, logical, _ = _typed(avro)
    if kind == "record":
        return {
            f["name"]: to_connect(datum.get(f["name"]), f["type"], decimals) for f in avro["fields"]
        }
    if kind == "array":
        return [to_connect(item, avro["items"], decimals) for item in datum]
    if kind == "map":
        return {k: to_connect(v, avro["values"], decimals) for k, v in datum.items()}
    if logical == "decimal":
        value = Decimal(datum).quantize(Decimal(1).scaleb(-int(avro.get("scale", 0))))
        if decimals == "string":
            return format(value, "f")
        if decimals == "double":
            return float(value)
        unscaled = int(value.scaleb(int(avro.get("scale", 0))))
        size = unscaled.bit_length() // 8 + 1  # Java's BigInteger.toByteArray length
        return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()
    if logical == "date":
        return (datum - _EPOCH.date()).days
    if logical in ("timestamp-millis", "timestamp-micros"):
        micros = 1000 if logical == "timestamp-millis" else 1
        return (datum - _EPOCH) // dt.timedelta(microseconds=micros)
    if kind in ("bytes", "fixed"):
        return base64.b64encode(datum).decode()
    return datum


def from_connect(value: Any, avro: Any, decimals: DecimalHandling) -> Any:
    """Connect JSON values -> the datum fastavro would read with ``avro``."""
    if value is None:
        return None
    avro, kind, logical, _ = _typed(avro)
    if kind == "record":
        return {
            f["name"]: from_connect(value.get(f["name"]), f["type"], decimals)
            for f in avro["fields"]
        }
    if kind == "array":
        return [from_connect(item, avro["items"], decimals) for item in value]
    if kind == "map":
        return {k: from_connect(v, avro["values"], decimals) for k, v in value.items()}
    if logical == "decimal":
        scale = int(avro.get("scale", 0))
        if decimals == "precise":
            unscaled = int.from_bytes(base64.b64decode(value, validate=True), "big", signed=True)
            return Decimal(unscaled).scaleb(-scale)
        return Decimal(str(value)).quantize(Decimal(1).scaleb(-scale))
    if logical == "date":
        return _EPOCH.date() + dt.timedelta(days=int(value))
    if logical == "timestamp-millis":
        return _EPOCH + dt.timedelta(milliseconds=int(value))
    if logical == "timestamp-micros":
        return _EPOCH + dt.timedelta(microseconds=int(value))
    if kind in ("bytes", "fixed"):
        return base64.b64decode(value, validate=True)
    if kind in ("int", "long") and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{value!r} is not an integer")
    return value


def connect_schema(
    avro: Any, decimals: DecimalHandling, field: str | None = None
) -> dict[str, Any]:
    """The Connect schema ``JsonConverter`` embeds for ``avro`` (schemas.enable=true)."""
    avro, kind, logical, optional = _typed(avro)
    schema: dict[str, Any]
    if kind == "record":
        schema = {
            "type": "struct",
            "fields": [connect_schema(f["type"], decimals, f["name"]) for f in avro["fields"]],
            "name": avro["name"],
        }
    elif kind == "array":
        schema = {"type": "array", "items": connect_schema(avro["items"], decimals)}
    elif kind == "map":
        schema = {
            "type": "map",
            "keys": {"type": "string", "optional": False},
            "values": connect_schema(avro["values"], decimals),
        }
    elif logical == "decimal" and decimals == "precise":
        schema = {
            "type": "bytes",
            "name": "org.apache.kafka.connect.data.Decimal",
            "version": 1,
            "parameters": {
                "scale": str(avro.get("scale", 0)),
                "connect.decimal.precision": str(avro["precision"]),
            },
        }
    elif logical == "decimal":
        schema = {"type": "string" if decimals == "string" else "double"}
    elif logical == "date":
        schema = {"type": "int32", "name": "org.apache.kafka.connect.data.Date", "version": 1}
    elif logical == "timestamp-millis":
        schema = {"type": "int64", "name": "org.apache.kafka.connect.data.Timestamp", "version": 1}
    elif logical == "timestamp-micros":
        schema = {"type": "int64", "name": "io.debezium.time.MicroTimestamp", "version": 1}
    else:
        schema = {"type": _CONNECT_TYPES[kind]}
    schema["optional"] = optional
    if field is not None:
        schema["field"] = field
    return schema


class JsonEncoder:
    """Writes records of one schema as ``JsonConverter`` does (the generator's JSON encoder).

    ``form`` picks schemas.enable: ``mixed`` alternates record by record.
    """

    def __init__(self, schema: KnownSchema, decimals: DecimalHandling, form: JsonForm) -> None:
        self.schema = schema
        self.decimals = decimals
        self.form = form
        self._avro = expanded(schema)
        self._connect = connect_schema(self._avro, decimals)
        self._written = 0

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """The record's JSON bytes."""
        payload = to_connect(record, self._avro, self.decimals)
        self._written += 1
        wrapped = self.form == "schemas" or (self.form == "mixed" and self._written % 2 == 0)
        document = {"schema": self._connect, "payload": payload} if wrapped else payload
        return json.dumps(document, separators=(",", ":")).encode()


def decode_connect_json(data: bytes, avro: Any, decimals: DecimalHandling) -> Any:
    """One ``JsonConverter`` record (either form) -> the datum fastavro would give.

    Raises ValueError for what is not a record of ``avro`` (the oracle counts it as poison).
    """
    document = json.loads(data)
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if isinstance(document.get("schema"), dict):
        if document.get("payload") is None:
            raise ValueError("a schema but no payload")
        document = document["payload"]
    datum = from_connect(document, avro, decimals)
    fastavro.validation.validate(datum, avro, raise_errors=True)
    return datum
