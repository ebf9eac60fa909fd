"""The workload generator (deterministic, realistic) and the oracle (hand-checked cases)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from cdc_devkit.oracle import EntityOracle, load_fingerprints
from cdc_devkit.workload import (
    ProduceReport,
    WorkloadGenerator,
    WorkloadSpec,
    register_source_schemas,
)
from cdc_shared.avro import (
    AvroDecoder,
    AvroEncoder,
    AvroSerdeError,
    FileSchemaRegistry,
    NullKeyError,
    UnknownSchemaError,
    subject_name,
)
from cdc_shared.clients.schemas import entity_schemas
from support.entities import CUSTOMERS, ORDERS, SCHEMAS


@pytest.fixture(scope="module")
def registry() -> FileSchemaRegistry:
    return FileSchemaRegistry([SCHEMAS])


def generate(registry: FileSchemaRegistry, **spec: Any) -> tuple[WorkloadGenerator, list[Any]]:
    generator = WorkloadGenerator([CUSTOMERS, ORDERS], registry, WorkloadSpec(**spec))
    return generator, list(generator.messages())


# --- generator ---------------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_other_bytes(registry: FileSchemaRegistry) -> None:
    _, first = generate(registry, events=3000, keys=300, seed=7)
    _, again = generate(registry, events=3000, keys=300, seed=7)
    _, other = generate(registry, events=3000, keys=300, seed=8)
    as_bytes = [(m.topic, m.key, m.value) for m in first]
    assert as_bytes == [(m.topic, m.key, m.value) for m in again]
    assert as_bytes != [(m.topic, m.key, m.value) for m in other]


def test_workload_has_every_ingredient(registry: FileSchemaRegistry) -> None:
    _, messages = generate(registry, events=20_000, keys=1000, poison_share=0.005)
    kinds = Counter(m.kind for m in messages)
    assert kinds["event"] > 15_000 and kinds["tombstone"] > 100 and kinds["redelivery"] > 100
    assert {m.poison_kind for m in messages if m.kind == "poison"} == {
        "corrupt",
        "unknown_schema",
        "null_key",
    }
    decoder = AvroDecoder(registry)
    ops: Counter[str] = Counter()
    for i, m in enumerate(messages):
        if m.kind == "tombstone":  # right after the delete of the same key
            previous = decoder.decode(messages[i - 1].value)
            assert previous is not None and previous["op"] == "d"
            assert messages[i - 1].key == m.key
        elif m.kind == "event":
            decoded = decoder.decode(m.value)
            assert decoded is not None
            ops[decoded["op"]] += 1
    assert set(ops) == {"r", "c", "u", "d"}
    # Hot keys: the hottest 1% of keys take far more than 1% of the changes.
    keys = Counter(m.key for m in messages if m.kind == "event")
    top = sum(n for _, n in keys.most_common(20))
    assert top > 0.1 * sum(keys.values())


def test_hot_tables_take_their_share_of_the_changes(registry: FileSchemaRegistry) -> None:
    spec = {"events": 4000, "keys": 300, "snapshot_rows": 0, "poison_share": 0.0}
    _, even = generate(registry, **spec, redelivery_share=0.0)
    _, skewed = generate(registry, **spec, redelivery_share=0.0, hot_tables=1)
    for messages, share in ((even, 0.5), (skewed, 0.7)):
        events = Counter(m.entity for m in messages if m.kind == "event")
        assert events[CUSTOMERS.name] / sum(events.values()) == pytest.approx(share, abs=0.03)


def test_schema_changes_midway(registry: FileSchemaRegistry) -> None:
    _, messages = generate(registry, events=4000, keys=200, redelivery_share=0, poison_share=0)
    v1, v2 = (v.fingerprint for v in registry.versions("dbserver1.inventory.customers-value"))
    writers = [m.value[2:10] for m in messages if m.entity == "customers" and m.kind == "event"]
    switch = writers.index(v2)
    assert 0.3 < switch / len(writers) < 0.7
    assert set(writers[:switch]) == {v1} and set(writers[switch:]) == {v2}


def test_poison_records_fail_with_the_expected_typed_error(registry: FileSchemaRegistry) -> None:
    _, messages = generate(registry, events=5000, keys=200, poison_share=0.02)
    poison = [m for m in messages if m.kind == "poison"]
    assert len(poison) > 50
    for m in poison:
        if m.poison_kind == "null_key":
            with pytest.raises(NullKeyError):
                AvroDecoder(registry, is_key=True).decode(m.key)
        elif m.poison_kind == "unknown_schema":
            with pytest.raises(UnknownSchemaError):
                AvroDecoder(registry).decode(m.value)
        else:
            with pytest.raises(AvroSerdeError):
                AvroDecoder(registry).decode(m.value)


def test_oracle_agrees_with_the_generators_own_model(registry: FileSchemaRegistry) -> None:
    """Two independent models of the same stream: the generator's and the oracle's."""
    generator, messages = generate(registry, events=20_000, keys=500)
    fingerprints = load_fingerprints([SCHEMAS])
    for state, entity in zip(generator.entities, (CUSTOMERS, ORDERS), strict=True):
        oracle = EntityOracle(entity, entity_schemas(entity, registry).key_fields, fingerprints)
        for offset, m in enumerate(messages):
            if m.entity == entity.name:
                oracle.feed(m.key, m.value, 0, offset)
        believed = {tuple(row[f] for f in entity.key): row for row in state.live.values()}
        assert set(oracle.rows) == set(believed)
        columns = {f["name"] for f in state.schemas.row_schema()["fields"]}
        for key, row in oracle.rows.items():
            assert {c: row.get(c) for c in columns} == {c: believed[key].get(c) for c in columns}
        assert oracle.undecodable > 0 and oracle.ignored > 0


# --- oracle, by hand ---------------------------------------------------------------------


class Events:
    """Hand-made customer events with chosen LSNs."""

    def __init__(self, registry: FileSchemaRegistry) -> None:
        schemas = entity_schemas(CUSTOMERS, registry)
        self.key_encoder = AvroEncoder(schemas.key)
        self.value_encoder = AvroEncoder(schemas.values[0])
        self.oracle = EntityOracle(CUSTOMERS, ["id"], load_fingerprints([SCHEMAS]))
        self.offset = 0

    def send(self, op: str, key: int | None, lsn: int, name: str = "n") -> None:
        row = {
            "id": key or 0,
            "first_name": name,
            "last_name": "x",
            "email": "e",
            "phone": None,
            "created_at": dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        }
        value = self.value_encoder.encode(
            {
                "before": row if op in ("u", "d") else None,
                "after": None if op in ("d", "t") else row,
                "source": {
                    "version": "v",
                    "connector": "postgresql",
                    "name": "db",
                    "ts_ms": lsn,
                    "db": "inventory",
                    "schema": "inventory",
                    "table": "customers",
                    "lsn": lsn,
                },
                "transaction": None,
                "op": op,
            }
        )
        encoded_key = None if key is None else self.key_encoder.encode({"id": key})
        self.oracle.feed(encoded_key, value, 0, self.offset)
        self.offset += 1

    def tombstone(self, key: int) -> None:
        self.oracle.feed(self.key_encoder.encode({"id": key}), None, 0, self.offset)
        self.offset += 1

    def names(self) -> dict[int, str]:
        return {k[0]: row["first_name"] for k, row in self.oracle.rows.items()}


@pytest.fixture
def events(registry: FileSchemaRegistry) -> Events:
    return Events(registry)


def test_delete_then_late_update_stays_deleted(events: Events) -> None:
    events.send("c", 1, 10)
    events.send("d", 1, 30)
    events.tombstone(1)
    events.send("u", 1, 20, "late")
    assert events.names() == {}
    assert events.oracle.deleted_keys == {(1,)}


def test_duplicate_deliveries_apply_once(events: Events) -> None:
    for _ in range(3):
        events.send("c", 1, 10, "first")
        events.send("u", 1, 20, "second")
    assert events.names() == {1: "second"}
    assert [c.op for c in events.oracle.applied] == ["c", "u"]
    assert events.oracle.ignored == 4


def test_insert_after_delete_with_newer_sequence(events: Events) -> None:
    events.send("c", 1, 10, "old")
    events.send("d", 1, 20)
    events.send("c", 1, 30, "reborn")
    assert events.names() == {1: "reborn"}
    assert [c.op for c in events.oracle.applied] == ["c", "d", "c"]


def test_update_arriving_before_its_insert(events: Events) -> None:
    events.send("u", 2, 50, "newest")
    events.send("c", 2, 40, "oldest")
    assert events.names() == {2: "newest"}


def test_equal_sequence_changes_nothing(events: Events) -> None:
    events.send("c", 3, 10, "a")
    events.send("u", 3, 10, "b")
    assert events.names() == {3: "a"}


def test_truncate_removes_older_rows_only(events: Events) -> None:
    events.send("c", 1, 10)
    events.send("c", 2, 20)
    events.send("t", None, 30)
    events.send("u", 1, 25, "late")  # older than the truncate: ignored
    events.send("c", 3, 40, "after")
    assert events.names() == {3: "after"}


def test_poison_is_counted_not_applied(events: Events) -> None:
    events.oracle.feed(None, b"\xc3\x01garbage", 0, 99)
    events.oracle.feed(b"\x00\x00", b"\x00\x00\x00", 0, 100)
    assert events.oracle.undecodable == 2 and events.oracle.rows == {}


def test_composite_key_and_multi_column_sequence(registry: FileSchemaRegistry) -> None:
    schemas = entity_schemas(ORDERS, registry)
    key_encoder, value_encoder = AvroEncoder(schemas.key), AvroEncoder(schemas.values[0])
    oracle = EntityOracle(ORDERS, ["order_id", "line_no"], load_fingerprints([SCHEMAS]))

    def send(order: int, line: int, ts: int, lsn: int, quantity: int, offset: int) -> None:
        row = {
            "order_id": order,
            "line_no": line,
            "customer_id": 1,
            "product": None,
            "quantity": quantity,
            "amount": Decimal("9.99"),
            "order_date": dt.date(2024, 1, 1),
            "status": "paid",
        }
        value = value_encoder.encode(
            {
                "before": None,
                "after": row,
                "transaction": None,
                "op": "c",
                "source": {
                    "version": "v",
                    "connector": "postgresql",
                    "name": "db",
                    "ts_ms": ts,
                    "db": "inventory",
                    "schema": "inventory",
                    "table": "orders",
                    "lsn": lsn,
                },
            }
        )
        oracle.feed(key_encoder.encode({"order_id": order, "line_no": line}), value, 0, offset)

    send(7, 1, ts=100, lsn=5, quantity=1, offset=0)
    send(7, 2, ts=100, lsn=6, quantity=2, offset=1)
    send(7, 1, ts=100, lsn=9, quantity=3, offset=2)  # same ts, later lsn: newer
    send(7, 1, ts=99, lsn=50, quantity=4, offset=3)  # earlier ts wins the comparison: older
    assert {k: r["quantity"] for k, r in oracle.rows.items()} == {(7, 1): 3, (7, 2): 2}
    assert oracle.rows[(7, 1)]["amount"] == Decimal("9.99")


def test_produce_reports_of_slices_add_up() -> None:
    whole = ProduceReport()
    whole.add(ProduceReport(2, {"event": 1, "poison": 1}, [("t", 1, 9, "corrupt")], 1.0))
    whole.add(ProduceReport(3, {"event": 2, "tombstone": 1}, [("t", 0, 4, "null_key")], 2.0))
    assert whole.produced == 5 and whole.seconds == 3.0
    assert whole.by_kind == {"event": 3, "poison": 1, "tombstone": 1}
    assert whole.poison == [("t", 0, 4, "null_key"), ("t", 1, 9, "corrupt")]


def test_source_schemas_are_registered_where_missing_only(tmp_path: Path) -> None:
    """What Debezium's converter does before its first record: register the files."""
    files = FileSchemaRegistry([SCHEMAS])
    target = FileSchemaRegistry([], write_dir=tmp_path)
    subjects = register_source_schemas([CUSTOMERS, ORDERS], target, files)
    expected = [
        subject_name(e.source_topic, is_key)
        for e in (CUSTOMERS, ORDERS)
        for is_key in (True, False)
    ]
    assert subjects == expected
    for subject in expected:
        assert [v.fingerprint for v in target.versions(subject)] == [
            v.fingerprint for v in files.versions(subject)
        ]
    assert register_source_schemas([CUSTOMERS, ORDERS], target, files) == []
