"""Erasure of keys from every copy (``cdc erase``), proven byte by byte, beside a running merger.

Against a real broker, Spark, Delta and Elasticsearch: a few keys of customers carry a
unique marker string in their values (inserts, updates, a delete, a value left unsent as
Debezium's TOAST placeholder, a quarantined poison record of the key, history versions).
With the merger running, they are erased; a late event older than the erasure stays out
of silver and the history, a re-insert after it is new data. After maintenance's VACUUM,
the marker is in no file under the storage root (every Parquet file decoded, every file's
raw bytes: ``_delta_log`` commits, checkpoints, ``_change_data``), in no document of the
index, and, once Kafka compacted it, in no event of the change topic; every other key
still equals the topics' oracle. ``cdc erase`` runs as its own process, SIGKILLed once
its request is recorded, its ``--resume`` SIGKILLed midway, finished by a second
``--resume``; bad requests are refused.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from cdc_cli import erase
from cdc_cli.maintenance import run_maintenance
from cdc_devkit.oracle import load_fingerprints, read_topic
from cdc_devkit.workload import GeneratedMessage, produce
from cdc_merger.main import start as start_merger
from cdc_publisher_es.main import start as start_publisher_es
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.clients.delta_rs import change_feed_rows
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.contracts.erasure import BRONZE_DELETED, PURGED, QUARANTINE_DELETED
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from pyspark.sql import SparkSession
from support.erasure import (
    DELETED,
    ERASED,
    MARKER,
    a_new_change,
    late_and_new,
    marker_places,
    with_markers,
)
from support.es import index_documents
from support.ingestion import generate, ingest_once, quarantine
from support.ops import cdc
from support.pipelines import Pipeline, PipelineFactory
from support.publishing import change_records, publish_once
from support.silver import assert_silver_equals, entity_oracle, merge_once
from support.waiting import wait_for

pytestmark = pytest.mark.integration

CDC = str(Path(sys.executable).with_name("cdc"))


def killed_when(command: list[str], reached: Callable[[], bool]) -> None:
    """Run ``command``; SIGKILL it once ``reached`` holds (looked at every second)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(reached, timeout_s=240)
    process.send_signal(signal.SIGKILL)
    assert process.wait(60) == -signal.SIGKILL, "it ended before the kill: proves less"


def erase_beside_a_running_merger(
    spark: SparkSession, kafka_config: KafkaConfig, pipeline: Pipeline, load: list[GeneratedMessage]
) -> None:
    """``cdc erase`` with the merger running, SIGKILLed once its request is recorded;
    ``cdc erase --resume`` SIGKILLed once bronze's rows are deleted; ``--resume`` again
    finishes it. After it, a late older event and a re-insert arrive."""
    config = pipeline.config
    runner = start_merger(config, once=False, spark=spark)
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        keys = [a for k in ERASED for a in ("--key", str(k))]
        command = [CDC, "erase", "--config", str(pipeline.path), "--entity", "customers", *keys]
        log = config.layout.erasure_log()
        killed_when(command, lambda: bool(change_feed_rows(config, log)))  # waiting for merger
        (left,) = erase.statuses(config)
        assert not left.done and left.keys == len(ERASED), left
        assert "not finished" in cdc("erase", "--config", str(pipeline.path), "--status").output
        resume = [CDC, "erase", "--config", str(pipeline.path), "--resume"]
        killed_when(resume, lambda: bool(erase.statuses(config)[0].steps[BRONZE_DELETED]))
        (left,) = erase.statuses(config)
        assert left.silver and left.steps[BRONZE_DELETED] and not left.done, left

        resumed = cdc("erase", "--config", str(pipeline.path), "--resume", "--json")
        assert resumed.exit_code == 0, resumed.output  # in this process: no third JVM
        (status,) = json.loads(resumed.stdout)["requests"]
        assert status["done"] and status["silver"] and status["history"], status
        assert all(status["steps"][s] for s in (BRONZE_DELETED, QUARANTINE_DELETED, PURGED))
        # After the erasure: a late older event of an erased key, a re-insert of another.
        produce(kafka_config, iter(late_and_new(pipeline, load)))
        ingest_once(pipeline, spark)
        silver_path = config.layout.silver("customers")

        def reinserted() -> bool:
            rows = spark.read.format("delta").load(silver_path).where(f"id = {ERASED[1]}")
            return rows.count() == 1

        wait_for(reinserted, timeout_s=300)
    finally:
        runner.request_stop()
        thread.join(180)


def bad_requests_say_why(spark: SparkSession, pipeline: Pipeline) -> None:
    """An unknown entity, a key of the wrong shape or type, a key not there: refused, saying
    why; with the merger stopped, a request is kept and finished once the merger ran."""
    config = pipeline.config
    entity = config.entity("customers")
    base = ("erase", "--config", str(pipeline.path))
    unknown = cdc(*base, "--entity", "nobody", "--key", "1")
    assert unknown.exit_code == 2 and "unknown entity 'nobody'" in unknown.output
    columns = cdc(*base, "--entity", "customers", "--key", '{"name": 1}')
    assert columns.exit_code == 2 and "key columns are id, not name" in columns.output
    with pytest.raises(erase.KeyShapeError, match=r"wrong shape.*\(id int\)"):
        erase.record(config, spark, entity, [{"id": "abc"}])
    with pytest.raises(erase.NothingToEraseError, match="none of the keys"):
        erase.record(config, spark, entity, [{"id": 999_999}])

    kept = sorted(set(silver_ids(spark, pipeline)) - set(ERASED))[0]
    stopped = cdc(*base, "--entity", "customers", "--key", str(kept))
    assert stopped.exit_code == 1 and "merger is not running" in stopped.output, stopped.output
    assert "cdc erase --resume" in stopped.output
    assert kept in silver_ids(spark, pipeline), "erased without the merger"
    merge_once(pipeline, spark)  # the merger applies what was recorded meanwhile
    resumed = cdc(*base, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert kept not in silver_ids(spark, pipeline)
    assert all(s.done for s in erase.statuses(config))


def publish_both(pipeline: Pipeline, spark: SparkSession) -> None:
    publish_once(pipeline, spark)
    start_publisher_es(pipeline.config, once=True, spark=spark).run()


def silver_ids(spark: SparkSession, pipeline: Pipeline) -> list[int]:
    path = pipeline.config.layout.silver("customers")
    return [r["id"] for r in spark.read.format("delta").load(path).select("id").collect()]


@pytest.fixture
def pipeline(make_pipeline: PipelineFactory) -> Pipeline:
    return make_pipeline(
        entities=("customers",),
        overrides={"customers": {"history": {"enabled": True, "freshness": "0 seconds"}}},
        merger={"metrics_port": 0},
        publisher_es={"metrics_port": 0},
        publisher_kafka={"metrics_port": 0, "delete_tombstones": True},
    )


def compacted_change_topic(kafka: KafkaConfig, topic: str) -> None:
    """The change topic as the erasure docs ask: compacted, its segments rolled within a
    second and cleaned as soon as dirty, one partition (the erased key's segment rolls at
    the next append of any key)."""
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    settings = {
        "cleanup.policy": "compact",
        "segment.ms": "1000",
        "min.cleanable.dirty.ratio": "0.01",
        "min.compaction.lag.ms": "0",
        "delete.retention.ms": "1000",
    }
    for future in admin.create_topics([NewTopic(topic, 1, 1, config=settings)]).values():
        future.result(30)


def test_erased_keys_are_in_no_file_nor_document_and_the_rest_equals_the_oracle(
    spark: SparkSession, kafka_config: KafkaConfig, pipeline: Pipeline
) -> None:
    config = pipeline.config
    entity = config.entity("customers")
    load = with_markers(pipeline, generate(pipeline, events=240, keys=16, poison_share=0))
    produce(kafka_config, iter(load))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    compacted_change_topic(kafka_config, entity.change_topic_name)
    publish_both(pipeline, spark)
    assert MARKER in repr(change_records(pipeline, kafka_config, "customers"))
    local, root = pafs.LocalFileSystem(), config.storage_root
    assert marker_places(local, root), "the marker never reached the tables: proves nothing"
    assert quarantine(spark, pipeline).count() == 1

    erase_beside_a_running_merger(spark, kafka_config, pipeline, load)
    merge_once(pipeline, spark)
    publish_both(pipeline, spark)  # the erased keys' deletes, each with a Kafka tombstone
    time.sleep(1.5)  # past segment.ms: the change topic's next append rolls its segment
    produce(kafka_config, iter([a_new_change(pipeline, load, key=1)]))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    publish_both(pipeline, spark)

    silver_path = config.layout.silver("customers")
    silver = {r["id"]: r for r in spark.read.format("delta").load(silver_path).collect()}
    assert ERASED[0] not in silver and DELETED not in silver, "an erased key came back"
    assert silver[ERASED[1]]["first_name"] == "New", "a re-insert after erasure is new data"
    history = spark.read.format("delta").load(config.layout.history("customers"))
    assert {r["id"] for r in history.where(f"id IN {ERASED}").collect()} == {ERASED[1]}
    assert quarantine(spark, pipeline).count() == 0

    # Every other key equals the oracle (the erased keys left out, the re-insert taken).
    fingerprints = load_fingerprints([pipeline.schema_dir])
    oracle = read_topic(kafka_config, entity_oracle(pipeline, entity, fingerprints))
    assert len(oracle.rows) > 5
    for key in ERASED:
        if key != ERASED[1]:
            oracle.rows.pop((key,), None)
    assert_silver_equals(spark, pipeline, oracle)

    es = make_elasticsearch(config.elasticsearch)
    documents = index_documents(es, entity.es_index_name)
    assert str(ERASED[0]) not in documents and str(ERASED[1]) in documents
    assert MARKER not in repr(documents)
    # The change topic forgets the erased keys' events by compaction (read_committed).
    wait_for(lambda: MARKER not in repr(change_records(pipeline, kafka_config, "customers")), 180)

    # Maintenance's VACUUM with the retention the test allows: every file is marker-free.
    report = run_maintenance(
        config,
        spark=spark,
        optimize=False,
        vacuum_hours=0,
        force_short_retention=True,
        quiet=dt.timedelta(0),
    )
    assert any(t.vacuumed_files for t in report.tables), report
    assert marker_places(local, root) == []

    bad_requests_say_why(spark, pipeline)
