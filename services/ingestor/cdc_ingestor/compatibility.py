"""Whether Avro can read data of one writer schema with a reader schema, and why not.

Avro's own ``SchemaCompatibility``, asked in the JVM (the library ``from_avro`` decodes
with), so the answer is the decoder's. The ingestor uses it to choose a reader schema
that reads every version it replaces (``readable_reader``) and to name the first field
that keeps a writer from being read (``incompatibility``): records of such a writer are
quarantined as ``incompatible_schema`` with that reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cdc_shared.avro import KnownSchema
from cdc_shared.jvm.bridge import avro_compatibility, avro_schema
from pyspark.sql import SparkSession

#: (reader, writer) fingerprints -> why Avro cannot resolve the writer to the reader, or None.
_REASONS: dict[tuple[bytes, bytes], str | None] = {}


def readable_reader(spark: SparkSession, versions: Sequence[KnownSchema]) -> KnownSchema:
    """The newest of ``versions`` (oldest first) that can read every version it replaces.

    A version that cannot is skipped: it never becomes the reader, so records of the
    versions before it keep decoding, and its own records are the incompatible ones.
    """
    reader, readable = versions[0], [versions[0]]
    for version in versions[1:]:
        if all(incompatibility(spark, version, older) is None for older in readable):
            reader = version
            readable.append(version)
    return reader


def incompatibility(spark: SparkSession, reader: KnownSchema, writer: KnownSchema) -> str | None:
    """Why Avro cannot resolve data written with ``writer`` to ``reader``; None if it can.

    Asks Avro's ``SchemaCompatibility`` in the JVM (the library ``from_avro`` decodes with)
    and names the first offending field by its path (``after.id``): a record inside a
    union is checked against the reader's record of the same name, so the reason is the
    field's rather than "reader union lacking writer type". Answers are cached (a few JVM
    calls per pair of schemas, asked for every batch).
    """
    if reader.fingerprint == writer.fingerprint:
        return None
    pair = (reader.fingerprint, writer.fingerprint)
    if pair not in _REASONS:
        _REASONS[pair] = _reason(
            spark, avro_schema(spark, reader.json()), avro_schema(spark, writer.json()), []
        )
    return _REASONS[pair]


def _reason(spark: SparkSession, reader: Any, writer: Any, path: list[str]) -> str | None:
    """The first incompatibility of two JVM Avro schemas, ``path`` naming where they sit."""
    result = avro_compatibility(spark, reader, writer)
    if result.getCompatibility().toString() == "COMPATIBLE":
        return None
    found = result.getIncompatibilities()[0]
    kind, location = found.getType().toString(), str(found.getLocation())
    here = [*path, *_field_names(reader, location)]
    if kind == "MISSING_UNION_BRANCH" and location.rsplit("/", 1)[-1].isdigit():
        branch = found.getWriterFragment().getTypes()[int(location.rsplit("/", 1)[-1])]
        if branch.getType().getName() == "record":
            for candidate in found.getReaderFragment().getTypes():
                if candidate.getFullName() == branch.getFullName():
                    deeper = _reason(spark, candidate, branch, here)
                    if deeper is not None:
                        return deeper
    where = ".".join(here) or "the top-level type"
    if kind == "READER_FIELD_MISSING_DEFAULT_VALUE":
        return f"{where}: the writer schema has no such field and the reader's has no default"
    return f"{where}: {kind.lower()}: {found.getMessage()}"


def _field_names(reader: Any, location: str) -> list[str]:
    """The record field names along an Avro compatibility ``location`` (``/fields/1/type``)."""
    names: list[str] = []
    node, tokens = reader, location.strip("/").split("/")
    for token, following in zip(tokens, [*tokens[1:], ""], strict=True):
        if token == "fields" and node.getType().getName() == "record" and following.isdigit():
            field = node.getFields()[int(following)]
            names.append(str(field.name()))
            node = field.schema()
        elif token in ("items", "values") and node.getType().getName() in ("array", "map"):
            node = node.getElementType() if token == "items" else node.getValueType()
    return names
