"""What the merger keeps in memory to keep stale events out of silver.

Two guards, each loaded once from its side table and then kept current by the merger
(the tables' only writer), so a batch consults them without reading a table:

- the truncate floor (a ``NewestSequence`` of the truncates): events not newer than the
  newest truncate are dropped.
- ``TombstoneIndex``: the newest delete per key that silver's rows no longer show; an
  upsert not newer than its key's tombstone is dropped, so a late event cannot
  resurrect a deleted row.

An entity's history also keeps the newest tombstone of all (a ``NewestSequence``): a
batch whose events are all newer than every tombstone and truncate needs neither table
read to rebuild its keys' versions (``cdc_merger.history.write_history``).

Sequences are lists of longs compared element by element; in memory each is packed into
one Python int that orders the same way (``pack_sequence``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from cdc_shared.contracts.silver import SEQUENCE
from cdc_shared.streaming.tables import holds_no_rows
from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F

log = logging.getLogger("cdc_merger")

_LONG_OFFSET = 1 << 63  # shifts a signed long into 0 .. 2**64 - 1
_LONG_BITS = 64


def pack_sequence(sequence: Iterable[int]) -> int:
    """One int that orders like the sequence (element by element) among equal lengths.

    A sequence's length is fixed per entity (one element per ``sequence_by`` path), so
    packed sequences of one entity compare exactly as the lists do. A one-element
    sequence packs to its element (the common case, and vectorised by
    ``packed_sequences``).
    """
    values = [int(v) for v in sequence]
    if len(values) == 1:
        return values[0]
    packed = 0
    for value in values:
        packed = (packed << _LONG_BITS) | (value + _LONG_OFFSET)
    return packed


def sequence_literal(sequence: list[int]) -> Column:
    """A sequence as a Spark ``array<bigint>`` literal."""
    return F.array(*[F.lit(v).cast("long") for v in sequence])


class NewestSequence:
    """The newest ``_cdc_seq`` of one of an entity's side tables (truncates, tombstones).

    Read from the table on first use (one small job), then raised by the merger as it
    writes the table. Raised before the write commits, it may run ahead of the table,
    never behind: its readers only skip work when a batch is newer than it.
    """

    def __init__(self, spark: SparkSession, path: str) -> None:
        self._spark = spark
        self._path = path
        self._sequence: list[int] | None = None
        self._loaded = False

    def get(self) -> list[int] | None:
        """The newest sequence, or None when the table holds none."""
        if not self._loaded:
            self._sequence = _newest_sequence(self._spark, self._path)
            self._loaded = True
        return self._sequence

    def raise_to(self, sequence: list[int]) -> None:
        """Remember a sequence written to the table (the newest never goes down)."""
        current = self.get()
        if current is None or sequence > current:
            self._sequence = list(sequence)


def _newest_sequence(spark: SparkSession, path: str) -> list[int] | None:
    """The newest ``_cdc_seq`` of a side table (a small job; none for an empty table)."""
    if holds_no_rows(spark, path):
        return None
    row = spark.read.format("delta").load(path).agg(F.max(SEQUENCE)).first()
    newest = None if row is None else row[0]
    return None if newest is None else [int(v) for v in newest]


def key_values(table: pa.Table, key: list[str]) -> Iterator[Hashable]:
    """The keys of an Arrow table's rows: the value itself for one column, else a tuple."""
    columns = [table.column(k).to_pylist() for k in key]
    return iter(columns[0]) if len(columns) == 1 else zip(*columns, strict=True)


def packed_sequences(table: pa.Table) -> Iterator[int]:
    """The ``_cdc_seq`` column of an Arrow table, packed (``pack_sequence``)."""
    column = table.column(SEQUENCE)
    lengths = pc.list_value_length(column)
    if table.num_rows and pc.all(pc.equal(lengths, 1)).as_py():
        return iter(pc.list_flatten(column).to_pylist())
    return (pack_sequence(s) for s in column.to_pylist())


def load_tombstones(
    spark: SparkSession, tombstone_path: str, silver_path: str, key: list[str]
) -> dict[Hashable, int]:
    """The newest tombstone per key, without the keys whose silver row is newer.

    One Spark job (none while the tombstones table is empty); the result crosses to the
    driver as Arrow.
    """
    if holds_no_rows(spark, tombstone_path):
        return {}
    tombstones = spark.read.format("delta").load(tombstone_path)
    newest = tombstones.groupBy(*key).agg(F.max(SEQUENCE).alias(SEQUENCE)).alias("t")
    silver = spark.read.format("delta").load(silver_path).alias("s")
    condition = F.col(f"s.{SEQUENCE}") > F.col(f"t.{SEQUENCE}")
    for k in key:
        condition = condition & (F.col(f"t.`{k}`") == F.col(f"s.`{k}`"))
    live = newest.join(silver, on=condition, how="left_anti")
    table = live.select(*[F.col(f"`{k}`") for k in key], SEQUENCE).toArrow()
    index = dict(zip(key_values(table, key), packed_sequences(table), strict=True))
    log.info("loaded %d tombstones from %s", len(index), tombstone_path)
    return index


class TombstoneIndex:
    """The newest delete per key, in memory: key -> packed sequence.

    Loaded on first use (the entity's first batch that looks a key up), then kept
    current: a delete raises its key's entry, an upsert newer than the entry removes it
    (silver's row, at least as new, guards the key from then on). Memory, measured
    with 1M tombstones by ``tests/bench/bench_tombstones.py``: about 110 bytes per key
    for an integer key and a one-element sequence, about 230 for a two-column key and a
    two-element one; the load needs about 0.5 GiB more for a moment (the Arrow read).
    An entity that stays idle never loads its index.
    """

    def __init__(self, load: Callable[[], dict[Hashable, int]], key: list[str]) -> None:
        self._load = load
        self._key = key
        self._newest: dict[Hashable, int] | None = None

    @classmethod
    def over(
        cls, spark: SparkSession, tombstone_path: str, silver_path: str, key: list[str]
    ) -> TombstoneIndex:
        """An index of the tombstones table (``load_tombstones``), loaded on first use."""
        return cls(lambda: load_tombstones(spark, tombstone_path, silver_path, key), key)

    def _index(self) -> dict[Hashable, int]:
        if self._newest is None:
            self._newest = self._load()
        return self._newest

    def __len__(self) -> int:
        return len(self._index())

    def stale_upserts(self, upserts: pa.Table) -> list[Hashable]:
        """Keys of the upserts (key columns and ``_cdc_seq``) not newer than their tombstone."""
        index = self._index()
        if not index:
            return []
        keys, sequences = key_values(upserts, self._key), packed_sequences(upserts)
        return [
            key
            for key, sequence in zip(keys, sequences, strict=True)
            if key in index and sequence <= index[key]
        ]

    def record(self, deletes: pa.Table, upserts: pa.Table) -> None:
        """Take in a batch just merged: its deletes and the upserts it offered silver."""
        index = self._index()
        for key, sequence in zip(
            key_values(deletes, self._key), packed_sequences(deletes), strict=True
        ):
            if sequence > index.get(key, -1):
                index[key] = sequence
        if not index:
            return
        for key, sequence in zip(
            key_values(upserts, self._key), packed_sequences(upserts), strict=True
        ):
            if key in index and sequence > index[key]:
                del index[key]

    def forget(self) -> None:
        """Drop what is in memory; the next use loads the table again (after an expiry)."""
        self._newest = None
