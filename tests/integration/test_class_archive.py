"""The class archive ``make jvm`` dumps is mapped by the drivers it starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from cdc_shared.jvm import artifacts as jvm
from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration


def test_the_sessions_driver_maps_spark_classes_from_the_archive(spark: SparkSession) -> None:
    archive = jvm.class_archive()
    assert archive.is_file(), f"{archive} missing: `make jvm` dumps it"
    runtime = spark.sparkContext._jvm.java.lang  # type: ignore[union-attr]
    arguments = list(runtime.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert f"-XX:SharedArchiveFile={archive}" in arguments
    jcmd = Path(runtime.System.getProperty("java.home")) / "bin" / "jcmd"
    pid = str(runtime.ProcessHandle.current().pid())
    metaspace = subprocess.run(
        [str(jcmd), pid, "VM.metaspace"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    found = re.search(r"Total Usage - \d+ loaders, (\d+) classes \((\d+) shared\)", metaspace)
    assert found, metaspace[:2000]
    # The JDK's own archive holds ~1,300 classes; Spark's and Delta's from ours bring the
    # count past 10,000. (Not a share of `loaded`: generated classes, never archived, grow
    # with every query a test session has run.)
    loaded, shared = int(found[1]), int(found[2])
    assert shared > 10_000, (loaded, shared)
