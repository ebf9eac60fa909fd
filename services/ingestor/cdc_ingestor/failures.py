"""How a failed ingestion query reads: restart it, hold a table, or stop the service.

Spark reports a failed query as one long error text; the patterns below pick out the
failures the ingestor knows and turn each into the line an operator reads. (A table's
own failures found while the batch runs in Python, an incompatible writer schema or a
registry past its retry budget, hold that table there: ``cdc_ingestor.ingestion``.)
"""

from __future__ import annotations

import re

from cdc_shared.clients.connect import (
    KAFKA_TOPIC_AUTHORIZATION_FAILED,
    kafka_authentication_failure,
    kafka_missing_permission,
)
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.failures import Failure, OnFailure

#: Spark's failure when the Kafka brokers are out of reach (a query restarted with backoff).
KAFKA_UNAVAILABLE = re.compile(
    r"org\.apache\.kafka\.common\.errors\.(TimeoutException|DisconnectException|NetworkException)"
    r"|Timed out waiting for a node assignment|Cannot fetch record.* in \d+ milliseconds"
)
#: Spark's failure when offsets the checkpoint needs are gone (failOnDataLoss is on).
KAFKA_DATA_LOSS = re.compile(r"KAFKA_DATA_LOSS|Some data may have been lost|OffsetOutOfRange")


def kafka_failures(config: PipelineConfig) -> OnFailure:
    """Read a failed ingestion: Kafka unreachable -> restart; offsets lost -> a clear stop.

    An ACL that refuses the ingestor a source topic holds that table (its group's query
    goes on without the topic), naming the missing permission; wrong credentials stop
    the service.
    """

    def read(group: str, error: str) -> Failure | None:
        if KAFKA_DATA_LOSS.search(error):
            topic = _topic_named(config, error)
            partitions = sorted({int(p) for p in re.findall(rf"{re.escape(topic)}-(\d+)", error)})
            where = ", ".join(map(str, partitions)) or "unknown (see Spark's reason)"
            spark_reason = re.search(r"Reason: (.*)", error)  # Spark's KAFKA_DATA_LOSS line
            return Failure(
                f"stopped: Kafka no longer has records it must ingest from topic {topic!r} "
                f"partition(s) {where} (deleted by retention or delete-records, or the topic "
                "was recreated). The stream stopped at the gap: nothing was skipped and "
                "bronze is as it was. To go on, accept the gap: run the ingestor once with "
                "ingestor.fail_on_data_loss: false (CDC_INGESTOR__FAIL_ON_DATA_LOSS=false), "
                "which reads on from the oldest record Kafka still has, then set it back; "
                "re-snapshot the source table if its rows are needed, and raise the topic's "
                "retention.ms so it does not happen again. Spark: "
                + (spark_reason.group(1) if spark_reason else error.partition("\n")[0])[:600]
            )
        if (refused := kafka_authentication_failure(config.kafka, error)) is not None:
            return Failure(refused)  # the same credentials would fail again
        if KAFKA_TOPIC_AUTHORIZATION_FAILED.search(error):
            # The driver only describes the topic (offsets); the executors read it.
            operation = "Describe" if "KafkaOffsetReader" in error else "Read"
            topic = _topic_named(config, error)
            return Failure(
                kafka_missing_permission(config.kafka, operation, "topic", topic),
                entity_only=True,  # the other tables' topics have their own ACLs
                table=_table_of(config, topic),
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


def _topic_named(config: PipelineConfig, error: str) -> str:
    """The source topic a failure is about: the first the error names (all, when none)."""
    topics = [entity.source_topic for entity in config.entities]
    named = [  # as a topic ("[db.orders]") or a partition of it ("db.orders-2")
        topic
        for topic in topics
        if re.search(rf"(?<![\w.-]){re.escape(topic)}(-\d+)?(?![\w.-])", error)
    ]
    return named[0] if named else ", ".join(topics)
