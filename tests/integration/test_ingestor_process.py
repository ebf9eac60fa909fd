"""The ingestor as a separate process: SIGKILLs at random moments and in the window after
a bronze commit, then a SIGTERM that lets the batch in flight finish; after a drain, bronze
and quarantine hold every Kafka record exactly once.

Both tables are in the group ``default``: one query reads both topics, and each bronze
commit holds both tables' rows of its batch. (The chaos run, tests/e2e/test_chaos.py,
kills the service under load too.)"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from cdc_devkit.workload import ProduceReport, produce
from cdc_shared.config.connections import KafkaConfig
from pyspark.sql import SparkSession
from support.ingestion import (
    assert_bronze_exactly_once,
    assert_quarantine_exactly_once,
    checkpoints_aside,
    generate,
    ingest_once,
    launch_ingestor,
)
from support.pipelines import Pipeline, PipelineFactory
from support.waiting import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# SIGKILLs per test: one in the dangerous window (after the sink's commit, before the
# checkpoint's), one elsewhere; more while the load lasts. Every restart costs a Spark
# start; the chaos run (tests/e2e/test_chaos.py) kills this service under load too.
KILLS = 2


def bronze_commits(pipeline: Pipeline) -> int:
    log_dir = Path(pipeline.config.layout.bronze()) / "_delta_log"
    return len(list(log_dir.glob("*.json"))) if log_dir.is_dir() else 0


def _batches_logged(log: Path) -> int:
    return log.read_text().count('"msg": "batch"') if log.exists() else 0


def _sigterm_finishes_the_batch(pipeline: Pipeline, log: Path) -> None:
    """A running ingestor serves /health and /metrics, and exits 0 on SIGTERM."""
    port = free_port()
    settings = {
        "CDC_INGESTOR__METRICS_PORT": str(port),
        "CDC_INGESTOR__METRICS_HOST": "127.0.0.1",
    }
    logged_before = _batches_logged(log)
    process = launch_ingestor(pipeline, log, env=settings)
    deadline = time.monotonic() + 120
    while _batches_logged(log) == logged_before and time.monotonic() < deadline:
        assert process.poll() is None, f"ingestor died by itself; see {log}"
        time.sleep(0.2)
    assert _batches_logged(log) > logged_before, f"no batch within 120 s; see {log}"
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["streams"]["default"]["active"] is True  # one query, both tables
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for entity in ("customers", "orders"):  # rows counted per table, not per query
        assert f'cdc_rows_total{{entity="{entity}",outcome="bronze_rows",service="ingestor"}}' in (
            metrics
        )
    since = len(log.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 0
    stopping = log.read_text()[since:]
    assert '"msg": "stop requested"' in stopping and '"msg": "stream stopped"' in stopping


def test_exactly_once_under_sigkill_then_sigterm_finishes_the_batch(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    tmp_path: Path,
) -> None:
    pipeline = make_pipeline(
        entities=("customers", "orders"),
        ingestor={
            "trigger_interval": "500 milliseconds",
            "max_offsets_per_trigger": 2000,
            "metrics_port": 0,
        },
    )
    # The first records in this process: the launched processes go on from its checkpoint.
    first = produce(kafka_config, iter(generate(pipeline, events=3000, keys=300)))
    ingest_once(pipeline, spark, max_offsets=100_000)
    messages = generate(pipeline, events=30_000, keys=2000, poison_share=0.005)
    reports: list[ProduceReport] = []
    load = threading.Thread(
        target=lambda: reports.append(produce(kafka_config, iter(messages), rate=1500))
    )
    load.start()
    rng = random.Random(20261125)
    log = tmp_path / "ingestor.log"
    kills = 0
    try:
        while kills < KILLS or load.is_alive():
            process = launch_ingestor(pipeline, log)
            if kills % 2 == 0:
                # The dangerous window: right after a bronze commit, before the checkpoint's.
                seen = bronze_commits(pipeline)
                deadline = time.monotonic() + 90
                while bronze_commits(pipeline) == seen and time.monotonic() < deadline:
                    time.sleep(0.02)
            else:
                time.sleep(rng.uniform(6, 20))
            assert process.poll() is None, f"ingestor died by itself; see {log}"
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
            kills += 1
    finally:
        load.join()
    report = reports[0]
    report.add(first)

    # Then a SIGTERM: the batch in flight finishes, the process exits 0. More load first,
    # so the stopped process surely has a batch to run.
    report.add(produce(kafka_config, iter(generate(pipeline, events=6000, keys=500))))
    _sigterm_finishes_the_batch(pipeline, log)

    # The drain: in this process, whose Spark is warm, in batches of the whole backlog.
    ingest_once(pipeline, spark, max_offsets=100_000)
    assert kills >= KILLS
    checkpoint = Path(pipeline.config.layout.checkpoint("ingestor", "default"))
    committed = [int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit()]
    assert max(committed) > 0  # the processes went on from the first run's checkpoint
    assert checkpoints_aside(pipeline) == []  # a kill never makes a new one
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    assert_quarantine_exactly_once(spark, pipeline, report)
