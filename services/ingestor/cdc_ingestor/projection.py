"""What a decoded batch writes: its bronze rows and its quarantine rows.

``decode`` gives every record an ``error_kind`` (null when it decoded and keeps the
contract); the records without one become bronze rows (``cdc_shared.contracts.bronze``), the
others quarantine rows with their raw bytes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from cdc_shared.config.entities import EntityConfig
from cdc_shared.contracts import bronze, quarantine
from cdc_shared.contracts.layout import INGESTOR
from cdc_shared.jvm.spark import clock
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql import types as T


def bronze_columns(entity: str, envelope: T.StructType) -> list[Column]:
    """A decoded record's bronze row (``cdc_shared.contracts.bronze``), for records that decoded.

    The key and the envelope's fields but ``op`` go into the one ``payload`` column.
    """
    payload = F.struct(
        F.col("decoded_key").alias("key"),
        *[F.col(f"envelope.`{f.name}`").alias(f.name) for f in envelope.fields if f.name != "op"],
    )
    return [
        F.lit(entity).alias(bronze.ENTITY),
        *[F.col(c) for c in bronze.KAFKA_COLUMNS],
        F.col("envelope.op").alias("op"),
        F.col("raw_value").isNull().alias("is_tombstone"),
        F.col("sequence"),
        F.col("writer_schema"),
        clock().alias("ingested_at"),
        F.to_variant_object(payload).alias(bronze.PAYLOAD),
    ]


def payload_type(key: T.DataType, envelope: T.StructType) -> T.StructType:
    """The type of the payload ``bronze_columns`` writes (bronze's ``cdc.payloadType.*``)."""
    fields = [f for f in envelope.fields if f.name != "op"]
    return T.StructType([T.StructField("key", key, True), *fields])


def quarantine_columns(entity: EntityConfig, batch_id: int | None) -> list[Column]:
    """The quarantine table's columns for a decoded record (QUARANTINE_SCHEMA's order).

    Without ``batch_id``, ``batch_id`` and ``quarantined_at`` are left null, for the
    caller to fill in on the driver: a per-batch literal would make the query compile
    anew every batch (see ``cdc_shared.jvm.spark.clock``).
    """
    given = {
        name: F.col(name)
        for name in (
            "error_kind",
            "error_message",
            "kafka_topic",
            "kafka_partition",
            "kafka_offset",
            "kafka_timestamp",
            "raw_key",
            "raw_value",
        )
    }
    if batch_id is not None:
        given |= {"batch_id": F.lit(batch_id), "quarantined_at": F.current_timestamp()}
    return quarantine.quarantine_columns(INGESTOR, entity.name, **given)


def stamped(rows: Sequence[Row], batch_id: int) -> list[dict[str, Any]]:
    """Quarantine rows made by ``quarantine_columns(entity, None)``, completed."""
    now = dt.datetime.now(dt.UTC)
    return [{**row.asDict(), "batch_id": batch_id, "quarantined_at": now} for row in rows]


def quarantine_rows(decoded: DataFrame, entity: EntityConfig, batch_id: int) -> DataFrame:
    """The records that did not decode or broke the contract, with their raw bytes."""
    return decoded.where(F.col("error_kind").isNotNull()).select(
        *quarantine_columns(entity, batch_id)
    )
