"""What a decoded batch writes: its bronze rows and its quarantine rows.

``decode`` gives every record an ``error_kind`` (null when it decoded and keeps the
contract); the records without one become bronze rows, the others quarantine rows with
their raw bytes. Also bronze's table properties, and the guard that fails a write meeting
a record of an incompatible writer schema when the entity stops on those.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from cdc_shared import tables
from cdc_shared.config import EntityConfig
from cdc_shared.layout import INGESTOR
from cdc_shared.spark import clock
from cdc_shared.tables import AUTO_COMPACT
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql import types as T

BRONZE_PROPERTIES = {
    "delta.appendOnly": "true",
    # Statistics only for the Kafka coordinates: readers stream bronze, they do not skip.
    "delta.dataSkippingNumIndexedCols": "4",
    # About one commit a second under load: a log checkpoint every ~100 s, not every 10 s.
    "delta.checkpointInterval": "100",
    **AUTO_COMPACT,
}
#: Starts the error that fails a write which met a record of an incompatible writer schema.
REFUSED_INCOMPATIBLE = "cdc-ingestor refused a record of an incompatible writer schema: "


def refusing_incompatible(decoded: DataFrame) -> DataFrame:
    """``decoded``, failing the job that meets a record of an incompatible writer schema.

    The error starts with ``REFUSED_INCOMPATIBLE``; a write of the batch stops before its
    commit, so nothing of the batch is written. Applied above ``decode``'s barrier, it
    costs a comparison per record, not a second decoding.
    """
    kind = F.col("error_kind")
    refused = F.raise_error(F.concat(F.lit(REFUSED_INCOMPATIBLE), F.col("error_message")))
    return decoded.withColumn(
        "error_kind", F.when(kind == F.lit("incompatible_schema"), refused).otherwise(kind)
    )


def bronze_rows(decoded: DataFrame) -> DataFrame:
    """The records that decoded: one bronze row each (tombstones included, flagged)."""
    envelope_fields = decoded.schema["envelope"].dataType
    assert isinstance(envelope_fields, T.StructType)
    return decoded.where(F.col("error_kind").isNull()).select(
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_timestamp",
        F.col("decoded_key").alias("key"),
        *[F.col(f"envelope.{f.name}").alias(f.name) for f in envelope_fields.fields],
        F.col("raw_value").isNull().alias("is_tombstone"),
        "sequence",
        "writer_schema",
        clock().alias("ingested_at"),
    )


def quarantine_columns(entity: EntityConfig, batch_id: int | None) -> list[Column]:
    """The quarantine table's columns for a decoded record (QUARANTINE_SCHEMA's order).

    Without ``batch_id``, ``batch_id`` and ``quarantined_at`` are left null, for the
    caller to fill in on the driver: a per-batch literal would make the query compile
    anew every batch (see ``cdc_shared.spark.clock``).
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
    return tables.quarantine_columns(INGESTOR, entity.name, **given)


def stamped(rows: Sequence[Row], batch_id: int) -> list[dict[str, Any]]:
    """Quarantine rows made by ``quarantine_columns(entity, None)``, completed."""
    now = dt.datetime.now(dt.UTC)
    return [{**row.asDict(), "batch_id": batch_id, "quarantined_at": now} for row in rows]


def quarantine_rows(decoded: DataFrame, entity: EntityConfig, batch_id: int) -> DataFrame:
    """The records that did not decode or broke the contract, with their raw bytes."""
    return decoded.where(F.col("error_kind").isNotNull()).select(
        *quarantine_columns(entity, batch_id)
    )
