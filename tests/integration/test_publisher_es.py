"""publisher-es end to end: generated load -> ingestor -> merger -> publisher -> the index.

Every assertion compares Elasticsearch with the independent oracle (cdc_devkit.oracle), which
decodes the source topic itself and shares no code with the services.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid

import pytest
from cdc_devkit.workload import GeneratedMessage, produce
from cdc_merger.main import start as start_merger
from cdc_publisher_es.bulk import BulkWriter, Scrubber
from cdc_publisher_es.documents import Action
from cdc_publisher_es.index_lifecycle import IndexLostError
from cdc_publisher_es.main import start as start_publisher
from cdc_publisher_es.mapping import ensure_index, index_mappings
from cdc_publisher_es.progress import IndexProgress
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import PublisherEsConfig
from cdc_shared.contracts.bronze import entity_changes
from cdc_shared.streaming.failures import StreamFailedError
from delta.tables import DeltaTable
from elasticsearch import NotFoundError
from pyspark.sql import SparkSession
from support.entities import CUSTOMERS
from support.es import (
    assert_index_equals_oracle,
    assert_index_equals_silver,
    build_silver,
    expected_id,
    index_differences,
    index_documents,
    normalize_source,
    oracle_of,
)
from support.ingestion import generate, ingest_once
from support.pipelines import PipelineFactory
from support.silver import without_auto_compaction

pytestmark = pytest.mark.integration

# A few bronze files per entity, merged two at a time: a few silver versions, so the change
# feed holds inserts, updates and deletes of the same keys.
SMALL_BATCHES = {
    "ingestor": {"max_offsets_per_trigger": 1000, "metrics_port": 0},
    "merger": {"max_files_per_trigger": 2, "metrics_port": 0},
}


def publish_once(config: PipelineConfig, spark: SparkSession) -> None:
    start_publisher(config, once=True, spark=spark).run()


def with_publisher(config: PipelineConfig, **settings: object) -> PipelineConfig:
    """``config`` with publisher_es settings replaced (the config is frozen)."""
    return config.model_copy(
        update={"publisher_es": config.publisher_es.model_copy(update=settings)}
    )


def test_index_equals_oracle_after_ingestor_and_merger(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    """The index equals the oracle; each table's column selection narrows silver and the
    index (the mapping too), bronze keeping every column. A second run publishes nothing
    anew; indexes lost between two runs are rebuilt from silver (or refused)."""
    pipeline = make_pipeline(
        **SMALL_BATCHES,
        publisher_es={"max_files_per_trigger": 2, "metrics_port": 0},
        overrides={
            "customers": {"except_columns": ["phone"]},
            "orders": {"columns": ["customer_id", "product", "amount", "order_date"]},
        },
    )
    build_silver(pipeline, spark, kafka_config, events=2000, keys=200)
    publish_once(pipeline.config, spark)
    first = assert_index_equals_oracle(pipeline, kafka_config)  # the oracle selects too
    layout = pipeline.config.layout
    for entity, left_out in (("customers", {"phone"}), ("orders", {"quantity", "status"})):
        typed = entity_changes(spark, layout.bronze(), entity).schema["after"]
        assert left_out <= set(typed.dataType.fieldNames())  # type: ignore[attr-defined]
        silver = spark.read.format("delta").load(layout.silver(entity)).columns
        assert not left_out & set(silver), silver
        alias = pipeline.config.entity(entity).es_index_name
        meta = make_elasticsearch(pipeline.config.elasticsearch).indices.get_mapping(index=alias)
        fields = next(iter(meta.body.values()))["mappings"]["properties"]
        assert not left_out & set(fields), fields

    # Both version derivations are exercised: one-column sequence (customers: 2 * lsn,
    # +1 on delete) and composite sequence (orders: the silver commit version).
    es = make_elasticsearch(pipeline.config.elasticsearch)
    oracle = oracle_of(pipeline, kafka_config, "customers")
    customers = first["customers"]
    for key, sequence in oracle.last_sequence.items():
        doc_id = expected_id(key)
        if doc_id in customers:
            assert customers[doc_id][0] == 2 * sequence[0]
    meta = es.indices.get_mapping(index=pipeline.config.entity("orders").es_index_name)
    mapping = next(iter(meta.body.values()))["mappings"]
    assert mapping["dynamic"] == "strict"
    assert mapping["properties"]["amount"] == {"type": "keyword"}  # exact decimal strings
    assert mapping["properties"]["order_date"]["type"] == "date"
    settings = es.indices.get_settings(index=pipeline.config.entity("orders").es_index_name)
    index_settings = next(iter(settings.body.values()))["settings"]["index"]
    assert index_settings["refresh_interval"] == "1s"
    assert index_settings["gc_deletes"] == "1h"
    alias = pipeline.config.entity("orders").es_index_name
    assert list(es.indices.get_alias(name=alias).body) == [f"{alias}-000001"]
    assert mapping["_meta"]["cdc_entity"] == "orders"

    # Nothing new: the index is untouched.
    config = pipeline.config
    publish_once(config, spark)
    assert assert_index_equals_oracle(pipeline, kafka_config) == first

    # The indexes deleted between two runs, while the progress is past every change.
    aliases = [entity.es_index_name for entity in config.entities]
    es.indices.delete(index=[f"{alias}-000001" for alias in aliases])
    # on_missing_index: stop refuses, saying how to rebuild, and creates no empty index.
    with pytest.raises(IndexLostError, match="on_missing_index: rebuild"):
        publish_once(with_publisher(config, on_missing_index="stop"), spark)
    assert not any(es.indices.exists_alias(name=alias) for alias in aliases)
    # By default the next run rebuilds each index from silver, then resumes.
    publish_once(config, spark)
    for entity in config.entities:
        assert_index_equals_silver(spark, config, entity.name)
    rebuilt = assert_index_equals_oracle(pipeline, kafka_config)
    assert rebuilt["customers"] == first["customers"]  # 2 * lsn: the versions of the feed
    for mapping in es.indices.get_mapping(index=aliases).body.values():
        assert "cdc_rebuild_pending" not in mapping["mappings"]["_meta"]


def progress_of(config: PipelineConfig) -> IndexProgress:
    """The progress documents of ``config``'s aliases (``publisher_es.progress_index``)."""
    es = make_elasticsearch(config.elasticsearch)
    return IndexProgress(es, config.publisher_es.progress_index)


def test_replay_of_old_versions_leaves_index_unchanged(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    """The alias's progress set back (as a crash before its write would leave it, or an
    operator): the next run publishes the changes since again, all older than the index
    holds, and the index is unchanged, versions too."""
    pipeline = make_pipeline(
        entities=("customers",),
        **SMALL_BATCHES,
        publisher_es={"max_files_per_trigger": 1, "metrics_port": 0},
    )
    with without_auto_compaction(spark):  # several bronze files: several silver versions
        build_silver(pipeline, spark, kafka_config, events=2000, keys=200, poison_share=0.0)
    config = pipeline.config
    publish_once(config, spark)
    before = assert_index_equals_oracle(pipeline, kafka_config)
    progress = progress_of(config)
    alias = config.entity("customers").es_index_name
    published = progress.read(alias)
    silver = DeltaTable.forPath(spark, config.layout.silver("customers")).history(1)
    assert published == silver.first()["version"] and published >= 3

    # 1. Set back to silver's version 1: the changes of versions 2 on are published again.
    progress.write(alias, "customers", 1)
    publish_once(config, spark)
    assert assert_index_equals_oracle(pipeline, kafka_config) == before  # versions too
    assert progress.read(alias) == published

    # 2. No progress at all (the document deleted): every change since version 0 again.
    progress.es.delete(index=config.publisher_es.progress_index, id=alias)
    publish_once(with_publisher(config, starting_version=0), spark)
    assert assert_index_equals_oracle(pipeline, kafka_config) == before
    assert progress.read(alias) == published

    quarantine = spark.read.format("delta").load(config.layout.quarantine("publisher_es"))
    assert quarantine.count() == 0


def test_unindexable_document_goes_to_quarantine_and_rest_of_batch_is_applied(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        entities=("customers",),
        **SMALL_BATCHES,
        publisher_es={"metrics_port": 0},  # big batches: good and bad documents together
    )
    pipeline.add_schema_version("customers", 2)  # loyalty_tier (string) from mid-workload
    build_silver(pipeline, spark, kafka_config, events=1500, keys=200, poison_share=0.0)
    config = pipeline.config
    alias = config.entity("customers").es_index_name
    es = make_elasticsearch(config.elasticsearch)
    # Someone mapped loyalty_tier as a number: a tier like "gold" cannot be indexed.
    es.indices.create(
        index=f"{alias}-000001",
        mappings={"properties": {"loyalty_tier": {"type": "long"}}},
        aliases={alias: {"is_write_index": True}},
    )
    publish_once(config, spark)

    oracle = oracle_of(pipeline, kafka_config, "customers")
    bad = {expected_id(k) for k, row in oracle.rows.items() if row.get("loyalty_tier")}
    good = {expected_id(k): row for k, row in oracle.rows.items() if not row.get("loyalty_tier")}
    assert bad, "no row with a loyalty tier: the test proves nothing"
    assert len(good) > 20, "too few indexable rows: the test proves little"

    quarantine = spark.read.format("delta").load(config.layout.quarantine("publisher_es"))
    rows = quarantine.collect()
    quarantined = {bytes(r.raw_key).decode() for r in rows}
    assert bad <= quarantined, f"not quarantined: {sorted(bad - quarantined)[:10]}"
    for r in rows:
        assert r.service == "publisher_es" and r.entity == "customers"
        assert r.error_kind == "document_parsing_exception"
        assert "loyalty_tier" in r.error_message
        assert json.loads(bytes(r.raw_value))["loyalty_tier"]
        assert r.source_table == config.layout.silver("customers")
        assert r.source_version is not None

    # The rest of each batch was applied: every other row is in the index as the oracle says.
    documents = index_documents(es, alias)
    for doc_id, row in good.items():
        assert doc_id in documents, f"{doc_id} missing although it could be indexed"
        assert normalize_source(row, documents[doc_id][1]) == row
    deleted = {expected_id(k) for k in oracle.deleted_keys}
    assert deleted and not deleted & set(documents)
    assert set(documents) - set(good) <= bad  # only older versions of quarantined rows

    # A write run again (a crash after the quarantine write, before the progress was
    # recorded: the progress set back) writes its quarantine rows once: the table's
    # txnAppId and the silver version its write reached.
    count = quarantine.count()
    progress = progress_of(config)
    published = progress.read(alias)
    progress.write(alias, "customers", -1)
    publish_once(config, spark)
    again = spark.read.format("delta").load(config.layout.quarantine("publisher_es"))
    assert again.count() == count
    assert progress.read(alias) == published


def wait_for_index_equal_to_silver(
    spark: SparkSession, config: PipelineConfig, entity: str, timeout_s: float = 240
) -> None:
    """Wait until the running publisher made the index of ``entity`` equal silver."""
    deadline = time.monotonic() + timeout_s
    problems = ["not compared yet"]
    while time.monotonic() < deadline:
        try:
            problems, _documents = index_differences(spark, config, entity)
        except NotFoundError as exc:  # the index is gone (and not restored yet)
            problems = [str(exc)]
        if not problems:
            return
        time.sleep(1)
    raise AssertionError(f"index of {entity} still differs from silver: {problems}")


class RunningPublisher:
    """``cdc-publisher-es`` (continuous) run in a thread of the test process."""

    def __init__(self, config: PipelineConfig, spark: SparkSession) -> None:
        self.runner = start_publisher(config, spark=spark)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:
            self.error = exc

    def stop(self, timeout_s: float = 120) -> BaseException | None:
        """Stop it (if it has not stopped by itself); how it ended."""
        self.runner.request_stop()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the publisher did not stop"
        return self.error


def test_index_lost_under_a_running_publisher_is_rebuilt_or_stops(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        entities=("customers",),
        **SMALL_BATCHES,
        publisher_es={"trigger_interval": "500 milliseconds", "metrics_port": 0},
    )
    config = pipeline.config
    messages = generate(
        pipeline, events=1200, keys=150, delete_share=0.2, redelivery_share=0.05, poison_share=0
    )
    third = len(messages) // 3

    def to_silver(part: list[GeneratedMessage]) -> None:
        produce(kafka_config, iter(part))
        ingest_once(pipeline, spark)
        start_merger(config, once=True, spark=spark).run()

    to_silver(messages[:third])
    es = make_elasticsearch(config.elasticsearch)
    index = f"{config.entity('customers').es_index_name}-000001"

    # 1. Deleted under a running publisher, then more changes: it rebuilds and goes on.
    publisher = RunningPublisher(config, spark)
    wait_for_index_equal_to_silver(spark, config, "customers")
    es.indices.delete(index=index)
    to_silver(messages[third : 2 * third])
    wait_for_index_equal_to_silver(spark, config, "customers")
    assert publisher.stop() is None
    mapping = es.indices.get_mapping(index=index).body[index]["mappings"]
    assert mapping["dynamic"] == "strict"  # created by the publisher, not auto-created

    # 2. With on_missing_index: stop, the stream stops at its next batch, saying how to rebuild.
    publisher = RunningPublisher(with_publisher(config, on_missing_index="stop"), spark)
    time.sleep(2)  # started: the alias was there
    es.indices.delete(index=index)
    to_silver(messages[2 * third :])
    publisher.thread.join(180)
    error = publisher.stop()
    assert isinstance(error, StreamFailedError), error
    # The group's query stops (every table of the group with it), naming the lost alias.
    assert str(error).startswith("publisher_es group 'default' stopped: "), error
    assert f"the alias {config.entity('customers').es_index_name!r}" in str(error), error
    assert "on_missing_index: rebuild" in str(error) and "Traceback" not in str(error)
    assert not es.indices.exists(index=index)

    # 3. The next (default) run rebuilds it: silver, and the independent oracle, again.
    publish_once(config, spark)
    assert_index_equals_silver(spark, config, "customers")
    assert_index_equals_oracle(pipeline, kafka_config)


# --- the bulk writer alone, against the real Elasticsearch --------------------------------


def _action(doc_id: str, version: int, source: object = None, op: str = "index") -> Action:
    body = None if op == "delete" else json.dumps(source)
    return Action(op, doc_id, version, body, 1, dt.datetime.now(dt.UTC))


def test_bulk_outcome_of_every_document(es_config: ElasticsearchConfig) -> None:
    es = make_elasticsearch(es_config)
    alias = f"pytest_bulk_{uuid.uuid4().hex[:8]}"
    settings = PublisherEsConfig(chunk_size=2)
    mappings = index_mappings(CUSTOMERS, {"n": {"type": "long"}}, "test")
    ensure_index(es, alias, settings, mappings)
    writer = BulkWriter(es, alias, settings)
    try:
        outcome = writer.write(
            [
                _action("1", 10, {"n": 1}),
                _action("2", 10, {"n": "not a number"}),  # parse error: quarantine
                _action("3", 10, {"n": 3}),
                _action("4", 5, op="delete"),  # nothing to delete: applied, version kept
                _action("5", 10, {"unknown": 1}),  # strict mapping: quarantine
                _action("6", 2, {"n": 2}),
                _action("6", 3, {"n": 3}),  # same window: only the newest is sent
            ]
        )
        assert (outcome.indexed, outcome.deleted, outcome.already_applied) == (3, 0, 1)
        assert outcome.superseded == 1 and outcome.total == 7
        assert sorted((f.action.doc_id, f.kind, f.status) for f in outcome.failures) == [
            ("2", "document_parsing_exception", 400),
            ("5", "strict_dynamic_mapping_exception", 400),
        ]

        # Replays and reordering never make a document older: 409 counts as applied.
        stale = writer.write([_action("1", 9, {"n": 99}), _action("4", 4, {"n": 4})])
        assert (stale.already_applied, stale.indexed, stale.failures) == (2, 0, [])
        documents = index_documents(es, alias)
        assert documents["1"] == (10, {"n": 1})
        assert "4" not in documents  # the delete's version outranks the older insert
        assert documents["6"] == (3, {"n": 3})
    finally:
        es.indices.delete(index=f"{alias}-000001", ignore_unavailable=True)


class _GaveUp(Exception):
    pass


def test_bulk_waits_with_backoff_while_elasticsearch_is_unreachable() -> None:
    secret = "pytest-secret-api-key"
    es = make_elasticsearch(
        ElasticsearchConfig(hosts=["http://127.0.0.1:9"], api_key=secret, request_timeout_s=2)
    )
    settings = PublisherEsConfig(initial_backoff_s=0.5, max_backoff_s=2.0, max_retries=1)
    problems: list[str | None] = []
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 6:
            raise _GaveUp  # the writer itself never gives up: the test stops it here

    writer = BulkWriter(
        es,
        "nowhere",
        settings,
        on_problem=problems.append,
        scrub=Scrubber([secret]),
        sleep=sleep,
        jitter=lambda: 1.0,
    )
    with pytest.raises(_GaveUp):
        writer.write([_action("1", 2, {"n": 1})])
    assert waits == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]  # exponential, capped
    assert problems and all(p and "Elasticsearch unavailable" in p for p in problems)
    assert not any(secret in (p or "") for p in problems)
