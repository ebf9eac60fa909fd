"""Connect JSON (Debezium with JsonConverter): the generator's encoder and the oracle's reader."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from cdc_devkit.connect_json import (
    JsonEncoder,
    connect_schema,
    decode_connect_json,
    expanded,
    from_connect,
    to_connect,
)
from cdc_devkit.oracle import EntityOracle, load_fingerprints
from cdc_devkit.workload import JSON_POISON_KINDS, WorkloadGenerator, WorkloadSpec
from cdc_shared.avro import AvroDecoder, FileSchemaRegistry
from cdc_shared.clients.schemas import entity_schemas
from hypothesis import given
from hypothesis import strategies as st
from support.entities import CUSTOMERS, ORDERS, SCHEMAS

AMOUNT = {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}
JSON_ORDERS = ORDERS.model_copy(update={"value_format": "json", "key_format": "json"})
JSON_CUSTOMERS = CUSTOMERS.model_copy(update={"value_format": "json", "key_format": "json"})


@pytest.fixture(scope="module")
def registry() -> FileSchemaRegistry:
    return FileSchemaRegistry([SCHEMAS])


def test_precise_decimals_are_base64_of_the_twos_complement_unscaled_value() -> None:
    assert to_connect(Decimal("12.50"), AMOUNT, "precise") == "BOI="
    assert from_connect("BOI=", AMOUNT, "precise") == Decimal("12.50")
    assert to_connect(Decimal("-0.01"), AMOUNT, "precise") == base64.b64encode(b"\xff").decode()
    assert to_connect(Decimal("1.28"), AMOUNT, "precise") == base64.b64encode(b"\x00\x80").decode()


@given(st.integers(min_value=-(10**10) + 1, max_value=10**10 - 1))
def test_every_decimal_survives_each_handling_mode(unscaled: int) -> None:
    value = Decimal(unscaled).scaleb(-2)
    for mode in ("precise", "string", "double"):
        encoded = json.loads(json.dumps(to_connect(value, AMOUNT, mode)))  # type: ignore[arg-type]
        assert from_connect(encoded, AMOUNT, mode) == value  # type: ignore[arg-type]


def test_dates_and_timestamps_are_epoch_numbers() -> None:
    date = {"type": "int", "logicalType": "date"}
    millis = {"type": "long", "logicalType": "timestamp-millis"}
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    assert to_connect(dt.date(1970, 1, 11), date, "precise") == 10
    assert to_connect(when, millis, "precise") == int(when.timestamp() * 1000)
    assert from_connect(int(when.timestamp() * 1000), millis, "precise") == when


@pytest.mark.parametrize("form", ["plain", "schemas", "mixed"])
def test_generated_json_reads_back_as_the_avro_datum(
    registry: FileSchemaRegistry, form: str
) -> None:
    json_messages = list(
        WorkloadGenerator(
            [JSON_ORDERS],
            registry,
            WorkloadSpec(events=300, keys=50, json_form=form),  # type: ignore[arg-type]
        ).messages()
    )
    avro_messages = list(
        WorkloadGenerator([ORDERS], registry, WorkloadSpec(events=300, keys=50)).messages()
    )
    schemas = entity_schemas(ORDERS, registry)
    value, key = expanded(schemas.value), expanded(schemas.key)
    wrapped = Counter()
    for as_json, as_avro in zip(json_messages, avro_messages, strict=True):
        if as_json.kind == "poison" or as_json.value is None:
            continue
        document = json.loads(as_json.value)
        wrapped[set(document) == {"schema", "payload"}] += 1
        assert decode_connect_json(as_json.value, value, "precise") == AvroDecoder(registry).decode(
            as_avro.value
        )
        assert decode_connect_json(as_json.key, key, "precise") == AvroDecoder(
            registry, is_key=True
        ).decode(as_avro.key)
    expected = {"plain": {False}, "schemas": {True}, "mixed": {False, True}}[form]
    assert set(wrapped) == expected


def test_the_embedded_schema_is_connects() -> None:
    schema = connect_schema(
        expanded(json.loads((SCHEMAS / "dbserver1.inventory.orders-value.avsc").read_text())),
        "precise",
    )
    assert schema["type"] == "struct" and schema["optional"] is False
    after = next(f for f in schema["fields"] if f["field"] == "after")
    assert after["optional"] is True
    amount = next(f for f in after["fields"] if f["field"] == "amount")
    assert amount["name"] == "org.apache.kafka.connect.data.Decimal"
    assert amount["parameters"] == {"scale": "2", "connect.decimal.precision": "10"}


def test_json_poison_is_refused_by_the_oracle(registry: FileSchemaRegistry) -> None:
    messages = list(
        WorkloadGenerator(
            [JSON_CUSTOMERS], registry, WorkloadSpec(events=4000, keys=200, poison_share=0.02)
        ).messages()
    )
    poison = [m for m in messages if m.kind == "poison"]
    assert {m.poison_kind for m in poison} == set(JSON_POISON_KINDS)
    schemas = entity_schemas(CUSTOMERS, registry)
    readers: dict[str, Any] = {"key": schemas.key.definition, "value": schemas.value.definition}
    oracle = EntityOracle(
        JSON_CUSTOMERS, ["id"], load_fingerprints([SCHEMAS]), json_readers=readers
    )
    for offset, message in enumerate(poison):
        oracle.feed(message.key, message.value, 0, offset)
    assert oracle.undecodable == len(poison)
    assert not oracle.rows


def test_an_oracle_of_a_json_entity_needs_its_readers() -> None:
    with pytest.raises(ValueError, match="json_readers"):
        EntityOracle(JSON_CUSTOMERS, ["id"], {})


def test_an_encoder_alternates_forms_when_mixed(registry: FileSchemaRegistry) -> None:
    encoder = JsonEncoder(entity_schemas(CUSTOMERS, registry).key, "precise", "mixed")
    forms = [set(json.loads(encoder.encode({"id": n}))) for n in range(4)]
    assert forms == [{"id"}, {"schema", "payload"}, {"id"}, {"schema", "payload"}]
