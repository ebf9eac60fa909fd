"""The merger's tables of an entity: where they live, their columns and properties.

Silver (Change Data Feed and deletion vectors on), its tombstones (deleted keys and the
sequence of their delete), its truncates, and its history when it has one; made at
start unless they exist (:func:`ensure_tables`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc_shared.contracts.silver import (
    COMMIT_TS,
    DELETED_AT,
    METADATA,
    OP,
    PERIOD,
    SEQUENCE,
    SOURCE_TS,
)
from cdc_shared.contracts.silver_side_tables import TRUNCATE_SCHEMA
from cdc_shared.streaming.tables import AUTO_COMPACT, ensure_table
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_merger.history import HistoryTable, history_schema

SILVER_PROPERTIES = {
    "delta.enableChangeDataFeed": "true",
    "delta.enableDeletionVectors": "true",
    **AUTO_COMPACT,
}
#: Puts deletion vectors in a new table's protocol whatever its property says.
DELETION_VECTORS_SUPPORTED = {"delta.feature.deletionVectors": "supported"}
TOMBSTONE_PROPERTIES = {"delta.enableDeletionVectors": "true", **AUTO_COMPACT}


@dataclass(frozen=True)
class SilverLayout:
    """Where one entity's silver table and its side tables live, and its key columns."""

    silver_path: str
    tombstone_path: str
    truncate_path: str
    key: list[str]
    #: The entity's SCD type 2 history, when it has one (``cdc_merger.history``).
    history: HistoryTable | None = None


def silver_schema(bronze_schema: T.StructType, key: list[str]) -> T.StructType:
    """Silver's columns: the row (bronze ``after``), then the change metadata."""
    after = bronze_schema["after"].dataType
    assert isinstance(after, T.StructType)
    missing = [k for k in key if k not in after.fieldNames()]
    if missing:
        raise ValueError(f"key columns {missing} are not columns of the row {after.simpleString()}")
    return T.StructType(
        [T.StructField(f.name, f.dataType, f.name not in key) for f in after.fields]
        + [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
            T.StructField(OP, T.StringType(), False),
            T.StructField(SOURCE_TS, T.TimestampType(), True),
            T.StructField(COMMIT_TS, T.TimestampType(), False),
        ]
    )


def tombstone_schema(silver: T.StructType, key: list[str]) -> T.StructType:
    """Tombstones: the key, the delete's sequence, and when it was recorded.

    Appended, never updated: a key deleted twice has two, and the newest decides.
    """
    return T.StructType(
        [T.StructField(k, silver[k].dataType, False) for k in key]
        + [
            T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
            T.StructField(DELETED_AT, T.TimestampType(), False),
        ]
    )


def stats_columns(schema: T.StructType, names: list[str]) -> dict[str, str]:
    """Statistics for the key and the merger's columns only, never a row's other values.

    Delta keeps each data file's min and max per column in its log (commits, checkpoints)
    for ``delta.logRetentionDuration``, after the rows are deleted and the files
    vacuumed: values there could not be erased (``cdc erase``). The key stays anyway (the
    tombstones keep it, so a late event cannot bring an erased row back). Delta keeps no
    statistics of arrays, maps and structs.
    """
    nested = (T.ArrayType, T.MapType, T.StructType)
    kept = [n for n in names if not isinstance(schema[n].dataType, nested)]
    return {"delta.dataSkippingStatsColumns": ",".join(f"`{c}`" for c in kept)}


def ensure_tables(
    spark: SparkSession,
    bronze_schema: T.StructType,
    layout: SilverLayout,
    deletion_vectors: bool = True,
) -> None:
    """Create silver (Change Data Feed on), its tombstones and truncates unless they exist.

    ``deletion_vectors``: whether a silver made here starts with its MERGEs writing
    deletion vectors (the table feature is in its protocol either way:
    ``cdc_merger.write_mode`` switches the property as the table grows). A history
    always has them on: its write (``history._replace_versions``) fails without them.
    """
    silver = silver_schema(bronze_schema, layout.key)
    writes = {"delta.enableDeletionVectors": "true" if deletion_vectors else "false"}
    properties = SILVER_PROPERTIES | DELETION_VECTORS_SUPPORTED | writes
    stats = stats_columns(silver, [*layout.key, *METADATA])
    ensure_table(spark, layout.silver_path, silver, properties | stats)
    ensure_table(
        spark, layout.tombstone_path, tombstone_schema(silver, layout.key), TOMBSTONE_PROPERTIES
    )
    ensure_table(spark, layout.truncate_path, TRUNCATE_SCHEMA, TOMBSTONE_PROPERTIES)
    if layout.history is not None:
        history = history_schema(silver)
        history_stats = stats_columns(history, [*layout.key, *PERIOD, SOURCE_TS])
        ensure_table(spark, layout.history.path, history, SILVER_PROPERTIES | history_stats)
