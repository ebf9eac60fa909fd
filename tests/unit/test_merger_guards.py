"""The merger's in-memory guards, without Spark: sequence packing and the tombstone index."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pyarrow as pa
from cdc_merger.guards import TombstoneIndex, pack_sequence, packed_sequences
from cdc_shared.contracts.silver import SEQUENCE
from hypothesis import given
from hypothesis import strategies as st

LONGS = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.integers(min_value=1, max_value=3).flatmap(lambda n: st.tuples(*[LONGS] * n)), st.data())
def test_packed_sequences_order_like_the_sequences(first: tuple[int, ...], data: Any) -> None:
    second = data.draw(st.tuples(*[LONGS] * len(first)))
    assert (pack_sequence(first) < pack_sequence(second)) == (list(first) < list(second))
    assert (pack_sequence(first) == pack_sequence(second)) == (first == second)


@given(
    st.integers(min_value=1, max_value=2).flatmap(
        lambda n: st.lists(st.lists(LONGS, min_size=n, max_size=n))
    )
)
def test_a_column_packs_like_each_sequence(sequences: list[list[int]]) -> None:
    column = pa.table({SEQUENCE: pa.array(sequences, pa.list_(pa.int64()))})
    assert list(packed_sequences(column)) == [pack_sequence(s) for s in sequences]


def events(key: list[str], rows: list[tuple[Any, ...]]) -> pa.Table:
    """Key columns then ``_cdc_seq``, one tuple per row."""
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in range(len(key) + 1)]
    table = {k: pa.array(list(columns[i])) for i, k in enumerate(key)}
    table[SEQUENCE] = pa.array([list(s) for s in columns[-1]], pa.list_(pa.int64()))
    return pa.table(table)


def index_of(key: list[str], loaded: dict[Hashable, int] | None = None) -> TombstoneIndex:
    return TombstoneIndex(lambda: dict(loaded or {}), key)


def test_an_upsert_not_newer_than_its_tombstone_is_stale() -> None:
    index = index_of(["id"])
    index.record(events(["id"], [(1, [20]), (2, [30])]), events(["id"], []))
    upserts = events(["id"], [(1, [10]), (1, [20]), (2, [31]), (3, [5])])
    assert index.stale_upserts(upserts) == [1, 1]


def test_a_newer_upsert_makes_the_tombstone_redundant() -> None:
    index = index_of(["id"])
    index.record(events(["id"], [(1, [20])]), events(["id"], []))
    index.record(events(["id"], []), events(["id"], [(1, [25])]))
    assert len(index) == 0
    assert index.stale_upserts(events(["id"], [(1, [5])])) == []  # silver's row guards now


def test_a_key_keeps_its_newest_delete() -> None:
    index = index_of(["id"])
    index.record(events(["id"], [(1, [40])]), events(["id"], []))
    index.record(events(["id"], [(1, [30])]), events(["id"], []))  # a late, older delete
    assert index.stale_upserts(events(["id"], [(1, [35])])) == [1]
    index.record(events(["id"], []), events(["id"], [(1, [35])]))  # not newer: kept
    assert len(index) == 1


def test_composite_keys_and_two_element_sequences() -> None:
    key = ["tenant", "id"]
    index = index_of(key, {("a", 1): pack_sequence([7, 0])})
    upserts = events(key, [("a", 1, [6, 9]), ("a", 1, [7, 1]), ("b", 1, [0, 0])])
    assert index.stale_upserts(upserts) == [("a", 1)]


def test_loaded_once_and_again_after_forget() -> None:
    loads: list[int] = []

    def load() -> dict[Hashable, int]:
        loads.append(1)
        return {1: pack_sequence([3])}

    index = TombstoneIndex(load, ["id"])
    assert len(index) == 1
    assert index.stale_upserts(events(["id"], [(1, [2])])) == [1]
    assert len(loads) == 1
    index.forget()
    assert len(index) == 1
    assert len(loads) == 2
