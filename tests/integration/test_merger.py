"""The merger service: generated load -> ingestor -> merger; silver equals the oracle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cdc_devkit.workload import produce
from cdc_merger.main import start as start_merger
from cdc_merger.merging import silver_layout
from cdc_shared.clients.delta_rs import transaction_versions
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.contracts.layout import MERGER_PROGRESS_APP
from cdc_shared.jvm.spark import counting_jobs
from cdc_shared.streaming.tables import table_properties
from pyspark.sql import SparkSession
from support.history import assert_history_equals_bronze
from support.ingestion import bronze, generate, generate_across_schema_change, ingest_once
from support.pipelines import Pipeline, PipelineFactory
from support.silver import (
    assert_change_feed_has_no_repeats,
    assert_silver_equals_oracle,
    merge_once,
)
from support.waiting import wait_for

pytestmark = pytest.mark.integration
MERGER = str(Path(sys.executable).with_name("cdc-merger"))
# SIGKILLs per test, both in the dangerous window (after the sink's commit, before the
# checkpoint's); every restart costs a Spark start. Kills at any
# moment under load are the chaos run's (tests/e2e/test_chaos.py).
KILLS = 2


def silver_version(spark: SparkSession, pipeline: Pipeline, entity: str) -> int:
    path = silver_layout(pipeline.config, pipeline.config.entity(entity)).silver_path
    return int(spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()[0].version)


def test_workload_through_ingestor_and_merger_equals_oracle(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        merger={"max_files_per_trigger": 4, "metrics_port": 0},
        ingestor={"max_offsets_per_trigger": 1500, "metrics_port": 0},
    )
    produce(
        kafka_config,
        iter(
            generate(
                pipeline,
                events=6000,
                keys=300,
                delete_share=0.2,
                redelivery_share=0.05,
                poison_share=0.005,
            )
        ),
    )
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    assert_change_feed_has_no_repeats(spark, pipeline)
    # Small silvers: their MERGEs rewrite files (merger.deletion_vectors_from_mib), and
    # deletion vectors stay in their protocol for when they grow. A history keeps them on.
    for entity in pipeline.config.entities:
        layout = silver_layout(pipeline.config, entity)
        properties = table_properties(spark, layout.silver_path)
        assert properties["delta.enableDeletionVectors"] == "false", entity.name
        assert properties["delta.feature.deletionVectors"] == "supported", entity.name
        if layout.history is not None:
            history = table_properties(spark, layout.history.path)
            assert history["delta.enableDeletionVectors"] == "true", entity.name

    versions = {e.name: silver_version(spark, pipeline, e.name) for e in pipeline.config.entities}
    with counting_jobs(spark) as jobs:
        merge_once(pipeline, spark)  # nothing new in bronze: silver untouched
    assert versions == {
        e.name: silver_version(spark, pipeline, e.name) for e in pipeline.config.entities
    }
    # ... and its restart read no table: one job looks at bronze's change feed since the
    # oldest progress for tables left behind (none), no job per table.
    time.sleep(1)  # the listener bus records jobs a moment after they start
    assert jobs() <= 1


@pytest.mark.slow
def test_exactly_once_effect_under_sigkill(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    """SIGKILLs of the merger, each right after a silver commit (which records the bronze
    version merged through), before the checkpoint's: silver equals the oracle, its feed
    repeats nothing, and the SCD type 2 history written in the same batches (after
    silver's MERGE, with a progress of its own) equals the history the bronze events make
    (phone untracked: updated in place)."""
    pipeline = make_pipeline(
        entities=("customers",),
        merger={
            "max_files_per_trigger": 3,
            "trigger_interval": "200 milliseconds",
            "metrics_port": 0,
        },
        ingestor={"max_offsets_per_trigger": 600, "metrics_port": 0},
        overrides={"customers": {"history": {"enabled": True, "except_columns": ["phone"]}}},
    )
    produce(
        kafka_config,
        iter(generate(pipeline, events=5000, keys=400, delete_share=0.2, redelivery_share=0.05)),
    )
    ingest_once(pipeline, spark)  # many small bronze files: many merger batches
    log_dir = (
        Path(silver_layout(pipeline.config, pipeline.config.entity("customers")).silver_path)
        / "_delta_log"
    )
    log = tmp_path / "merger.log"
    for _ in range(KILLS):
        process = subprocess.Popen(
            [MERGER, "--config", str(pipeline.path)],
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
            start_new_session=True,
        )
        # Right after a batch's silver commit, before the checkpoint's (version 0, the
        # table's creation, is no batch's).
        seen = max(1, len(list(log_dir.glob("*.json"))) if log_dir.is_dir() else 0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
            not log_dir.is_dir() or len(list(log_dir.glob("*.json"))) <= seen
        ):
            time.sleep(0.02)
        assert process.poll() is None, f"merger died by itself; see {log}"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    # The drain: in this process, whose Spark is warm, in one batch.
    update = {"max_files_per_trigger": 100_000}
    merger = pipeline.config.merger.model_copy(update=update)
    start_merger(
        pipeline.config.model_copy(update={"merger": merger}), once=True, spark=spark
    ).run()
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    assert_change_feed_has_no_repeats(spark, pipeline)
    versions = assert_history_equals_bronze(spark, pipeline, "customers")
    keys = spark.read.format("delta").load(pipeline.config.layout.silver("customers")).count()
    assert versions > keys  # updates and deletes made more versions than keys alive


def test_bronze_schema_change_is_merged_without_a_restart(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    """Bronze's payload type of a table gains a column while the merger runs: silver
    evolves without a restart (the new column joins silver; the one the column selection
    excludes never does)."""
    pipeline = make_pipeline(
        entities=("customers",),
        merger={"trigger_interval": "1 second", "metrics_port": 0},
        overrides={"customers": {"except_columns": ["phone"]}},
    )
    messages, switch = generate_across_schema_change(
        pipeline, "customers", tmp_path, events=1500, keys=150, poison_share=0, redelivery_share=0
    )
    produce(kafka_config, iter(messages[:switch]))
    ingest_once(pipeline, spark)
    silver_path = silver_layout(pipeline.config, pipeline.config.entity("customers")).silver_path
    runner = start_merger(pipeline.config, once=False, spark=spark)
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        first_merge = Path(silver_path) / "_delta_log" / "00000000000000000001.json"
        wait_for(first_merge.exists, timeout_s=300)
        pipeline.add_schema_version("customers", 2)
        produce(kafka_config, iter(messages[switch:]))
        ingest_once(pipeline, spark)  # bronze gains loyalty_tier under the running merger
        assert "loyalty_tier" in bronze(spark, pipeline, "customers").select("after.*").columns

        def merged_the_new_column() -> bool:
            silver = spark.read.format("delta").load(silver_path)
            return (
                "loyalty_tier" in silver.columns
                and silver.where("loyalty_tier IS NOT NULL").count() > 0
            )

        wait_for(merged_the_new_column, timeout_s=300)
        assert thread.is_alive(), "the merger stopped instead of rebuilding its stream"
        time.sleep(5)  # let the batch in flight finish
    finally:
        runner.request_stop()
        thread.join(180)
    merge_once(pipeline, spark)  # anything left after the stop
    assert "phone" not in spark.read.format("delta").load(silver_path).columns
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    assert_change_feed_has_no_repeats(spark, pipeline)


def test_a_table_left_out_of_a_run_is_merged_from_its_own_progress(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    """Customers is left out of a merger run (a deployment of orders alone) while bronze
    holds new rows of both; back in the pipeline, nothing new in bronze, the next start
    finds customers behind where the group's checkpoint stands and merges it from its own
    progress (silver's log): silver equals the oracle, its feed repeats nothing."""
    pipeline = make_pipeline(merger={"metrics_port": 0})
    messages = generate(pipeline, events=600, keys=30, poison_share=0)
    produce(kafka_config, iter(messages[:300]))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    produce(kafka_config, iter(messages[300:]))
    ingest_once(pipeline, spark)
    config = pipeline.config
    silver = {"customers": config.layout.silver("customers")}
    (merged_before,) = transaction_versions(config, silver, MERGER_PROGRESS_APP).values()
    orders_only = config.model_copy(update={"entities": [config.entity("orders")]})
    start_merger(orders_only, once=True, spark=spark).run()
    assert transaction_versions(config, silver, MERGER_PROGRESS_APP) == {"customers": merged_before}
    merge_once(pipeline, spark)  # bronze has nothing the group's checkpoint did not read
    (merged,) = transaction_versions(config, silver, MERGER_PROGRESS_APP).values()
    assert merged is not None and merged_before is not None and merged > merged_before
    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    assert_change_feed_has_no_repeats(spark, pipeline)
