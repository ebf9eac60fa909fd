"""How a failed ingestion query reads (``cdc_ingestor.failures``): restart, hold, or stop."""

from __future__ import annotations

from cdc_ingestor.failures import kafka_failures
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig

CONFIG = PipelineConfig(
    entities=[
        EntityConfig(name="customers", source_topic="db.customers", key=["id"]),
        EntityConfig(name="orders", source_topic="db.orders", key=["id"]),
    ],
)


def test_offsets_lost_to_retention_stop_naming_the_topic_and_the_setting_that_accepts_it() -> None:
    lost = (
        "org.apache.spark.SparkException: [KAFKA_DATA_LOSS] Some data may have been lost "
        "because they are not available in Kafka any more; partitions db.orders-2, "
        "db.orders-0 ...\nReason: the offsets were deleted"
    )
    failure = kafka_failures(CONFIG)("default", lost)
    assert failure is not None
    assert not failure.transient and not failure.entity_only  # the service stops, at the gap
    assert "topic 'db.orders' partition(s) 0, 2" in failure.message
    assert "nothing was skipped and bronze is as it was" in failure.message
    assert "ingestor.fail_on_data_loss: false" in failure.message
    assert "CDC_INGESTOR__FAIL_ON_DATA_LOSS=false" in failure.message
    assert failure.message.endswith("Spark: the offsets were deleted")


def test_a_refused_topic_holds_its_table_alone_naming_the_permission() -> None:
    read = kafka_failures(CONFIG)
    refused = (
        "org.apache.kafka.common.errors.TopicAuthorizationException: "
        "Not authorized to access topics: [db.customers]"
    )
    failure = read("default", refused)
    assert failure is not None
    assert failure.entity_only and failure.table == "customers"  # held, the others go on
    assert "refused Read on topic 'db.customers'" in failure.message
    assert "db.orders" not in failure.message
    described = read("default", refused + "\n\tat ...KafkaOffsetReader...")
    assert described is not None and "refused Describe on topic" in described.message


def test_an_unreachable_broker_restarts_the_query_and_an_unknown_error_is_not_read() -> None:
    read = kafka_failures(CONFIG)
    failure = read("default", "org.apache.kafka.common.errors.TimeoutException: timed out")
    assert failure is not None and failure.transient
    assert "restarts from its checkpoint" in failure.message
    assert read("default", "java.lang.IllegalStateException: something else") is None
