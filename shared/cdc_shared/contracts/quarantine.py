"""The quarantine tables' contract: what a service could not process, and why.

Each service that refuses records keeps them in its own table
(``StorageLayout.quarantine``), one row per record: where it came from (the Kafka
coordinates, or the silver table and version), the error, the raw key and value bytes,
and when. ``cdc quarantine`` lists, shows and replays them (docs/design.md, "Tables").
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.jvm.driver_frames import frame_from_rows

#: What could not be processed, from any service (docs/design.md, "Tables").
QUARANTINE_SCHEMA = T.StructType(
    [
        T.StructField("service", T.StringType(), False),
        T.StructField("entity", T.StringType(), False),
        T.StructField("error_kind", T.StringType(), False),
        T.StructField("error_message", T.StringType(), False),
        T.StructField("kafka_topic", T.StringType(), True),
        T.StructField("kafka_partition", T.IntegerType(), True),
        T.StructField("kafka_offset", T.LongType(), True),
        T.StructField("kafka_timestamp", T.TimestampType(), True),
        T.StructField("raw_key", T.BinaryType(), True),
        T.StructField("raw_value", T.BinaryType(), True),
        T.StructField("source_table", T.StringType(), True),
        T.StructField("source_version", T.LongType(), True),
        T.StructField("batch_id", T.LongType(), False),
        T.StructField("quarantined_at", T.TimestampType(), False),
    ]
)

QUARANTINE_PROPERTIES = {"delta.appendOnly": "true"}


def properties_for(config: PipelineConfig) -> dict[str, str]:
    """A quarantine table's properties: append-only unless ``retention.quarantine_hours``.

    With a retention, ``delta.appendOnly`` is left as it is (``cdc maintenance`` turns it
    off before its first delete).
    """
    return {} if config.retention.quarantine_hours is not None else QUARANTINE_PROPERTIES


def quarantine_columns(service: str, entity: str, **given: Column) -> list[Column]:
    """The quarantine table's columns, in its order, for a DataFrame of refused records.

    ``given`` names the columns the caller has (``error_kind``, ``raw_value``, ...); the
    others are typed nulls. ``service`` and ``entity`` are literals.
    """
    unknown = set(given) - set(QUARANTINE_SCHEMA.fieldNames()) - {"service", "entity"}
    if unknown:
        raise ValueError(f"not quarantine columns: {sorted(unknown)}")
    fixed = {"service": F.lit(service), "entity": F.lit(entity)}
    return [
        fixed.get(f.name, given.get(f.name, F.lit(None))).cast(f.dataType).alias(f.name)
        for f in QUARANTINE_SCHEMA.fields
    ]


@dataclass(frozen=True)
class QuarantineRecord:
    """One refused record built on the driver (publishers): a row of the quarantine table."""

    service: str
    entity: str
    error_kind: str
    error_message: str
    batch_id: int
    raw_key: bytes | None = None
    raw_value: bytes | None = None
    source_table: str | None = None
    source_version: int | None = None
    kafka_topic: str | None = None
    kafka_partition: int | None = None
    kafka_offset: int | None = None
    kafka_timestamp: dt.datetime | None = None
    quarantined_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def row(self) -> tuple[Any, ...]:
        """The values in the table's column order."""
        return tuple(getattr(self, name) for name in QUARANTINE_SCHEMA.fieldNames())


def quarantine_frame(spark: SparkSession, records: Sequence[QuarantineRecord]) -> DataFrame:
    """The records as a DataFrame of the quarantine table's schema."""
    return frame_from_rows(spark, [r.row() for r in records], QUARANTINE_SCHEMA)


#: The quarantine's columns that name one Kafka record: its entity and coordinates.
QUARANTINED_RECORD = ("entity", "kafka_topic", "kafka_partition", "kafka_offset")
