"""``cdc-publisher-kafka``: silver Change Data Feed -> Avro change topics, exactly-once.

Per entity: silver's change feed (source) -> change events encoded with the topic's
registered schemas (transform) -> one Kafka transaction per micro-batch that also records
how far it got (sink). A replayed micro-batch skips everything already published.
"""

from __future__ import annotations

import logging
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
from cdc_shared.changefeed import LatestVersion, change_feed, shape_changes
from cdc_shared.clients import make_admin
from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.layout import PUBLISHER_KAFKA
from cdc_shared.schemas import entity_schemas, make_registry
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    QueryIdentity,
    StreamRunner,
    foreach_batch_writer,
    rebuilding_on_schema_change,
    start_streams,
)
from cdc_shared.tables import wait_for_table
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_publisher_kafka.contract import ChangeTopicContract, encode_changes, register_contract
from cdc_publisher_kafka.transactions import (
    Message,
    Progress,
    TransactionalPublisher,
    ensure_topics,
)

SERVICE = PUBLISHER_KAFKA
log = logging.getLogger("cdc_publisher_kafka")


class EntityPublication:
    """One entity's stream: ``silver/<entity>`` changes into its change topic."""

    def __init__(
        self,
        spark: SparkSession,
        config: PipelineConfig,
        entity: EntityConfig,
        runner: StreamRunner,
        contract: ChangeTopicContract,
    ) -> None:
        self.spark = spark
        self.config = config
        self.settings = config.publisher_kafka
        self.entity = entity
        self.runner = runner
        self.contract = contract
        self.identity = QueryIdentity()
        self.silver_path = config.layout.silver(entity.name)
        self.latest_version = LatestVersion(spark, self.silver_path)
        self.publisher = TransactionalPublisher(
            config.kafka,
            self.settings,
            contract.topic,
            on_problem=lambda problem: runner.set_problem(entity.name, problem),
        )

    def source(self) -> DataFrame:
        """Silver's change feed from the configured start."""
        return change_feed(self.spark, self.silver_path, self.settings)

    def writer(self, once: bool) -> DataStreamWriter:
        """source -> foreachBatch(publish in one transaction)."""
        return foreach_batch_writer(
            self.source(),
            self.process_batch,
            self.config.checkpoint_path(SERVICE, self.entity.name),
            once,
            self.settings.trigger_interval,
        )

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Publish the batch's changes not published yet, with the progress, atomically."""
        started = time.monotonic()
        query_id = self.identity.get()
        published = self.publisher.progress
        if published is not None and published.covers(query_id, batch_id):
            log.info(
                "batch already published: skipped",
                extra={"service": SERVICE, "entity": self.entity.name, "batch_id": batch_id},
            )
            self.runner.report(self.entity.name, batch_id, BatchStats(counts={"skipped": 1}))
            return
        changes = shape_changes(batch, self.entity.key, self.settings.include_before)
        encoded = encode_changes(self.spark, changes, self.contract).toArrow()
        if published is not None:
            # Here, not in Spark: a literal that changes every batch would make Spark
            # compile the encoding query again every batch.
            encoded = encoded.filter(pc.greater(encoded["commit_version"], published.version))
        encoded = encoded.sort_by("commit_version")  # per key: changes in commit order
        messages, counts = self._messages(encoded)
        extra: dict[str, object] = {}
        if messages:
            last_version = int(encoded.column("commit_version")[-1].as_py())
            self.publisher.publish(messages, Progress(last_version, query_id, batch_id))
            # The Delta source reports no latest offset: lag = silver versions not yet read.
            extra["lag"] = max(0, self.latest_version.get() - last_version)
        self.runner.report(
            self.entity.name,
            batch_id,
            BatchStats(
                counts={"input_rows": encoded.num_rows, "published": len(messages), **counts},
                extra={
                    **extra,
                    "publish_ms": int((time.monotonic() - started) * 1000),
                    "published_up_to_version": (
                        self.publisher.progress.version if self.publisher.progress else None
                    ),
                },
            ),
        )

    def _messages(self, encoded: pa.Table) -> tuple[list[Message], dict[str, int]]:
        keys = encoded.column("key").to_pylist()
        values = encoded.column("value").to_pylist()
        ops = encoded.column("op").to_pylist()
        counts = {"c": 0, "u": 0, "d": 0}
        messages: list[Message] = []
        tombstones = self.settings.delete_tombstones
        for key, value, op in zip(keys, values, ops, strict=True):
            counts[op] += 1
            messages.append((key, value))
            if tombstones and op == "d":
                messages.append((key, None))
        return messages, {"inserts": counts["c"], "updates": counts["u"], "deletes": counts["d"]}


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Create the topics, register the schemas, start one stream per entity."""
    settings = config.publisher_kafka
    registry = make_registry(config)
    entities = config.select_entities(entity_names)
    ensure_topics(
        make_admin(config.kafka),
        [
            NewTopic(
                settings.progress_topic,
                1,
                settings.topic_replication_factor,
                config={"cleanup.policy": "compact"},
            ),
            *[
                NewTopic(
                    e.change_topic_name,
                    settings.topic_partitions,
                    settings.topic_replication_factor,
                )
                for e in entities
            ],
        ],
    )
    publications: dict[str, EntityPublication] = {}

    def open_stream(
        spark: SparkSession, entity: EntityConfig, runner: StreamRunner
    ) -> tuple[DataStreamWriter, QueryIdentity]:
        silver_path = config.layout.silver(entity.name)
        hint = f"start the merger for entity {entity.name!r} first"
        wait_for_table(spark, silver_path, 0 if once else 3600, hint, log)
        # Registered on every (re)build: after silver's schema changed, the rebuilt stream
        # publishes with the newest schemas.
        registry.refresh()
        contract = register_contract(entity, entity_schemas(entity, registry), registry)
        publication = publications.get(entity.name)
        if publication is None:
            publication = EntityPublication(spark, config, entity, runner, contract)
            publication.publisher.start()
            publications[entity.name] = publication
        publication.contract = contract
        return publication.writer(once), publication.identity

    runner = start_streams(
        SERVICE,
        config,
        settings,
        entity_names,
        spark,
        None,
        open_stream,
        on_failure=rebuilding_on_schema_change("silver"),
    )
    for publication in publications.values():
        runner.on_close(publication.publisher.close)
    return runner


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-publisher-kafka``."""
    return service_main(
        SERVICE, "silver Change Data Feed -> Avro change topics (exactly-once).", start, argv
    )


if __name__ == "__main__":
    sys.exit(main())
