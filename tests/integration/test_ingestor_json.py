"""Debezium JSON (Kafka Connect's JsonConverter) into bronze: same rows as Avro, poison kept."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from cdc_devkit.workload import GeneratedMessage, WorkloadGenerator, WorkloadSpec, produce
from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, decode
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.clients.schemas import entity_schemas
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import EntityConfig
from pyspark.sql import DataFrame, SparkSession
from support.entities import ORDERS, SCHEMAS
from support.ingestion import (
    assert_bronze_exactly_once,
    generate,
    ingest_once,
    quarantine,
    typed_bronze_rows,
)
from support.pipelines import PipelineFactory
from support.silver import assert_silver_equals_oracle, merge_once

pytestmark = pytest.mark.integration

REGISTRY = FileSchemaRegistry([SCHEMAS])
JSON = {"value_format": "json", "key_format": "json"}


def _records(messages: list[GeneratedMessage]) -> list[tuple[Any, ...]]:
    when = dt.datetime(2026, 11, 27, tzinfo=dt.UTC)
    return [(m.key, m.value, m.topic, 0, offset, when, 0) for offset, m in enumerate(messages)]


def _decoded(
    spark: SparkSession, entity: EntityConfig, messages: list[GeneratedMessage]
) -> DataFrame:
    plan = DecodePlan.from_schemas(entity_schemas(entity, REGISTRY), REGISTRY, entity=entity)
    raw = spark.createDataFrame(_records(messages), KAFKA_SCHEMA)
    return decode(spark, raw, plan, entity.sequence_by)


def _generated(entity: EntityConfig, form: str = "mixed") -> list[GeneratedMessage]:
    spec = WorkloadSpec(events=400, keys=60, poison_share=0, json_form=form)  # type: ignore[arg-type]
    return list(WorkloadGenerator([entity], REGISTRY, spec).messages())


@pytest.mark.parametrize("decimals", ["precise", "string", "double"])
def test_json_records_decode_to_the_bronze_rows_of_the_same_avro_records(
    spark: SparkSession, decimals: str
) -> None:
    as_json = ORDERS.model_copy(update={**JSON, "decimal_handling": decimals})
    columns = [
        c
        for c in typed_bronze_rows(_decoded(spark, ORDERS, [])).columns
        if c not in ("writer_schema", "ingested_at")
    ]
    avro = typed_bronze_rows(_decoded(spark, ORDERS, _generated(ORDERS))).select(columns)
    json_rows = _decoded(spark, as_json, _generated(as_json))
    assert json_rows.where("error_kind is not null").count() == 0
    got = typed_bronze_rows(json_rows).select(columns)
    assert got.schema.simpleString() == avro.schema.simpleString()
    expected = sorted(avro.collect(), key=lambda r: r.kafka_offset)
    assert expected and sorted(got.collect(), key=lambda r: r.kafka_offset) == expected


def _valid_envelope(form: str = "plain") -> dict[str, Any]:
    as_json = ORDERS.model_copy(update=JSON)
    message = next(
        m
        for m in _generated(as_json, form)
        if m.value and json.loads(m.value).get("payload", json.loads(m.value)).get("op") == "c"
    )
    assert message.value is not None
    return json.loads(message.value)


def test_bad_json_goes_to_quarantine_with_a_kind_and_a_reason(spark: SparkSession) -> None:
    as_json = ORDERS.model_copy(update=JSON)
    good = _valid_envelope()
    wrapped = _valid_envelope("schemas")
    key = b'{"order_id": 1, "line_no": 1}'

    def changed(**fields: Any) -> bytes:
        return json.dumps({**good, **fields}).encode()

    def changed_after(**fields: Any) -> bytes:
        return changed(after={**good["after"], **fields})

    after_without_id = {k: v for k, v in good["after"].items() if k != "order_id"}
    cases: list[tuple[bytes | None, bytes | None, str, str]] = [
        (key, b"{not json", "malformed_json", "value is not JSON"),
        (key, b"[1, 2]", "malformed_json", "not an object"),
        (key, b'"text"', "malformed_json", "not an object"),
        (key, b"", "truncated", "empty"),
        (
            key,
            json.dumps({"schema": wrapped["schema"], "payload": None}).encode(),
            "missing_payload",
            "no 'payload'",
        ),
        (key, changed(ts_ms="soon"), "wrong_type", "JSON type does not fit"),
        (key, changed(after=after_without_id), "wrong_type", "after.order_id is required"),
        (key, changed(op=None), "wrong_type", "op is required"),
        (key, changed_after(amount="@@not base64@@"), "wrong_type", "after.amount does not parse"),
        (
            key,
            changed_after(amount="AQAAAAAAAAAAAAAAAAAAAAAA"),
            "wrong_type",
            "after.amount does not parse",
        ),
        (key, changed_after(order_date="Monday"), "wrong_type", "JSON type does not fit"),
        (b"{oops", changed(), "malformed_json", "key is not JSON"),
        (b'{"order_id": 1}', changed(), "wrong_type", "key: line_no is required"),
        (None, changed(), "null_key", "no key"),
    ]
    messages = [GeneratedMessage("orders", "t", k, v, "poison") for k, v, _, _ in cases]
    valid = {
        json.dumps(wrapped).encode(): None,
        changed_after(amount="/w=="): Decimal("-0.01"),  # 0xff
        changed_after(amount="gAA="): Decimal("-327.68"),  # 0x8000
        changed_after(amount="AIA="): Decimal("1.28"),  # 0x0080
    }
    messages += [GeneratedMessage("orders", "t", key, v, "event") for v in valid]
    rows = sorted(_decoded(spark, as_json, messages).collect(), key=lambda r: r.kafka_offset)
    for offset, (row, (_, _, kind, reason)) in enumerate(zip(rows, cases, strict=False)):
        assert (row.kafka_offset, row.error_kind) == (offset, kind), row.error_message
        assert reason in row.error_message
    decoded = rows[len(cases) :]
    assert [r.error_kind for r in decoded] == [None] * len(valid)
    assert decoded[0].envelope.after.amount is not None
    amounts = [r.envelope.after.amount for r in decoded[1:]]
    assert amounts == [a for a in valid.values() if a is not None]


@pytest.mark.parametrize(("form", "decimals"), [("mixed", "precise"), ("plain", "double")])
def test_a_json_workload_lands_exactly_once_and_merges_to_the_oracle(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    form: str,
    decimals: str,
) -> None:
    pipeline = make_pipeline(entity_settings={**JSON, "decimal_handling": decimals})
    messages = generate(pipeline, events=3000, keys=300, poison_share=0.01, json_form=form)
    report = produce(kafka_config, iter(messages), partitions=3)
    ingest_once(pipeline, spark)
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    expected = Counter((topic, kind) for topic, _, _, kind in report.poison)
    assert {kind for _, kind in expected} <= {"malformed_json", "wrong_type", "null_key"}
    quarantined = quarantine(spark, pipeline).select("kafka_topic", "error_kind").collect()
    assert Counter((r.kafka_topic, r.error_kind) for r in quarantined) == expected
    merge_once(pipeline, spark)
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
