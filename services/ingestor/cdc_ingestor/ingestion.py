"""One entity's ingestion: its Kafka topic -> ``bronze/<entity>``, exactly-once, with quarantine.

Spark's Kafka source (source) -> JVM Avro or JSON decoding and contract checks
(transform) -> one foreachBatch writing bronze and quarantine idempotently (sink). The
ingestor runs one such stream per entity, or all of them in one query
(:mod:`cdc_ingestor.one_query`), which writes each entity of a batch through the same
:meth:`EntityIngestion.process_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from cdc_shared.avro import SchemaRegistry
from cdc_shared.clients import spark_kafka_options
from cdc_shared.config import ConfigError, PipelineConfig
from cdc_shared.driver_frames import frame_from_rows
from cdc_shared.jvm_bridge import observation_ready
from cdc_shared.layout import ALL_ENTITIES, INGESTOR
from cdc_shared.observability import Stopwatch
from cdc_shared.stream_checkpoint import CheckpointFiles, HadoopFiles, planned_batches
from cdc_shared.streaming import BatchStats, EntityStreamBase
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    app_id,
    ensure_table,
    idempotent_append,
)
from pyspark.sql import DataFrame, DataFrameReader, Observation, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamReader

from cdc_ingestor.decode import KAFKA_SCHEMA, check_sequence_paths, decode
from cdc_ingestor.framing_headers import BatchHeaders
from cdc_ingestor.incompatible_schema import (
    IncompatibleSchemaError,
    incompatible_stop,
    log_incompatible,
)
from cdc_ingestor.outcomes import count_outcomes, outcome_metrics, outcomes
from cdc_ingestor.projection import (
    BRONZE_PROPERTIES,
    REFUSED_INCOMPATIBLE,
    bronze_rows,
    quarantine_rows,
    refusing_incompatible,
    stamped,
)
from cdc_ingestor.schema_learning import SchemaTracker

SERVICE = INGESTOR

#: A batch or a stream reader (:func:`kafka_reader` sets up either).
ReaderT = TypeVar("ReaderT", DataFrameReader, DataStreamReader)


@dataclass(eq=False)
class EntityIngestion(EntityStreamBase):
    """One entity's stream: its source topic into ``bronze/<entity>``."""

    registry: SchemaRegistry  # one for every entity of the service

    def __post_init__(self) -> None:
        self.schemas = SchemaTracker(self.spark, self.entity, self.registry)
        self.bronze_path = self.config.layout.bronze(self.entity.name)
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        if not self.config.ingestor.one_query:
            refuse_per_entity_after_one_query(self.config, HadoopFiles(self.spark))
        check_sequence_paths(self.spark, self.entity, self.schemas.plan)

    def prepare(self, wait_s: float) -> None:
        """Bronze and quarantine, with explicit schemas, unless they exist.

        Nothing to wait for (``wait_s``): the source is Kafka, not a table.
        """
        empty = frame_from_rows(self.spark, [], KAFKA_SCHEMA)
        bronze_schema = bronze_rows(
            decode(self.spark, empty, self.schemas.plan, self.entity.sequence_by)
        ).schema
        ensure_table(self.spark, self.bronze_path, bronze_schema, BRONZE_PROPERTIES)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)

    def source(self) -> DataFrame:
        """The entity's source topic (:func:`kafka_source`)."""
        return kafka_source(
            self.spark,
            self.config,
            self.entity.source_topic,
            self.config.ingestor.starting_offsets,
        )

    def process_batch(
        self, batch: DataFrame, batch_id: int, headers: BatchHeaders | None = None
    ) -> None:
        """Decode, then append bronze and quarantine idempotently (txnAppId + batch id).

        The decode plan is brought up to date with the registry first
        (``SchemaTracker.update``), and narrowed to the writer schemas the batch uses
        when its framing ``headers`` are known (the one query finds them with its topics).
        Then one decoding pass writes bronze while counting the outcomes and collecting
        the (rare) records to quarantine (observed metrics); when so configured, a record
        of an incompatible writer schema fails that write before its commit, and the
        batch is refused. A replayed batch, whose bronze write Delta skips without running
        it, is counted by a pass of its own. Each pass reads the batch's offsets from
        Kafka again: caching the raw records instead cost ~650 MiB more peak RSS at
        500k-record batches for no throughput (``tests/bench/bench_ingestor.py``).
        """
        app = app_id(SERVICE, self.entity.name, self.identity.get())
        lap = Stopwatch()
        plan = self.schemas.update(batch, headers)
        lap("plan")
        decoded = decode(self.spark, batch, plan, self.entity.sequence_by)
        refuse = self.config.ingestor.on_incompatible_schema == "stop"
        written = refusing_incompatible(decoded) if refuse else decoded
        observation = Observation(f"ingest-{self.entity.name}-{batch_id}")
        observed = written.observe(observation, *outcome_metrics(self.entity))
        try:
            idempotent_append(
                bronze_rows(observed), self.bronze_path, app, batch_id, merge_schema=True
            )
        except Exception as error:
            if REFUSED_INCOMPATIBLE not in str(error):
                raise
            counts, rejected = count_outcomes(decoded, self.entity)
            count = counts.get("incompatible_schema", 0)
            raise IncompatibleSchemaError(incompatible_stop(self.entity, count, rejected)) from None
        lap("bronze")
        counts, rejected = (
            outcomes(observation.get)
            if observation_ready(observation)
            else count_outcomes(decoded, self.entity)  # a replay: Delta skipped the write
        )
        errors = {kind: n for kind, n in counts.items() if kind != "ok"}
        if errors.get("incompatible_schema"):
            log_incompatible(self.entity, batch_id, errors["incompatible_schema"], rejected)
        if errors:
            collected = len(rejected) == sum(errors.values())
            quarantined = (
                frame_from_rows(self.spark, stamped(rejected, batch_id), QUARANTINE_SCHEMA)
                if collected
                else quarantine_rows(decoded, self.entity, batch_id)  # many: another pass
            )
            idempotent_append(quarantined, self.quarantine_path, app, batch_id)
            lap("quarantine")
        self.report(
            batch_id,
            BatchStats(
                counts={
                    "input_rows": sum(counts.values()),
                    "bronze_rows": counts.get("ok", 0),
                    "quarantined_rows": sum(errors.values()),
                },
                extra={"errors": errors, **lap.laps},
            ),
        )


def kafka_source(
    spark: SparkSession, config: PipelineConfig, topics: str, starting_offsets: str
) -> DataFrame:
    """``topics`` (comma-separated) through Spark's Kafka source, failOnDataLoss on.

    With the records' headers: a replayed record's ``cdc.replay.of`` gives its sequence.
    """
    settings = config.ingestor
    reader = kafka_reader(spark.readStream, config, topics, starting_offsets)
    if settings.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", settings.max_offsets_per_trigger)
    return reader.load()


def kafka_reader(
    reader: ReaderT, config: PipelineConfig, topics: str, starting_offsets: str
) -> ReaderT:
    """``reader`` (a stream's or a batch's) set to read ``topics`` as the ingestor does.

    From ``starting_offsets``, failOnDataLoss on, with the records' headers.
    """
    return (
        reader.format("kafka")
        .options(**spark_kafka_options(config.kafka))
        .option("subscribe", topics)
        .option("startingOffsets", starting_offsets)
        .option("failOnDataLoss", "true")
        .option("includeHeaders", "true")
    )


def refuse_per_entity_after_one_query(config: PipelineConfig, files: CheckpointFiles) -> None:
    """ConfigError when the ingestor ran as one query: per-entity streams would repeat it.

    They would resume from where they stood before the switch to one query
    (:mod:`cdc_ingestor.one_query`) and write what it wrote to bronze a second time.
    """
    group = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    if planned_batches(files, group):
        raise ConfigError(
            f"ingestor.one_query is off, but the ingestor ran as one query ({group}): "
            "per-entity streams would resume from before it and write records to bronze "
            "twice. Turn ingestor.one_query on again."
        )
