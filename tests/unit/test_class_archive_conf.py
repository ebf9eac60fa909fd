"""The driver's JVM options: the class archive of ``make jvm`` when it exists, UTC, a local
driver's collector, the user's options last."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm import artifacts as jvm
from cdc_shared.jvm.spark import (
    DRIVER_JAVA_OPTIONS,
    DRIVER_TIME_ZONE,
    JVM_LOGGING,
    LOCAL_DRIVER_GC,
    LOCAL_DRIVER_YOUNG,
    spark_conf,
)

LOGGING = f"-Dlog4j2.configurationFile={JVM_LOGGING}"
UTC = f"{DRIVER_TIME_ZONE} {LOGGING}"  # the time zone and our logging, on every master
LOCAL = f"{UTC} {LOCAL_DRIVER_GC} {LOCAL_DRIVER_YOUNG}"

CLUSTER = "spark://127.0.0.1:7077"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(jvm.JVM_CACHE_ENV_VAR, str(tmp_path))
    return tmp_path


def options(conf: dict[str, str] | None = None, master: str = "local[2]") -> str | None:
    return spark_conf(SparkConfig(master=master, conf=conf or {}), "t").get(DRIVER_JAVA_OPTIONS)


def test_without_an_archive_a_local_driver_gets_its_collector_and_young_cap(cache: Path) -> None:
    assert options() == LOCAL
    assert options({DRIVER_JAVA_OPTIONS: "-Xss4m"}) == f"{LOCAL} -Xss4m"


@pytest.mark.parametrize(
    "sizing", ["-Xmn1g", "-XX:MaxNewSize=2g", "-XX:NewSize=1g", "-XX:NewRatio=2"]
)
def test_the_users_young_generation_replaces_our_cap(cache: Path, sizing: str) -> None:
    assert options({DRIVER_JAVA_OPTIONS: sizing}) == f"{UTC} {LOCAL_DRIVER_GC} {sizing}"


def test_a_cluster_driver_keeps_the_jvm_default_collector(cache: Path) -> None:
    assert options(master=CLUSTER) == UTC
    assert options({DRIVER_JAVA_OPTIONS: "-Xss4m"}, master=CLUSTER) == f"{UTC} -Xss4m"


def test_the_users_time_zone_comes_after_ours(cache: Path) -> None:
    # The JVM takes the last -D of a property: theirs.
    zone = "-Duser.timezone=Europe/Berlin"
    assert options({DRIVER_JAVA_OPTIONS: zone}) == f"{LOCAL} {zone}"


@pytest.mark.parametrize("collector", ["-XX:+UseG1GC", "-XX:+UseSerialGC", "-XX:+UseZGC"])
def test_the_users_collector_replaces_ours(cache: Path, collector: str) -> None:
    # The JVM refuses to start with two collectors.
    assert options({DRIVER_JAVA_OPTIONS: f"-Xss4m {collector}"}) == f"{UTC} -Xss4m {collector}"


def test_an_archive_comes_first_so_the_users_options_win(cache: Path) -> None:
    archive = jvm.class_archive()
    assert archive.is_relative_to(cache)
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"archive")
    assert options() == f"-XX:SharedArchiveFile={archive} {LOCAL}"
    assert options({DRIVER_JAVA_OPTIONS: "-Xshare:off"}) == (
        f"-XX:SharedArchiveFile={archive} {LOCAL} -Xshare:off"
    )
    assert options(master=CLUSTER) == f"-XX:SharedArchiveFile={archive} {UTC}"


def test_the_users_logging_file_replaces_ours(cache: Path) -> None:
    assert JVM_LOGGING.is_file()  # shipped beside cdc_shared.jvm.spark
    theirs = "-Dlog4j2.configurationFile=/etc/spark/log4j2.properties"
    chosen = options({DRIVER_JAVA_OPTIONS: theirs})
    assert chosen is not None and LOGGING not in chosen and chosen.endswith(theirs)
