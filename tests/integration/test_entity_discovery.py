"""A table whose topic starts matching an entity set while the services run is taken up.

The ingestor, the merger and publisher-kafka run continuously in this process (as
``cdc run`` runs them) over a pipeline with one table listed by hand and an entity set
whose pattern selects a topic that does not exist yet. Once the services run, the new
table's first changes are produced: each service takes the table up without a restart,
and its silver and change topic end equal to the oracle and silver's feed. Both tables
are in the group ``default``: each service takes the table up by starting the group's
query again with the new table (the ingestor on a new checkpoint, each topic where it
stood; the merger and the publisher on theirs, the new table from its own progress).
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, produce
from cdc_ingestor.main import start as start_ingestor
from cdc_merger.main import start as start_merger
from cdc_publisher_kafka.main import start as start_publisher_kafka
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entity_sets import resolve_entity_sets
from cdc_shared.streaming.runner import StreamRunner
from pyspark.sql import SparkSession
from support.ingestion import generate
from support.pipelines import ENTITIES, SCHEMAS, Pipeline, PipelineFactory
from support.publishing import assert_change_topics_exactly_once, change_records
from support.silver import assert_silver_equals_oracle
from support.waiting import eventually, wait_for

pytestmark = pytest.mark.integration


def test_a_table_that_appears_while_the_services_run_is_taken_up(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    fast = {"trigger_interval": "1 second", "metrics_port": 0}
    pipeline = make_pipeline(
        entities=("customers",),
        entity_discovery_interval_s=2,
        ingestor=fast,
        merger=fast,
        publisher_kafka=fast,
        entity_sets=[],  # filled in below, once the run's topic names are known
    )
    orders_topic = pipeline.topic("orders")
    for part in ("key", "value"):
        shutil.copy(
            SCHEMAS / f"dbserver1.inventory.orders-{part}.avsc",
            pipeline.schema_dir / f"{orders_topic}-{part}.avsc",
        )
    text = pipeline.path.read_text().replace(
        "entity_sets: []",
        "entity_sets:\n"
        f"- topics_regex: 'pytest_{pipeline.run}\\.inventory\\.(?P<table>orders)'\n"
        f"  key: {ENTITIES['orders']['key']}\n"
        f"  sequence_by: {ENTITIES['orders']['sequence_by']}\n"
        f"  change_topic: 'pytest-{pipeline.run}.{{table}}-changes'\n",
    )
    pipeline.path.write_text(text)
    config = pipeline.config
    assert [e.name for e in config.entities] == ["customers"]  # no orders topic yet
    produce(kafka_config, iter(generate(pipeline, events=100, keys=30, poison_share=0)))

    runners: list[StreamRunner] = []
    threads: list[threading.Thread] = []
    failures: list[BaseException] = []

    def run(runner: StreamRunner) -> None:
        try:
            runner.run()
        except BaseException as failure:
            failures.append(failure)

    try:
        for start in (start_ingestor, start_merger, start_publisher_kafka):
            runners.append(start(config, once=False, spark=spark))
            threads.append(threading.Thread(target=run, args=(runners[-1],), daemon=True))
            threads[-1].start()
        wait_for(lambda: not failures and _published(pipeline, kafka_config, "customers"), 240)

        # The table appears: its topic's first records, as a connector writes them.
        (orders,) = resolve_entity_sets(config, [orders_topic], lambda _topic: None)
        registry = FileSchemaRegistry([pipeline.schema_dir])
        spec = WorkloadSpec(events=150, keys=40, poison_share=0.0, seed=5)
        produced_at = time.monotonic()
        produce(kafka_config, WorkloadGenerator([orders], registry, spec).messages())
        wait_for(lambda: bool(failures) or _published(pipeline, kafka_config, "orders"), 240)
        assert not failures, failures
        delay = time.monotonic() - produced_at
        print(f"new table: first change in its topic {delay:.1f} s after its first record")
        for runner in runners:  # the group's query, restarted with orders' table
            assert list(runner.queries) == ["default"], runner.service
            assert runner.health()["streams"]["default"]["active"], runner.service
        # Every event of the new table reaches silver and its change topic, no restart;
        # customers' are not published twice.
        eventually(lambda: assert_silver_equals_oracle(spark, pipeline, kafka_config))
        eventually(lambda: assert_change_topics_exactly_once(spark, pipeline, kafka_config))
    finally:
        for runner in runners:
            runner.request_stop()
        for thread in threads:
            thread.join(300)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, failures

    assert [e.name for e in pipeline.config.entities] == ["customers", "orders"]


def _published(pipeline: Pipeline, kafka: KafkaConfig, entity: str) -> bool:
    """Whether the entity's change topic holds a change event yet."""
    if entity not in {e.name for e in pipeline.config.entities}:
        return False
    try:
        return any(r.event for r in change_records(pipeline, kafka, entity))
    except Exception:  # the topic does not exist yet
        return False
