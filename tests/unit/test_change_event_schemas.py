"""The change-event schemas checked in for downstream teams are the ones the code derives."""

from __future__ import annotations

import json
from pathlib import Path

import fastavro
import pytest
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.clients.schemas import change_event_schemas, entity_schemas
from cdc_shared.config.names import avro_namespace
from cdc_shared.config.pipeline import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("entity_name", ["customers", "orders"])
def test_checked_in_change_event_schemas_match_derivation(
    entity_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "deploy/local/pipeline.yaml")
    entity = config.entity(entity_name)
    key, value = change_event_schemas(
        entity, entity_schemas(entity, FileSchemaRegistry([ROOT / "schemas"]))
    )
    folder = ROOT / "schemas" / "changes"
    assert json.loads((folder / f"{entity.change_topic_name}-key.avsc").read_text()) == key
    assert json.loads((folder / f"{entity.change_topic_name}-value.avsc").read_text()) == value
    parsed = fastavro.parse_schema(value)
    assert [f["name"] for f in parsed["fields"]] == [
        "op",
        "key",
        "before",
        "after",
        "commit_version",
        "commit_timestamp",
        "source_sequence",
    ]


def test_change_event_rows_follow_the_newest_source_schema() -> None:
    config = load_config(ROOT / "deploy/local/pipeline.yaml")
    entity = config.entity("customers")
    _, value = change_event_schemas(
        entity, entity_schemas(entity, FileSchemaRegistry([ROOT / "schemas"]))
    )
    row = value["fields"][2]["type"][1]
    assert "loyalty_tier" in [f["name"] for f in row["fields"]]


@pytest.mark.parametrize("change_topic", ["orders-cdc", "team-a.customers", "cdc.2024.customers"])
def test_change_events_of_an_awkward_topic_have_a_valid_namespace(
    change_topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "deploy/local/pipeline.yaml")
    entity = config.entity("customers").model_copy(update={"change_topic": change_topic})
    key, value = change_event_schemas(
        entity, entity_schemas(entity, FileSchemaRegistry([ROOT / "schemas"]))
    )
    namespace = avro_namespace(change_topic)
    assert namespace != change_topic
    assert fastavro.parse_schema(key)["name"] == f"{namespace}.Key"
    assert fastavro.parse_schema(value)["name"] == f"{namespace}.ChangeEvent"


def test_a_column_selection_narrows_the_change_event_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "deploy/local/pipeline.yaml")
    registry = FileSchemaRegistry([ROOT / "schemas"])

    def row_fields(**selection: object) -> list[str]:
        entity = config.entity("customers").model_copy(update=selection)
        _key, value = change_event_schemas(entity, entity_schemas(entity, registry))
        row = fastavro.parse_schema(value)["fields"][2]["type"][1]
        return [f["name"] for f in row["fields"]]

    every = row_fields()
    assert "phone" in every
    assert row_fields(except_columns=["phone"]) == [c for c in every if c != "phone"]
    assert row_fields(columns=["email"]) == ["id", "email"]  # the key always
