"""The Spark schemas of silver's side tables, which the merger writes.

``silver/_versions`` (``cdc_shared.contracts.silver.VERSIONS_COLUMNS``: each silver
commit, read by the publishers) and an entity's truncates (``silver/_truncates/<entity>``:
the sequence of each TRUNCATE, which ends every version before it). Apart from
``cdc_shared.contracts.silver`` so that module's names stay importable without PySpark.
"""

from __future__ import annotations

from pyspark.sql import types as T

from cdc_shared.contracts.silver import SEQUENCE, VERSIONS_COLUMNS

#: ``silver/_versions`` (``cdc_shared.contracts.silver.VERSIONS_COLUMNS``): written by the merger.
SILVER_VERSIONS_SCHEMA = T.StructType(
    [
        T.StructField(VERSIONS_COLUMNS[0], T.StringType(), False),
        T.StructField(VERSIONS_COLUMNS[1], T.LongType(), False),
        T.StructField(VERSIONS_COLUMNS[2], T.TimestampType(), False),
    ]
)

#: ``silver/_truncates/<entity>``: one row per TRUNCATE of the source table.
TRUNCATE_SCHEMA = T.StructType(
    [
        T.StructField(SEQUENCE, T.ArrayType(T.LongType()), False),
        T.StructField("truncated_at", T.TimestampType(), False),
    ]
)
