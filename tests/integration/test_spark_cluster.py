"""The pipeline in its production shape: Spark applications of a standalone cluster,
tables and checkpoints on S3-compatible object storage.

``cdc infra``'s cluster (a master and one worker on loopback) and S3 server (S3Proxy) run
the real services: each service command is a subprocess whose SparkSession is an
application of the cluster (the test session's own SparkSession is local: it only reads
the results), with ``storage_root: s3a://cdc/<fresh prefix>``. The change topics' schemas
are put in the schema folder: publisher-kafka writes ``<root>/_schemas`` only on a local
root.

One test (slow: it kills processes) runs the ingestor and the merger as streams, SIGKILLs
the merger's driver and then the worker, each mid-batch, lets both recover without
exiting, and runs the publishers ``--once``: nothing is lost or repeated in bronze,
quarantine, silver, the change topics or the indexes; every service ran tasks on the
cluster's executors, none of which ran Python. (It used to have a fast sibling running the
four services ``--once``; that run is a subset of this one and cost 4-5 minutes of CI.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cdc_cli.status import collect_status
from cdc_devkit import infra
from cdc_devkit.workload import produce
from cdc_merger.apply import LOST_CHECKPOINT
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.jvm import bridge as jvm_bridge
from pyspark.sql import SparkSession
from support.cluster import (
    NO_PYTHON,
    SERVICES,
    Bucket,
    active_apps,
    alive,
    alive_workers,
    assert_change_topics_exactly_once,
    batch_logs,
    cluster_s3_pipeline,
    completed_apps,
    executor_backends,
    executor_logs,
    launch_service,
    run_once,
    sigkill_group,
    wait_ok,
    wait_until,
    worker_pid,
    write_change_schemas,
)
from support.es import assert_index_equals_oracle
from support.ingestion import assert_bronze_exactly_once, assert_quarantine_exactly_once, generate
from support.pipelines import Pipeline
from support.servers import TEST_INFRA
from support.silver import assert_change_feed_has_no_repeats, assert_silver_equals_oracle

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.s3]

PUBLISHERS = ("cdc-publisher-kafka", "cdc-publisher-es")


def _read_bucket(spark: SparkSession, pipeline: Pipeline) -> None:
    """Let the test session's SparkSession read the pipeline's root (the S3A settings are
    per bucket, on its Hadoop configuration: the rest of the session is unaffected)."""
    jvm_bridge.set_hadoop_options(spark, pipeline.config.spark.hadoop_options())


def _assert_outputs_equal_oracle(
    spark: SparkSession, pipeline: Pipeline, kafka: KafkaConfig
) -> None:
    """Silver, each change topic (every event exactly once) and each index: the oracle."""
    assert_silver_equals_oracle(spark, pipeline, kafka)
    assert_change_feed_has_no_repeats(spark, pipeline)
    assert_change_topics_exactly_once(spark, pipeline, kafka)
    assert_index_equals_oracle(pipeline, kafka)


@pytest.mark.slow
def test_driver_and_worker_killed_mid_batch_lose_and_repeat_nothing(
    spark: SparkSession,
    spark_master: str,
    s3_endpoint: str,
    kafka_config: KafkaConfig,
    es_config: ElasticsearchConfig,
    tmp_path: Path,
) -> None:
    """The ingestor and the merger run (not ``--once``) on the cluster, one core each, over
    customers' load in small batches (``orders`` is left out to keep the test short); then:

    1. the merger's driver (its Python process and JVM) gets SIGKILL while a batch is in
       flight (its offsets logged, its commit not), at the moment that batch's silver
       commit is seen when it is; a new merger finishes the batch;
    2. with a second part of the load produced, the worker JVM gets SIGKILL halfway
       through a merger batch, with an ingestor batch in flight too: its executors exit
       with it, as on a lost machine (any that does not is killed). No worker is left: the
       merger's batch must stand still (else the kill is repeated on a new worker, at most
       three times). A new worker joins, the master gives both applications executors
       again and both batches commit, neither service exiting: the lost tasks are run
       again, and a merger batch whose MERGE source (a local checkpoint, held by the
       lost executor) is gone is applied again from bronze;
    3. both catch up (``cdc status``: lag 0) and stop on SIGTERM (exit 0); the publishers
       then run ``--once`` (they are SIGKILLed mid-batch in their own process tests).

    Bronze and quarantine hold each Kafka record once; silver, the change topic (every
    event exactly once) and the index equal the oracle; silver's change feed has no change
    twice. The master lists an application of each service, and their executors' logs
    show tasks run with the shipped Delta jar and no attempt to start Python
    (``PYSPARK_PYTHON`` names no program; the poison records' quarantine, a DataFrame made
    on the driver, travels as Arrow).
    """
    pipeline = cluster_s3_pipeline(
        tmp_path,
        kafka_config,
        es_config,
        s3_endpoint,
        spark_master,
        cores_max=1,  # two applications at once on the worker's two cores
        entities=("customers",),
        ingestor={"max_offsets_per_trigger": 250, "trigger_interval": "1 second"},
        merger={"max_files_per_trigger": 6, "trigger_interval": "1 second"},
    )
    write_change_schemas(pipeline)
    _read_bucket(spark, pipeline)
    config = pipeline.config
    messages = generate(
        pipeline, events=1000, keys=150, delete_share=0.15, redelivery_share=0.03, poison_share=0.01
    )
    first = len(messages) * 2 // 5  # the rest once the merger has recovered
    report = produce(kafka_config, iter(messages[:first]))
    bucket = Bucket()
    ingestor = config.layout.checkpoint("ingestor", "default")
    merger = config.layout.checkpoint("merger", "default")
    logs = {command: tmp_path / f"{command}.log" for command in SERVICES}

    def launch(command: str) -> subprocess.Popen[bytes]:
        return launch_service(command, pipeline, logs[command])

    before = completed_apps()
    running = {command: launch(command) for command in ("cdc-ingestor", "cdc-merger")}
    try:
        # 1. The merger's driver, mid-batch.
        silver = config.layout.silver("customers")
        killed = _kill_merger_driver_mid_batch(bucket, merger, silver, running["cdc-merger"])
        wait_until(lambda: "cdc-merger" not in active_apps(), 60, "its application lives on")
        running["cdc-merger"] = launch("cdc-merger")
        wait_until(
            lambda: bucket.committed(merger) >= killed, 300, "the killed batch never committed", 1
        )

        # 2. The worker, mid-batch.
        report.add(produce(kafka_config, iter(messages[first:])))
        in_flight = _kill_worker_mid_batch(bucket, ingestor, merger, logs["cdc-merger"])

        def recovered() -> bool:
            for command, process in running.items():
                if process.poll() is not None:
                    run = logs[command].read_text(errors="replace")
                    raise AssertionError(f"{command} exited {process.returncode}: {run[-3000:]}")
            return (
                bucket.committed(ingestor) >= in_flight[ingestor]
                and bucket.committed(merger) >= in_flight[merger]
            )

        wait_until(recovered, 400, "the batches in flight at the worker's loss never committed", 1)
        apps = active_apps()
        assert all(apps[c]["cores"] >= 1 for c in running), f"applications without cores: {apps}"

        # 3. Catch up, stop.
        _wait_for_no_lag(spark, pipeline, ("ingestor", "merger"))
        for process in running.values():
            process.send_signal(signal.SIGTERM)
        for command, process in running.items():
            wait_ok(command, process, logs[command], timeout_s=300)
    finally:
        for process in running.values():
            if process.poll() is None:
                sigkill_group(process)

    merger_log = logs["cdc-merger"].read_text(errors="replace")
    if LOST_CHECKPOINT in merger_log:  # the kill took a MERGE source: applied again
        assert "applying the batch again" in merger_log, merger_log[-3000:]
    run_once(pipeline, tmp_path, *PUBLISHERS)
    _assert_executors_ran_jvm_only(before)
    assert report.poison, "no poison record: quarantine was not exercised"
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    assert_quarantine_exactly_once(spark, pipeline, report)
    _assert_outputs_equal_oracle(spark, pipeline, kafka_config)


def _assert_executors_ran_jvm_only(before: dict[str, str]) -> None:
    """Every service ran as a cluster application whose executors ran tasks with the Delta
    jar their driver shipped, and no application's executors tried to run Python (a UDF,
    or a DataFrame made from Python rows by pyspark's worker, would fail its tasks with
    ``PYSPARK_PYTHON`` naming no program)."""
    ran = {app_id: name for app_id, name in completed_apps().items() if app_id not in before}
    assert sorted(set(ran.values())) == sorted(SERVICES), f"applications on the cluster: {ran}"
    logs = {app_id: executor_logs(app_id) for app_id in ran}
    for app_id, name in ran.items():
        assert NO_PYTHON not in logs[app_id], f"{name} ({app_id}): an executor tried Python"
    for service in SERVICES:
        of_service = [logs[app_id] for app_id, name in ran.items() if name == service]
        assert any("Finished task" in log for log in of_service), f"{service}: no task ran"
        assert any("delta-spark" in log for log in of_service), f"{service}: no Delta jar"


def _kill_merger_driver_mid_batch(
    bucket: Bucket,
    checkpoint: str,
    silver: str,
    merger: subprocess.Popen[bytes],
    search_s: float = 120,
) -> int:
    """SIGKILL the merger's process group while a batch is in flight (offsets logged, not
    committed), at the moment that batch's silver commit is seen; after ``search_s``
    without seeing one, at once. Returns the batch id."""
    give_up = time.monotonic() + search_s
    while True:
        batch = int(
            wait_until(lambda: bucket.in_flight(checkpoint), 300, "no merger batch in flight", 0.05)
        )
        version = bucket.delta_version(silver)
        while bucket.committed(checkpoint) < batch:
            if bucket.delta_version(silver) > version or time.monotonic() > give_up:
                sigkill_group(merger)
                assert bucket.committed(checkpoint) < batch, "killed just after the commit"
                return batch
            time.sleep(0.05)
        assert merger.poll() is None, f"the merger exited {merger.returncode}"


def _kill_worker_mid_batch(
    bucket: Bucket, ingestor: str, merger: str, merger_log: Path, attempts: int = 3
) -> dict[str, int]:
    """SIGKILL the worker JVM halfway through a merger batch (half as long after it began
    as the merger's last batch took) while the ingestor has a batch in flight too, then
    any of its executors that outlives it; wait until the master sees no worker.

    The merger's batch must then stand still, or the worker is started again and the kill
    repeated (the batch had done its executors' work already). Starts a new worker and
    returns the batch ids in flight at the kill, by checkpoint.
    """
    last = batch_logs(merger_log)
    halfway = last[-1]["duration_ms"] / 2000 if last else 3.0
    began: dict[int, float] = {}  # merger batch -> when it was first seen in flight

    def halfway_through() -> dict[str, int] | None:
        batch = bucket.in_flight(merger)
        if batch is None:
            return None
        began.setdefault(batch, time.monotonic())
        other = bucket.in_flight(ingestor)
        if other is None or time.monotonic() - began[batch] < halfway:
            return None
        return {ingestor: other, merger: batch}

    for _ in range(attempts):
        in_flight = wait_until(halfway_through, 300, "no batches in flight together", 0.05)
        worker = worker_pid()
        executors = list(executor_backends())
        assert executors, "no executor on the worker"
        os.kill(worker, signal.SIGKILL)
        for pid in _wait_for_exit(executors, timeout_s=15):
            with contextlib.suppress(ProcessLookupError):  # a lost machine takes them along
                os.kill(pid, signal.SIGKILL)
        assert not alive(worker)
        wait_until(lambda: not alive_workers(), 60, "the master still lists a live worker")
        time.sleep(3)  # no executor anywhere: a batch with tasks left cannot go on
        stuck = bucket.committed(merger) < in_flight[merger]
        infra.start_spark_cluster(TEST_INFRA)  # a new worker joins
        if stuck:
            return in_flight
    raise AssertionError("the worker was never killed with executor work in flight")


def _wait_for_exit(pids: list[int], timeout_s: float) -> list[int]:
    """Wait for ``pids`` to exit; those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def _wait_for_no_lag(
    spark: SparkSession, pipeline: Pipeline, services: tuple[str, ...], timeout_s: float = 400
) -> None:
    """Until ``cdc status`` shows lag 0 for ``services`` twice in a row (the two reads of
    one status are not atomic)."""
    config = pipeline.config
    deadline = time.monotonic() + timeout_s
    zero_in_a_row = 0
    while zero_in_a_row < 2:
        assert time.monotonic() < deadline, f"still lagging: {collect_status(config, spark=spark)}"
        lags = [
            s.lag
            for entity in collect_status(config, spark=spark).entities
            for s in entity.streams
            if s.service in services
        ]
        zero_in_a_row = zero_in_a_row + 1 if all(lag == 0 for lag in lags) else 0
        time.sleep(2)
