"""The Spark cluster's settings and endpoints, and spark_conf for a cluster master."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cdc_devkit import infra
from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm.spark import spark_conf


def test_settings_defaults_and_env_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    defaults = infra.InfraSettings(state_dir=tmp_path)
    assert (defaults.spark_master_port, defaults.spark_workers) == (7077, 1)
    monkeypatch.setenv("CDC_INFRA_SPARK_MASTER_PORT", "37077")
    monkeypatch.setenv("CDC_INFRA_SPARK_WORKERS", "2")
    monkeypatch.setenv("CDC_INFRA_SPARK_WORKER_MEMORY", "1g")
    settings = infra.InfraSettings(state_dir=tmp_path)
    assert (settings.spark_master_port, settings.spark_workers) == (37077, 2)
    assert settings.spark_worker_memory == "1g"
    served = infra.endpoints(settings, with_spark_cluster=True)
    assert served.spark_master == "spark://127.0.0.1:37077"
    assert infra.endpoints(settings).spark_master is None


def test_workers_are_one_server_stopped_after_the_master_starts(tmp_path: Path) -> None:
    assert infra.SERVERS.index(infra.SPARK_WORKERS) > infra.SERVERS.index("spark-master")
    settings = infra.InfraSettings(state_dir=tmp_path)
    assert infra.running(settings)[infra.SPARK_WORKERS] is False
    (tmp_path / "spark-worker-0.pid").write_text("999999999")  # no such process
    assert infra.running(settings)[infra.SPARK_WORKERS] is False
    assert infra.stop(settings, infra.SPARK_WORKERS) is False
    assert not (tmp_path / "spark-worker-0.pid").exists()


def test_local_masters_are_unchanged_and_get_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cdc_shared.jvm.spark"):
        conf = spark_conf(SparkConfig(master="local[2]"), "t")
    assert conf["spark.sql.shuffle.partitions"] == "4"
    assert "spark.cores.max" not in conf
    assert not [r for r in caplog.records if "spark.cores.max" in r.getMessage()]


def test_a_standalone_master_without_cores_max_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    master = "spark://127.0.0.1:7077"
    with caplog.at_level(logging.WARNING, logger="cdc_shared.jvm.spark"):
        conf = spark_conf(SparkConfig(master=master), "cdc-merger")
        sized = spark_conf(SparkConfig(master=master, conf={"spark.cores.max": "2"}), "t")
    assert conf["spark.master"] == master and conf["spark.sql.shuffle.partitions"] == "200"
    warned = [r.getMessage() for r in caplog.records if "spark.cores.max" in r.getMessage()]
    assert len(warned) == 1 and "cdc-merger" in warned[0]
    assert sized["spark.cores.max"] == "2"
