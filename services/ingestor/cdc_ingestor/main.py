"""``cdc-ingestor``: Kafka CDC topics -> bronze Delta, exactly-once, with quarantine.

Per entity: Spark's Kafka source (source) -> JVM Avro decoding and contract checks
(transform) -> one foreachBatch writing bronze and quarantine idempotently (sink).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from cdc_shared.avro import AvroSerdeError, SchemaRegistry, UnknownSchemaError, read_header
from cdc_shared.clients import spark_kafka_options
from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.schemas import entity_schemas, make_registry
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    QueryIdentity,
    StreamRunner,
    foreach_batch_writer,
    start_streams,
)
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    app_id,
    ensure_table,
    idempotent_append,
)
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_ingestor.decode import (
    BRONZE_PROPERTIES,
    KAFKA_SCHEMA,
    DecodePlan,
    bronze_rows,
    check_sequence_paths,
    decode,
    quarantine_columns,
    quarantine_rows,
)

SERVICE = "ingestor"
#: Quarantined records of one batch collected to the driver and written from there;
#: a batch with more is quarantined by a third pass over it instead.
MAX_COLLECTED_QUARANTINE = 20_000
log = logging.getLogger("cdc_ingestor")


class EntityIngestion:
    """One entity's stream: its source topic into ``bronze/<entity>``."""

    def __init__(
        self,
        spark: SparkSession,
        config: PipelineConfig,
        entity: EntityConfig,
        registry: SchemaRegistry,
        runner: StreamRunner,
    ) -> None:
        self.spark = spark
        self.config = config
        self.entity = entity
        self.registry = registry
        self.runner = runner
        self.identity = QueryIdentity()
        self.plan = DecodePlan.from_schemas(entity_schemas(entity, registry), registry)
        self.bronze_path = config.table_path("bronze", entity.name)
        self.quarantine_path = config.table_path("quarantine", SERVICE)
        check_sequence_paths(spark, entity, self.plan)

    def create_tables(self) -> None:
        """Bronze and quarantine, with explicit schemas, unless they exist."""
        empty = self.spark.createDataFrame([], KAFKA_SCHEMA)
        bronze_schema = bronze_rows(
            decode(self.spark, empty, self.plan, self.entity.sequence_by)
        ).schema
        ensure_table(self.spark, self.bronze_path, bronze_schema, BRONZE_PROPERTIES)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)

    def source(self) -> DataFrame:
        """The entity's source topic through Spark's Kafka source (failOnDataLoss on)."""
        settings = self.config.ingestor
        reader = (
            self.spark.readStream.format("kafka")
            .options(**spark_kafka_options(self.config.kafka))
            .option("subscribe", self.entity.source_topic)
            .option("startingOffsets", settings.starting_offsets)
            .option("failOnDataLoss", "true")
            .option("includeHeaders", "false")
        )
        if settings.max_offsets_per_trigger:
            reader = reader.option("maxOffsetsPerTrigger", settings.max_offsets_per_trigger)
        return reader.load()

    def writer(self, once: bool) -> DataStreamWriter:
        """source -> foreachBatch(decode, write bronze + quarantine)."""
        return foreach_batch_writer(
            self.source(),
            self.process_batch,
            self.config.checkpoint_path(SERVICE, self.entity.name),
            once,
            self.config.ingestor.trigger_interval,
        )

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Decode, then append bronze and quarantine idempotently (txnAppId + batch id).

        Two passes over the batch, each decoding once: the first counts the outcomes and
        collects the (rare) records to quarantine, the second writes bronze. Only the raw
        Kafka records are cached between them (decoded nested rows cost more to cache
        than to decode again).
        """
        app = app_id(SERVICE, self.entity.name, self.identity.get())
        timings: dict[str, int] = {}
        clock = time.monotonic()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.monotonic()
            timings[f"{name}_ms"] = int((now - clock) * 1000)
            clock = now

        raw = batch.persist(StorageLevel.MEMORY_AND_DISK)  # flat bytes: cheap to cache
        try:
            decoded = decode(self.spark, raw, self.plan, self.entity.sequence_by)
            counts, rejected = self._check(decoded, batch_id)
            if counts.get("unknown_schema") and self._learn_writers(rejected):
                decoded = decode(self.spark, raw, self.plan, self.entity.sequence_by)
                counts, rejected = self._check(decoded, batch_id)
            lap("check")
            idempotent_append(
                bronze_rows(decoded), self.bronze_path, app, batch_id, merge_schema=True
            )
            lap("bronze")
            errors = {kind: n for kind, n in counts.items() if kind != "ok"}
            if errors:
                collected = len(rejected) == sum(errors.values())
                quarantined = (
                    self.spark.createDataFrame(rejected, QUARANTINE_SCHEMA)
                    if collected
                    else quarantine_rows(decoded, self.entity, batch_id)  # many: a third pass
                )
                idempotent_append(quarantined, self.quarantine_path, app, batch_id)
                lap("quarantine")
        finally:
            raw.unpersist()
        self.runner.report(
            self.entity.name,
            batch_id,
            BatchStats(
                counts={
                    "input_rows": sum(counts.values()),
                    "bronze_rows": counts.get("ok", 0),
                    "quarantined_rows": sum(errors.values()),
                },
                extra={"errors": errors, **timings},
            ),
        )

    def _check(self, decoded: DataFrame, batch_id: int) -> tuple[dict[str, int], list[Any]]:
        """One pass: records per outcome, and up to a limit of the records to quarantine."""
        outcome = F.coalesce(F.col("error_kind"), F.lit("ok"))
        record = F.struct(*quarantine_columns(self.entity, batch_id))
        rows = (
            decoded.select(
                outcome.alias("outcome"),
                F.when(F.col("error_kind").isNotNull(), record).alias("rejected"),
            )
            .groupBy("outcome")
            .agg(
                F.count("*").alias("n"),
                F.slice(F.collect_list("rejected"), 1, MAX_COLLECTED_QUARANTINE).alias("rows"),
            )
            .collect()
        )
        counts = {r.outcome: int(r.n) for r in rows}
        collected = [row for r in rows for row in r.rows]
        if sum(n for k, n in counts.items() if k != "ok") > MAX_COLLECTED_QUARANTINE:
            collected = []  # written by a pass of their own
        return counts, collected

    def _learn_writers(self, rejected: list[Any]) -> bool:
        """Ask the registry about unknown headers; True if it knew some (decode again).

        The reader becomes the subject's newest schema (unless pinned), so a compatible new
        column reaches bronze (the bronze write merges the schema).
        """
        headers = {
            (part, bytes(data))
            for row in rejected
            if row.error_kind == "unknown_schema"
            for part, data in (("value", row.raw_value), ("key", row.raw_key))
            if data is not None
        }
        self.registry.refresh()
        known = {"value": self.plan.value_writers, "key": self.plan.key_writers}
        learned: dict[str, list[Any]] = {"value": [], "key": []}
        for part, data in headers:
            try:
                head = read_header(data)
            except AvroSerdeError:
                continue
            if data[: head.size] in known[part]:
                continue
            try:
                schema = self.registry.resolve(head)
            except UnknownSchemaError:
                continue
            if schema not in learned[part]:
                learned[part].append(schema)
        if not learned["value"] and not learned["key"]:
            return False
        log.info(
            "new writer schemas",
            extra={
                "service": SERVICE,
                "entity": self.entity.name,
                "schemas": [s.fingerprint.hex() for s in learned["value"] + learned["key"]],
            },
        )
        newest = DecodePlan.from_schemas(entity_schemas(self.entity, self.registry), self.registry)
        self.plan = newest.with_writers(
            [*self.plan.value_writers.values(), *learned["value"]],
            [*self.plan.key_writers.values(), *learned["key"]],
        )
        log.info(
            "reader schema",
            extra={
                "service": SERVICE,
                "entity": self.entity.name,
                "value_reader": self.plan.value_reader.fingerprint.hex(),
            },
        )
        return True


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Create the tables and start one stream per entity; ``run()`` the result."""
    registry = make_registry(config)

    def open_stream(
        spark: SparkSession, entity: EntityConfig, runner: StreamRunner
    ) -> tuple[DataStreamWriter, QueryIdentity]:
        ingestion = EntityIngestion(spark, config, entity, registry, runner)
        ingestion.create_tables()
        return ingestion.writer(once), ingestion.identity

    return start_streams(
        SERVICE,
        config,
        config.ingestor,
        entity_names,
        spark,
        "maxOffsetsBehindLatest",
        open_stream,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-ingestor``."""
    return service_main(
        SERVICE, "Kafka CDC topics -> bronze Delta tables, exactly-once.", start, argv
    )


if __name__ == "__main__":
    sys.exit(main())
