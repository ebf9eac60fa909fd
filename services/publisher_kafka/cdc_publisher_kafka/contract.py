"""The change topic's contract: its registered Avro schemas, and encoding changes in the JVM.

The key and value schemas (``cdc_shared.clients.schemas.change_event_schemas``) are registered
under TopicNameStrategy: in the Confluent registry when one is configured (messages then
carry the Confluent header), else as .avsc files under ``<storage_root>/_schemas`` (Avro
single-object encoding, found by fingerprint). Encoding runs in Spark with ``to_avro``;
only the finished bytes reach Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdc_shared.avro import KnownSchema, SchemaRegistry, subject_name
from cdc_shared.clients.schemas import EntitySchemas, change_event_schemas
from cdc_shared.config.entities import EntityConfig
from cdc_shared.jvm.bridge import spark_type_of_avro
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.avro.functions import to_avro


@dataclass(frozen=True)
class ChangeTopicContract:
    """The registered key and value schemas of one entity's change topic."""

    topic: str
    key: KnownSchema
    value: KnownSchema

    @property
    def row_schema(self) -> dict[str, Any]:
        """The ``Row`` record of the value schema (the type of ``before``/``after``)."""
        for field in self.value.definition["fields"]:
            if field["name"] == "before":
                branch: dict[str, Any] = field["type"][1]
                return branch
        raise AssertionError("a change event schema always has a 'before' field")


def register_contract(
    entity: EntityConfig, schemas: EntitySchemas, registry: SchemaRegistry
) -> ChangeTopicContract:
    """Register the entity's change-event schemas for its change topic (idempotent)."""
    topic = entity.change_topic_name
    key_definition, value_definition = change_event_schemas(entity, schemas)
    return ChangeTopicContract(
        topic=topic,
        key=registry.register(subject_name(topic, True), key_definition),
        value=registry.register(subject_name(topic, False), value_definition),
    )


def _aligned_row(
    spark: SparkSession, row: Column, present: set[str], record: dict[str, Any]
) -> Column:
    """``row`` with exactly the record's fields, in its order.

    A field silver does not have yet (the source schema gained it, but no event carried
    it so far) is null, typed as Spark reads the field's Avro type.
    """
    fields = []
    for field in record["fields"]:
        name = field["name"]
        if name in present:
            fields.append(row[name].alias(name))
        else:
            fields.append(F.lit(None).cast(spark_type_of_avro(spark, field["type"])).alias(name))
    return F.when(row.isNotNull(), F.struct(*fields))


def encode_changes(
    spark: SparkSession, changes: DataFrame, contract: ChangeTopicContract
) -> DataFrame:
    """Shaped changes -> ``commit_version``, ``op``, framed ``key`` and ``value`` bytes."""
    row_type = changes.schema["after"].dataType
    assert isinstance(row_type, T.StructType)
    present = set(row_type.fieldNames())
    record = contract.row_schema
    event = F.struct(
        F.col("op"),
        F.col("key"),
        _aligned_row(spark, F.col("before"), present, record).alias("before"),
        _aligned_row(spark, F.col("after"), present, record).alias("after"),
        F.col("commit_version"),
        F.col("commit_timestamp"),
        F.col("source_sequence"),
    )
    return changes.select(
        F.col("commit_version"),
        F.col("op"),
        F.concat(F.lit(contract.key.header), to_avro(F.col("key"), contract.key.json())).alias(
            "key"
        ),
        F.concat(F.lit(contract.value.header), to_avro(event, contract.value.json())).alias(
            "value"
        ),
    )
