"""publisher-es as a process: SIGKILLs at random moments and an Elasticsearch restart.

Silver changes version by version while the publisher runs as ``cdc-publisher-es`` in
its own process group; it is killed with SIGKILL twice (once mid-batch, once after
Elasticsearch was stopped under it and started again). A final ``--once`` run in the
test's own process drains silver; the index must equal the oracle.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cdc_devkit import infra
from cdc_devkit.workload import produce
from cdc_publisher_es.main import start
from cdc_shared.config.connections import KafkaConfig
from pyspark.sql import SparkSession
from support.es import assert_index_equals_oracle
from support.ingestion import generate, ingest_once
from support.pipelines import PipelineFactory
from support.servers import TEST_INFRA
from support.silver import merge_in_slices
from support.waiting import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PUBLISHER = str(Path(sys.executable).with_name("cdc-publisher-es"))
# SIGKILLs: one mid-batch, one after Elasticsearch came back; every restart costs a
# Spark start.
KILLS = 2


def committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return len([e for e in commits.iterdir() if e.name.isdigit()]) if commits.is_dir() else 0


def wait_for_commit_after(checkpoint: Path, seen: int, timeout_s: float) -> bool:
    """Wait until the checkpoint holds more than ``seen`` committed batches."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if committed_batches(checkpoint) > seen:
            return True
        time.sleep(0.05)
    return False


def health(port: int) -> tuple[int, dict[str, Any]]:
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    except httpx.HTTPError:
        return 0, {}
    return response.status_code, response.json()


def wait_for_health(port: int, status: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, body = health(port)
        if code == status:
            return body
        time.sleep(0.25)
    raise AssertionError(f"/health did not answer {status} within {timeout_s} s")


def test_index_equals_oracle_under_sigkill_and_elasticsearch_restart(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    port = free_port()
    pipeline = make_pipeline(
        entities=("customers",),
        ingestor={"max_offsets_per_trigger": 1000, "metrics_port": 0},
        merger={"max_files_per_trigger": 1, "metrics_port": 0},
        publisher_es={
            "max_files_per_trigger": 1,  # many small batches: kills land mid-batch
            "trigger_interval": "200 milliseconds",
            "chunk_size": 25,
            "initial_backoff_s": 0.2,
            "max_backoff_s": 2.0,
            "metrics_port": port,
            "metrics_host": "127.0.0.1",
        },
    )
    spec = {"delete_share": 0.2, "redelivery_share": 0.05, "poison_share": 0.0}
    produce(kafka_config, iter(generate(pipeline, events=3000, keys=300, **spec)))
    ingest_once(pipeline, spark)
    # Silver changes while the publishers run: each batch has new versions to publish.
    merging = threading.Thread(
        target=merge_in_slices, args=(pipeline, spark, "customers", 30), kwargs={"pause_s": 1.0}
    )
    merging.start()
    checkpoint = Path(pipeline.config.layout.checkpoint("publisher_es", "default"))
    log = tmp_path / "publisher-es.log"
    rng = random.Random(7)
    kills = 0
    restarted_es = False
    for run in range(KILLS):  # run 0 mid-batch; 1 the ES restart
        process = subprocess.Popen(
            [PUBLISHER, "--config", str(pipeline.path)],
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
            start_new_session=True,
        )
        try:
            seen = committed_batches(checkpoint)
            if run == 1:  # Elasticsearch goes away while batches are being written
                assert wait_for_commit_after(checkpoint, seen, 180), f"no progress; see {log}"
                infra.stop(TEST_INFRA, "elasticsearch")
                try:
                    body = wait_for_health(port, 503, 120)
                    problems = [str(s["problem"]) for s in body["streams"].values()]
                    assert any("Elasticsearch" in p for p in problems), body
                    time.sleep(3)
                    assert process.poll() is None, f"publisher gave up on a down ES; see {log}"
                    stalled = committed_batches(checkpoint)
                finally:
                    infra.start_elasticsearch(TEST_INFRA)
                restarted_es = True
                assert wait_for_commit_after(checkpoint, stalled, 180), f"no resume; see {log}"
                wait_for_health(port, 200, 120)
                time.sleep(2)  # let the listener log the retried batch
            else:  # mid-batch: just after a batch committed, the next one runs
                wait_for_commit_after(checkpoint, seen, 120)
                time.sleep(rng.uniform(0.0, 1.0))
            assert process.poll() is None, f"publisher died by itself; see {log}"
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        kills += 1
    assert kills == KILLS and restarted_es
    merging.join(600)
    assert not merging.is_alive(), "silver's slices were not all merged"

    start(pipeline.config, once=True, spark=spark).run()  # the drain, with this warm Spark
    assert_index_equals_oracle(pipeline, kafka_config)
    batches = [
        json.loads(line)
        for line in log.read_text().splitlines()
        if line.startswith("{") and '"msg": "batch"' in line
    ]
    assert any(b.get("retried", 0) > 0 for b in batches), "no batch retried: ES never failed it"
