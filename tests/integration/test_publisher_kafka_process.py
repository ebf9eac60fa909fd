"""publisher-kafka as a process: a SIGKILL right after a Kafka commit, and a broker restart
mid-run; read_committed consumers still see every change exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cdc_devkit import infra
from cdc_devkit.workload import produce
from cdc_shared.clients.connect import make_consumer
from cdc_shared.config.connections import KafkaConfig
from confluent_kafka import KafkaException, TopicPartition
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from support.ingestion import generate, ingest_once
from support.pipelines import Pipeline, PipelineFactory
from support.publishing import assert_change_topics_exactly_once
from support.servers import TEST_INFRA
from support.silver import assert_silver_equals_oracle, merge_in_slices

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PUBLISHER = str(Path(sys.executable).with_name("cdc-publisher-kafka"))
# SIGKILLs, each in the dangerous window (after the sink's commit, which records the
# table's progress, before the checkpoint's). Every restart costs a Spark start; the
# chaos run (tests/e2e/test_chaos.py) kills this service at random moments under load.
KILLS = 1


class ProgressWatch:
    """Reads the publisher's committed progress (the last version it published)."""

    def __init__(self, kafka: KafkaConfig, pipeline: Pipeline, entity: str) -> None:
        topic = pipeline.config.entity(entity).change_topic_name
        self.partition = TopicPartition(pipeline.config.publisher_kafka.progress_topic, 0)
        self.consumer = make_consumer(
            kafka, f"cdc-publisher-kafka.{topic}", **{"isolation.level": "read_committed"}
        )

    def version(self, timeout_s: float = 180) -> int:
        """The last published version (-1: none yet); waits while the broker is away."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                (committed,) = self.consumer.committed([self.partition], timeout=10)
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                continue
            return committed.offset - 1 if committed.offset >= 0 else -1


def _start(config: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [PUBLISHER, "--config", str(config), *extra],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        start_new_session=True,
    )


def _wait_for_new_progress(watch: ProgressWatch, since: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = watch.version()
        if version > since:
            return version
        time.sleep(0.01)
    raise AssertionError(f"the publisher published nothing new within {timeout_s} s")


def _last_changed_version(spark: SparkSession, table: str) -> int:
    """The newest version of ``table`` in its change feed (compactions change no row)."""
    feed = spark.read.format("delta").option("readChangeFeed", "true")
    changes = feed.option("startingVersion", 0).load(table)
    (newest,) = changes.agg(F.max("_commit_version")).collect()
    return int(newest[0])


def test_exactly_once_under_sigkill_and_broker_restart(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = make_pipeline(
        entities=("customers",),
        ingestor={"metrics_port": 0},
        publisher_kafka={
            "max_files_per_trigger": 1,
            "trigger_interval": "200 milliseconds",
            "metrics_port": 0,
        },
    )
    produce(
        kafka_config,
        iter(generate(pipeline, events=3000, keys=200, delete_share=0.2, redelivery_share=0.05)),
    )
    ingest_once(pipeline, spark)
    # Silver changes while the publishers run (24 versions): each batch has new versions.
    merging = threading.Thread(
        target=merge_in_slices, args=(pipeline, spark, "customers", 24), kwargs={"pause_s": 1.0}
    )
    merging.start()

    watch = ProgressWatch(kafka_config, pipeline, "customers")
    log = tmp_path / "publisher.log"
    for _ in range(KILLS):
        process = _start(pipeline.path, log)
        # Right after a Kafka commit, before Spark's checkpoint commit.
        _wait_for_new_progress(watch, watch.version())
        assert process.poll() is None, f"publisher died by itself; see {log}"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)

    # The broker goes away in the middle of a run and comes back.
    process = _start(pipeline.path, log)
    _wait_for_new_progress(watch, watch.version())
    infra.stop(TEST_INFRA, "kafka")
    time.sleep(5)
    infra.up(TEST_INFRA)
    _wait_for_new_progress(watch, watch.version(), timeout_s=180)
    assert process.poll() is None, f"publisher did not survive the broker restart; see {log}"
    # The same run publishes the rest of silver, then stops on SIGTERM.
    merging.join(600)
    assert not merging.is_alive(), "silver's slices were not all merged"
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    last = _last_changed_version(spark, pipeline.config.layout.silver("customers"))
    deadline = time.monotonic() + 300
    while watch.version() < last and time.monotonic() < deadline:
        assert process.poll() is None, f"publisher died by itself; see {log}"
        time.sleep(0.5)
    assert watch.version() == last, f"silver version {last} not published; see {log}"
    process.send_signal(signal.SIGTERM)
    assert process.wait(300) == 0, f"publisher did not stop cleanly on SIGTERM; see {log}"
    watch.consumer.close()
    commits = Path(pipeline.config.layout.checkpoint("publisher_kafka", "default")) / "commits"
    assert any(commits.iterdir()), "the group's query committed nothing"
    assert_change_topics_exactly_once(spark, pipeline, kafka_config)
