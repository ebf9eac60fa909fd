"""Encode and decode framed Avro messages, one at a time or in batches.

Decoding reads the framing header, finds the writer schema in the registry, and
resolves writer -> reader (fastavro), so producers may evolve schemas compatibly. A
batch is grouped by header first: each writer schema is looked up, and its resolution
to the reader prepared, once per batch rather than once per record.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fastavro
import pyarrow as pa
from fastavro.read import SchemaResolutionError
from fastavro.validation import ValidationError, validate

from cdc_shared.avro.errors import (
    AvroSerdeError,
    CorruptPayloadError,
    IncompatibleSchemaError,
    NullKeyError,
    SchemaTypeError,
    TruncatedPayloadError,
)
from cdc_shared.avro.framing import read_header
from cdc_shared.avro.registry import KnownSchema, SchemaRegistry


class AvroEncoder:
    """Writes records with one writer schema, framed as its registry frames them."""

    def __init__(self, schema: KnownSchema) -> None:
        self.schema = schema
        self._header = schema.header

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """Frame and encode ``record``; SchemaTypeError names the offending field."""
        buffer = io.BytesIO()
        buffer.write(self._header)
        try:
            fastavro.schemaless_writer(
                buffer, self.schema.parsed, record, strict_allow_default=True
            )
        except Exception as exc:
            raise SchemaTypeError(self._explain(record, exc)) from None
        return buffer.getvalue()

    def _explain(self, record: Mapping[str, Any], exc: Exception) -> str:
        try:
            validate(record, self.schema.parsed, raise_errors=True, strict=True)
        except ValidationError as invalid:
            details = "; ".join(str(e) for e in invalid.errors)
            return f"record does not match {self.schema.full_name}: {details}"
        except Exception:  # validation itself choked: fall back to the writer's message
            pass
        return f"record does not match {self.schema.full_name}: {exc}"


@dataclass
class DecodedBatch:
    """Decoded records in input order; ``None`` where the input was a tombstone or failed.

    ``errors`` maps an input position to its typed error; positions absent from it and
    holding ``None`` were tombstones (null values).
    """

    records: list[dict[str, Any] | None]
    errors: dict[int, AvroSerdeError] = field(default_factory=dict)
    writers: dict[int, KnownSchema] = field(default_factory=dict)  # position -> writer

    @property
    def ok_count(self) -> int:
        """Records decoded successfully (tombstones excluded)."""
        return sum(1 for r in self.records if r is not None)


class AvroDecoder:
    """Reads framed messages into dicts shaped by ``reader`` (default: the writer schema).

    ``is_key`` makes a null message an error (a key is required); for values a null
    message is a tombstone and decodes to ``None``.
    """

    def __init__(
        self, registry: SchemaRegistry, reader: KnownSchema | None = None, *, is_key: bool = False
    ) -> None:
        self.registry = registry
        self.reader = reader
        self.is_key = is_key

    def decode(self, data: bytes | None) -> dict[str, Any] | None:
        """Decode one message; raises a typed AvroSerdeError on any failure."""
        if data is None:
            if self.is_key:
                raise NullKeyError("message has no key, but the entity's key is required")
            return None
        header = read_header(data)
        writer = self.registry.resolve(header)
        return self._read(data, header.size, writer, self._reader_for(writer))

    def decode_batch(self, messages: Sequence[bytes | None] | pa.Array) -> DecodedBatch:
        """Decode many messages; failures are collected per position, never raised."""
        values: Sequence[bytes | None] = (
            messages.to_pylist() if isinstance(messages, pa.Array) else messages
        )
        batch = DecodedBatch(records=[None] * len(values))
        groups: dict[bytes, list[int]] = {}
        for position, data in enumerate(values):
            if data is None:
                if self.is_key:
                    batch.errors[position] = NullKeyError("message has no key")
                continue
            prefix = bytes(data[:10]) if data[:1] != b"\x00" else bytes(data[:5])
            groups.setdefault(prefix, []).append(position)
        for prefix, positions in groups.items():
            try:
                header = read_header(values[positions[0]] or prefix)
                writer = self.registry.resolve(header)
            except AvroSerdeError as exc:
                for position in positions:
                    batch.errors[position] = exc
                continue
            self._decode_group(batch, values, positions, header.size, writer)
        return batch

    def _decode_group(
        self,
        batch: DecodedBatch,
        values: Sequence[bytes | None],
        positions: list[int],
        offset: int,
        writer: KnownSchema,
    ) -> None:
        """The hot loop: one writer schema; a failure is re-read by ``_read`` to classify it."""
        read, parsed, reader = fastavro.schemaless_reader, writer.parsed, self._reader_for(writer)
        records, writers = batch.records, batch.writers
        for position in positions:
            data = values[position]
            assert data is not None
            stream = io.BytesIO(data)
            stream.seek(offset)
            try:
                record = read(stream, parsed, reader)
            except Exception:
                record = None
            if isinstance(record, dict) and stream.tell() == len(data):
                records[position] = record
                writers[position] = writer
                continue
            try:
                self._read(data, offset, writer, reader)
            except AvroSerdeError as exc:
                batch.errors[position] = exc
            else:  # pragma: no cover - the fast path and _read disagree
                raise AssertionError("a datum failed once and decoded the second time")

    def _reader_for(self, writer: KnownSchema) -> Any:
        if self.reader is None or self.reader.fingerprint == writer.fingerprint:
            return None  # same schema: no resolution needed
        return self.reader.parsed

    @staticmethod
    def _read(data: bytes, offset: int, writer: KnownSchema, reader: Any) -> dict[str, Any]:
        stream = io.BytesIO(data)
        stream.seek(offset)
        try:
            record = fastavro.schemaless_reader(stream, writer.parsed, reader)
        except SchemaResolutionError as exc:
            raise IncompatibleSchemaError(
                f"writer schema {writer.full_name} ({writer.fingerprint.hex()}) cannot be "
                f"read as the reader schema: {exc}"
            ) from None
        except (
            EOFError,
            ValueError,
            IndexError,
            UnicodeDecodeError,
            TypeError,
            OverflowError,
        ) as exc:
            if isinstance(exc, EOFError) or stream.tell() >= len(data):
                raise TruncatedPayloadError(
                    f"payload of {len(data) - offset} bytes ends inside a {writer.full_name} datum"
                ) from None
            raise CorruptPayloadError(
                f"payload is not a valid {writer.full_name} datum: {type(exc).__name__}: {exc}"
            ) from None
        trailing = len(data) - stream.tell()
        if trailing:
            raise CorruptPayloadError(
                f"{trailing} bytes left over after a complete {writer.full_name} datum"
            )
        if not isinstance(record, dict):
            raise CorruptPayloadError(f"{writer.full_name} datum is not a record")
        return record
