"""Real Spark with Delta: CDF after MERGE, and a Kafka -> Delta stream with a checkpoint."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import pytest
from cdc_cli.application import POOL_PROPERTY
from cdc_shared.clients.connect import make_producer, spark_kafka_options
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.streaming.tables import AUTO_COMPACT, ensure_table, has_commits, table_properties
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

pytestmark = pytest.mark.integration


def test_merge_update_and_delete_show_in_change_data_feed(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = str(tmp_path / "people")
    (
        spark.createDataFrame([(1, "ada"), (2, "grace"), (3, "alan")], "id INT, name STRING")
        .write.format("delta")
        .option("delta.enableChangeDataFeed", "true")
        .save(path)
    )
    changes = spark.createDataFrame(
        [(1, "ada lovelace", "u"), (3, None, "d"), (4, "edsger", "c")],
        "id INT, name STRING, op STRING",
    )
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(changes.alias("s"), "t.id = s.id")
        .whenMatchedDelete(condition="s.op = 'd'")
        .whenMatchedUpdate(set={"name": "s.name"})
        .whenNotMatchedInsert(condition="s.op != 'd'", values={"id": "s.id", "name": "s.name"})
        .execute()
    )
    feed = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 1)
        .load(path)
        .select("id", "name", "_change_type", "_commit_version")
    )
    got = sorted((r.id, r.name, r._change_type, r._commit_version) for r in feed.collect())
    assert got == [
        (1, "ada", "update_preimage", 1),
        (1, "ada lovelace", "update_postimage", 1),
        (3, "alan", "delete", 1),
        (4, "edsger", "insert", 1),
    ]
    current = sorted((r.id, r.name) for r in spark.read.format("delta").load(path).collect())
    assert current == [(1, "ada lovelace"), (2, "grace"), (4, "edsger")]


def test_kafka_stream_to_delta_with_checkpoint(
    spark: SparkSession, kafka_config: KafkaConfig, topic: str, tmp_path: Path
) -> None:
    producer = make_producer(kafka_config)
    for i in range(100):
        producer.produce(topic, key=str(i).encode(), value=f"v{i}".encode())
    assert producer.flush(30) == 0

    table, checkpoint = str(tmp_path / "bronze"), str(tmp_path / "checkpoint")

    def run_once() -> None:
        query = (
            spark.readStream.format("kafka")
            .options(**spark_kafka_options(kafka_config))
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .load()
            .select("partition", "offset", F.col("value").cast("string").alias("value"))
            .writeStream.format("delta")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start(table)
        )
        query.awaitTermination(120)
        assert query.exception() is None

    run_once()
    for i in range(100, 130):
        producer.produce(topic, key=str(i).encode(), value=f"v{i}".encode())
    assert producer.flush(30) == 0
    run_once()  # resumes from the checkpoint: only the 30 new records

    rows = spark.read.format("delta").load(table)
    assert rows.count() == 130
    assert rows.select("partition", "offset").distinct().count() == 130
    assert {r.value for r in rows.collect()} == {f"v{i}" for i in range(130)}


def test_counting_jobs_counts_this_threads_jobs_and_its_background_calls(
    spark: SparkSession,
) -> None:
    from cdc_shared.jvm.spark import BackgroundCall, counting_jobs

    spark.range(3).collect()  # before the block: not counted
    with counting_jobs(spark) as jobs:
        spark.range(10).collect()
        BackgroundCall(lambda: spark.range(5).collect()).wait()
    spark.range(3).collect()  # after the block: not counted
    time.sleep(1)  # Spark records jobs through its listener bus
    assert jobs() == 2


def test_a_background_call_raises_what_the_call_raised(spark: SparkSession) -> None:
    from cdc_shared.jvm.spark import BackgroundCall

    def fail() -> None:
        raise ValueError("in the background")

    call = BackgroundCall(fail)
    with pytest.raises(ValueError, match="in the background"):
        call.wait()


def test_a_streams_batches_run_in_the_pool_its_starter_chose(
    spark: SparkSession, tmp_path: Path
) -> None:
    # `cdc run` puts each service in its own FAIR pool by starting its streams with the
    # pool set on the starting thread: the stream thread and its foreachBatch inherit it.
    seen: list[str | None] = []

    def record(batch: DataFrame, _batch_id: int) -> None:
        batch.count()
        seen.append(batch.sparkSession.sparkContext.getLocalProperty(POOL_PROPERTY))

    context = spark.sparkContext
    context.setLocalProperty(POOL_PROPERTY, "merger")
    try:
        query = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 10)
            .load()
            .writeStream.foreachBatch(record)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
    finally:
        context.setLocalProperty(POOL_PROPERTY, None)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        query.stop()
    assert len(seen) >= 2
    assert set(seen) == {"merger"}
    assert context.getLocalProperty(POOL_PROPERTY) is None  # the starter's own is unchanged


def test_a_table_creation_killed_before_its_first_commit_is_created_again(
    spark: SparkSession, tmp_path: Path
) -> None:
    # What a SIGKILL between Delta's mkdir of the log and its commit 0 leaves behind.
    path = tmp_path / "quarantine"
    (path / "_delta_log" / "_staged_commits").mkdir(parents=True)
    schema = T.StructType([T.StructField("id", T.LongType(), False)])

    ensure_table(spark, str(path), schema, {"delta.appendOnly": "true"})

    assert has_commits(spark, str(path))
    table = DeltaTable.forPath(spark, str(path))
    assert table.toDF().schema == schema
    assert dict(table.detail().first()["properties"])["delta.appendOnly"] == "true"


def test_an_existing_table_is_kept_by_ensure_table(spark: SparkSession, tmp_path: Path) -> None:
    path = str(tmp_path / "kept")
    spark.createDataFrame([(1,), (2,)], "id LONG").write.format("delta").save(path)

    ensure_table(spark, path, T.StructType([T.StructField("id", T.LongType())]), {})

    assert sorted(row.id for row in spark.read.format("delta").load(path).collect()) == [1, 2]


def test_an_existing_table_gets_the_tuning_it_lacks_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A table made before a tuning property was shipped gets it on the next start, and
    a start that finds it set commits nothing (its properties are read right)."""
    path = str(tmp_path / "tuned")
    spark.createDataFrame([(1,)], "id LONG").write.format("delta").save(path)
    schema = T.StructType([T.StructField("id", T.LongType())])

    def version() -> int:
        return int(DeltaTable.forPath(spark, path).history(1).first()["version"])

    ensure_table(spark, path, schema, AUTO_COMPACT)
    assert table_properties(spark, path)["delta.autoOptimize.autoCompact"] == "true"
    assert version() == 1  # the ALTER
    ensure_table(spark, path, schema, AUTO_COMPACT)
    assert version() == 1


def test_java_objects_python_dropped_are_released_while_the_driver_idles(
    spark: SparkSession,
) -> None:
    # py4j caches a Java object's methods on its proxy, and each cached method points back
    # at the proxy: every proxy Python called a method on (each batch's DataFrames, their
    # sessions, their plans) is freed only by Python's cyclic collector, and until then
    # py4j's gateway keeps the Java object alive. Python collects its oldest objects
    # rarely and never while idle: without the session's collector
    # (cdc_shared.jvm.spark.collect_python_garbage) such a proxy, and the plans it holds in the
    # driver's heap, stay. The test does not collect itself after the proxy is dropped.
    from cdc_shared.jvm.spark import PYTHON_GC_INTERVAL

    frame = spark.range(3)._jdf
    assert frame.count() == 3  # caches the method: the proxy is in a reference cycle now
    released = weakref.ref(frame)
    gc.collect()  # as a long-running driver's would be: among the oldest objects
    del frame
    interval = float(spark.conf.get(PYTHON_GC_INTERVAL, "0")) or 10.0  # 0: no collector
    deadline = time.monotonic() + 3 * interval
    while released() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert released() is None, f"the Java object's proxy still alive after {3 * interval} s"
