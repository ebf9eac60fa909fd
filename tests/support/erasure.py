"""Marked values for erasure tests: records whose values carry a marker, and where it is.

The erased keys' records are decoded, their names replaced by a unique marker, encoded
again; :func:`marker_places` then reads every file under a storage root (local or S3):
raw bytes, and Parquet decoded (its pages are compressed).
"""

from __future__ import annotations

from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
from cdc_devkit.workload import GeneratedMessage
from cdc_shared.avro.framing import read_header
from cdc_shared.avro.registry import FileSchemaRegistry
from cdc_shared.avro.serde import AvroDecoder, AvroEncoder
from cdc_shared.contracts.unavailable import DEBEZIUM_PLACEHOLDER

from support.pipelines import Pipeline

MARKER = "Zq7ErasedMarker"
ERASED = (3, 7, 11)  # customers' ids whose values carry the marker
DELETED = 11  # the erased key whose last event is a delete


class Envelopes:
    """Decodes and re-encodes the generator's customers records (Avro, schema v1)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.registry = FileSchemaRegistry([pipeline.schema_dir])
        self.keys = AvroDecoder(self.registry, is_key=True)
        self.values = AvroDecoder(self.registry)

    def key(self, message: GeneratedMessage) -> int | None:
        """The customers id of an event (None for another entity's or a keyless record)."""
        if message.entity != "customers" or message.kind != "event" or not message.key:
            return None
        decoded = self.keys.decode(message.key)
        return None if decoded is None else int(decoded["id"])

    def value(self, message: GeneratedMessage) -> dict[str, Any] | None:
        return None if message.value is None else self.values.decode(message.value)

    def encode(self, message: GeneratedMessage, envelope: dict[str, Any]) -> GeneratedMessage:
        assert message.value is not None
        schema = self.registry.resolve(read_header(message.value))
        value = AvroEncoder(schema).encode(envelope)
        return GeneratedMessage(message.entity, message.topic, message.key, value, message.kind)


def marked(row: dict[str, Any] | None, key: int) -> dict[str, Any] | None:
    if row is None:
        return None
    return {**row, "first_name": f"{MARKER}{key}f", "last_name": f"{MARKER}{key}l"}


def with_markers(pipeline: Pipeline, load: list[GeneratedMessage]) -> list[GeneratedMessage]:
    """The load with the erased keys' values marked, an unsent value, a delete, a poison."""
    codec = Envelopes(pipeline)
    out: list[GeneratedMessage] = []
    last: dict[int, tuple[GeneratedMessage, dict[str, Any]]] = {}
    toasted = False
    for message in load:
        key = codec.key(message) if message.kind == "event" else None
        envelope = codec.value(message) if key in ERASED else None
        if key is None or envelope is None:
            out.append(message)
            continue
        envelope = {**envelope, "before": marked(envelope["before"], key)}
        envelope["after"] = marked(envelope["after"], key)
        if envelope["op"] == "u" and not toasted:  # PostgreSQL left a large value unsent
            envelope["after"]["last_name"] = DEBEZIUM_PLACEHOLDER
            toasted = True
        out.append(codec.encode(message, envelope))
        last[key] = (message, envelope)
    assert set(last) == set(ERASED) and toasted, "the load lacks events of the erased keys"
    message, envelope = last[DELETED]
    source = {**envelope["source"], "lsn": envelope["source"]["lsn"] + 1}
    gone = {**envelope, "op": "d", "before": envelope["after"], "after": None, "source": source}
    out.append(codec.encode(message, gone))
    poison = message.value[:5] + b"\xff" + MARKER.encode() if message.value else b""
    out.append(GeneratedMessage(message.entity, message.topic, message.key, poison, "poison"))
    return out


def late_and_new(pipeline: Pipeline, load: list[GeneratedMessage]) -> list[GeneratedMessage]:
    """After the erasure: a late, older event of an erased key, and a re-insert of another."""
    codec = Envelopes(pipeline)
    events = [m for m in load if m.kind == "event" and codec.key(m) in ERASED]
    first = next(m for m in events if codec.key(m) == ERASED[0])
    envelope = codec.value(first)
    assert envelope is not None and envelope["after"] is not None
    # (Unmarked: a late event reaching bronze after the request stays there, by the rule.)
    older = {**envelope["after"], "first_name": "Late", "last_name": "Event"}
    late = codec.encode(first, {**envelope, "after": older})
    newest = max(codec.value(m)["source"]["lsn"] for m in events)  # type: ignore[index]
    again = next(m for m in events if codec.key(m) == ERASED[1])
    envelope = codec.value(again)
    assert envelope is not None and envelope["after"] is not None
    after = {**envelope["after"], "first_name": "New", "last_name": "Data"}
    source = {**envelope["source"], "lsn": newest + 1000}
    reinsert = codec.encode(
        again, {**envelope, "op": "c", "before": None, "after": after, "source": source}
    )
    return [late, reinsert]


def a_new_change(pipeline: Pipeline, load: list[GeneratedMessage], key: int) -> GeneratedMessage:
    """An update of ``key`` newer than every event of the load (no marker)."""
    codec = Envelopes(pipeline)
    events = [m for m in load if m.kind == "event" and codec.key(m) == key]
    envelope = codec.value(events[-1])
    assert envelope is not None and envelope["after"] is not None
    customers = [codec.value(m) for m in load if codec.key(m) is not None]
    newest = max(e["source"]["lsn"] for e in customers if e is not None)
    source = {**envelope["source"], "lsn": newest + 2000}
    after = {**envelope["after"], "first_name": "Rolled"}
    return codec.encode(events[-1], {**envelope, "op": "u", "after": after, "source": source})


def marker_places(fs: pafs.FileSystem, root: str) -> list[str]:
    """Every file under ``root`` whose raw bytes, or decoded Parquet values, hold the marker."""
    found = []
    needle = MARKER.encode()
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        with fs.open_input_stream(info.path) as stream:
            raw = stream.read()
        if needle in raw:
            found.append(f"{info.path} (raw bytes)")
        elif info.path.endswith(".parquet"):
            decoded = pq.read_table(info.path, filesystem=fs).to_pylist()
            if needle in repr(decoded).encode():
                found.append(f"{info.path} (decoded)")
    return found
