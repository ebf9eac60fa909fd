"""publisher-kafka: silver's change feed -> change topics, exactly once for read_committed."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest
from cdc_devkit.workload import produce
from cdc_publisher_kafka.main import start
from cdc_publisher_kafka.progress import Progress
from cdc_publisher_kafka.transactions import (
    RECORD_OVERHEAD_BYTES,
    Oversized,
    TransactionalPublisher,
)
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.services import PublisherKafkaConfig
from cdc_shared.streaming.service import run_to_exit_code
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from support.change_topics import ChangeRecord
from support.ingestion import generate, ingest_once
from support.pipelines import Pipeline, PipelineFactory
from support.publishing import assert_change_topics_exactly_once, change_records, publish_once
from support.silver import merge_once

pytestmark = pytest.mark.integration


def _load(pipeline: Pipeline, kafka: KafkaConfig, spark: SparkSession, part: int = 0) -> None:
    """Produce one half of the workload (0: first, 1: second), ingest and merge it."""
    messages = generate(pipeline, events=3000, keys=200, delete_share=0.2, redelivery_share=0.05)
    half = len(messages) // 2
    produce(kafka, iter(messages[:half] if part == 0 else messages[half:]))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)


def _forget_last_checkpoint_commit(checkpoint: Path) -> int:
    """What a crash after the Kafka commit and before Spark's checkpoint commit leaves."""
    commits = checkpoint / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    return last


def _admin(kafka: KafkaConfig) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka.bootstrap_servers})


def _create_topic(kafka: KafkaConfig, topic: str, partitions: int, **config: str) -> None:
    admin = _admin(kafka)  # kept until the result: a dropped client fails its futures
    admin.create_topics([NewTopic(topic, partitions, 1, config=config)])[topic].result(60)


def _delete_topic(kafka: KafkaConfig, topic: str) -> None:
    """Delete ``topic`` and wait until the broker no longer lists it."""
    admin = _admin(kafka)
    admin.delete_topics([topic])[topic].result(60)
    deadline = time.monotonic() + 60
    while topic in admin.list_topics(timeout=30).topics:
        assert time.monotonic() < deadline, f"{topic} still listed after its deletion"
        time.sleep(0.5)


def _set_max_message_bytes(kafka: KafkaConfig, topic: str, limit: int) -> None:
    """Lower the topic's ``max.message.bytes``, and wait until the broker reports it."""
    admin = _admin(kafka)
    resource = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(
                "max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET
            )
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result(60)
    deadline = time.monotonic() + 30
    while True:
        described = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
        (configs,) = (f.result(30) for f in described.values())
        if configs["max.message.bytes"].value == str(limit):
            return
        assert time.monotonic() < deadline, f"max.message.bytes of {topic} not {limit} yet"
        time.sleep(0.2)


def _assert_before_images_and_tombstones(records: list[ChangeRecord]) -> None:
    """Each event's ``before`` is the row as its topic last showed it (None for an insert);
    a tombstone (null value) follows each delete of its key at once."""
    last_after: dict[object, dict[str, object] | None] = {}
    deletes = 0
    for position, record in enumerate(records):
        key = record.key["id"]
        if record.event is None:
            previous = records[position - 1]
            assert previous.event is not None and previous.event["op"] == "d"
            assert previous.key == record.key
            continue
        op, before = record.event["op"], record.event["before"]
        if op == "c":
            assert before is None
        else:
            assert before == last_after[key]
        deletes += op == "d"
        last_after[key] = record.event["after"]
    assert deletes > 0
    assert sum(r.event is None for r in records) == deletes


def test_change_topics_equal_silver_feed_and_oracle(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Exactly once, also across a replayed batch; before images and delete tombstones; an
    event over its topic's max.message.bytes goes to quarantine while the rest goes on; a
    change topic deleted since the last start stops the next one; a column selection
    narrows the events."""
    pipeline = make_pipeline(
        merger={"max_files_per_trigger": 2, "metrics_port": 0},
        ingestor={"max_offsets_per_trigger": 1000, "metrics_port": 0},
        publisher_kafka={
            "max_files_per_trigger": 2,
            "metrics_port": 0,
            "include_before": True,
            "delete_tombstones": True,
            "retry_attempts": 3,  # a transaction that cannot go through fails fast
            "max_backoff_s": 2,
        },
        overrides={"customers": {"except_columns": ["phone"]}},  # a narrower replica
    )
    config = pipeline.config
    customers = config.entity("customers")
    limit = 2000  # above every event of the workload
    _create_topic(kafka_config, customers.change_topic_name, 3, **{"max.message.bytes": str(limit)})
    _load(pipeline, kafka_config, spark, part=0)
    publish_once(pipeline, spark)
    first = assert_change_topics_exactly_once(spark, pipeline, kafka_config)
    assert all(n > 0 for n in first.values())
    events = [r.event for r in change_records(pipeline, kafka_config, "customers") if r.event]
    images = [e[image] for e in events for image in ("before", "after") if e.get(image)]
    assert images and not [i for i in images if "phone" in i], "phone is not selected"

    _load(pipeline, kafka_config, spark, part=1)  # more changes to the same keys
    # One row grows past the topic's limit (a long string), after the normal changes.
    silver = config.layout.silver("customers")
    big_id = spark.read.format("delta").load(silver).select("id").orderBy("id").first()["id"]
    spark.sql(f"UPDATE delta.`{silver}` SET email = repeat('x', 3000) WHERE id = {big_id}")
    big_version = DeltaTable.forPath(spark, silver).history(1).first()["version"]
    left_out = {"customers": {((big_id,), big_version)}}
    publish_once(pipeline, spark)  # returns: the stream went on past the large event
    second = assert_change_topics_exactly_once(spark, pipeline, kafka_config, left_out)
    assert all(second[e] > first[e] for e in first)
    _assert_before_images_and_tombstones(change_records(pipeline, kafka_config, "customers"))
    quarantine = config.layout.quarantine("publisher_kafka")
    (row,) = spark.read.format("delta").load(quarantine).collect()
    assert (row.service, row.entity, row.error_kind) == (
        "publisher_kafka",
        "customers",
        "oversized_event",
    )
    assert (row.source_table, row.source_version) == (silver, big_version)
    size = len(row.raw_key) + len(row.raw_value) + RECORD_OVERHEAD_BYTES
    assert size > limit and b"x" * 3000 in row.raw_value
    assert f"{size} bytes" in row.error_message and f"{limit} bytes" in row.error_message

    # A crash between the Kafka commit and the checkpoint commit: the batch (the one
    # with the large event) is replayed and must publish, and quarantine, nothing.
    _forget_last_checkpoint_commit(Path(config.layout.checkpoint("publisher_kafka", "default")))
    publish_once(pipeline, spark)
    assert assert_change_topics_exactly_once(spark, pipeline, kafka_config, left_out) == second
    assert spark.read.format("delta").load(quarantine).count() == 1

    # The change topic is deleted (the next start creates it again, empty): refused.
    _delete_topic(kafka_config, customers.change_topic_name)
    caplog.set_level(logging.ERROR, logger="cdc_publisher_kafka")
    code = run_to_exit_code(
        "publisher_kafka", str(pipeline.path), lambda c: start(c, once=True, spark=spark).run()
    )
    assert code == 1
    assert f"change topic {customers.change_topic_name} holds less" in caplog.text
    assert f"--delete --group cdc-publisher-kafka.{customers.change_topic_name}" in caplog.text


def test_a_limit_lowered_while_running_leaves_out_only_the_large_event(
    kafka_config: KafkaConfig,
) -> None:
    """The broker refuses a transaction's messages as too large (its topic's limit was
    lowered after the start): the transaction runs again, without the large one only."""
    run = uuid.uuid4().hex[:8]
    topic, progress_topic = f"pytest-{run}-changes", f"pytest-{run}-progress"
    _create_topic(kafka_config, topic, 1)
    _create_topic(kafka_config, progress_topic, 1, **{"cleanup.policy": "compact"})
    settings = PublisherKafkaConfig(
        progress_topic=progress_topic, retry_attempts=2, max_backoff_s=0.5
    )
    publisher = TransactionalPublisher(kafka_config, settings, topic)
    try:
        publisher.start()
        _set_max_message_bytes(kafka_config, topic, 2000)
        messages = [(b"k1", b"a" * 100), (b"k2", b"b" * 5000), (b"k3", b"c" * 100)]
        set_aside: list[list[Oversized]] = []
        left_out = publisher.publish(messages, Progress(7, "q", 0), set_aside.append)
        assert [o.index for o in left_out] == [1] and set_aside == [left_out]
        assert left_out[0].limit_bytes == 2000 and left_out[0].size_bytes > 5000
    finally:
        publisher.close()
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_config.bootstrap_servers,
            "group.id": f"pytest-{run}",
            "isolation.level": "read_committed",
        }
    )
    got: list[tuple[bytes | None, bytes | None, int]] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            for m in consumer.consume(10, timeout=0.5):
                assert m.error() is None, m.error()
                got.append((m.key(), m.value(), int(m.offset() or 0)))
        time.sleep(1)  # nothing else may follow
        assert not consumer.consume(10, timeout=0.5)
    finally:
        consumer.close()
    assert [(k, v) for k, v, _ in got] == [messages[0], messages[2]]
    again = TransactionalPublisher(kafka_config, settings, topic)
    try:  # the progress records the offset written, and the topic holds it
        progress = again.start()
        assert progress is not None and progress.version == 7
        assert progress.offsets == {0: got[-1][2]}
    finally:
        again.close()
