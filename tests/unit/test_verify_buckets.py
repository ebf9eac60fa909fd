"""``cdc verify``'s key buckets without servers: spills, digests and the drill-down."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cdc_cli import verify_buckets
from cdc_cli.verify import (
    RowShape,
    TargetRecord,
    compare_target,
    null_update_columns,
    spill_target,
)
from cdc_cli.verify_buckets import (
    MAX_BUCKETS,
    REPEATED,
    BucketSpill,
    bucket_count,
    bucket_of,
    compare_spills,
    digest,
    key_text,
)
from cdc_shared.config.entities import EntityConfig
from pyspark.sql import types as T

SCHEMA = T.StructType(
    [
        T.StructField("id", T.IntegerType()),
        T.StructField("name", T.StringType()),
        T.StructField("updated_at", T.TimestampType()),
        T.StructField("_cdc_seq", T.ArrayType(T.LongType())),
    ]
)
SHAPE = RowShape.of(SCHEMA, EntityConfig(name="c", source_topic="t", key=["id"]))
BUCKETS = 8


def _row(key: int, name: str | None = None) -> dict[str, object]:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=key)
    return {"id": key, "name": name or f"n{key}", "updated_at": at, "_cdc_seq": [key]}


def _silver(folder: Path, keys: range, buckets: int = BUCKETS) -> BucketSpill:
    spill = BucketSpill(folder / "silver", buckets)
    for position, key in enumerate(keys):
        row = _row(key)
        spill.add(key_text(SHAPE.key_of(row)), SHAPE.hash_of(row), position)
    return spill


def _keys_bucket(key: int, buckets: int = BUCKETS) -> int:
    return bucket_of(key_text((key,)), buckets)


def test_bucket_count_follows_the_row_count_within_bounds() -> None:
    assert bucket_count(0) == 1
    assert bucket_count(1, rows_per_bucket=10) == 1
    assert bucket_count(101, rows_per_bucket=10) == 11
    assert bucket_count(10**12) == MAX_BUCKETS


def test_a_key_has_one_bucket_whatever_side_it_comes_from() -> None:
    # Canonical values: the ES side's text timestamp and silver's datetime key alike.
    stamp = T.StructType([T.StructField("at", T.TimestampType())])
    shape = RowShape.of(stamp, EntityConfig(name="c", source_topic="t", key=["at"]))
    from_silver = key_text(shape.key_of({"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}))
    from_es = key_text(shape.key_of({"at": "2026-01-01T00:00:00Z"}))
    assert from_silver == from_es
    assert bucket_of(from_silver, 64) == bucket_of(from_es, 64)
    assert {bucket_of(key_text((k,)), 16) for k in range(1000)} == set(range(16))


def test_the_last_record_of_a_key_by_position_wins_and_a_delete_removes_it(
    tmp_path: Path,
) -> None:
    spill = BucketSpill(tmp_path, 1)
    spill.add("[1]", "v2", 7)
    spill.add("[1]", "v1", 3)  # written later, but an older offset: stale
    spill.add("[2]", "v1", 1)
    spill.add("[2]", None, 2)  # deleted last
    spill.add("[3]", None, 4)
    spill.add("[3]", "v3", 5)  # deleted, then inserted again
    assert spill.live(0) == {"[1]": "v2", "[3]": "v3"}
    assert digest(spill.live(0)) == digest({"[3]": "v3", "[1]": "v2"})  # order-free
    assert digest({"[1]": "v2"}) != digest({"[1]": "v3"}) != digest({"[2]": "v3"})


def test_equal_sides_compare_no_key(tmp_path: Path) -> None:
    silver = _silver(tmp_path, range(200))
    target = spill_target(
        (TargetRecord(_row(k), _row(k), k) for k in reversed(range(200))),
        SHAPE,
        tmp_path / "es",
        BUCKETS,
    )
    result = compare_spills(silver, target, examples=5)
    assert (result.buckets, result.buckets_differing, result.rows) == (BUCKETS, 0, 200)
    assert result.counts == {"missing": 0, "extra": 0, "different": 0}
    assert result.examples == {}


def test_drill_down_finds_missing_extra_different_stale_and_deleted_keys(
    tmp_path: Path,
) -> None:
    silver = _silver(tmp_path, range(100))
    events: list[TargetRecord] = []
    for key in range(100):
        if key == 10:
            continue  # never published: missing
        events.append(TargetRecord(_row(key), _row(key), 1000 + key))
    events.append(TargetRecord(_row(20), _row(20, "changed"), 2000))  # different
    events.append(TargetRecord(_row(30), _row(30, "older"), 5))  # stale, read later
    events.append(TargetRecord(_row(40), None, 2001))  # a delete as the last event: missing
    events.append(TargetRecord(_row(50), _row(50, "older"), 2002))  # a stale version last
    events.append(TargetRecord(_row(500), _row(500), 2003))  # not in silver: extra
    events.append(TargetRecord(_row(600), _row(600), 2004))
    events.append(TargetRecord(_row(600), None, 2005))  # extra, then deleted: absent

    comparison = compare_target("change_topic", "topic", SHAPE, silver, events, examples=5)
    assert (comparison.missing, comparison.extra, comparison.different) == (2, 1, 2)
    assert comparison.examples == {
        "missing": ["id=10", "id=40"],
        "extra": ["id=500"],
        "different": ["id=20", "id=50"],
    }
    assert comparison.rows == 99 - 1 + 1  # 10 and 40 gone, 500 there
    differing = {_keys_bucket(k) for k in (10, 20, 40, 50, 500)}
    assert (comparison.buckets, comparison.buckets_differing) == (BUCKETS, len(differing))
    assert not comparison.ok
    assert not (tmp_path / "change_topic").exists()  # the target's spill is removed


def test_examples_are_the_first_keys_in_order_across_buckets(tmp_path: Path) -> None:
    silver = _silver(tmp_path, range(300))
    kept = [TargetRecord(_row(k), _row(k), k) for k in range(300) if k % 7]
    result = compare_spills(silver, spill_target(kept, SHAPE, tmp_path / "t", BUCKETS), 3)
    assert result.counts["missing"] == len(range(0, 300, 7))
    assert result.examples == {"missing": [(0,), (105,), (112,)]}  # by repr, as before
    assert result.buckets_differing == len({_keys_bucket(k) for k in range(0, 300, 7)})


def test_a_small_write_buffer_spills_often_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify_buckets, "BUFFER_CHARS", 100)  # a flush every few records
    silver = _silver(tmp_path, range(500), buckets=16)
    assert len(list((tmp_path / "silver").iterdir())) == 16
    records = [TargetRecord(_row(k), _row(k), k) for k in range(500) if k != 77]
    result = compare_spills(silver, spill_target(records, SHAPE, tmp_path / "t", 16), 5)
    assert (result.counts["missing"], result.buckets_differing) == (1, 1)
    assert result.examples == {"missing": [(77,)]}
    assert silver.live(_keys_bucket(77, 16))  # silver read back only for that bucket


def test_sides_must_have_the_same_buckets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="buckets"):
        compare_spills(BucketSpill(tmp_path / "a", 2), BucketSpill(tmp_path / "b", 3), 5)


def test_a_key_recorded_twice_on_a_one_per_key_side_differs(tmp_path: Path) -> None:
    # The history's current versions: one per key. A second one for a key is different
    # even when both hold silver's values; one for a key silver lacks is extra.
    silver = _silver(tmp_path, range(100))
    records = [TargetRecord(_row(k), _row(k), k) for k in range(100)]
    records += [TargetRecord(_row(7), _row(7), 100), TargetRecord(_row(500), _row(500), 101)]
    records += [TargetRecord(_row(501), _row(501), 102), TargetRecord(_row(501), None, 103)]
    topic = compare_target("change_topic", "t", SHAPE, silver, records, examples=5)
    assert (topic.missing, topic.extra, topic.different) == (0, 1, 0)  # a topic may repeat
    history = compare_target("history", "h", SHAPE, silver, records, 5, one_per_key=True)
    assert (history.missing, history.extra, history.different) == (0, 2, 1)
    assert history.examples == {"extra": ["id=500", "id=501"], "different": ["id=7"]}
    assert history.rows == 102
    spill = BucketSpill(tmp_path / "one", 1, one_per_key=True)
    spill.add("[1]", "v1", 1)
    spill.add("[1]", "v1", 2)
    spill.add("[2]", "v2", 3)
    assert spill.live(0) == {"[1]": REPEATED, "[2]": "v2"}


def test_a_shape_within_columns_keeps_the_key_and_the_named_columns_in_order() -> None:
    entity = EntityConfig(name="c", source_topic="t", key=["id"])
    assert SHAPE.within({"updated_at", "phone"}) == RowShape.of(SCHEMA, entity, ["updated_at"])
    assert [f.name for f in SHAPE.within(["updated_at", "name"]).fields] == [
        "id",
        "name",
        "updated_at",
    ]
    assert SHAPE.within([f.name for f in SHAPE.fields]) == SHAPE  # the history carries all
    assert [f.name for f in SHAPE.within([]).fields] == ["id"]


def test_null_update_columns_are_the_named_or_every_non_key_column_silver_has() -> None:
    columns = ["id", "name", "updated_at"]

    def named(setting: bool | list[str]) -> list[str]:
        entity = EntityConfig(name="c", source_topic="t", key=["id"], ignore_null_updates=setting)
        return null_update_columns(entity, columns)

    assert named(False) == []
    assert named(True) == ["name", "updated_at"]
    assert named(["updated_at", "email"]) == ["updated_at"]  # email: not in silver
