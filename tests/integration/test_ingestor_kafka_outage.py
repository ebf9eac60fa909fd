"""The ingestor as a process when Kafka fails: the broker goes away mid-run, and offsets
lost to retention (delete-records) under a stopped ingestor."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cdc_devkit import infra
from cdc_devkit.workload import ProduceReport, produce
from cdc_shared.clients.connect import make_admin
from cdc_shared.config.connections import KafkaConfig
from confluent_kafka import TopicPartition
from pyspark.sql import SparkSession
from support.ingestion import (
    assert_bronze_exactly_once,
    bronze,
    generate,
    ingest_once,
    launch_ingestor,
    topic_offsets,
)
from support.pipelines import Pipeline, PipelineFactory
from support.servers import TEST_INFRA
from support.waiting import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def wait_for_health(port: int, healthy: bool, timeout_s: float = 120) -> dict[str, Any]:
    """The first ``/health`` answer that is (or is not) 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            if (answer.status_code == 200) == healthy:
                return dict(answer.json())
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"/health did not become {'200' if healthy else '503'} in {timeout_s} s")


def test_broker_outage_mid_run_loses_and_duplicates_nothing(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    port = free_port()
    pipeline = make_pipeline(
        entities=("customers",),
        ingestor={
            "trigger_interval": "500 milliseconds",
            "max_offsets_per_trigger": 1500,
            "metrics_port": port,
            "metrics_host": "127.0.0.1",
        },
    )
    messages = generate(pipeline, events=8000, keys=800, poison_share=0.005)
    before = produce(kafka_config, iter(messages[:5000]))
    log = tmp_path / "ingestor.log"
    process = launch_ingestor(pipeline, log)
    try:
        deadline = time.monotonic() + 180
        while '"msg": "batch"' not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert wait_for_health(port, healthy=True)["streams"]["default"]["active"]  # the group

        infra.stop(TEST_INFRA, "kafka")  # with a backlog left: a batch is likely in flight
        down = wait_for_health(port, healthy=False, timeout_s=60)["streams"]["default"]  # group
        assert down["problem"] is not None and "Kafka unreachable" in down["problem"], down
        time.sleep(15)  # stays down a while; the service must neither exit nor skip
        assert process.poll() is None, f"ingestor died while Kafka was down; see {log}"
        assert wait_for_health(port, healthy=False, timeout_s=5)

        infra.start_kafka(TEST_INFRA)
        after = produce(kafka_config, iter(messages[5000:]))
        assert wait_for_health(port, healthy=True, timeout_s=120)
        batches = log.read_text().count('"msg": "batch"')
        deadline = time.monotonic() + 120  # the running service resumes by itself
        while log.read_text().count('"msg": "batch"') <= batches + 1:
            assert time.monotonic() < deadline, f"no batch after Kafka came back; see {log}"
            time.sleep(1)
        assert process.poll() is None, f"ingestor died after Kafka came back; see {log}"
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(180)
    assert code == 0, f"ingestor did not stop cleanly; see {log}"
    text = log.read_text()
    assert "Kafka unreachable; ingestion waits and retries" in text
    assert "Kafka reachable again" in text

    ingest_once(pipeline, spark)  # the drain: in this process, whose Spark is warm
    report = ProduceReport()
    for part in (before, after):
        report.add(part)
    assert report.produced == len(messages)
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    assert bronze(spark, pipeline, "customers").count() == len(messages) - len(report.poison)


def test_offsets_lost_to_retention_stop_with_topic_and_partition(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = make_pipeline(entities=("customers",), ingestor={"metrics_port": 0})
    topic = pipeline.topic("customers")
    messages = generate(pipeline, events=3000, keys=300, poison_share=0)
    produce(kafka_config, iter(messages[:1500]))
    log = tmp_path / "ingestor.log"
    assert launch_ingestor(pipeline, log, "--once").wait(300) == 0, f"first run failed; see {log}"
    landed = bronze(spark, pipeline, "customers").count()
    assert landed == 1500

    # The ingestor is stopped; records it has not read yet are deleted (as retention would).
    produce(kafka_config, iter(messages[1500:]))
    admin = make_admin(kafka_config)
    high = max(o for p, o in topic_offsets(kafka_config, topic) if p == 1) + 1
    for future in admin.delete_records([TopicPartition(topic, 1, high - 10)]).values():
        future.result(30)
    version = spark.sql(f"DESCRIBE HISTORY delta.`{bronze_path(pipeline)}`").first()

    process = launch_ingestor(pipeline, log, "--once")
    assert process.wait(300) == 1, f"the ingestor did not stop on lost offsets; see {log}"
    failure = [line for line in log.read_text().splitlines() if "no longer has records" in line]
    assert failure, f"no data-loss message; see {log}"
    assert f"topic '{topic}' partition(s) 1 " in failure[-1]
    assert "retention" in failure[-1] and "ingestor.fail_on_data_loss: false" in failure[-1]
    assert bronze(spark, pipeline, "customers").count() == landed
    after = spark.sql(f"DESCRIBE HISTORY delta.`{bronze_path(pipeline)}`").first()
    assert version is not None and after is not None and after.version == version.version

    # The documented way on: one run that accepts the gap reads on from the oldest record
    # Kafka still has; bronze then holds what it had and every record Kafka still holds.
    before = {(r.kafka_partition, r.kafka_offset) for r in _offsets(spark, pipeline)}
    accept = {"CDC_INGESTOR__FAIL_ON_DATA_LOSS": "false"}
    process = launch_ingestor(pipeline, log, "--once", env=accept)
    assert process.wait(300) == 0, f"the run accepting the gap failed; see {log}"
    rows = _offsets(spark, pipeline)
    landed_now = {(r.kafka_partition, r.kafka_offset) for r in rows}
    assert len(rows) == len(landed_now), "duplicate offsets in bronze"
    assert landed_now == before | topic_offsets(kafka_config, topic)


def _offsets(spark: SparkSession, pipeline: Pipeline) -> list[Any]:
    return bronze(spark, pipeline, "customers").select("kafka_partition", "kafka_offset").collect()


def bronze_path(pipeline: Pipeline) -> str:
    return pipeline.config.layout.bronze()
