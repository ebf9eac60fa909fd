"""The move from a deployment of the releases before one bronze, killed as it moves.

A pipeline runs as those releases did (a query per entity, a bronze table each: the
state ``support.legacy`` writes with real queries), part of it left undone: records in
Kafka not ingested, bronze rows not merged, an ingestor batch written to bronze but not
committed to its checkpoint. Then the services of this release start on the same root:
the ingestor carries each topic on where the old tables end, the merger drains what the
old tables hold that it had not merged. Each is SIGKILLed in the middle of its move, then
run again. Every Kafka record is in exactly one of the old bronze tables, the new bronze
and the quarantine, and silver equals the oracle (an independent replay of the topics).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cdc_devkit.workload import produce
from cdc_shared.clients.delta_rs import transaction_versions
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.contracts.bronze import entity_changes
from pyspark.sql import SparkSession
from support.ingestion import generate, ingest_once, launch_ingestor, quarantine, topic_offsets
from support.legacy import legacy_ingest, legacy_merge
from support.pipelines import Pipeline, PipelineFactory
from support.silver import assert_silver_equals_oracle, merge_once

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MERGER = str(Path(sys.executable).with_name("cdc-merger"))


def _commits(log: Path) -> int:
    return len(list(log.glob("*.json"))) if log.is_dir() else 0


def _kill_after_commit(process: subprocess.Popen[bytes], log: Path, output: Path) -> None:
    """SIGKILL ``process`` right after the next commit to the table whose log is ``log``."""
    seen = _commits(log)
    deadline = time.monotonic() + 240
    while _commits(log) <= seen:
        assert process.poll() is None, f"the service died by itself; see {output}"
        assert time.monotonic() < deadline, f"no commit to {log.parent} in time; see {output}"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def _forget_last_commit(checkpoint: Path) -> None:
    """As if the process died after the batch's bronze commit, before the checkpoint's."""
    commits = sorted(
        (p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    commits[-1].unlink()
    commits[-1].with_name(f".{commits[-1].name}.crc").unlink(missing_ok=True)


def _assert_each_record_once(
    spark: SparkSession, pipeline: Pipeline, kafka: KafkaConfig, poisoned: set[tuple[str, int, int]]
) -> None:
    """Old bronze tables, the new bronze and the quarantine hold each record once."""
    layout = pipeline.config.layout
    quarantined = {
        (r.kafka_topic, r.kafka_partition, r.kafka_offset)
        for r in quarantine(spark, pipeline).collect()
    }
    assert quarantined == poisoned
    for entity in pipeline.config.entities:
        old = spark.read.format("delta").load(layout.legacy_bronze(entity.name))
        new = entity_changes(spark, layout.bronze(), entity.name)
        landed = [
            (r.kafka_partition, r.kafka_offset)
            for frame in (old, new)
            for r in frame.select("kafka_partition", "kafka_offset").collect()
        ]
        assert len(landed) == len(set(landed)), f"{entity.name}: a record landed twice"
        held = {(p, o) for t, p, o in quarantined if t == entity.source_topic}
        assert set(landed) | held == topic_offsets(kafka, entity.source_topic), entity.name
        assert old.count() > 0 and new.count() > 0, entity.name


def test_a_deployment_of_tables_of_its_own_moves_killed_midway(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = make_pipeline(
        merger={"max_files_per_trigger": 2, "metrics_port": 0, "trigger_interval": "1 second"},
        ingestor={
            "max_offsets_per_trigger": 400,
            "metrics_port": 0,
            "trigger_interval": "1 second",
        },
    )
    config = pipeline.config
    layout = config.layout
    messages = generate(pipeline, events=6000, keys=300, delete_share=0.2, poison_share=0.01)
    third = len(messages) // 3
    reports = [produce(kafka_config, iter(messages[:third]))]
    legacy_ingest(spark, pipeline)
    legacy_merge(spark, pipeline)  # merged up to here
    reports.append(produce(kafka_config, iter(messages[third : 2 * third])))
    legacy_ingest(spark, pipeline)  # ingested, not merged
    # The last ingestor batch of one table: in bronze, not committed to its checkpoint.
    _forget_last_commit(Path(layout.legacy_checkpoint("ingestor", "customers")))
    reports.append(produce(kafka_config, iter(messages[2 * third :])))  # not ingested
    poisoned = {(t, p, o) for report in reports for t, p, o, _ in report.poison}

    # The ingestor's move: killed right after its first commit to the new bronze.
    output = tmp_path / "services.log"
    bronze_log = Path(layout.bronze()) / "_delta_log"
    ingestor = launch_ingestor(pipeline, output)
    _kill_after_commit(ingestor, bronze_log, output)
    _kill_after_commit(launch_ingestor(pipeline, output), bronze_log, output)
    # The merger's move (its drain of the old tables): killed after a commit to silver.
    silver_log = Path(layout.silver("customers")) / "_delta_log"
    with output.open("ab") as log:
        merger = subprocess.Popen(
            [MERGER, "--config", str(pipeline.path)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    _kill_after_commit(merger, silver_log, output)
    drained = transaction_versions(config, {"c": layout.silver("customers")}, "cdc-merger-legacy")
    assert drained["c"] is None, "the drain was not killed midway"

    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    _assert_each_record_once(spark, pipeline, kafka_config, poisoned)
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    paths = {e.name: layout.silver(e.name) for e in config.entities}
    assert all(v == 1 for v in transaction_versions(config, paths, "cdc-merger-legacy").values())
