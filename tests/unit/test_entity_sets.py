"""Tables by pattern: which topics an entity set selects and the entities it makes of them."""

from __future__ import annotations

from typing import Any

import pytest
from cdc_shared.config.entities import EntityConfig, entity_name_from
from cdc_shared.config.entity_sets import resolve_entity_sets, with_discovered_entities
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import ConfigError, interval_seconds
from cdc_shared.streaming.discovery import EntityDiscovery
from cdc_shared.streaming.tables import SourceTableMissingError

BROKER_TOPICS = [
    "dbserver1.inventory.customers",
    "dbserver1.inventory.orders",
    "dbserver1.inventory.order_lines",
    "dbserver1.inventory.audit_log",
    "dbserver1.inventory.tmp_import_2024",
    "dbserver1.other.customers",
    "connect-configs",
    "cdc.inventory.customers",  # this pipeline's own change topic
    "_cdc_publisher_progress",
]
KEYS = {
    "dbserver1.inventory.customers": ["id"],
    "dbserver1.inventory.orders": ["order_id"],
    "dbserver1.inventory.order_lines": ["order_id", "line_no"],
}


def config(*sets: dict[str, Any], entities: list[dict[str, Any]] | None = None) -> PipelineConfig:
    return PipelineConfig(entity_sets=list(sets), entities=entities or [])


def resolved(cfg: PipelineConfig, topics: list[str] = BROKER_TOPICS) -> dict[str, Any]:
    return {e.name: e for e in resolve_entity_sets(cfg, topics, KEYS.get)}


def test_a_pattern_selects_topics_names_tables_and_takes_keys_from_key_schemas() -> None:
    cfg = config(
        {
            "topics_regex": r"dbserver1\.inventory\.(?P<table>.+)",
            "exclude": ["dbserver1.inventory.audit_log", r".*\.tmp_.*"],
            "change_topic": "cdc.inventory.{table}",
            "es_index": "inventory-{table}",
            "sequence_by": ["source.lsn"],
            "overrides": {"orders": {"sequence_by": ["source.ts_ms", "source.lsn"]}},
        }
    )
    entities = resolved(cfg)
    assert sorted(entities) == ["customers", "order_lines", "orders"]
    lines = entities["order_lines"]
    assert lines.source_topic == "dbserver1.inventory.order_lines"
    assert lines.key == ["order_id", "line_no"]
    assert lines.sequence_by == ["source.lsn"]
    assert lines.change_topic_name == "cdc.inventory.order_lines"
    assert lines.es_index_name == "inventory-order_lines"
    assert entities["orders"].sequence_by == ["source.ts_ms", "source.lsn"]
    # The pipeline's own outputs and other schemas' topics are never selected.
    assert all(e.source_topic.startswith("dbserver1.inventory.") for e in entities.values())


def test_an_entity_listed_by_hand_wins_over_a_set_and_keeps_its_settings() -> None:
    cfg = config(
        {"topics_regex": r"dbserver1\.inventory\.(customers|orders)"},
        entities=[
            {
                "name": "clients",
                "source_topic": "dbserver1.inventory.customers",
                "key": ["id"],
                "change_topic": "cdc.clients",
            }
        ],
    )
    entities = resolved(cfg)
    assert sorted(entities) == ["orders"]  # customers is the hand-listed `clients`
    assert entities["orders"].change_topic_name == "cdc.orders"


def test_listed_topics_take_the_last_segment_or_a_name_template() -> None:
    plain = config({"topics": ["dbserver1.other.customers"], "key": ["id"]})
    assert sorted(resolved(plain)) == ["customers"]
    templated = config(
        {
            "topics": ["dbserver1.inventory.orders", "dbserver1.other.customers"],
            "key": ["id"],
            "name": "{topic}",
        }
    )
    assert sorted(resolved(templated)) == [
        "dbserver1_inventory_orders",
        "dbserver1_other_customers",
    ]


def test_a_topic_without_key_schema_or_configured_key_is_refused_by_name() -> None:
    cfg = config({"topics_regex": r"dbserver1\.inventory\.(.+)"})
    with pytest.raises(ConfigError, match=r"'dbserver1\.inventory\.audit_log'.*no key schema"):
        resolved(cfg)
    keyed = config(
        {"topics_regex": r"dbserver1\.inventory\.(.+)", "overrides": {"audit_log": {"key": ["at"]}}}
    )
    with pytest.raises(ConfigError, match="tmp_import_2024"):
        resolved(keyed)


def test_two_sets_selecting_one_topic_and_two_topics_making_one_table_are_errors() -> None:
    overlapping = config(
        {"topics_regex": r"dbserver1\.inventory\.(.+)", "key": ["id"]},
        {"topics": ["dbserver1.inventory.orders"], "key": ["id"]},
    )
    with pytest.raises(ConfigError, match="selected by two entity sets"):
        resolved(overlapping)
    same_name = config({"topics_regex": r"dbserver1\.\w+\.(customers)", "key": ["id"]})
    with pytest.raises(ConfigError, match="share the name 'customers'"):
        resolved(same_name)


def test_a_catch_all_pattern_does_not_feed_on_its_own_change_topics() -> None:
    cfg = config({"topics_regex": r"dbserver1\.inventory\.(orders)|cdc\.(.+)", "key": ["id"]})
    topics = ["dbserver1.inventory.orders", "cdc.orders"]
    assert [e.source_topic for e in resolve_entity_sets(cfg, topics, KEYS.get)] == [
        "dbserver1.inventory.orders"
    ]


@pytest.mark.parametrize(
    ("entity_set", "message"),
    [
        ({}, "give topics_regex, topics, or both"),
        ({"topics_regex": "db.(unclosed"}, "not a regular expression"),
        ({"topics": ["a"], "change_topic": "cdc.{schema}.{table}"}, r"names \['schema'\]"),
        ({"topics_regex": r"(?P<db>\w+)\.(?P<table>\w+)", "name": "{schema}"}, "names"),
        ({"topics": ["a"], "overrides": {"a": {"source_topic": "b"}}}, "cannot override"),
    ],
)
def test_a_wrong_entity_set_fails_at_load_with_its_path(
    entity_set: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        config(entity_set)
    assert "entity_sets" in str(caught.value)


def test_discovery_adds_the_selected_entities_and_leaves_configs_without_sets_alone() -> None:
    cfg = config({"topics_regex": r"dbserver1\.inventory\.(orders)", "key": ["order_id"]})
    found = with_discovered_entities(cfg, topics=lambda _config: BROKER_TOPICS)
    assert [e.name for e in found.entities] == ["orders"]
    assert found.entity("orders").key == ["order_id"]
    bare = PipelineConfig()
    assert with_discovered_entities(bare, topics=lambda _config: BROKER_TOPICS) is bare


def test_entity_names_are_made_from_any_text() -> None:
    assert entity_name_from("Order-Lines") == "order_lines"
    assert entity_name_from("2024_sales") == "t2024_sales"


def test_a_running_service_takes_up_new_tables_once_their_source_is_there(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = with_discovered_entities(
        config({"topics_regex": r"dbserver1\.inventory\.(?P<table>.+)", "key": ["id"]}),
        topics=lambda _config: ["dbserver1.inventory.customers"],
    )
    broker = ["dbserver1.inventory.customers"]
    ready = {"orders": False}
    started: list[str] = []

    def start(entity: EntityConfig) -> bool:
        if not ready.get(entity.name, True):
            raise SourceTableMissingError("bronze/orders is not a Delta table yet")
        if entity.name == "audit_log":
            raise ConfigError("sequence path source.lsn is not in the rows")
        started.append(entity.name)
        return True

    discovery = EntityDiscovery(cfg, "merger", start, topics=lambda _config: broker)
    assert discovery.look() == []  # nothing new
    broker += ["dbserver1.inventory.orders", "dbserver1.inventory.audit_log"]
    assert discovery.look() == []  # orders' bronze is not there yet; audit_log refused
    ready["orders"] = True
    assert discovery.look() == ["orders"]
    assert discovery.look() == []  # taken up once
    assert started == ["orders"]
    assert cfg.entity("orders").source_topic == "dbserver1.inventory.orders"  # known by name
    refusals = [r.message for r in caplog.records if "audit_log" in r.message]
    assert len(refusals) == 1, refusals  # a persisting problem is logged once


def test_a_service_that_stops_takes_up_nothing_more() -> None:
    cfg = config({"topics_regex": r"dbserver1\.inventory\.(?P<table>.+)", "key": ["id"]})
    discovery = EntityDiscovery(
        cfg, "ingestor", lambda _entity: False, topics=lambda _c: BROKER_TOPICS
    )
    assert discovery.look() == []
    assert discovery.started == []


def test_cold_tables_of_a_set_are_written_less_often_than_the_hot_ones() -> None:
    cfg = config(
        {
            "topics_regex": r"dbserver1\.inventory\.(?P<table>.+)",
            "key": ["id"],
            "freshness": "1 minute",  # every table of the set is cold ...
            "overrides": {"orders": {"freshness": None}},  # ... but the hot one
        }
    )
    found = resolved(cfg)
    # A table with a freshness waits in its group's work queue until its oldest change is
    # that old (tests/unit/test_table_queue.py); the hot one is written every batch.
    assert found["customers"].freshness == "1 minute"
    assert interval_seconds(found["customers"].freshness) == 60.0
    assert found["orders"].freshness is None
    with pytest.raises(ValueError, match="freshness"):
        config({"topics": ["a"], "key": ["id"], "freshness": "often"})
    bad_override = config({"topics": ["a"], "key": ["id"], "overrides": {"a": {"freshness": "1"}}})
    with pytest.raises(ConfigError, match="freshness"):
        resolve_entity_sets(bad_override, ["a"], KEYS.get)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5 seconds", 5.0),
        ("500 ms", 0.5),
        ("1 minute", 60.0),
        ("2 hours", 7200.0),
        ("1.5 s", 1.5),
        ("soon", None),
        ("5 fortnights", None),
    ],
)
def test_intervals_are_read_in_seconds(text: str, seconds: float | None) -> None:
    assert interval_seconds(text) == seconds
