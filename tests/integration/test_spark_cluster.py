"""The ingestor and the merger on a Spark standalone cluster (``spark.master: spark://...``).

``cdc infra``'s cluster (a master and a worker on loopback) runs the real services: a
generated workload goes through ``cdc-ingestor --once`` and ``cdc-merger --once``, each a
subprocess whose SparkSession is an application of the cluster (the test session's own
SparkSession is local, and a process holds one SparkContext). Silver must equal the
oracle, the master must list both applications as finished, and the worker's executor
logs must show tasks run there (with the jars the driver shipped: Delta, Kafka, Avro).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cdc_devkit import infra
from cdc_devkit.workload import produce
from cdc_shared.config import KafkaConfig
from pyspark.sql import SparkSession
from support.ingestion import generate
from support.pipelines import Pipeline, PipelineFactory
from support.servers import TEST_INFRA
from support.silver import assert_silver_equals_oracle

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

SERVICES = ("cdc-ingestor", "cdc-merger")


def _cluster_pipeline(make_pipeline: PipelineFactory, master: str) -> Pipeline:
    """The usual test pipeline, its Spark applications sized for the one small worker."""
    pipeline = make_pipeline(ingestor={"metrics_port": 0}, merger={"metrics_port": 0})
    document = yaml.safe_load(pipeline.path.read_text())
    document["spark"] = {
        "master": master,
        "conf": {
            "spark.ui.enabled": "false",
            # The driver stays on loopback, like the cluster.
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.memory": "1g",
            "spark.executor.memory": "1g",
            "spark.cores.max": str(TEST_INFRA.spark_worker_cores),
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.databricks.delta.snapshotPartitions": "2",
        },
    }
    pipeline.path.write_text(yaml.safe_dump(document))
    return pipeline


def _run_service(command: str, pipeline: Pipeline, log: Path) -> None:
    """``command --config ... --once`` in its own process; fails with its log's tail."""
    with log.open("wb") as out:
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name(command)),
                *("--config", str(pipeline.path), "--once"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYSPARK_PYTHON": sys.executable},
            timeout=600,
            check=False,
        )
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{tail}"


def _completed_apps() -> dict[str, str]:
    """Application id to name, of the applications the master lists as completed."""
    state = infra.spark_master_state(TEST_INFRA)
    assert state is not None, "the Spark master does not answer"
    return {app["id"]: app["name"] for app in state.get("completedapps", [])}


def _executor_logs(app_id: str) -> str:
    """Every executor's stderr of ``app_id`` on this cluster's workers."""
    logs = (TEST_INFRA.state_dir / "spark").glob(f"worker-*/{app_id}/*/stderr")
    return "".join(p.read_text(errors="replace") for p in logs)


def test_ingestor_and_merger_run_on_a_standalone_cluster(
    spark: SparkSession,
    spark_master: str,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    tmp_path: Path,
) -> None:
    assert spark_master == infra.spark_master_url(TEST_INFRA)
    pipeline = _cluster_pipeline(make_pipeline, spark_master)
    produce(
        kafka_config,
        iter(generate(pipeline, events=600, keys=100, delete_share=0.15, redelivery_share=0.02)),
    )
    before = _completed_apps()

    for command in SERVICES:
        _run_service(command, pipeline, tmp_path / f"{command}.log")

    ran = {app_id: name for app_id, name in _completed_apps().items() if app_id not in before}
    assert sorted(ran.values()) == sorted(SERVICES), f"applications on the cluster: {ran}"
    for app_id, name in ran.items():
        executor_log = _executor_logs(app_id)
        assert "Finished task" in executor_log, f"{name} ({app_id}) ran no task on a worker"
        assert "delta-spark" in executor_log, f"{name}: the executors fetched no Delta jar"
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
