"""Drivers start with the class archive of ``make jvm`` when it exists, users' options last."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdc_shared import jvm
from cdc_shared.config import SparkConfig
from cdc_shared.spark import DRIVER_JAVA_OPTIONS, spark_conf


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(jvm.JVM_CACHE_ENV_VAR, str(tmp_path))
    return tmp_path


def test_without_an_archive_the_driver_options_are_left_alone(cache: Path) -> None:
    assert DRIVER_JAVA_OPTIONS not in spark_conf(SparkConfig(), "t")
    user = SparkConfig(conf={DRIVER_JAVA_OPTIONS: "-Xss4m"})
    assert spark_conf(user, "t")[DRIVER_JAVA_OPTIONS] == "-Xss4m"


def test_an_archive_comes_first_so_the_users_options_win(cache: Path) -> None:
    archive = jvm.class_archive()
    assert archive.is_relative_to(cache)
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"archive")
    assert spark_conf(SparkConfig(), "t")[DRIVER_JAVA_OPTIONS] == (
        f"-XX:SharedArchiveFile={archive}"
    )
    user = SparkConfig(conf={DRIVER_JAVA_OPTIONS: "-Xshare:off"})
    assert spark_conf(user, "t")[DRIVER_JAVA_OPTIONS] == (
        f"-XX:SharedArchiveFile={archive} -Xshare:off"
    )
