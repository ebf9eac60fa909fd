"""A deployment of the releases before one bronze, for the tests of the move from it.

Those releases ran a streaming query per entity (or one over all of them) with a
checkpoint each (``_checkpoints/<service>/<entity>``) and a bronze table per entity
(``bronze/<entity>``). These functions write that state with real Spark queries of the
same shape: Spark's Kafka source and Delta source checkpoints, Delta tables with the
same columns, the same ``txnAppId`` idempotent appends, the merger's own apply step.
"""

from __future__ import annotations

from cdc_ingestor.decode import decode
from cdc_ingestor.ingestion import kafka_source
from cdc_ingestor.projection import quarantine_rows
from cdc_ingestor.schema_learning import SchemaTracker
from cdc_merger.apply import MergeState, apply_batch
from cdc_merger.merging import silver_layout
from cdc_merger.silver_tables import ensure_tables
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.contracts.layout import INGESTOR, MERGER
from cdc_shared.jvm.spark import clock
from cdc_shared.streaming.tables import idempotent_append
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from support.pipelines import Pipeline
from support.silver import refuse_rejects


def legacy_bronze_rows(decoded: DataFrame) -> DataFrame:
    """The records that decoded, as a bronze table of one entity held them."""
    envelope = decoded.schema["envelope"].dataType
    assert isinstance(envelope, T.StructType)
    return decoded.where(F.col("error_kind").isNull()).select(
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_timestamp",
        F.col("decoded_key").alias("key"),
        *[F.col(f"envelope.{f.name}").alias(f.name) for f in envelope.fields],
        F.col("raw_value").isNull().alias("is_tombstone"),
        "sequence",
        "writer_schema",
        clock().alias("ingested_at"),
    )


def legacy_ingest(spark: SparkSession, pipeline: Pipeline, max_offsets: int = 500) -> None:
    """Each entity's topic -> ``bronze/<entity>`` and the quarantine, a query each, once."""
    for entity in pipeline.config.entities:
        _ingest_entity(spark, pipeline, entity, max_offsets)


def _ingest_entity(
    spark: SparkSession, pipeline: Pipeline, entity: EntityConfig, max_offsets: int
) -> None:
    config = pipeline.config
    tracker = SchemaTracker(spark, entity, make_registry(config))
    bronze = config.layout.legacy_bronze(entity.name)
    quarantine = config.layout.quarantine(INGESTOR)
    app = f"cdc-{INGESTOR}-{entity.name}-legacy"

    def write(batch: DataFrame, batch_id: int) -> None:
        decoded = decode(spark, batch, tracker.update(batch), entity.sequence_by)
        idempotent_append(legacy_bronze_rows(decoded), bronze, app, batch_id, merge_schema=True)
        idempotent_append(quarantine_rows(decoded, entity, batch_id), quarantine, app, batch_id)

    query = (
        kafka_source(spark, config, entity.source_topic, "earliest")
        .writeStream.foreachBatch(write)
        .option("checkpointLocation", config.layout.legacy_checkpoint(INGESTOR, entity.name))
        .option("maxOffsetsPerTrigger", max_offsets)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def legacy_merge(spark: SparkSession, pipeline: Pipeline) -> None:
    """Each entity's ``bronze/<entity>`` -> silver, a Delta stream each, once."""
    for entity in pipeline.config.entities:
        _merge_entity(spark, pipeline, entity)


def _merge_entity(spark: SparkSession, pipeline: Pipeline, entity: EntityConfig) -> None:
    config = pipeline.config
    layout = silver_layout(config, entity)
    bronze = config.layout.legacy_bronze(entity.name)
    ensure_tables(spark, spark.read.format("delta").load(bronze).schema, layout)
    state = MergeState(spark, layout)

    def apply(batch: DataFrame, _batch_id: int) -> None:
        apply_batch(spark, batch, layout, refuse_rejects, state)

    query = (
        spark.readStream.format("delta")
        .load(bronze)
        .writeStream.foreachBatch(apply)
        .option("checkpointLocation", config.layout.legacy_checkpoint(MERGER, entity.name))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
