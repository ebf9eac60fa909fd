"""``cdc-publisher-kafka``: silver Change Data Feed -> Avro change topics, exactly-once.

One query per group of tables (``cdc_shared.streaming.publishing``): each table's silver change
feed since its progress (source) -> change events encoded with the topic's registered
schemas (transform) -> one Kafka transaction per table write that also records how far
it got (sink). A write run again skips everything already published.
An event larger than the change topic accepts goes to ``quarantine/publisher_kafka``
instead (in the same batch, before its transaction commits); a change topic that went
back (deleted and created again) stops the start, saying how to publish again. An ACL
that refuses the publisher its change topic (or its progress) stops that entity only,
naming the missing permission; a refused transactional id stops the service.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from cdc_shared.avro import SchemaRegistry
from cdc_shared.clients.connect import make_admin
from cdc_shared.clients.schemas import entity_schemas, make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import PublisherKafkaConfig
from cdc_shared.contracts.layout import PUBLISHER_KAFKA
from cdc_shared.contracts.quarantine import QuarantineRecord, quarantine_frame
from cdc_shared.streaming.changefeed import change_feed_range, row_columns, shape_changes
from cdc_shared.streaming.failures import EntityStoppedError, StreamFailedError
from cdc_shared.streaming.groups import TableGroup
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.publishing import ChangeFeedGroup
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.runtime import StreamService, start_service
from cdc_shared.streaming.service import service_main
from cdc_shared.streaming.tables import idempotent_append
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]
from pyspark.sql import SparkSession

from cdc_publisher_kafka.contract import ChangeTopicContract, encode_changes, register_contract
from cdc_publisher_kafka.progress import Progress
from cdc_publisher_kafka.transactions import (
    ChangeTopicResetError,
    Message,
    Oversized,
    PermissionRefusedError,
    TransactionalIdRefusedError,
    TransactionalPublisher,
    ensure_topics,
)

SERVICE = PUBLISHER_KAFKA
#: The quarantine's ``error_kind`` of an event larger than its change topic accepts.
OVERSIZED_EVENT = "oversized_event"
log = logging.getLogger("cdc_publisher_kafka")

#: Who wrote a progress (``Progress.query_id``): the group queries of this release.
PROGRESS_WRITER = "cdc-publisher-kafka"


def _row_fields(contract: ChangeTopicContract) -> set[str]:
    """The row fields the topic's registered value schema holds."""
    return {field["name"] for field in contract.row_schema["fields"]}


@dataclass(eq=False)
class TopicPublication:
    """One table's publication: ``silver/<entity>``'s changes into its change topic.

    Its one transactional producer is made by ``start`` and lives as long as the service;
    its progress (the last silver version published) is the change topic's progress
    group's, committed in each transaction.
    """

    spark: SparkSession
    config: PipelineConfig
    entity: EntityConfig
    registry: SchemaRegistry  # one for every table of the service
    set_problem: Callable[[str, str | None], None]

    def __post_init__(self) -> None:
        self.settings = self.config.publisher_kafka
        self.silver_path = self.config.layout.silver(self.entity.name)
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        self.contract: ChangeTopicContract | None = None  # registered by start()
        self.publisher: TransactionalPublisher | None = None  # made by start()

    def start(self) -> int:
        """Register the topic's schemas; make and start the producer; the version published.

        A change topic that lost what was published to it stops the start
        (StreamFailedError), saying how to publish again. ACLs that refuse this table's
        topic or group hold this table alone (EntityStoppedError); a refused
        transactional id stops the service.
        """
        self._register()
        publisher = TransactionalPublisher(
            self.config.kafka,
            self.settings,
            self.entity.change_topic_name,
            on_problem=lambda problem: self.set_problem(self.entity.name, problem),
        )
        started = False
        try:
            progress = publisher.start()
            started = True
        except ChangeTopicResetError as exc:
            raise StreamFailedError(f"{exc}. {self._republish_hint(publisher)}") from None
        except TransactionalIdRefusedError as exc:  # no transaction at all: the service
            raise StreamFailedError(f"stream for entity {self.entity.name!r} {exc}") from None
        except PermissionRefusedError as exc:  # its own topic or group: this table alone
            raise EntityStoppedError(str(exc)) from None
        finally:
            if not started:  # its producer and consumer: a failed start is made anew
                publisher.close()
        self.publisher = publisher
        return -1 if progress is None else progress.version

    def _register(self) -> None:
        """The topic's schemas, from the entity's newest source schemas (registered)."""
        self.registry.refresh()
        schemas = entity_schemas(self.entity, self.registry)
        self.contract = register_contract(self.entity, schemas, self.registry)

    def _republish_hint(self, publisher: TransactionalPublisher) -> str:
        """How to publish silver again into a change topic that was recreated."""
        group = publisher.transactional_id
        return (
            f"To publish silver's changes into it again: stop publisher-kafka, delete the "
            f"progress (kafka-consumer-groups --bootstrap-server <brokers> --delete "
            f"--group {group}), then start it: it publishes from "
            "publisher_kafka.starting_version or starting_timestamp (unset: from silver's "
            "version 0, as far as its change feed is retained)"
        )

    def close(self) -> None:
        """Release the producer, if ``start`` made one (when the runner closes)."""
        if self.publisher is not None:
            self.publisher.close()

    def publish(self, spark: SparkSession, since: int, until: int) -> BatchStats:
        """Publish silver's changes after ``since`` up to ``until`` and the progress, atomically."""
        started = time.monotonic()
        contract, publisher = self._started()
        feed = change_feed_range(spark, self.silver_path, self.settings, since, until)
        if feed is None:
            return BatchStats(counts={"input_rows": 0})
        if not set(row_columns(feed.schema)) <= _row_fields(contract):
            self._register()  # silver gained a column: the topic's schemas gain it too
            contract, publisher = self._started()
        changes = shape_changes(feed, self.entity.key, self.settings.include_before)
        encoded = encode_changes(spark, changes, contract).toArrow()
        published = publisher.progress
        if published is not None:
            # Here, not in Spark: a literal that changes every batch would make Spark
            # compile the encoding query again every batch.
            encoded = encoded.filter(pc.greater(encoded["commit_version"], published.version))
        encoded = encoded.sort_by("commit_version")  # per key: changes in commit order
        messages, versions, counts = self._messages(encoded)
        oversized: list[Oversized] = []
        if messages:

            def quarantine(events: list[Oversized]) -> None:
                self._quarantine(events, messages, versions, until)

            progress = Progress(until, PROGRESS_WRITER, until)
            oversized = publisher.publish(messages, progress, quarantine)
        return BatchStats(
            counts={
                "input_rows": encoded.num_rows,
                "published": len(messages) - len(oversized),
                "quarantined": len(oversized),
                **counts,
            },
            extra={
                "publish_ms": int((time.monotonic() - started) * 1000),
                "published_up_to_version": until,
            },
        )

    def _started(self) -> tuple[ChangeTopicContract, TransactionalPublisher]:
        """The contract and producer of ``start`` (which runs before any publication)."""
        if self.contract is None or self.publisher is None:
            raise RuntimeError(f"the publication of {self.entity.name!r} was not started")
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
        until: int,
    ) -> None:
        """Quarantine the events too large for the change topic (idempotent per version)."""
        topic = self.entity.change_topic_name
        records = [
            QuarantineRecord(
                SERVICE,
                self.entity.name,
                OVERSIZED_EVENT,
                f"{e.describe()}; not published to {topic} (silver version {versions[e.index]})",
                until,
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
            f"cdc-{SERVICE}-{self.entity.name}",
            until,
        )
        log.warning(
            "change events too large for the change topic: quarantined",
            extra={
                "service": SERVICE,
                "entity": self.entity.name,
                "silver_version": until,
                "count": len(events),
                "first": events[0].describe(),
            },
        )


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
    group_names: list[str] | None = None,
) -> StreamRunner:
    """Create the topics, register the schemas, start each group's query; ``run()`` it."""
    settings = config.publisher_kafka
    registry = make_registry(config)
    progress_topic = NewTopic(
        settings.progress_topic,
        1,
        settings.topic_replication_factor,
        config={"cleanup.policy": "compact"},
    )
    admin = make_admin(config.kafka)
    ensure_topics(admin, [progress_topic, *[change_topic(e, settings) for e in config.entities]])

    def open_group(
        spark: SparkSession, pipeline: PipelineConfig, group: TableGroup, runner: StreamRunner
    ) -> ChangeFeedGroup:
        def open_table(entity: EntityConfig) -> TopicPublication:
            ensure_topics(make_admin(pipeline.kafka), [change_topic(entity, settings)])
            return TopicPublication(spark, pipeline, entity, registry, runner.set_problem)

        return ChangeFeedGroup(spark, pipeline, group, runner, SERVICE, settings, open_table)

    publisher_kafka = StreamService(
        SERVICE,
        settings,
        open_group,
        lag=None,  # silver versions not yet published: each batch reports it
    )
    return start_service(publisher_kafka, config, entity_names, once, spark, group_names)


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
