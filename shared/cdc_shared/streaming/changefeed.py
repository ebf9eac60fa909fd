"""Reading silver's Change Data Feed as changes: what both publishers consume.

A publisher streams ``silver/<entity>`` with ``readChangeFeed`` and shapes each micro-batch
into one row per change, in commit order:

- ``op``: ``c`` (CDF ``insert``), ``u`` (``update_postimage``) or ``d`` (``delete``);
- ``key``: a struct of the primary key columns;
- ``after``: the row after the change (null on delete);
- ``before``: the row before an update or delete, when asked for (else null);
- ``commit_version`` / ``commit_timestamp``: the silver commit of the change;
- ``source_sequence``: the row's ``_cdc_seq``. For a delete that is the sequence of the
  row it removed (Delta's change feed shows a deleted row as it was), so it repeats the
  previous change's sequence; see :func:`external_version` for how a strictly growing
  per-key version is derived from it.

The merger applies one MERGE per micro-batch with one event per key, so a key changes at
most once per silver commit, and ordering by commit version orders the changes of a key.
"""

from __future__ import annotations

import time

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_shared.config.services import ChangeFeedConfig
from cdc_shared.contracts.silver import METADATA, SEQUENCE

CHANGE_TYPE = "_change_type"
COMMIT_VERSION = "_commit_version"
COMMIT_TIMESTAMP = "_commit_timestamp"
CDF_COLUMNS = (CHANGE_TYPE, COMMIT_VERSION, COMMIT_TIMESTAMP)

OP_OF_CHANGE_TYPE = {"insert": "c", "update_postimage": "u", "delete": "d"}

#: Columns of a shaped change batch (see the module docstring).
CHANGE_COLUMNS = (
    "op",
    "key",
    "before",
    "after",
    "commit_version",
    "commit_timestamp",
    "source_sequence",
)

#: The largest source sequence an ES version can carry: versions are 2 * sequence (+1 for
#: a delete), and Elasticsearch versions are signed 64-bit.
MAX_SEQUENCE_FOR_VERSION = (1 << 62) - 1


def change_feed_range(
    spark: SparkSession,
    silver_path: str,
    settings: ChangeFeedConfig,
    since: int,
    until: int,
) -> DataFrame | None:
    """Silver's Change Data Feed after version ``since`` up to ``until`` (a batch read).

    A table nothing was published from (``since`` -1) starts where configured:
    ``starting_timestamp``, else ``starting_version`` (default 0, the table's creation,
    so a first start publishes every change silver ever had). None when that start is
    past ``until``.
    """
    reader = spark.read.format("delta").option("readChangeFeed", "true")
    if since < 0 and settings.starting_timestamp is not None:
        reader = reader.option("startingTimestamp", settings.starting_timestamp)
    else:
        first = max(since + 1, settings.starting_version or 0)
        if first > until:
            return None
        reader = reader.option("startingVersion", first)
    return reader.option("endingVersion", until).load(silver_path)


def row_columns(schema: T.StructType) -> list[str]:
    """The entity's own columns in a silver (or silver CDF) schema: no metadata columns."""
    hidden = set(METADATA) | set(CDF_COLUMNS)
    return [f.name for f in schema.fields if f.name not in hidden]


def shape_changes(batch: DataFrame, key: list[str], include_before: bool = False) -> DataFrame:
    """One row per change (``CHANGE_COLUMNS``), ordered by commit version.

    ``include_before`` pairs each ``update_postimage`` with its ``update_preimage`` (same key,
    same version) and gives a delete its removed row; otherwise ``before`` is null.
    """
    columns = row_columns(batch.schema)
    missing = [k for k in key if k not in columns]
    if missing:
        raise ValueError(f"key columns {missing} are not columns of silver ({columns})")
    row = F.struct(*[F.col(f"`{c}`") for c in columns])
    row_type = batch.select(row.alias("row")).schema["row"].dataType
    change_type = F.col(CHANGE_TYPE)
    op: Column = F.lit(None).cast("string")
    for cdf_type, letter in OP_OF_CHANGE_TYPE.items():
        op = F.when(change_type == cdf_type, F.lit(letter)).otherwise(op)

    changes = batch.where(change_type.isin(*OP_OF_CHANGE_TYPE)).select(
        op.alias("op"),
        F.struct(*[F.col(f"`{k}`") for k in key]).alias("key"),
        F.when(change_type == "delete", row).alias("_removed"),
        F.when(change_type != "delete", row).alias("after"),
        F.col(COMMIT_VERSION).alias("commit_version"),
        F.col(COMMIT_TIMESTAMP).alias("commit_timestamp"),
        F.col(SEQUENCE).alias("source_sequence"),
    )
    if include_before:
        preimages = batch.where(change_type == "update_preimage").select(
            F.struct(*[F.col(f"`{k}`") for k in key]).alias("_pre_key"),
            F.col(COMMIT_VERSION).alias("_pre_version"),
            row.alias("_preimage"),
        )
        changes = changes.join(
            preimages,
            (changes["key"] == preimages["_pre_key"])
            & (changes["commit_version"] == preimages["_pre_version"]),
            "left",
        ).withColumn("before", F.coalesce(F.col("_removed"), F.col("_preimage")))
    else:
        changes = changes.withColumn("before", F.lit(None).cast(row_type))
    return changes.select(*CHANGE_COLUMNS)


def external_version(op: str, source_sequence: list[int], commit_version: int) -> int:
    """A version that grows with every change of a key: Elasticsearch's external version.

    With a one-column sequence (e.g. a log sequence number) the version is
    ``2 * sequence``, plus one for a delete: a delete shows the removed row's sequence, so
    it must outrank that row, while any later re-insert has a greater sequence and
    outranks the delete. It depends only on the source, so it survives a rebuild of
    silver. With a composite sequence, which one number cannot order, it is the silver
    commit version (strictly growing per key, but new after a rebuild of silver).
    """
    if len(source_sequence) == 1 and 0 <= source_sequence[0] <= MAX_SEQUENCE_FOR_VERSION:
        return 2 * source_sequence[0] + (1 if op == "d" else 0)
    return commit_version


def silver_version(spark: SparkSession, silver_path: str) -> int:
    """The latest committed version of a Delta table."""
    return int(DeltaTable.forPath(spark, silver_path).history(1).collect()[0]["version"])


class LatestVersion:
    """A Delta table's latest version, read at most every ``max_age_s``.

    For a publisher's lag: a history read is a Spark job, too dear for every micro-batch.
    """

    def __init__(self, spark: SparkSession, path: str, max_age_s: float = 10.0) -> None:
        self.spark, self.path, self.max_age_s = spark, path, max_age_s
        self._version = 0
        self._read_at = -float("inf")

    def get(self) -> int:
        """The version as of at most ``max_age_s`` ago."""
        now = time.monotonic()
        if now - self._read_at >= self.max_age_s:
            self._version = silver_version(self.spark, self.path)
            self._read_at = now
        return self._version
