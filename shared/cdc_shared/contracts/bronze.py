"""The bronze table's contract: every entity's change log in one Delta table.

The ingestor appends each micro-batch of every topic it reads to one table
(``StorageLayout.bronze``), partitioned by ``entity``: one commit per batch, whatever the
number of tables in it. A row is one Kafka record that decoded:

- ``entity``, then the columns every entity shares (``SHARED_COLUMNS``): the Kafka
  coordinates, the change's ``op``, whether the record was a Kafka tombstone, its
  ``sequence`` (the entity's ``sequence_by`` values), the writer schema and the ingest
  time;
- ``payload``: the decoded key (``key``) and the rest of the Debezium envelope
  (``before``, ``after``, ``source``, ...) as one ``VARIANT``: self-describing, so
  tables of different shapes share the column.

Each entity's payload type (a Spark struct type) is a table property,
``cdc.payloadType.<entity>``, set by the ingestor before it appends rows of a new type
(widened, never narrowed: a column that leaves the source stays, as with a table per
entity). :func:`entity_changes` reads one entity's rows of a range of versions typed
again, with the columns a table of its own would have: that is how the merger reads
bronze, and how to look at an entity's change log:

    >>> changes = entity_changes(spark, layout.bronze(), "customers")
    >>> changes.where("op = 'd'").select("key.id", "before.email").show()

Change Data Feed is on, so the rows of a range of versions are read by version
(``readChangeFeed``): the feed's inserts are exactly the appended rows (compaction's
rewrites are not changes).

Bronze only appends, unless the pipeline sets a retention (``retention.bronze_hours``,
an entity's ``bronze_retention_hours``): then ``cdc maintenance`` deletes rows older than
it that the merger has merged, and records per entity, in the table property
``cdc.retention.deletedBefore.<entity>``, before when rows may be gone
(:func:`retention_marks`). Readers take only the feed's inserts, and the merger's stream
skips the deletes' commits (``skipChangeCommits``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import ENTITY_COLUMN, INGESTED_AT, RETENTION_PROPERTY
from cdc_shared.streaming.tables import AUTO_COMPACT, table_properties

ENTITY = ENTITY_COLUMN
PAYLOAD = "payload"
#: The Kafka record's coordinates: (topic, partition, offset) is unique in bronze.
KAFKA_COLUMNS = ("kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp")
#: The columns beside ``entity`` and ``payload``, the same for every entity.
SHARED_COLUMNS = (
    *KAFKA_COLUMNS,
    "op",
    "is_tombstone",
    "sequence",
    "writer_schema",
    INGESTED_AT,
)
SCHEMA = T.StructType(
    [
        T.StructField(ENTITY, T.StringType(), False),
        T.StructField("kafka_topic", T.StringType(), True),
        T.StructField("kafka_partition", T.IntegerType(), True),
        T.StructField("kafka_offset", T.LongType(), True),
        T.StructField("kafka_timestamp", T.TimestampType(), True),
        T.StructField("op", T.StringType(), True),
        T.StructField("is_tombstone", T.BooleanType(), False),
        T.StructField("sequence", T.ArrayType(T.LongType()), False),
        T.StructField("writer_schema", T.StringType(), True),
        T.StructField(INGESTED_AT, T.TimestampType(), True),
        T.StructField(PAYLOAD, T.VariantType(), True),
    ]
)
PROPERTIES = {
    "delta.appendOnly": "true",
    "delta.enableChangeDataFeed": "true",
    # Statistics for the entity and the Kafka coordinates: readers select by entity.
    "delta.dataSkippingNumIndexedCols": "5",
    # About one commit a second under load: a log checkpoint every ~100 s, not every 10 s.
    "delta.checkpointInterval": "100",
    **AUTO_COMPACT,
}
#: The table property holding an entity's payload type (Spark's JSON form of a struct).
TYPE_PROPERTY = "cdc.payloadType."
#: The Change Data Feed's rows that are bronze rows (not a retention delete's).
APPENDED = "_change_type = 'insert'"


def properties_for(config: PipelineConfig) -> dict[str, str]:
    """Bronze's table properties: append-only unless the pipeline sets a retention.

    With one, ``delta.appendOnly`` is left as it is: ``cdc maintenance`` turns it off
    before its first delete, and the ingestor does not turn it back on.
    """
    retained = config.retention.bronze_hours is not None or any(
        e.bronze_retention_hours is not None for e in config.entities
    )
    if not retained:
        return PROPERTIES
    return {k: v for k, v in PROPERTIES.items() if k != "delta.appendOnly"}


def retention_marks(properties: Mapping[str, str]) -> dict[str, dt.datetime]:
    """Per entity, before when retention may have deleted its rows (bronze's properties)."""
    return {
        key[len(RETENTION_PROPERTY) :]: dt.datetime.fromisoformat(value)
        for key, value in properties.items()
        if key.startswith(RETENTION_PROPERTY)
    }


def payload_types(properties: Mapping[str, str]) -> dict[str, T.StructType]:
    """Each entity's payload type, from bronze's table properties."""
    types: dict[str, T.StructType] = {}
    for key, value in properties.items():
        if key.startswith(TYPE_PROPERTY):
            parsed = T.StructType.fromJson(json.loads(value))
            types[key[len(TYPE_PROPERTY) :]] = parsed
    return types


def read_payload_types(spark: SparkSession, path: str) -> dict[str, T.StructType]:
    """Each entity's payload type in bronze's latest version (no Spark job)."""
    return payload_types(table_properties(spark, path))


def widened(old: T.StructType | None, new: T.StructType) -> T.StructType:
    """A struct type that holds both ``old`` and ``new``: ``old``'s fields, then ``new``'s.

    A field in both takes ``new``'s type, widened the same way where both are structs.
    The ingestor's reader schema only moves to a version that reads every earlier one,
    so types of a field agree but for fields added inside nested structs.
    """
    if old is None:
        return new
    fields = {f.name: f for f in old.fields}
    for field in new.fields:
        before = fields.get(field.name)
        data_type = field.dataType
        if (
            before is not None
            and isinstance(before.dataType, T.StructType)
            and isinstance(data_type, T.StructType)
        ):
            data_type = widened(before.dataType, data_type)
        fields[field.name] = T.StructField(field.name, data_type, True)
    return T.StructType(list(fields.values()))


def typed(rows: DataFrame, payload_type: T.StructType) -> DataFrame:
    """Bronze rows of one entity with their payload as columns again (see the module).

    The columns: the Kafka coordinates, then the payload's fields (``key``, ``before``,
    ``after``, ...) in ``payload_type``, then ``op``, ``is_tombstone``, ``sequence``,
    ``writer_schema`` and ``ingested_at``. A row written under an older type reads null
    for the fields it lacks.
    """
    payload = F.col(PAYLOAD).cast(payload_type)
    return rows.select(
        *KAFKA_COLUMNS,
        *[payload[f.name].alias(f.name) for f in payload_type.fields],
        *[c for c in SHARED_COLUMNS if c not in KAFKA_COLUMNS],
    )


def entity_changes(
    spark: SparkSession,
    path: str,
    entity: str,
    since_version: int | None = None,
    until_version: int | None = None,
    payload_type: T.StructType | None = None,
) -> DataFrame:
    """``entity``'s bronze rows, typed (:func:`typed`): all, or those of a range of versions.

    ``since_version`` (exclusive) and ``until_version`` (inclusive) bound the commits read
    (Change Data Feed, its inserts); without ``since_version`` (or -1), every row up to
    ``until_version`` (the table as of that version: the same rows, without reading
    every commit since the table's first, but for those retention deleted); without
    either, every row bronze holds. ``payload_type`` defaults to
    the entity's latest (read from the table's properties).
    """
    if payload_type is None:
        types = read_payload_types(spark, path)
        if entity not in types:
            raise ValueError(f"bronze ({path}) holds no rows of entity {entity!r}")
        payload_type = types[entity]
    reader = spark.read.format("delta")
    if since_version is not None and since_version >= 0:
        reader = reader.option("readChangeFeed", "true")
        reader = reader.option("startingVersion", since_version + 1)
        if until_version is not None:
            reader = reader.option("endingVersion", until_version)
    elif until_version is not None:  # every row up to a version: bronze only appends
        reader = reader.option("versionAsOf", until_version)
    rows = reader.load(path).where(F.col(ENTITY) == F.lit(entity))
    if since_version is not None and since_version >= 0:
        rows = rows.where(APPENDED)  # not the rows a retention delete removed
    return typed(rows, payload_type)
