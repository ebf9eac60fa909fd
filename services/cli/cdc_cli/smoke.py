"""A smoke pipeline over the real local servers: Kafka -> Delta (MERGE, CDF) -> Elasticsearch.

It proves the wiring (connector jars, Delta, Kafka, Elasticsearch) on a fresh machine in
about a minute. The real services replace each step as they are built.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from cdc_shared.clients import make_elasticsearch, make_producer, spark_kafka_options
from cdc_shared.config import ElasticsearchConfig, KafkaConfig, SparkConfig
from cdc_shared.spark import build_spark_session
from delta.tables import DeltaTable
from elasticsearch import helpers
from pyspark.sql import Window
from pyspark.sql import functions as F


@dataclass(frozen=True)
class SmokeResult:
    """What the smoke pipeline moved, and whether every stage agrees."""

    produced: int
    bronze_rows: int
    silver_rows: int
    expected_silver_rows: int
    change_feed_rows: int
    indexed_documents: int
    seconds: float

    @property
    def ok(self) -> bool:
        """Every stage holds what the produced events imply."""
        return (
            self.bronze_rows == self.produced
            and self.silver_rows == self.expected_silver_rows
            and self.indexed_documents == self.expected_silver_rows
        )


def run_smoke(
    kafka: KafkaConfig, elasticsearch: ElasticsearchConfig, storage_root: Path, events: int = 2000
) -> SmokeResult:
    """Produce ``events`` upserts over ``events // 4`` keys and carry them to Elasticsearch."""
    started = time.monotonic()
    run = uuid.uuid4().hex[:8]
    topic = f"smoke.{run}"
    keys = max(1, events // 4)
    producer = make_producer(kafka, **{"enable.idempotence": True})
    for i in range(events):
        record = {"id": i % keys, "name": f"name-{i}", "seq": i}
        producer.produce(topic, key=str(record["id"]).encode(), value=json.dumps(record).encode())
    producer.flush(60)

    spark = build_spark_session(SparkConfig(master="local[2]"), app_name="cdc-smoke")
    root = storage_root / "smoke" / run
    bronze = str(root / "bronze")
    query = (
        spark.readStream.format("kafka")
        .options(**spark_kafka_options(kafka))
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .load()
        .select(
            F.from_json(F.col("value").cast("string"), "id INT, name STRING, seq INT").alias("r")
        )
        .select("r.*")
        .writeStream.format("delta")
        .option("checkpointLocation", str(root / "_checkpoint"))
        .trigger(availableNow=True)
        .start(bronze)
    )
    query.awaitTermination()

    silver = str(root / "silver")
    latest = (
        spark.read.format("delta")
        .load(bronze)
        .withColumn("rank", F.row_number().over(Window.partitionBy("id").orderBy(F.desc("seq"))))
        .where("rank = 1")
        .drop("rank")
    )
    latest.limit(0).write.format("delta").option("delta.enableChangeDataFeed", "true").save(silver)
    (
        DeltaTable.forPath(spark, silver)
        .alias("t")
        .merge(latest.alias("s"), "t.id = s.id")
        .whenMatchedUpdateAll(condition="s.seq > t.seq")
        .whenNotMatchedInsertAll()
        .execute()
    )
    feed = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 1)
        .load(silver)
        .collect()
    )
    es = make_elasticsearch(elasticsearch)
    index = f"smoke-{run}"
    helpers.bulk(
        es,
        (
            {"_index": index, "_id": str(row.id), "_source": {"name": row.name, "seq": row.seq}}
            for row in feed
        ),
    )
    es.indices.refresh(index=index)
    result = SmokeResult(
        produced=events,
        bronze_rows=spark.read.format("delta").load(bronze).count(),
        silver_rows=spark.read.format("delta").load(silver).count(),
        expected_silver_rows=keys,
        change_feed_rows=len(feed),
        indexed_documents=int(es.count(index=index)["count"]),
        seconds=time.monotonic() - started,
    )
    es.indices.delete(index=index)
    return result
