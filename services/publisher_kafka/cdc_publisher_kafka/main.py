"""``cdc-publisher-kafka``: silver Change Data Feed -> Avro change topics, exactly-once.

Per entity (or all entities in one query, ``publisher_kafka.one_query``): silver's
change feed (source) -> change events encoded with the topic's
registered schemas (transform) -> one Kafka transaction per micro-batch that also records
how far it got (sink). A replayed micro-batch skips everything already published.
An event larger than the change topic accepts goes to ``quarantine/publisher_kafka``
instead (in the same batch, before its transaction commits); a change topic that went
back (deleted and created again) stops the start, saying how to publish again. An ACL
that refuses the publisher its change topic (or its progress) stops that entity only,
naming the missing permission; a refused transactional id stops the service.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from cdc_shared.avro import SchemaRegistry
from cdc_shared.changefeed import LatestVersion, change_feed, shape_changes
from cdc_shared.clients import make_admin
from cdc_shared.config import EntityConfig, PipelineConfig, PublisherKafkaConfig
from cdc_shared.layout import PUBLISHER_KAFKA, StorageLayout
from cdc_shared.schemas import entity_schemas, make_registry
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    EntityStoppedError,
    EntityStreamBase,
    Failure,
    OnFailure,
    StreamFailedError,
    StreamRunner,
    StreamService,
    rebuilding_on_schema_change,
    refuse_some_entities_in_one_query,
    start_service,
)
from cdc_shared.streaming.delta_union import delta_tables_group
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    QuarantineRecord,
    app_id,
    ensure_table,
    idempotent_append,
    quarantine_frame,
    wait_for_table,
)
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]
from pyspark.sql import DataFrame, SparkSession

from cdc_publisher_kafka.contract import ChangeTopicContract, encode_changes, register_contract
from cdc_publisher_kafka.transactions import (
    ChangeTopicResetError,
    Message,
    Oversized,
    PermissionRefusedError,
    Progress,
    TransactionalIdRefusedError,
    TransactionalPublisher,
    ensure_topics,
)

SERVICE = PUBLISHER_KAFKA
#: The quarantine's ``error_kind`` of an event larger than its change topic accepts.
OVERSIZED_EVENT = "oversized_event"
log = logging.getLogger("cdc_publisher_kafka")

#: A batch the broker's ACLs refused (transactions.py), as Spark reports the failed query.
REFUSED = re.compile(r"\b(PermissionRefusedError|TransactionalIdRefusedError): ([^\n]*)")


@dataclass(eq=False)
class EntityPublication(EntityStreamBase):
    """One entity's stream: ``silver/<entity>`` changes into its change topic.

    Kept when the runner rebuilds its query (see ``start``), so that its one
    transactional producer, made by the first ``prepare``, lives as long as the service.
    """

    registry: SchemaRegistry  # one for every entity of the service

    def __post_init__(self) -> None:
        self.settings = self.config.publisher_kafka
        self.silver_path = self.config.layout.silver(self.entity.name)
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        self.latest_version = LatestVersion(self.spark, self.silver_path)
        self.contract: ChangeTopicContract | None = None  # registered by prepare()
        self.publisher: TransactionalPublisher | None = None  # made by the first prepare()

    def prepare(self, wait_s: float) -> None:
        """Wait for silver, make and start the producer once.

        A change topic that lost what was published to it stops the start
        (StreamFailedError), saying how to publish again. ACLs that refuse this entity's
        topic or group stop this entity alone (EntityStoppedError); a refused
        transactional id stops the service.
        """
        hint = f"start the merger for entity {self.entity.name!r} first"
        wait_for_table(self.spark, self.silver_path, wait_s, hint, log)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)
        if self.publisher is None:
            publisher = TransactionalPublisher(
                self.config.kafka,
                self.settings,
                self.entity.change_topic_name,
                on_problem=self.set_problem,
            )
            started = False
            try:
                publisher.start()
                started = True
            except ChangeTopicResetError as exc:
                raise StreamFailedError(f"{exc}. {self._republish_hint(publisher)}") from None
            except TransactionalIdRefusedError as exc:  # no transaction at all: the service
                raise StreamFailedError(f"stream for entity {self.entity.name!r} {exc}") from None
            except PermissionRefusedError as exc:  # its own topic or group: this entity alone
                raise EntityStoppedError(str(exc)) from None
            finally:
                if not started:  # its producer and consumer: a failed start is made anew
                    publisher.close()
            self.publisher = publisher  # only once started

    def _republish_hint(self, publisher: TransactionalPublisher) -> str:
        """How to publish silver again into a change topic that was recreated."""
        group = publisher.transactional_id
        checkpoint = self.config.checkpoint_path(SERVICE, self.entity.name)
        return (
            f"To publish silver's changes into it again: stop publisher-kafka, delete the "
            f"progress (kafka-consumer-groups --bootstrap-server <brokers> --delete "
            f"--group {group}) and the checkpoint {checkpoint}, then start it: it "
            "publishes from publisher_kafka.starting_version or starting_timestamp (unset: "
            "from silver's version 0, as far as its change feed is retained)"
        )

    def close(self) -> None:
        """Release the producer, if ``prepare`` made one (when the runner closes)."""
        if self.publisher is not None:
            self.publisher.close()

    def source(self) -> DataFrame:
        """Silver's change feed from the configured start."""
        return self.stream_from(None)

    def stream_from(self, version: int | None) -> DataFrame:
        """Silver's change feed from ``version`` (None: the configured start).

        The topic's schemas are registered on every (re)build of the query (alone or in
        the one query): after silver's schema changed, the rebuilt stream publishes with
        the newest schemas.
        """
        self.registry.refresh()
        schemas = entity_schemas(self.entity, self.registry)
        self.contract = register_contract(self.entity, schemas, self.registry)
        return change_feed(self.spark, self.silver_path, self.settings, version)

    def first_start(self) -> int | None:
        """A new stream starts where configured (``publisher_kafka.starting_version``, ...)."""
        return None

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Publish the batch's changes not published yet, with the progress, atomically."""
        started = time.monotonic()
        contract, publisher = self._prepared()
        query_id = self.identity.get()
        published = publisher.progress
        if published is not None and published.covers(query_id, batch_id):
            log.info(
                "batch already published: skipped",
                extra={"service": SERVICE, "entity": self.entity.name, "batch_id": batch_id},
            )
            self.report(batch_id, BatchStats(counts={"skipped": 1}))
            return
        changes = shape_changes(batch, self.entity.key, self.settings.include_before)
        encoded = encode_changes(self.spark, changes, contract).toArrow()
        if published is not None:
            # Here, not in Spark: a literal that changes every batch would make Spark
            # compile the encoding query again every batch.
            encoded = encoded.filter(pc.greater(encoded["commit_version"], published.version))
        encoded = encoded.sort_by("commit_version")  # per key: changes in commit order
        messages, versions, counts = self._messages(encoded)
        extra: dict[str, object] = {}
        oversized: list[Oversized] = []
        if messages:
            last_version = int(encoded.column("commit_version")[-1].as_py())

            def quarantine(events: list[Oversized]) -> None:
                self._quarantine(events, messages, versions, batch_id)

            oversized = publisher.publish(
                messages, Progress(last_version, query_id, batch_id), quarantine
            )
            # The Delta source reports no latest offset: lag = silver versions not yet read.
            extra["lag"] = max(0, self.latest_version.get() - last_version)
        self.report(
            batch_id,
            BatchStats(
                counts={
                    "input_rows": encoded.num_rows,
                    "published": len(messages) - len(oversized),
                    "quarantined": len(oversized),
                    **counts,
                },
                extra={
                    **extra,
                    "publish_ms": int((time.monotonic() - started) * 1000),
                    "published_up_to_version": (
                        publisher.progress.version if publisher.progress else None
                    ),
                },
            ),
        )

    def _prepared(self) -> tuple[ChangeTopicContract, TransactionalPublisher]:
        """The contract and producer of ``prepare`` (which runs before any batch)."""
        if self.contract is None or self.publisher is None:
            raise RuntimeError(f"the stream of {self.entity.name!r} was not prepared")
        return self.contract, self.publisher

    def _messages(self, encoded: pa.Table) -> tuple[list[Message], list[int], dict[str, int]]:
        """The batch's messages, the silver version of each, and the counts per operation."""
        keys = encoded.column("key").to_pylist()
        values = encoded.column("value").to_pylist()
        ops = encoded.column("op").to_pylist()
        commit_versions = encoded.column("commit_version").to_pylist()
        counts = {"c": 0, "u": 0, "d": 0}
        messages: list[Message] = []
        versions: list[int] = []
        tombstones = self.settings.delete_tombstones
        for key, value, op, version in zip(keys, values, ops, commit_versions, strict=True):
            counts[op] += 1
            messages.append((key, value))
            versions.append(version)
            if tombstones and op == "d":
                messages.append((key, None))
                versions.append(version)
        counts = {"inserts": counts["c"], "updates": counts["u"], "deletes": counts["d"]}
        return messages, versions, counts

    def _quarantine(
        self,
        events: list[Oversized],
        messages: list[Message],
        versions: list[int],
        batch_id: int,
    ) -> None:
        """Quarantine the events too large for the change topic (idempotent per batch)."""
        topic = self.entity.change_topic_name
        records = [
            QuarantineRecord(
                SERVICE,
                self.entity.name,
                OVERSIZED_EVENT,
                f"{e.describe()}; not published to {topic} (silver version {versions[e.index]})",
                batch_id,
                raw_key=messages[e.index][0],
                raw_value=messages[e.index][1],
                source_table=self.silver_path,
                source_version=versions[e.index],
            )
            for e in events
        ]
        idempotent_append(
            quarantine_frame(self.spark, records),
            self.quarantine_path,
            app_id(SERVICE, self.entity.name, self.identity.get()),
            batch_id,
        )
        log.warning(
            "change events too large for the change topic: quarantined",
            extra={
                "service": SERVICE,
                "entity": self.entity.name,
                "batch_id": batch_id,
                "count": len(events),
                "first": events[0].describe(),
            },
        )


def refused_permissions(on_failure: OnFailure) -> OnFailure:
    """``on_failure``, after recognising a batch that the broker's ACLs refused.

    A refused change topic, progress topic or progress group stops that entity only: the
    other entities' topics and groups have their own ACLs, and their transactions go on.
    A refused transactional id stops the service: it cannot run a transaction at all.
    The line names the missing permission and how to grant it, never a secret.
    """

    def read(entity: str, error: str) -> Failure | None:
        if refused := REFUSED.search(error):
            service_wide = refused.group(1) == "TransactionalIdRefusedError"
            return Failure(refused.group(2), entity_only=not service_wide)
        return on_failure(entity, error)

    return read


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Create the topics, register the schemas, start the streams; ``run()`` the result.

    One stream per entity, or one query for all of them (``publisher_kafka.one_query``).
    """
    refuse_some_entities_in_one_query(config, SERVICE, entity_names)  # before any topic
    settings = config.publisher_kafka
    registry = make_registry(config)
    entities = config.select_entities(entity_names)
    progress_topic = NewTopic(
        settings.progress_topic,
        1,
        settings.topic_replication_factor,
        config={"cleanup.policy": "compact"},
    )
    ensure_topics(
        make_admin(config.kafka), [progress_topic, *[change_topic(e, settings) for e in entities]]
    )
    publications: dict[str, EntityPublication] = {}
    at_start = {entity.name for entity in entities}

    def kept_publication(
        spark: SparkSession, pipeline: PipelineConfig, entity: EntityConfig, runner: StreamRunner
    ) -> EntityPublication:
        """The entity's publication: made once, reused when its query is rebuilt.

        A table taken up while the service runs gets its change topic here, and its
        producer is closed with the runner.
        """
        if entity.name not in publications:
            if entity.name not in at_start:
                ensure_topics(make_admin(pipeline.kafka), [change_topic(entity, settings)])
            publication = EntityPublication(spark, pipeline, entity, runner, registry)
            publications[entity.name] = publication
            if entity.name not in at_start:
                runner.on_close(publication.close)
        return publications[entity.name]

    publisher_kafka = StreamService(
        SERVICE,
        settings,
        kept_publication,
        lag=None,  # silver versions not yet published: each batch reports it
        on_failure=refused_permissions(rebuilding_on_schema_change("silver")),
        # One query: replays are harmless (each topic's progress says which silver
        # versions it holds), so each table starts where its previous stream reached.
        open_group=(
            delta_tables_group(SERVICE, kept_publication, StorageLayout.silver)
            if settings.one_query
            else None
        ),
    )
    runner = start_service(publisher_kafka, config, entity_names, once, spark)
    for name in at_start & publications.keys():
        runner.on_close(publications[name].close)
    return runner


def change_topic(entity: EntityConfig, settings: PublisherKafkaConfig) -> NewTopic:
    """The entity's change topic as publisher-kafka creates it (when it does not exist)."""
    return NewTopic(
        entity.change_topic_name, settings.topic_partitions, settings.topic_replication_factor
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-publisher-kafka``."""
    return service_main(
        SERVICE, "silver Change Data Feed -> Avro change topics (exactly-once).", start, argv
    )


if __name__ == "__main__":
    sys.exit(main())
