"""publisher-es end to end: generated load -> ingestor -> merger -> publisher -> the index.

Every assertion compares Elasticsearch with the independent oracle (cdc_cli.oracle), which
decodes the source topic itself and shares no code with the services.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cdc_publisher_es.main import start as start_publisher
from cdc_shared.clients import make_elasticsearch
from cdc_shared.config import KafkaConfig, PipelineConfig
from pyspark.sql import SparkSession
from support.es import (
    assert_index_equals_oracle,
    build_silver,
    expected_id,
    index_documents,
    normalize_source,
    oracle_of,
)
from support.pipelines import PipelineFactory

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
    pipeline = make_pipeline(
        **SMALL_BATCHES, publisher_es={"max_files_per_trigger": 2, "metrics_port": 0}
    )
    build_silver(pipeline, spark, kafka_config, events=2000, keys=200)
    publish_once(pipeline.config, spark)
    first = assert_index_equals_oracle(pipeline, kafka_config)

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

    publish_once(pipeline.config, spark)  # nothing new: the index is untouched
    assert assert_index_equals_oracle(pipeline, kafka_config) == first


def forget_batches(checkpoint: Path, first_forgotten: int) -> int:
    """Set the checkpoint back: drop the offsets and commits of every batch from
    ``first_forgotten`` on (with Hadoop's ``.N.crc`` files); how many commits were dropped.
    """
    forgotten = 0
    for folder in ("offsets", "commits"):
        for entry in list((checkpoint / folder).iterdir()):
            number = entry.name.removeprefix(".").removesuffix(".crc")
            if number.isdigit() and int(number) >= first_forgotten:
                entry.unlink()
                forgotten += folder == "commits" and entry.name == number
    return forgotten


def test_replay_of_old_versions_leaves_index_unchanged(
    spark: SparkSession, kafka_config: KafkaConfig, make_pipeline: PipelineFactory
) -> None:
    pipeline = make_pipeline(
        entities=("customers",),
        **SMALL_BATCHES,
        publisher_es={"max_files_per_trigger": 1, "metrics_port": 0},
    )
    build_silver(pipeline, spark, kafka_config, events=2000, keys=200, poison_share=0.0)
    config = pipeline.config
    publish_once(config, spark)
    before = assert_index_equals_oracle(pipeline, kafka_config)

    # 1. The checkpoint set back to its second batch: the same query replays the rest.
    checkpoint = Path(config.checkpoint_path("publisher_es", "customers"))
    assert forget_batches(checkpoint, first_forgotten=2) >= 3
    publish_once(config, spark)
    assert assert_index_equals_oracle(pipeline, kafka_config) == before  # versions too

    # 2. A new checkpoint from silver version 0: every change replayed, older than the index.
    shutil.rmtree(checkpoint)
    publish_once(with_publisher(config, starting_version=0), spark)
    assert assert_index_equals_oracle(pipeline, kafka_config) == before

    quarantine = spark.read.format("delta").load(config.table_path("quarantine", "publisher_es"))
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

    quarantine = spark.read.format("delta").load(config.table_path("quarantine", "publisher_es"))
    rows = quarantine.collect()
    quarantined = {bytes(r.raw_key).decode() for r in rows}
    assert bad <= quarantined, f"not quarantined: {sorted(bad - quarantined)[:10]}"
    for r in rows:
        assert r.service == "publisher_es" and r.entity == "customers"
        assert r.error_kind == "document_parsing_exception"
        assert "loyalty_tier" in r.error_message
        assert json.loads(bytes(r.raw_value))["loyalty_tier"]
        assert r.source_table == config.table_path("silver", "customers")
        assert r.source_version is not None

    # The rest of each batch was applied: every other row is in the index as the oracle says.
    documents = index_documents(es, alias)
    for doc_id, row in good.items():
        assert doc_id in documents, f"{doc_id} missing although it could be indexed"
        assert normalize_source(row, documents[doc_id][1]) == row
    deleted = {expected_id(k) for k in oracle.deleted_keys}
    assert deleted and not deleted & set(documents)
    assert set(documents) - set(good) <= bad  # only older versions of quarantined rows

    # A replayed batch (crash after the quarantine write, before the checkpoint commit)
    # writes its quarantine rows once: txnAppId/txnVersion.
    count = quarantine.count()
    commits = Path(config.checkpoint_path("publisher_es", "customers")) / "commits"
    last = max(int(e.name) for e in commits.iterdir() if e.name.isdigit())
    (commits / str(last)).unlink()  # the batch's offsets stay: Spark reruns it as is
    (commits / f".{last}.crc").unlink(missing_ok=True)
    publish_once(config, spark)
    again = spark.read.format("delta").load(config.table_path("quarantine", "publisher_es"))
    assert again.count() == count
