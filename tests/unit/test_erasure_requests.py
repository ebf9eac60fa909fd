"""``cdc erase``'s keys as given, and the erasure log's requests as the merger takes them."""

from __future__ import annotations

import datetime as dt

import pytest
from cdc_cli.erase import KeyShapeError, parse_keys
from cdc_merger.erasure import Erasures
from cdc_shared.config.entities import EntityConfig
from cdc_shared.contracts.erasure import BRONZE_DELETED, ErasureRequest, requests_of, steps_done

ONE = EntityConfig(name="customers", source_topic="t", key=["id"])
TWO = EntityConfig(name="lines", source_topic="t", key=["order_id", "line"])
AT = dt.datetime(2026, 12, 7, tzinfo=dt.UTC)


def test_keys_are_json_objects_or_the_value_of_a_one_column_key() -> None:
    given = ["42", '"abc"', "abc", '{"id": 7}', "", "  "]  # a --keys file: blank lines skipped
    assert parse_keys(ONE, given) == [{"id": 42}, {"id": "abc"}, {"id": "abc"}, {"id": 7}]
    assert parse_keys(TWO, ['{"line": 1, "order_id": 9}']) == [{"line": 1, "order_id": 9}]


@pytest.mark.parametrize(
    ("entity", "given", "says"),
    [
        (TWO, ["9"], "a key of 2 columns (order_id, line); give it as a JSON object"),
        (ONE, ['{"name": 1}'], "key columns are id, not name"),
        (TWO, ['{"order_id": 1}'], "key columns are order_id, line, not order_id"),
        (ONE, [""], "no key given"),
    ],
)
def test_a_key_of_the_wrong_shape_is_refused_saying_why(
    entity: EntityConfig, given: list[str], says: str
) -> None:
    with pytest.raises(KeyShapeError) as refused:
        parse_keys(entity, given)
    assert says in str(refused.value)


def _row(version: int, entity: str, key: str | None, step: str | None = None) -> dict[str, object]:
    return {
        "_commit_version": version,
        "request": None if step is None else 1,
        "entity": entity,
        "key": key,
        "bronze_version": None if step else 5 + version,
        "step": step,
        "recorded_at": AT,
    }


def test_the_log_reads_as_requests_per_commit_and_entity_with_their_steps() -> None:
    rows = [
        _row(1, "customers", '{"id":3}'),
        _row(1, "customers", '{"id":7}'),
        _row(1, "orders", '{"id":3}'),
        _row(2, "customers", None, BRONZE_DELETED),
        _row(3, "customers", '{"id":9}'),
    ]
    requests = requests_of(rows)
    assert [(r.request, r.entity, r.keys, r.bronze_version) for r in requests] == [
        (1, "customers", ('{"id":3}', '{"id":7}'), 6),
        (1, "orders", ('{"id":3}',), 6),
        (3, "customers", ('{"id":9}',), 8),
    ]
    assert steps_done(rows) == {1: {BRONZE_DELETED: AT}}


def test_requests_are_due_in_order_once_the_table_reached_their_bronze_version() -> None:
    erasures = Erasures()
    erasures.pending = tuple(
        ErasureRequest(request, "customers", ('{"id":1}',), bronze, AT)
        for request, bronze in ((1, 10), (4, 20), (6, 30))
    )
    assert [r.request for r in erasures.due(None, 25)] == [1, 4]
    assert [r.request for r in erasures.due(1, 25)] == [4]
    assert [r.request for r in erasures.due(4, 25)] == []  # 6 waits for version 30
    assert [r.request for r in erasures.due(-1, 5)] == []
