"""Where a new merger stream starts in bronze: its first commit only when the commits replay it.

Each case is a real Delta table shaped as bronze gets shaped (appends, auto compaction,
VACUUM, a schema change); the oracle is what a stream from version 0 reads against the
table's own rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cdc_merger.bronze_start import (
    FROM_FIRST_COMMIT_MARKER,
    reads_from_first_commit,
    replayable_from_first_commit,
)
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration


def _append(spark: SparkSession, path: str, first: int, rows: int, files: int = 2) -> None:
    frame = spark.range(first, first + rows).selectExpr("id", "cast(id as string) AS name")
    frame.repartition(files).write.format("delta").mode("append").save(path)


def _appended_then_compacted(spark: SparkSession, path: str) -> None:
    """Two appends of 10 rows, then a compaction (removes without a data change)."""
    _append(spark, path, 0, 10)
    _append(spark, path, 10, 10)
    DeltaTable.forPath(spark, path).optimize().executeCompaction()


def _from_first_commit(spark: SparkSession, path: str) -> list[int]:
    """The ids a stream reading ``path`` from version 0 sees (one available-now run)."""
    sink = f"{path}-sink"
    query = (
        spark.readStream.format("delta")
        .option("startingVersion", 0)
        .load(path)
        .writeStream.format("delta")
        .option("checkpointLocation", f"{sink}-checkpoint")
        .trigger(availableNow=True)
        .start(sink)
    )
    query.awaitTermination()
    return sorted(r.id for r in spark.read.format("delta").load(sink).collect())


def test_appended_and_compacted_bronze_is_read_from_its_first_commit(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = str(tmp_path / "bronze")
    _appended_then_compacted(spark, path)
    _append(spark, path, 20, 10)

    assert replayable_from_first_commit(spark, path)
    assert _from_first_commit(spark, path) == list(range(30))


def test_vacuumed_or_reshaped_bronze_starts_from_its_snapshot(
    spark: SparkSession, tmp_path: Path
) -> None:
    vacuumed = str(tmp_path / "vacuumed")
    _appended_then_compacted(spark, vacuumed)
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        DeltaTable.forPath(spark, vacuumed).vacuum(0)  # the appended files are gone
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    assert not replayable_from_first_commit(spark, vacuumed)

    widened = str(tmp_path / "widened")
    _append(spark, widened, 0, 10)
    (
        spark.range(10, 20)
        .selectExpr("id", "cast(id as string) AS name", "id AS extra")
        .write.format("delta")
        .mode("append")
        .option("mergeSchema", "true")
        .save(widened)
    )
    assert not replayable_from_first_commit(spark, widened)

    deleted = str(tmp_path / "deleted")
    _append(spark, deleted, 0, 10)
    DeltaTable.forPath(spark, deleted).delete("id < 3")
    assert not replayable_from_first_commit(spark, deleted)

    assert not replayable_from_first_commit(spark, str(tmp_path / "missing"))


def test_the_choice_is_kept_in_the_checkpoint(spark: SparkSession, tmp_path: Path) -> None:
    """Made once for a new stream; a planned batch without the mark keeps the snapshot."""
    path = str(tmp_path / "bronze")
    _append(spark, path, 0, 10)
    checkpoint = tmp_path / "checkpoint"
    assert reads_from_first_commit(spark, path, str(checkpoint))
    assert (checkpoint / FROM_FIRST_COMMIT_MARKER).exists()

    DeltaTable.forPath(spark, path).delete("id < 3")  # no longer replayable ...
    assert reads_from_first_commit(spark, path, str(checkpoint))  # ... the choice stands

    planned = tmp_path / "planned"
    (planned / "offsets").mkdir(parents=True)
    (planned / "offsets" / "0").write_text("v1\n{}\n{}\n")
    fresh = str(tmp_path / "fresh")
    _append(spark, fresh, 0, 10)
    assert not reads_from_first_commit(spark, fresh, str(planned))
    assert not (planned / FROM_FIRST_COMMIT_MARKER).exists()
