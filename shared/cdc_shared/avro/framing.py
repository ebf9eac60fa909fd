"""The two message framings, told apart by their first bytes.

- Confluent wire format: ``0x00`` + 4-byte big-endian schema id (a schema registry).
- Avro single-object encoding: ``0xC3 0x01`` + 8-byte CRC-64-AVRO fingerprint of the
  schema's Parsing Canonical Form, little-endian (the file registry).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from cdc_shared.avro.errors import TruncatedPayloadError, UnknownFramingError

CONFLUENT_MAGIC = b"\x00"
SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_HEADER_SIZE = 5
SINGLE_OBJECT_HEADER_SIZE = 10


class Framing(enum.Enum):
    """How the writer schema is named in front of the Avro payload."""

    CONFLUENT = "confluent"
    SINGLE_OBJECT = "single_object"


@dataclass(frozen=True)
class Header:
    """A parsed framing header: which schema wrote the payload that follows."""

    framing: Framing
    schema_id: int | None  # Confluent
    fingerprint: bytes | None  # single-object, 8 bytes as written on the wire

    @property
    def size(self) -> int:
        """Bytes the header occupies before the Avro payload."""
        if self.framing is Framing.CONFLUENT:
            return CONFLUENT_HEADER_SIZE
        return SINGLE_OBJECT_HEADER_SIZE

    def describe(self) -> str:
        """Human-readable schema reference, for error messages."""
        if self.framing is Framing.CONFLUENT:
            return f"schema id {self.schema_id}"
        assert self.fingerprint is not None
        return f"fingerprint {self.fingerprint.hex()}"


def read_header(data: bytes) -> Header:
    """Parse the framing header at the start of ``data``."""
    if data[:1] == CONFLUENT_MAGIC:
        if len(data) < CONFLUENT_HEADER_SIZE:
            raise TruncatedPayloadError(
                f"message of {len(data)} bytes is shorter than the 5-byte Confluent header"
            )
        (schema_id,) = struct.unpack_from(">I", data, 1)
        return Header(Framing.CONFLUENT, schema_id, None)
    if data[:2] == SINGLE_OBJECT_MAGIC:
        if len(data) < SINGLE_OBJECT_HEADER_SIZE:
            raise TruncatedPayloadError(
                f"message of {len(data)} bytes is shorter than the 10-byte single-object header"
            )
        return Header(Framing.SINGLE_OBJECT, None, bytes(data[2:SINGLE_OBJECT_HEADER_SIZE]))
    if not data:
        raise TruncatedPayloadError("message is empty (0 bytes)")
    raise UnknownFramingError(
        f"message starts with {bytes(data[:2]).hex()}: neither Confluent (00) nor "
        "Avro single-object (c301) framing"
    )


def confluent_header(schema_id: int) -> bytes:
    """The 5-byte Confluent header for ``schema_id``."""
    return CONFLUENT_MAGIC + struct.pack(">I", schema_id)


def single_object_header(fingerprint: bytes) -> bytes:
    """The 10-byte single-object header for an 8-byte wire-order fingerprint."""
    if len(fingerprint) != 8:
        raise ValueError(f"a CRC-64-AVRO fingerprint has 8 bytes, got {len(fingerprint)}")
    return SINGLE_OBJECT_MAGIC + fingerprint
