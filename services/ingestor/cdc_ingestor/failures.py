"""How a failed ingestion query reads: restart it, stop its entity, or stop the service.

Spark reports a failed query as one long error text; the patterns below pick out the
failures the ingestor knows and turn each into the line an operator reads.
"""

from __future__ import annotations

import re

from cdc_shared.avro import REGISTRY_UNAVAILABLE
from cdc_shared.clients import (
    KAFKA_TOPIC_AUTHORIZATION_FAILED,
    kafka_authentication_failure,
    kafka_missing_permission,
)
from cdc_shared.config import PipelineConfig
from cdc_shared.layout import ALL_ENTITIES, INGESTOR
from cdc_shared.streaming import Failure, OnFailure

from cdc_ingestor.incompatible_schema import INCOMPATIBLE

#: Spark's failure when the Kafka brokers are out of reach (a query restarted with backoff).
KAFKA_UNAVAILABLE = re.compile(
    r"org\.apache\.kafka\.common\.errors\.(TimeoutException|DisconnectException|NetworkException)"
    r"|Timed out waiting for a node assignment|Cannot fetch record.* in \d+ milliseconds"
)
#: Spark's failure when offsets the checkpoint needs are gone (failOnDataLoss is on).
KAFKA_DATA_LOSS = re.compile(r"KAFKA_DATA_LOSS|Some data may have been lost|OffsetOutOfRange")


def kafka_failures(config: PipelineConfig) -> OnFailure:
    """Read a failed ingestion: Kafka unreachable -> restart; offsets lost -> a clear stop.

    An ACL that refuses the ingestor its source topic stops that entity only, naming the
    missing permission (the one query holds that table back and goes on without it);
    wrong credentials stop the service. A schema registry that stayed
    unavailable past its retry budget stops the entity with the registry's one line
    (nothing of the batch was written or quarantined).
    """

    def read(entity: str, error: str) -> Failure | None:
        if incompatible := INCOMPATIBLE.search(error):
            return Failure(incompatible.group(1), entity_only=True)
        if registry := REGISTRY_UNAVAILABLE.search(error):
            return Failure(
                f"stopped: {registry.group(1)}; nothing of the batch was written or "
                "quarantined: restart once the registry answers",
                entity_only=True,
            )
        if KAFKA_DATA_LOSS.search(error):
            topic = _topic_named(config, entity, error)
            partitions = sorted({int(p) for p in re.findall(rf"{re.escape(topic)}-(\d+)", error)})
            where = ", ".join(map(str, partitions)) or "unknown (see Spark's reason)"
            spark_reason = re.search(r"Reason: (.*)", error)  # Spark's KAFKA_DATA_LOSS line
            one_query = (
                " A new checkpoint of the one query restarts every table: set "
                "ingestor.starting_offsets to the last line of its last committed "
                "offsets/<n> file, the lost partitions set to -2 (docs/configuration.md, "
                "One ingestion query for all tables)."
                if entity == ALL_ENTITIES
                else ""
            )
            return Failure(
                f"stopped: Kafka no longer has records it must ingest from topic {topic!r} "
                f"partition(s) {where} (deleted by retention or delete-records, or the topic "
                "was recreated). The stream stopped at the gap: nothing was skipped and bronze is "
                "as it was. To go on, "
                "accept the gap and restart with a new checkpoint (move "
                f"{config.checkpoint_path(INGESTOR, entity)} aside), then re-snapshot the "
                "source table if its rows are needed; raise the topic's retention.ms so it "
                f"does not happen again.{one_query} Spark: "
                + (spark_reason.group(1) if spark_reason else error.partition("\n")[0])[:600]
            )
        if (refused := kafka_authentication_failure(config.kafka, error)) is not None:
            return Failure(refused)  # the same credentials would fail again
        if KAFKA_TOPIC_AUTHORIZATION_FAILED.search(error):
            # The driver only describes the topic (offsets); the executors read it.
            operation = "Describe" if "KafkaOffsetReader" in error else "Read"
            topic = _topic_named(config, entity, error)
            return Failure(
                kafka_missing_permission(config.kafka, operation, "topic", topic),
                entity_only=True,  # the other entities' topics have their own ACLs
                table=_table_of(config, topic) if entity == ALL_ENTITIES else None,
            )
        if KAFKA_UNAVAILABLE.search(error):
            return Failure(
                f"Kafka unavailable ({config.kafka.bootstrap_servers}): "
                "the stream failed and restarts from its checkpoint",
                transient=True,
            )
        return None

    return read


def _table_of(config: PipelineConfig, topic: str) -> str | None:
    """The entity reading ``topic`` (None: no single one, e.g. several topics named)."""
    return next((e.name for e in config.entities if e.source_topic == topic), None)


def _topic_named(config: PipelineConfig, stream: str, error: str) -> str:
    """The source topic a failure of ``stream`` is about.

    An entity's stream reads one topic; the one query (``ALL_ENTITIES``) reads them all:
    the first topic the error names (every one when it names none).
    """
    if stream != ALL_ENTITIES:
        return config.entity(stream).source_topic
    topics = [entity.source_topic for entity in config.entities]
    named = [  # as a topic ("[db.orders]") or a partition of it ("db.orders-2")
        topic
        for topic in topics
        if re.search(rf"(?<![\w.-]){re.escape(topic)}(-\d+)?(?![\w.-])", error)
    ]
    return named[0] if named else ", ".join(topics)
