"""Silver gains a column while both publishers run: each reads silver's changes by version
range, registers (publisher-kafka) or maps (publisher-es) the new column and publishes
it, without a restart and without losing or repeating a change."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from cdc_devkit.workload import produce
from cdc_publisher_es.main import start as start_publisher_es
from cdc_publisher_kafka.main import start as start_publisher_kafka
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.connections import KafkaConfig
from pyspark.sql import SparkSession
from support.es import assert_index_equals_oracle, index_documents
from support.ingestion import generate_across_schema_change, ingest_once
from support.pipelines import PipelineFactory
from support.publishing import assert_change_topics_exactly_once, change_records
from support.silver import merge_once
from support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NEW_COLUMN = "loyalty_tier"  # in the customers value schema v2


def test_publishers_follow_a_silver_schema_change_without_a_restart(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    streaming = {"trigger_interval": "1 second", "metrics_port": 0}
    pipeline = make_pipeline(
        entities=("customers",),
        ingestor={"metrics_port": 0},
        merger={"metrics_port": 0},
        publisher_kafka=streaming,
        publisher_es=streaming,
    )
    messages, switch = generate_across_schema_change(
        pipeline, "customers", tmp_path, events=1500, keys=150, poison_share=0, redelivery_share=0
    )
    produce(kafka_config, iter(messages[:switch]))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    config = pipeline.config
    alias = config.entity("customers").es_index_name
    es = make_elasticsearch(config.elasticsearch)
    runners = [
        start_publisher_kafka(config, once=False, spark=spark),
        start_publisher_es(config, once=False, spark=spark),
    ]
    threads = [threading.Thread(target=runner.run) for runner in runners]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: bool(change_records(pipeline, kafka_config, "customers")), 300)
        wait_for(
            lambda: es.indices.exists_alias(name=alias) and bool(index_documents(es, alias)), 300
        )

        pipeline.add_schema_version("customers", 2)
        produce(kafka_config, iter(messages[switch:]))
        ingest_once(pipeline, spark)
        merge_once(pipeline, spark)  # silver gains the column under the running publishers
        assert (
            NEW_COLUMN in spark.read.format("delta").load(config.layout.silver("customers")).columns
        )

        def published_the_new_column() -> bool:
            return any(
                ((r.event or {}).get("after") or {}).get(NEW_COLUMN) is not None
                for r in change_records(pipeline, kafka_config, "customers")
            )

        def indexed_the_new_column() -> bool:
            return any(
                source.get(NEW_COLUMN) is not None
                for _, source in index_documents(es, alias).values()
            )

        wait_for(published_the_new_column, 300)
        wait_for(indexed_the_new_column, 300)
        assert all(t.is_alive() for t in threads), "a publisher stopped at the new column"
        time.sleep(5)  # let the batches in flight finish
    finally:
        for runner in runners:
            runner.request_stop()
        for thread in threads:
            thread.join(180)
    # Drain what the stop left, then check both outputs completely.
    start_publisher_kafka(config, once=True, spark=spark).run()
    start_publisher_es(config, once=True, spark=spark).run()
    assert_change_topics_exactly_once(spark, pipeline, kafka_config)
    assert_index_equals_oracle(pipeline, kafka_config)
