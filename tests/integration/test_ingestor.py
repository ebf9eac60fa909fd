"""The ingestor on real Kafka and Delta: exactly-once bronze, quarantine, replays, evolution."""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from cdc_devkit.workload import (
    produce,
)
from cdc_ingestor import ingestion as ingestor_main
from cdc_ingestor import positions
from cdc_ingestor.main import start
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.streaming.failures import StreamFailedError
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from support.dying import Killed, dying_after, dying_before
from support.ingestion import (
    assert_bronze_exactly_once,
    assert_quarantine_exactly_once,
    bronze,
    checkpoints_aside,
    generate,
    generate_across_schema_change,
    ingest_once,
    ingestor_checkpoint,
    quarantine,
)
from support.pipelines import Pipeline, PipelineFactory
from support.waiting import wait_for

pytestmark = pytest.mark.integration


def test_workload_lands_exactly_once_with_poison_in_quarantine(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline()
    messages = generate(pipeline, events=6000, keys=400, poison_share=0.01)
    report = produce(kafka_config, iter(messages), partitions=3)
    ingest_once(pipeline, spark)
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)

    expected = Counter((topic, kind) for topic, _, _, kind in report.poison)
    quarantined = (
        quarantine(spark, pipeline)
        .select("kafka_topic", "kafka_partition", "kafka_offset", "error_kind", "error_message")
        .collect()
    )
    assert Counter((r.kafka_topic, r.error_kind) for r in quarantined) == expected
    assert all(r.error_message for r in quarantined)
    coordinates = {(r.kafka_topic, r.kafka_partition, r.kafka_offset) for r in quarantined}
    assert len(coordinates) == len(quarantined)

    customers = bronze(spark, pipeline, "customers")
    tombstones = customers.where("is_tombstone").count()
    assert tombstones == sum(  # tombstones, and their re-deliveries
        1 for m in messages if m.value is None and m.kind != "poison" and m.entity == "customers"
    )
    assert customers.where("is_tombstone and op is not null").count() == 0
    assert {r.op for r in customers.select("op").distinct().collect()} == {"r", "c", "u", "d", None}
    assert (
        customers.where("size(sequence) != 1 or sequence[0] is null and not is_tombstone").count()
        == 0
    )

    before = customers.count()
    ingest_once(pipeline, spark)  # nothing new: nothing written
    assert bronze(spark, pipeline, "customers").count() == before


def test_replayed_batch_writes_nothing_twice(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    """A crash after the Delta commits, before the checkpoint commit, replays the batch."""
    pipeline = make_pipeline(entities=("customers",))
    report = produce(
        kafka_config, iter(generate(pipeline, events=2000, keys=200, poison_share=0.01))
    )
    ingest_once(pipeline, spark)
    checkpoint = ingestor_checkpoint(pipeline)
    commits = sorted(
        (p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    last = commits[-1]  # as if the process died before committing the batch:
    last.unlink()
    last.with_name(f".{last.name}.crc").unlink(missing_ok=True)
    bronze_before = bronze(spark, pipeline, "customers").count()
    quarantine_before = quarantine(spark, pipeline).count()
    ingest_once(pipeline, spark)
    assert bronze(spark, pipeline, "customers").count() == bronze_before
    assert quarantine(spark, pipeline).count() == quarantine_before
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)


def test_crash_between_bronze_and_quarantine_commits_loses_nothing(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replayed batch's bronze write is skipped, unobserved; its quarantine still lands."""
    pipeline = make_pipeline(entities=("customers",))
    report = produce(
        kafka_config, iter(generate(pipeline, events=2000, keys=200, poison_share=0.01))
    )
    assert report.poison
    quarantine_path = pipeline.config.layout.quarantine("ingestor")
    append = ingestor_main.idempotent_append

    def crash_at_the_quarantine_commit(frame: Any, path: str, *args: Any, **kwargs: Any) -> None:
        if path == quarantine_path:
            raise RuntimeError("simulated crash after the bronze commit")
        append(frame, path, *args, **kwargs)

    monkeypatch.setattr(ingestor_main, "idempotent_append", crash_at_the_quarantine_commit)
    with pytest.raises(StreamFailedError, match="simulated crash"):
        ingest_once(pipeline, spark)
    assert bronze(spark, pipeline, "customers").count() > 0  # the bronze commit happened
    assert quarantine(spark, pipeline).count() == 0

    monkeypatch.undo()
    ingest_once(pipeline, spark)  # replays the batch
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    assert_quarantine_exactly_once(spark, pipeline, report)


def test_a_lost_checkpoint_starts_where_bronze_stands_under_a_new_app_id(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    """Bronze's commits record how far each topic is written: a new checkpoint starts
    there, reads nothing twice, and writes under a new ``txnAppId`` (the new query's id),
    so Delta does not skip its batches as ones the old query wrote."""
    pipeline = make_pipeline(entities=("customers",))
    report = produce(kafka_config, iter(generate(pipeline, events=1000, keys=100)))
    ingest_once(pipeline, spark)
    first = bronze(spark, pipeline, "customers").count()
    shutil.rmtree(ingestor_checkpoint(pipeline))
    report.add(produce(kafka_config, iter(generate(pipeline, events=500, keys=100))))
    ingest_once(pipeline, spark)  # batch ids from 0 again, under the new query's id
    assert bronze(spark, pipeline, "customers").count() > first
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)
    app_ids = {
        action["txn"]["appId"]
        for commit in sorted((Path(pipeline.config.layout.bronze()) / "_delta_log").glob("*.json"))
        for action in map(json.loads, commit.read_text().splitlines())
        if "txn" in action
    }
    assert len(app_ids) == 2, app_ids


def test_a_group_goes_on_where_it_stood_without_a_table_and_with_it_back(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table taken out of the pipeline, later put back: the group's query reads other
    topics. Spark's Kafka source would report the dropped topic's records lost, and read
    the table put back from its start; each start moves the checkpoint aside instead and
    starts a new one where each topic stood (bronze's commits say): bronze holds every
    record once. The second time the process dies just before moving the checkpoint
    aside, then just after (before the new query plans a batch): the next start begins
    where the first would have."""
    pipeline = make_pipeline(ingestor={"metrics_port": 0})
    report = produce(kafka_config, iter(generate(pipeline, events=400, keys=40, poison_share=0.02)))
    ingest_once(pipeline, spark)
    document = yaml.safe_load(pipeline.path.read_text())
    entities = document["entities"]

    document["entities"] = [e for e in entities if e["name"] != "customers"]  # taken out
    pipeline.path.write_text(yaml.safe_dump(document))
    report.add(produce(kafka_config, iter(generate(pipeline, events=300, keys=40))))  # orders
    ingest_once(pipeline, spark)
    assert len(checkpoints_aside(pipeline)) == 1
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)  # orders: none twice

    document["entities"] = entities  # put back
    pipeline.path.write_text(yaml.safe_dump(document))
    report.add(produce(kafka_config, iter(generate(pipeline, events=300, keys=40))))
    checkpoint = ingestor_checkpoint(pipeline)
    monkeypatch.setattr(positions, "move_aside", dying_before(positions.move_aside))
    with pytest.raises(Killed):
        ingest_once(pipeline, spark)
    assert (checkpoint / "offsets").exists() and len(checkpoints_aside(pipeline)) == 1
    monkeypatch.undo()
    monkeypatch.setattr(positions, "move_aside", dying_after(positions.move_aside))
    with pytest.raises(Killed):
        ingest_once(pipeline, spark)
    monkeypatch.undo()
    assert not (checkpoint / "offsets").exists() and len(checkpoints_aside(pipeline)) == 2
    ingest_once(pipeline, spark)
    assert_bronze_exactly_once(spark, pipeline, kafka_config, report)  # both: none twice
    assert_quarantine_exactly_once(spark, pipeline, report)


def test_schema_evolution_midway_without_restart(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = make_pipeline(
        entities=("customers",), ingestor={"trigger_interval": "1 second", "metrics_port": 0}
    )
    # The producer knows version 2 from the start; the ingestor learns it from the registry.
    messages, switch = generate_across_schema_change(
        pipeline, "customers", tmp_path, events=2000, keys=200, poison_share=0, redelivery_share=0
    )
    v2 = messages[switch].value[2:10]  # type: ignore[index]

    produce(kafka_config, iter(messages[:switch]))
    runner = start(pipeline.config, once=False, spark=spark)
    thread = threading.Thread(target=runner.run)
    thread.start()
    try:
        wait_for(lambda: table_count(spark, pipeline) == switch)
        assert "loyalty_tier" not in bronze(spark, pipeline, "customers").select("after.*").columns
        pipeline.add_schema_version("customers", 2)  # deployed while the ingestor runs
        produce(kafka_config, iter(messages[switch:]))
        wait_for(lambda: table_count(spark, pipeline) == len(messages))
    finally:
        runner.request_stop()
        thread.join(120)
    table = bronze(spark, pipeline, "customers")
    assert "loyalty_tier" in table.select("after.*").columns
    tiers = (
        table.where(F.col("writer_schema") == f"fingerprint:{v2.hex()}")
        .where("after.loyalty_tier is not null")
        .count()
    )
    assert tiers > 0
    assert (
        table.where(F.col("writer_schema") != f"fingerprint:{v2.hex()}")
        .where("after.loyalty_tier is not null")
        .count()
        == 0
    )
    assert quarantine_count(spark, pipeline) == 0


def table_count(spark: SparkSession, pipeline: Pipeline) -> int:
    try:
        return bronze(spark, pipeline, "customers").count()
    except Exception:
        return -1


def quarantine_count(spark: SparkSession, pipeline: Pipeline) -> int:
    return quarantine(spark, pipeline).count()
