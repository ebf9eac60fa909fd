"""A record's framing header: which writer schema its Avro bytes name.

A Confluent-framed record starts with the magic byte and a 4-byte schema id; a
single-object one with its 2-byte marker and the schema's 8-byte fingerprint. These
columns find the header, name its writer schema as bronze and messages show it, and list
the headers a batch uses (per topic) before any record is decoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cdc_shared.avro import KnownSchema
from cdc_shared.avro.framing import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

#: The framing headers a batch's records use: its values', then its keys'.
BatchHeaders = tuple[set[bytes], set[bytes]]


def writers_by_header(schemas: Sequence[KnownSchema]) -> dict[bytes, KnownSchema]:
    """Each of ``schemas`` by every header that names it (single-object; Confluent with an id)."""
    headers: dict[bytes, KnownSchema] = {}
    for schema in schemas:
        headers[SINGLE_OBJECT_MAGIC + schema.fingerprint] = schema
        if schema.schema_id is not None:
            headers[schema.header] = schema
    return headers


def header(column: Column) -> Column:
    """The framing header at the start of ``column``; null when neither framing fits."""
    return F.when(
        (F.substring(column, 1, 1) == F.lit(CONFLUENT_MAGIC)) & (F.length(column) >= 5),
        F.substring(column, 1, 5),
    ).when(
        (F.substring(column, 1, 2) == F.lit(SINGLE_OBJECT_MAGIC)) & (F.length(column) >= 10),
        F.substring(column, 1, 10),
    )


def writer_label(prefix: bytes, writer: KnownSchema) -> str:
    """How a writer schema is named in bronze and in messages: by what its header carries."""
    if prefix[:1] == CONFLUENT_MAGIC:
        return f"id:{writer.schema_id}"
    return f"fingerprint:{writer.fingerprint.hex()}"


def text_by_header(head: Column, texts: Mapping[bytes, str]) -> Column:
    """The text of the header ``head`` holds; null for any other header."""
    chosen: Column | None = None
    for prefix, text in texts.items():
        chosen = (
            F.when(head == F.lit(prefix), F.lit(text))
            if chosen is None
            else chosen.when(head == F.lit(prefix), F.lit(text))
        )
    return chosen if chosen is not None else F.lit(None).cast("string")


def writer_labels(head: Column, writers: Mapping[bytes, KnownSchema]) -> Column:
    """The label (``writer_label``) of the writer schema the header ``head`` names."""
    return text_by_header(head, {prefix: writer_label(prefix, w) for prefix, w in writers.items()})


def headers_by_topic(raw: DataFrame) -> dict[str, BatchHeaders]:
    """The topics of a batch of Kafka records, each with the framing headers it uses.

    One cheap pass over the raw bytes: which topics are present and which writer
    schemas each needs, before any record is decoded.
    """
    rows = (
        raw.select(
            "topic", header(F.col("value")).alias("value"), header(F.col("key")).alias("key")
        )
        .distinct()
        .collect()
    )
    found: dict[str, BatchHeaders] = {}
    for row in rows:
        values, keys = found.setdefault(row["topic"], (set(), set()))
        if row["value"] is not None:
            values.add(bytes(row["value"]))
        if row["key"] is not None:
            keys.add(bytes(row["key"]))
    return found


def batch_headers(raw: DataFrame) -> BatchHeaders:
    """The framing headers a batch of Kafka records uses, whatever its topics."""
    values: set[bytes] = set()
    keys: set[bytes] = set()
    for topic_values, topic_keys in headers_by_topic(raw).values():
        values |= topic_values
        keys |= topic_keys
    return values, keys
