"""publisher-es without servers: Avro -> mapping, document ids, windows, secrets."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from cdc_publisher_es.bulk import Scrubber
from cdc_publisher_es.documents import Action, document_id, latest_per_document
from cdc_publisher_es.mapping import (
    MAX_EXACT_DECIMAL_PRECISION,
    avro_properties,
    entity_properties,
    index_settings,
    spark_type_mapping,
)
from cdc_shared.clients.schemas import envelope_row_schema
from cdc_shared.config.services import PublisherEsConfig
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql import types as T

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def row_schema(name: str) -> dict[str, object]:
    return envelope_row_schema(json.loads((SCHEMAS / name).read_text()))


def test_customers_mapping_from_avro() -> None:
    properties = avro_properties(
        row_schema("dbserver1.inventory.customers-value.avsc"),
        PublisherEsConfig(text_fields=["last_name"]),
    )
    assert properties["id"] == {"type": "integer"}
    assert properties["first_name"] == {"type": "keyword", "ignore_above": 8191}
    assert properties["last_name"]["type"] == "text"
    assert properties["last_name"]["fields"]["keyword"]["type"] == "keyword"
    assert properties["phone"]["type"] == "keyword"  # ["null", "string"]
    assert properties["created_at"] == {"type": "date"}  # timestamp-millis


def test_orders_mapping_decimal_date_enum() -> None:
    schema = row_schema("dbserver1.inventory.orders-value.avsc")
    as_string = avro_properties(schema, PublisherEsConfig())
    assert as_string["amount"] == {"type": "keyword"}  # default: exact strings
    scaled = avro_properties(schema, PublisherEsConfig(decimal_as="scaled_float"))
    assert scaled["amount"] == {"type": "scaled_float", "scaling_factor": 100}
    assert scaled["order_date"] == {"type": "date", "format": "strict_date"}
    assert scaled["status"]["type"] == "keyword"
    assert scaled["order_id"] == {"type": "long"}


def test_wide_decimal_stays_a_string_even_when_scaled_floats_are_asked_for() -> None:
    wide = {"type": "bytes", "logicalType": "decimal", "precision": 30, "scale": 4}
    schema = {"type": "record", "name": "R", "fields": [{"name": "x", "type": wide}]}
    assert MAX_EXACT_DECIMAL_PRECISION < 30
    assert avro_properties(schema, PublisherEsConfig(decimal_as="scaled_float"))["x"] == {
        "type": "keyword"
    }


def test_nested_records_arrays_maps_and_micros() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {
                "name": "address",
                "type": [
                    "null",
                    {
                        "type": "record",
                        "name": "Address",
                        "fields": [
                            {"name": "city", "type": "string"},
                            {"name": "zip", "type": ["null", "int"]},
                        ],
                    },
                ],
            },
            {"name": "previous", "type": {"type": "array", "items": "Address"}},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "attributes", "type": {"type": "map", "values": "string"}},
            {"name": "seen", "type": {"type": "long", "logicalType": "timestamp-micros"}},
            {"name": "blob", "type": "bytes"},
            {"name": "nothing", "type": "null"},
        ],
    }
    properties = avro_properties(schema, PublisherEsConfig(text_fields=["address.city"]))
    assert properties["address"]["properties"]["city"]["type"] == "text"
    assert properties["address"]["properties"]["zip"] == {"type": "integer"}
    assert properties["previous"]["type"] == "nested"  # a named record, referenced
    assert properties["previous"]["properties"]["city"]["type"] == "keyword"
    assert properties["tags"]["type"] == "keyword"
    assert properties["attributes"] == {"type": "flattened"}
    assert properties["seen"] == {"type": "date_nanos"}
    assert properties["blob"] == {"type": "binary"}
    assert "nothing" not in properties


def test_columns_unknown_to_avro_are_mapped_from_spark_types() -> None:
    silver = T.StructType(
        [
            T.StructField("id", T.IntegerType()),
            T.StructField("added", T.StructType([T.StructField("n", T.DecimalType(12, 3))])),
            T.StructField("items", T.ArrayType(T.StructType([T.StructField("a", T.LongType())]))),
        ]
    )
    avro = {"type": "record", "name": "R", "fields": [{"name": "id", "type": "long"}]}
    properties = entity_properties(avro, silver, PublisherEsConfig(decimal_as="scaled_float"))
    assert properties["id"] == {"type": "long"}  # Avro wins where it knows the field
    assert properties["added"]["properties"]["n"] == {
        "type": "scaled_float",
        "scaling_factor": 1000,
    }
    assert properties["items"]["type"] == "nested"
    assert spark_type_mapping(T.TimestampType(), "t", PublisherEsConfig()) == {"type": "date_nanos"}


def test_index_settings_are_explicit() -> None:
    index = index_settings(PublisherEsConfig(refresh_interval="2s", gc_deletes="6h"))["index"]
    assert index["refresh_interval"] == "2s"
    assert index["gc_deletes"] == "6h"
    assert index["number_of_shards"] == 1 and index["number_of_replicas"] == 0


def test_document_id_of_one_column_is_its_value() -> None:
    assert document_id([42]) == "42"
    assert document_id(["a|b"]) == "a|b"


@given(
    st.lists(st.text(alphabet="ab|\\", max_size=4), min_size=2, max_size=3),
    st.lists(st.text(alphabet="ab|\\", max_size=4), min_size=2, max_size=3),
)
def test_composite_ids_are_unambiguous(a: list[str], b: list[str]) -> None:
    if len(a) == len(b):
        assert (document_id(a) == document_id(b)) == (a == b)


def _action(doc_id: str, version: int, op: str = "index") -> Action:
    return Action(op, doc_id, version, None if op == "delete" else "{}", 1, dt.datetime.now())  # noqa: DTZ005


def test_latest_per_document_keeps_the_highest_version() -> None:
    actions = [_action("1", 4), _action("2", 2), _action("1", 7, "delete"), _action("1", 5)]
    kept, dropped = latest_per_document(actions)
    assert dropped == 2
    assert [(a.doc_id, a.version, a.op) for a in kept] == [("1", 7, "delete"), ("2", 2, "index")]


def test_scrubber_removes_secrets_and_url_credentials() -> None:
    scrub = Scrubber(["s3cr3t-key", ""])
    text = scrub("failed: ApiKey s3cr3t-key at https://elastic:hunter2@es.example:9200/_bulk")
    assert "s3cr3t-key" not in text and "hunter2" not in text
    assert "es.example:9200" in text
