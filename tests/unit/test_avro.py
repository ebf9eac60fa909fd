"""Avro serde: round trips in both framings, schema evolution, and every bad-input kind."""

from __future__ import annotations

import datetime as dt
import io
import json
import struct
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from cdc_shared.avro import (
    AvroDecoder,
    AvroEncoder,
    ConfluentSchemaRegistry,
    CorruptPayloadError,
    FileSchemaRegistry,
    IncompatibleSchemaError,
    NullKeyError,
    SchemaTypeError,
    TruncatedPayloadError,
    UnknownFramingError,
    UnknownSchemaError,
    parse_schema,
)
from cdc_shared.avro.framing import Framing, read_header
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
CUSTOMERS = "dbserver1.inventory.customers-value"


@pytest.fixture(scope="module")
def files() -> FileSchemaRegistry:
    return FileSchemaRegistry([SCHEMAS])


def source(lsn: int = 100) -> dict[str, Any]:
    return {
        "version": "2.7.3.Final",
        "connector": "postgresql",
        "name": "dbserver1",
        "ts_ms": 1_700_000_000_000,
        "snapshot": "false",
        "db": "inventory",
        "schema": "inventory",
        "table": "customers",
        "txId": 7,
        "lsn": lsn,
    }


millis = st.datetimes(
    min_value=dt.datetime(1970, 1, 2),  # noqa: DTZ001 (hypothesis wants naive bounds)
    max_value=dt.datetime(2200, 1, 1),  # noqa: DTZ001
    timezones=st.just(dt.UTC),
).map(lambda t: t.replace(microsecond=t.microsecond // 1000 * 1000))
text = st.text(max_size=30)
customer_rows = st.fixed_dictionaries(
    {
        "id": st.integers(-(2**31), 2**31 - 1),
        "first_name": text,
        "last_name": text,
        "email": text,
        "phone": st.none() | text,
        "created_at": millis,
    }
)


def envelope(after: dict[str, Any] | None, op: str = "c", before: Any = None) -> dict[str, Any]:
    full = {"before": before, "after": after, "source": source(), "transaction": None, "op": op}
    return {**full, "ts_ms": 1_700_000_000_001, "ts_us": None, "ts_ns": None}


def expected(record: dict[str, Any]) -> dict[str, Any]:
    """What a decode gives back: every optional source field present."""
    return {
        **record,
        "source": {
            "sequence": None,
            "ts_us": None,
            "ts_ns": None,
            "xmin": None,
            **record["source"],
        },
    }


# --- round trips -----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(row=customer_rows, op=st.sampled_from(["c", "u", "r"]))
def test_single_object_round_trip(files: FileSchemaRegistry, row: dict[str, Any], op: str) -> None:
    v1 = files.versions(CUSTOMERS)[0]
    data = AvroEncoder(v1).encode(envelope(row, op))
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == v1.fingerprint
    assert AvroDecoder(files).decode(data) == expected(envelope(row, op))


@settings(max_examples=100, deadline=None)
@given(row=customer_rows)
def test_confluent_round_trip(files: FileSchemaRegistry, row: dict[str, Any]) -> None:
    registry = ConfluentSchemaRegistry("mock://round-trip", files=files)
    registered = registry.register(CUSTOMERS, files.versions(CUSTOMERS)[0].definition)
    data = AvroEncoder(registered).encode(envelope(row))
    assert read_header(data).framing is Framing.CONFLUENT
    assert struct.unpack(">I", data[1:5])[0] == registered.schema_id
    assert AvroDecoder(registry).decode(data) == expected(envelope(row))
    assert registry.latest(CUSTOMERS).schema_id == registered.schema_id
    # Single-object messages still decode through the registry's file fallback.
    single = AvroEncoder(files.versions(CUSTOMERS)[0]).encode(envelope(row))
    assert AvroDecoder(registry).decode(single) == expected(envelope(row))


@settings(max_examples=100, deadline=None)
@given(row=customer_rows, tier=st.none() | st.sampled_from(["gold", "silver"]))
def test_schema_evolution_both_ways(
    files: FileSchemaRegistry, row: dict[str, Any], tier: str | None
) -> None:
    v1, v2 = files.versions(CUSTOMERS)
    old = AvroEncoder(v1).encode(envelope(row))
    # Old writer, new reader: the added column takes its default.
    assert AvroDecoder(files, v2).decode(old)["after"] == {**row, "loyalty_tier": None}  # type: ignore[index]
    # New writer, old reader: the added column is dropped.
    new = AvroEncoder(v2).encode(envelope({**row, "loyalty_tier": tier}))
    assert AvroDecoder(files, v1).decode(new)["after"] == row  # type: ignore[index]
    assert AvroDecoder(files, v2).decode(new)["after"] == {**row, "loyalty_tier": tier}  # type: ignore[index]


def test_genuine_debezium_shaped_records(files: FileSchemaRegistry) -> None:
    """Avro-JSON samples shaped as Debezium writes them, encoded to binary, then decoded."""
    samples = json.loads((ROOT / "tests/data/debezium-customers-samples.json").read_text())
    v1 = files.versions(CUSTOMERS)[0]
    key_schema = files.latest("dbserver1.inventory.customers-key")
    decoder = AvroDecoder(files, files.latest(CUSTOMERS))
    key_decoder = AvroDecoder(files, is_key=True)
    ops = []
    for sample in samples:
        value = next(fastavro.json_reader(io.StringIO(json.dumps(sample["value"])), v1.parsed))
        framed = v1.header + _binary(v1.parsed, value)
        decoded = decoder.decode(framed)
        assert decoded is not None
        ops.append(decoded["op"])
        assert decoded["source"]["connector"] == "postgresql"
        row = decoded["after"] or decoded["before"]
        assert row["id"] == sample["key"]["id"]
        assert row["loyalty_tier"] is None  # resolved to the newest schema
        assert row["created_at"] == dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
        key = key_decoder.decode(key_schema.header + _binary(key_schema.parsed, sample["key"]))
        assert key == sample["key"]
    assert ops == ["r", "u", "d"]


def _binary(schema: Any, record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, record)
    return out.getvalue()


# --- batches ----------------------------------------------------------------------------


def test_batch_decodes_lists_and_arrow_with_errors_in_place(files: FileSchemaRegistry) -> None:
    v1, v2 = files.versions(CUSTOMERS)
    rows = [
        {
            "id": i,
            "first_name": "a",
            "last_name": "b",
            "email": "e",
            "phone": None,
            "created_at": dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        }
        for i in range(4)
    ]
    good1 = AvroEncoder(v1).encode(envelope(rows[0]))
    good2 = AvroEncoder(v2).encode(envelope({**rows[1], "loyalty_tier": "gold"}))
    messages = [good1, None, good2[:-4], b"\xc3\x01" + b"\x99" * 8 + good1[10:], good2, b"junk"]
    for batch_input in (messages, pa.array(messages, type=pa.binary())):
        batch = AvroDecoder(files, v2).decode_batch(batch_input)
        assert batch.records[0]["after"]["id"] == 0  # type: ignore[index]
        assert batch.records[1] is None and 1 not in batch.errors  # tombstone
        assert isinstance(batch.errors[2], TruncatedPayloadError)
        assert isinstance(batch.errors[3], UnknownSchemaError)
        assert batch.records[4]["after"]["loyalty_tier"] == "gold"  # type: ignore[index]
        assert isinstance(batch.errors[5], UnknownFramingError)
        assert batch.ok_count == 2
        assert batch.writers[0].version == 1 and batch.writers[4].version == 2


def test_batch_of_keys_flags_null_keys(files: FileSchemaRegistry) -> None:
    key_schema = files.latest("dbserver1.inventory.customers-key")
    key = AvroEncoder(key_schema).encode({"id": 5})
    batch = AvroDecoder(files, is_key=True).decode_batch([key, None])
    assert batch.records[0] == {"id": 5}
    assert isinstance(batch.errors[1], NullKeyError)


# --- every bad input has its typed error -------------------------------------------------


def good_message(files: FileSchemaRegistry) -> bytes:
    row = {
        "id": 1,
        "first_name": "a",
        "last_name": "b",
        "email": "e",
        "phone": "p",
        "created_at": dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    }
    return AvroEncoder(files.versions(CUSTOMERS)[0]).encode(envelope(row))


@pytest.mark.parametrize(
    ("mangle", "error", "words"),
    [
        (lambda m: m[:-5], TruncatedPayloadError, "ends inside"),
        (lambda m: m[:6], TruncatedPayloadError, "single-object header"),
        (lambda m: b"", TruncatedPayloadError, "empty"),
        (lambda m: b"\x00\x00", TruncatedPayloadError, "Confluent header"),
        (lambda m: m + b"\x00\x01", CorruptPayloadError, "left over"),
        (lambda m: m[:10] + b"\x09" + m[11:], CorruptPayloadError, "not a valid"),
        (lambda m: b"\xc3\x01" + bytes(8) + m[10:], UnknownSchemaError, "fingerprint 0000"),
        (lambda m: b"\x00\x00\x00\x00\x07" + m[10:], UnknownSchemaError, "schema id 7"),
        (lambda m: b'{"id": 1}', UnknownFramingError, "neither Confluent"),
    ],
)
def test_bad_bytes_raise_typed_errors(
    files: FileSchemaRegistry, mangle: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        AvroDecoder(files).decode(mangle(good_message(files)))


def test_unknown_confluent_id_in_registry(files: FileSchemaRegistry) -> None:
    registry = ConfluentSchemaRegistry("mock://unknown-id", files=files)
    with pytest.raises(UnknownSchemaError, match="schema id 4242"):
        AvroDecoder(registry).decode(b"\x00" + struct.pack(">I", 4242) + b"\x02")


def test_incompatible_reader_schema(files: FileSchemaRegistry) -> None:
    definition = json.loads((SCHEMAS / f"{CUSTOMERS}.avsc").read_text())
    value = definition["fields"][0]["type"][1]
    value["fields"].append({"name": "required_new", "type": "string"})  # no default
    reader = parse_schema(definition)
    with pytest.raises(IncompatibleSchemaError, match="cannot be read as the reader schema"):
        AvroDecoder(files, reader).decode(good_message(files))


def test_null_key_is_an_error_but_null_value_is_a_tombstone(files: FileSchemaRegistry) -> None:
    with pytest.raises(NullKeyError):
        AvroDecoder(files, is_key=True).decode(None)
    assert AvroDecoder(files).decode(None) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"op": 5}, "op"),
        ({"source": {**source(), "lsn": "not a number"}}, "lsn"),
        ({"after": {"id": "x"}}, "Envelope"),
    ],
)
def test_wrong_type_on_encode(
    files: FileSchemaRegistry, change: dict[str, Any], words: str
) -> None:
    record = envelope(None)
    record.update(change)
    with pytest.raises(SchemaTypeError, match=words):
        AvroEncoder(files.versions(CUSTOMERS)[0]).encode(record)


# --- registries ---------------------------------------------------------------------------


def test_file_registry_registers_derived_schemas_as_files(tmp_path: Path) -> None:
    registry = FileSchemaRegistry([SCHEMAS], write_dir=tmp_path)
    schema = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]}
    first = registry.register("topic-value", schema)
    assert registry.register("topic-value", schema) is first  # idempotent
    evolved = {
        **schema,
        "fields": [*schema["fields"], {"name": "b", "type": ["null", "int"], "default": None}],
    }
    second = registry.register("topic-value", evolved)
    assert (first.version, second.version) == (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topic-value.avsc", "topic-value.v2.avsc"]
    reopened = FileSchemaRegistry([], write_dir=tmp_path)
    assert reopened.latest("topic-value").fingerprint == second.fingerprint


def test_fingerprint_matches_avro_spec(files: FileSchemaRegistry) -> None:
    """CRC-64-AVRO of the canonical form, little-endian on the wire (fastavro's hex order)."""
    known = files.latest("dbserver1.inventory.customers-key")
    canonical = fastavro.schema.to_parsing_canonical_form(known.parsed)
    assert known.fingerprint.hex() == fastavro.schema.fingerprint(canonical, "CRC-64-AVRO")
    # The spec's example: CRC-64-AVRO("null") = 0x63dd24e7cc258f8a, written little-endian.
    null_fingerprint = bytes.fromhex(fastavro.schema.fingerprint('"null"', "CRC-64-AVRO"))
    assert null_fingerprint == (0x63DD24E7CC258F8A).to_bytes(8, "little")


def test_a_file_registry_lists_what_it_resolves_and_an_http_one_does_not(tmp_path: Path) -> None:
    """The ingestor plans every listed schema and then needs no look at a batch's headers."""
    (tmp_path / f"{CUSTOMERS}.avsc").write_text((SCHEMAS / f"{CUSTOMERS}.avsc").read_text())
    files = FileSchemaRegistry([tmp_path])
    v1 = files.latest(CUSTOMERS)
    assert files.listing() == [v1]

    (tmp_path / f"{CUSTOMERS}.v2.avsc").write_text((SCHEMAS / f"{CUSTOMERS}.v2.avsc").read_text())
    assert files.listing() == [v1], "listed before the registry looked again"
    files.refresh()
    assert {s.fingerprint for s in files.listing()} == {
        v1.fingerprint,
        files.latest(CUSTOMERS).fingerprint,
    }
    assert len(files.listing()) == 2

    assert ConfluentSchemaRegistry("mock://listing", files=files).listing() is None
