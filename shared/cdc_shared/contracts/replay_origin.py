"""The ``cdc.replay.of`` header: where a replayed record's change was first read.

``cdc quarantine replay`` produces a quarantined source record again, unchanged, to the
partition it came from, where it lands at a new, higher offset. Its header
``cdc.replay.of = <topic>/<partition>/<offset>`` names the coordinates the change was
first read at (across repeated replays: the first of them). The ingestor takes the Kafka
coordinates of the record's sequence (``kafka.partition``, ``kafka.offset`` in
``sequence_by``) from the header, so a replayed change is ordered where it first
arrived and never overwrites a newer change of its key; bronze's ``kafka_*`` columns
keep where the replayed record was actually read. Sequence paths into the envelope need
nothing: replay keeps the payload.

The header is checked, not trusted blindly: it must name an earlier offset of the
record's own topic and partition (replay never produces elsewhere), once. A record whose
header does not is quarantined as ``bad_replay_header``.

One home for the header's name and form: the CLI writes it with ``origin_header`` and
reads it back with ``parse_origin``; the ingestor decodes it with ``replay_origin``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

REPLAY_HEADER = "cdc.replay.of"
BAD_REPLAY_HEADER = "bad_replay_header"
#: Spark's Kafka source's ``headers`` column (``includeHeaders``).
HEADERS_TYPE = T.ArrayType(
    T.StructType([T.StructField("key", T.StringType()), T.StructField("value", T.BinaryType())])
)
_TOPIC, _PARTITION, _OFFSET = r"[a-zA-Z0-9._-]+", r"[0-9]{1,10}", r"[0-9]{1,19}"
_FORM = re.compile(f"({_TOPIC})/({_PARTITION})/({_OFFSET})")
#: The same form for Spark (Java regex; ``\z`` is the very end, ``$`` allows a newline).
_JAVA_FORM = f"^({_TOPIC})/({_PARTITION})/({_OFFSET})\\z"
_MAX_INT, _MAX_LONG = 2**31 - 1, 2**63 - 1
_SHOWN = 120  # characters of a bad header quoted in the error message


@dataclass(frozen=True)
class Origin:
    """Kafka coordinates a change was first read at."""

    topic: str
    partition: int
    offset: int


def origin_header(origin: Origin) -> bytes:
    """The ``cdc.replay.of`` header value naming ``origin``."""
    return f"{origin.topic}/{origin.partition}/{origin.offset}".encode()


def parse_origin(value: bytes | str | None) -> Origin | None:
    """The coordinates a ``cdc.replay.of`` header value names; None if it is not one."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    found = _FORM.fullmatch(value)
    if found is None:
        return None
    topic, partition, offset = found.group(1), int(found.group(2)), int(found.group(3))
    if partition > _MAX_INT or offset > _MAX_LONG:
        return None
    return Origin(topic, partition, offset)


@dataclass(frozen=True)
class ReplayColumns:
    """What a record's headers say about its sequence coordinates, as Spark columns.

    ``partition`` and ``offset`` are where the change was first read: the header's for a
    replayed record, the record's own otherwise (and when the header is bad: the record
    is quarantined then). ``checks`` are (condition, error kind, message), first wins.
    """

    partition: Column
    offset: Column
    checks: list[tuple[Column, str, Column]]


def replay_origin(
    headers: Column, topic: Column, partition: Column, offset: Column
) -> ReplayColumns:
    """The sequence coordinates of records with ``headers`` read at (topic, partition, offset)."""
    found = F.filter(headers, lambda h: h["key"] == F.lit(REPLAY_HEADER))
    count = F.coalesce(F.size(found), F.lit(0))
    present = headers.isNotNull() & (count > 0)
    text = F.element_at(found, 1)["value"].cast("string")
    named_topic = F.regexp_extract(text, _JAVA_FORM, 1)
    named_partition = F.regexp_extract(text, _JAVA_FORM, 2).try_cast("int")
    named_offset = F.regexp_extract(text, _JAVA_FORM, 3).try_cast("long")
    shown = F.concat(F.lit(f"{REPLAY_HEADER} header '"), F.substring(text, 1, _SHOWN), F.lit("'"))
    checks: list[tuple[Column, str, Column]] = [
        (
            present & (count > 1),
            BAD_REPLAY_HEADER,
            F.concat(
                F.lit("the record has "),
                count.cast("string"),
                F.lit(f" {REPLAY_HEADER} headers; a replay sets exactly one"),
            ),
        ),
        (
            present & (text.isNull() | named_partition.isNull() | named_offset.isNull()),
            BAD_REPLAY_HEADER,
            F.concat(
                F.coalesce(shown, F.lit(f"{REPLAY_HEADER} header without a value")),
                F.lit(" is not <topic>/<partition>/<offset>"),
            ),
        ),
        (
            present & (named_topic != topic),
            BAD_REPLAY_HEADER,
            F.concat(
                shown,
                F.lit(" names another topic than the one the record was read from ("),
                topic,
                F.lit("); a replay goes back to its own topic"),
            ),
        ),
        (
            present & (named_partition != partition),
            BAD_REPLAY_HEADER,
            F.concat(
                shown,
                F.lit(" names another partition than the one the record was read from ("),
                partition.cast("string"),
                F.lit("); a replay goes back to its own partition"),
            ),
        ),
        (
            present & (named_offset >= offset),
            BAD_REPLAY_HEADER,
            F.concat(
                shown,
                F.lit(" names an offset not before the record's own ("),
                offset.cast("string"),
                F.lit("); a replayed change was first read before its replay"),
            ),
        ),
    ]
    first_partition = F.when(present, F.coalesce(named_partition, partition)).otherwise(partition)
    first_offset = F.when(present, F.coalesce(named_offset, offset)).otherwise(offset)
    return ReplayColumns(first_partition, first_offset, checks)
