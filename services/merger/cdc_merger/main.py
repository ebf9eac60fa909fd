"""``cdc-merger``: bronze change log -> silver current state, order-safe and idempotent.

Per entity: a Delta stream over ``bronze/<entity>`` (source) -> latest event per key,
tombstone filter (transform) -> one MERGE into ``silver/<entity>`` plus tombstones (sink).
"""

from __future__ import annotations

import logging
import sys
import time

from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    QueryIdentity,
    StreamRunner,
    foreach_batch_writer,
    start_streams,
)
from cdc_shared.tables import wait_for_table
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_merger.apply import SilverLayout, apply_batch, ensure_tables

SERVICE = "merger"
log = logging.getLogger("cdc_merger")


def silver_layout(config: PipelineConfig, entity: EntityConfig) -> SilverLayout:
    """``silver/<entity>`` and its tombstones at ``silver/_tombstones/<entity>``."""
    return SilverLayout(
        silver_path=config.table_path("silver", entity.name),
        tombstone_path=config.table_path("silver/_tombstones", entity.name),
        key=list(entity.key),
    )


class EntityMerge:
    """One entity's stream: ``bronze/<entity>`` into ``silver/<entity>``."""

    def __init__(
        self,
        spark: SparkSession,
        config: PipelineConfig,
        entity: EntityConfig,
        runner: StreamRunner,
    ) -> None:
        self.spark = spark
        self.config = config
        self.entity = entity
        self.runner = runner
        self.identity = QueryIdentity()
        self.bronze_path = config.table_path("bronze", entity.name)
        self.layout = silver_layout(config, entity)

    def create_tables(self, wait_s: float) -> None:
        """Silver and tombstones, shaped by bronze (waits for the ingestor to create it)."""
        hint = f"start the ingestor for entity {self.entity.name!r} first"
        wait_for_table(self.spark, self.bronze_path, wait_s, hint, log)
        bronze_schema = self.spark.read.format("delta").load(self.bronze_path).schema
        ensure_tables(self.spark, bronze_schema, self.layout)

    def source(self) -> DataFrame:
        """Bronze as a Delta stream, limited per micro-batch."""
        settings = self.config.merger
        reader = self.spark.readStream.format("delta")
        if settings.max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", settings.max_files_per_trigger)
        if settings.max_bytes_per_trigger:
            reader = reader.option("maxBytesPerTrigger", settings.max_bytes_per_trigger)
        return reader.load(self.bronze_path)

    def writer(self, once: bool) -> DataStreamWriter:
        """source -> foreachBatch(apply to silver)."""
        return foreach_batch_writer(
            self.source(),
            self.process_batch,
            self.config.checkpoint_path(SERVICE, self.entity.name),
            once,
            self.config.merger.trigger_interval,
        )

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Apply the batch; replaying it changes nothing (every step compares sequences)."""
        started = time.monotonic()
        events = batch.persist()
        try:
            # Spark does not count rows a MERGE reads: count them for the batch log.
            input_rows = events.count()
            result = apply_batch(self.spark, events, self.layout)
        finally:
            events.unpersist()
        self.runner.report(
            self.entity.name,
            batch_id,
            BatchStats(
                counts={
                    "input_rows": input_rows,
                    "applied_keys": result.keys,
                    "deletes": result.deletes,
                },
                extra={"merge_ms": int((time.monotonic() - started) * 1000)},
            ),
        )


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Create the tables and start one stream per entity; ``run()`` the result."""

    def open_stream(
        spark: SparkSession, entity: EntityConfig, runner: StreamRunner
    ) -> tuple[DataStreamWriter, QueryIdentity]:
        merge = EntityMerge(spark, config, entity, runner)
        merge.create_tables(wait_s=0 if once else 3600)
        return merge.writer(once), merge.identity

    # Lag: bronze files not yet merged.
    return start_streams(
        SERVICE, config, config.merger, entity_names, spark, "numFilesOutstanding", open_stream
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-merger``."""
    return service_main(SERVICE, "bronze Delta change logs -> silver Delta tables.", start, argv)


if __name__ == "__main__":
    sys.exit(main())
