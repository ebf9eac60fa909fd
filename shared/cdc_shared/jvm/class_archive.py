"""The JVM class archive that makes every Spark driver start faster.

A JVM spends seconds of a Spark driver's start loading and verifying the same ~17,000
classes (Spark, Scala, Delta). The JDK's class data sharing (CDS) maps classes a
previous run dumped to an archive file instead: the session starts ~3 s sooner, and every
restart of a service (after a crash, a deploy, each kill in the tests) with it.

``python -m cdc_shared.jvm.class_archive`` (run by ``make jvm``) starts a driver that dumps
its classes at exit (``-XX:ArchiveClassesAtExit``) after a small Delta workload: writes,
a MERGE, a streaming ``foreachBatch`` and a Change Data Feed read, the kinds of work the
services do. :func:`cdc_shared.jvm.spark.spark_conf` then starts every driver with the
archive (``-XX:SharedArchiveFile``) when it exists. The archive belongs to one JDK build
and one Spark classpath; a JVM that finds it does not match says so in a warning and
starts without it, so a stale archive costs only the time it would have saved.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm import artifacts as jvm
from cdc_shared.jvm.spark import DRIVER_JAVA_OPTIONS, LOCAL_DRIVER_GC, spark_conf

log = logging.getLogger(__name__)


def exercise(spark: SparkSession, folder: Path) -> None:
    """Work that loads the classes the services load.

    Delta writes and reads, a MERGE from a streaming ``foreachBatch`` (available-now
    trigger), a Change Data Feed read.
    """
    source, target = str(folder / "source"), str(folder / "target")
    rows = spark.range(200).select(
        F.col("id").alias("key"),
        (F.col("id") % 7).alias("value"),
        F.current_timestamp().alias("at"),
    )
    rows.write.format("delta").save(source)
    rows.limit(0).write.format("delta").option("delta.enableChangeDataFeed", "true").save(target)

    def merge(batch: DataFrame, batch_id: int) -> None:
        (
            DeltaTable.forPath(spark, target)
            .alias("t")
            .merge(batch.alias("s"), "t.key = s.key")
            .whenMatchedUpdateAll()
            .whenNotMatchedInsertAll()
            .execute()
        )

    query = (
        spark.readStream.format("delta")
        .load(source)
        .writeStream.foreachBatch(merge)
        .option("checkpointLocation", str(folder / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    changes = spark.read.format("delta").option("readChangeFeed", "true")
    changes.option("startingVersion", 0).load(target).groupBy("_change_type").count().collect()


def build(archive: Path) -> bool:
    """Dump a new archive to ``archive`` (atomically); False if the JVM could not.

    A failure (e.g. a JDK without a base archive) is a warning: drivers then start
    without an archive, as they would have anyway.
    """
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-m", "cdc_shared.jvm.class_archive", "--dump-to", str(partial)],
        check=False,
        capture_output=True,
        text=True,
    )
    if child.returncode != 0 or not partial.is_file() or partial.stat().st_size == 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join((child.stdout + child.stderr).splitlines()[-15:])
        log.warning("no class archive written (drivers start without one):\n%s", tail)
        return False
    partial.replace(archive)
    log.info(
        "class archive %s written (%.0f MiB) in %.0f s",
        archive,
        archive.stat().st_size / 2**20,
        time.monotonic() - started,
    )
    return True


def _dump_child(partial: Path) -> None:
    """The child's side of :func:`build`: one driver dumping at exit, one workload."""
    conf = spark_conf(SparkConfig(), "cdc-class-archive")
    # The collector the local drivers run with; only errors: the dump warns of every
    # class of a signed jar it skips, as it must.
    conf[DRIVER_JAVA_OPTIONS] = (
        f"{LOCAL_DRIVER_GC} -XX:ArchiveClassesAtExit={partial} -Xlog:cds=error"
    )
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    with tempfile.TemporaryDirectory(prefix="cdc-class-archive-") as folder:
        exercise(spark, Path(folder))
    spark.stop()  # the JVM dumps its classes when the gateway exits with this process


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m cdc_shared.jvm.class_archive`` writes ``jvm.class_archive()``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump-to", type=Path, help=argparse.SUPPRESS)  # build()'s child
    options = parser.parse_args(argv)
    if options.dump_to is not None:
        _dump_child(options.dump_to)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(jvm.class_archive())
    return 0  # an archive is an optimisation: its absence fails nothing


if __name__ == "__main__":
    sys.exit(main())
