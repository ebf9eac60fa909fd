"""Table groups: which tables each query of a service runs (``cdc_shared.streaming.groups``)."""

from __future__ import annotations

import pytest
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.streaming.groups import group_named_by, table_groups


def _config(groups: list[dict[str, object]] | None = None) -> PipelineConfig:
    names = ["customers", "orders", "order_lines", "orders_archive", "payments"]
    return PipelineConfig(
        entities=[{"name": n, "source_topic": f"db.{n}", "key": ["id"]} for n in names],
        groups=groups or [],
        merger={"trigger_interval": "7 seconds"},
    )


def _shape(config: PipelineConfig, **chosen: list[str]) -> dict[str, tuple[list[str], str]]:
    groups = table_groups(config, config.merger, chosen.get("entities"), chosen.get("groups"))
    return {group.name: (group.names, group.trigger_interval) for group in groups}


def test_without_groups_every_table_is_in_the_default_group_at_the_service_s_trigger() -> None:
    config = _config()
    names = [e.name for e in config.entities]
    assert _shape(config) == {"default": (names, "7 seconds")}


def test_each_configured_group_is_a_query_and_the_tables_no_group_names_are_default() -> None:
    config = _config(
        [
            {"name": "hot", "tables": ["orders", "order_*"], "trigger_interval": "1 second"},
            {"name": "cold", "tables": ["*_archive", "order_lines"]},
            {"name": "unused", "tables": ["nothing_matches"]},
        ]
    )
    assert _shape(config) == {
        "default": (["customers", "payments"], "7 seconds"),
        "hot": (["orders", "order_lines"], "1 second"),  # order_lines: the first group's
        "cold": (["orders_archive"], "7 seconds"),  # no trigger of its own: the service's
    }  # a group no table falls in runs no query


def test_group_runs_only_the_groups_named_and_refuses_an_unknown_one() -> None:
    config = _config([{"name": "hot", "tables": ["orders"]}, {"name": "empty", "tables": ["x"]}])
    assert _shape(config, groups=["hot"]) == {"hot": (["orders"], "7 seconds")}
    assert list(_shape(config, groups=["default"])) == ["default"]
    with pytest.raises(ConfigError, match=r"unknown groups \['nope'\].*hot, empty, default"):
        _shape(config, groups=["nope"])
    with pytest.raises(ConfigError, match="no tables to run"):
        _shape(config, groups=["empty"])


def test_entity_runs_those_tables_as_one_group_named_by_them() -> None:
    config = _config([{"name": "hot", "tables": ["orders"]}])
    chosen = _shape(config, entities=["orders", "customers"])
    assert chosen == {"tables-customers-orders": (["orders", "customers"], "7 seconds")}
    with pytest.raises(ConfigError, match="unknown entity 'nope'"):
        _shape(config, entities=["nope"])


def test_a_group_named_by_many_tables_has_a_short_stable_name() -> None:
    names = [f"table_with_a_long_name_{n}" for n in range(10)]
    named = group_named_by(names)
    assert named == group_named_by(list(reversed(names)))  # the same set, the same name
    assert named.startswith("tables-") and len(named) == len("tables-") + 12
    assert named != group_named_by(names[:-1])
    assert group_named_by(["b", "a", "a"]) == "tables-a-b"
