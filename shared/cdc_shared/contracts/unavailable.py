"""Values the source could not send: Debezium's placeholder, and the value kept instead.

PostgreSQL does not write an unchanged TOASTed value (a large ``text``, ``jsonb``,
``bytea`` or array, stored out of line) to the WAL of an UPDATE unless the table's
REPLICA IDENTITY is FULL, so Debezium puts a placeholder in ``after`` instead
(``unavailable.value.placeholder``, default ``__debezium_unavailable_value``). Stored as
it is, the placeholder would overwrite the real value in silver, and from there in the
change topics and the index.

A column carrying the placeholder keeps its prior value: the newest earlier event of the
same key in the batch that carries a real value (an insert and an update of one key in
one batch), else the value silver already holds (the MERGE keeps the target's value),
else null, counted as ``unavailable_values`` and logged. Debezium renders the
placeholder by the column's type (its ``UnchangedToastedPlaceholder``); each rendering
is recognised here:

- strings: the placeholder; for ``hstore`` as JSON ``{"<p>":"<p>"}``; for ``bytea`` under
  ``binary.handling.mode`` base64 or hex, the placeholder's bytes so encoded;
- bytes: the placeholder's bytes;
- arrays: of strings ``["<p>"]`` (or, for ``uuid[]``, the name-based UUID of the
  placeholder's bytes), of bytes ``[<p bytes>]``, of integers the placeholder's bytes as
  numbers;
- maps (``hstore`` as a map): ``{"<p>": "<p>"}``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from dataclasses import dataclass

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

#: Debezium's default ``unavailable.value.placeholder``.
DEBEZIUM_PLACEHOLDER = "__debezium_unavailable_value"
#: The candidates' column listing, per row, the columns whose value silver must keep.
UNAVAILABLE = "_cdc_unavailable"

_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)


def placeholder_bytes(setting: str) -> bytes:
    """The placeholder's bytes as Debezium reads its setting (``hex:`` prefix: hex octets)."""
    if setting.startswith("hex:"):
        return bytes.fromhex(setting[4:])
    return setting.encode()


def _name_uuid(data: bytes) -> str:
    """Java's ``UUID.nameUUIDFromBytes``: MD5 of the bytes, version 3 (no namespace)."""
    return str(uuid.UUID(bytes=hashlib.md5(data, usedforsecurity=False).digest(), version=3))


@dataclass(frozen=True)
class Placeholder:
    """One pipeline's placeholder, and how to spot it in a column of each type."""

    data: bytes

    @classmethod
    def of(cls, setting: str | None) -> Placeholder | None:
        """The placeholder of a ``merger.unavailable_value_placeholder`` setting (None: off)."""
        return None if setting is None else cls(placeholder_bytes(setting))

    @property
    def text(self) -> str:
        """The placeholder as a string (how string columns carry it)."""
        return self.data.decode(errors="replace")

    def _strings(self) -> list[str]:
        return [
            self.text,
            json.dumps({self.text: self.text}, separators=(",", ":")),
            base64.b64encode(self.data).decode(),
            self.data.hex(),
        ]

    def spots(self, data_type: T.DataType) -> bool:
        """Whether a column of this type can carry the placeholder."""
        return self.matches(F.lit(None), data_type) is not None

    def matches(self, value: Column, data_type: T.DataType) -> Column | None:
        """True where ``value`` is the placeholder; None for a type that never carries it."""
        if isinstance(data_type, T.StringType):
            return value.isin(*self._strings())
        if isinstance(data_type, T.BinaryType):
            return value == F.lit(bytearray(self.data))
        if isinstance(data_type, T.MapType):
            if isinstance(data_type.keyType, T.StringType) and isinstance(
                data_type.valueType, T.StringType
            ):
                return (F.size(value) == 1) & (F.element_at(value, F.lit(self.text)) == self.text)
            return None
        if isinstance(data_type, T.ArrayType):
            element = data_type.elementType
            one = F.size(value) == 1
            if isinstance(element, T.StringType):
                first = F.element_at(value, 1)
                return one & first.isin(self.text, _name_uuid(self.data))
            if isinstance(element, T.BinaryType):
                return one & (F.element_at(value, 1) == F.lit(bytearray(self.data)))
            if isinstance(element, _INTEGRAL):
                # Java's bytes are signed: each becomes a number in -128 .. 127.
                signed = [b - 256 if b > 127 else b for b in self.data]
                return value == F.array(*[F.lit(b) for b in signed]).cast(data_type)
        return None
