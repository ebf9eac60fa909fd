"""Helpers for publisher-es tests: read an index whole, compare it with the oracle, restart ES."""

from __future__ import annotations

import base64
import datetime as dt
from decimal import Decimal
from typing import Any

from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_devkit.workload import produce
from cdc_merger.main import start as start_merger
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig
from elasticsearch import Elasticsearch
from elasticsearch.helpers import scan
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from support.ingestion import generate, ingest_once
from support.pipelines import Pipeline


def build_silver(
    pipeline: Pipeline, spark: SparkSession, kafka: KafkaConfig, **workload: object
) -> None:
    """Generated workload -> Kafka -> ingestor once -> merger once (several silver versions).

    Deletes and re-deliveries are on by default; ``workload`` overrides the WorkloadSpec.
    """
    spec = {"delete_share": 0.2, "redelivery_share": 0.05, "poison_share": 0.005, **workload}
    produce(kafka, iter(generate(pipeline, **spec)))
    ingest_once(pipeline, spark)
    start_merger(pipeline.config, once=True, spark=spark).run()


def index_documents(es: Elasticsearch, alias: str) -> dict[str, tuple[int, dict[str, Any]]]:
    """Every document behind ``alias`` after a refresh: id -> (version, source)."""
    es.indices.refresh(index=alias)
    return {
        hit["_id"]: (hit["_version"], hit["_source"])
        for hit in scan(es, index=alias, query={"query": {"match_all": {}}}, version=True)
    }


def expected_id(key: tuple[Any, ...]) -> str:
    """The document id the publisher must give a key (written here independently)."""
    if len(key) == 1:
        return str(key[0])
    return "|".join(str(p).replace("\\", "\\\\").replace("|", "\\|") for p in key)


def _as_expected(expected: Any, got: Any) -> Any:
    """``got`` (JSON from Elasticsearch) in the Python type the oracle decoded."""
    if got is None:
        return None
    if isinstance(expected, dt.datetime):
        parsed = dt.datetime.fromisoformat(got)
        return parsed if expected.tzinfo is not None else parsed.replace(tzinfo=None)
    if isinstance(expected, dt.date):
        return dt.date.fromisoformat(got)
    if isinstance(expected, Decimal):
        return Decimal(repr(got)) if isinstance(got, float) else Decimal(str(got))
    if isinstance(expected, bytes):
        return base64.b64decode(got)
    return got


def normalize_source(expected: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """``got`` with the oracle row's field set; absent fields count as null."""
    return {name: _as_expected(value, got.get(name)) for name, value in expected.items()}


def oracle_of(pipeline: Pipeline, kafka: KafkaConfig, entity: str) -> EntityOracle:
    """The independent oracle's final state of ``entity``, from the source topic."""
    config = pipeline.config
    fingerprints = load_fingerprints([pipeline.schema_dir])
    spec = config.entity(entity)
    return read_topic(kafka, EntityOracle(spec, list(spec.key), fingerprints))


def assert_index_equals_oracle(
    pipeline: Pipeline,
    kafka: KafkaConfig,
    *,
    skip_ids: frozenset[str] = frozenset(),
) -> dict[str, dict[str, tuple[int, dict[str, Any]]]]:
    """Every entity's index holds exactly the oracle's rows: same ids, same field values.

    ``skip_ids`` are ids allowed to differ (e.g. quarantined). Returns the indexes read.
    """
    config = pipeline.config
    es = make_elasticsearch(config.elasticsearch)
    read: dict[str, dict[str, tuple[int, dict[str, Any]]]] = {}
    for entity in config.entities:
        oracle = oracle_of(pipeline, kafka, entity.name)
        documents = index_documents(es, entity.es_index_name)
        read[entity.name] = documents
        expected = {expected_id(k): row for k, row in oracle.rows.items()}
        assert oracle.rows, f"the oracle of {entity.name} is empty: the test proves nothing"
        got_ids = set(documents) - skip_ids
        assert got_ids == set(expected) - skip_ids, (
            f"index of {entity.name}: missing {sorted(set(expected) - got_ids)[:10]}, "
            f"extra {sorted(got_ids - set(expected))[:10]}"
        )
        deleted = {expected_id(k) for k in oracle.deleted_keys}
        assert deleted, f"no deleted key in the {entity.name} workload: the test proves little"
        assert not deleted & got_ids, f"deleted keys present in {entity.name}"
        wrong = [
            (doc_id, row, documents[doc_id][1])
            for doc_id, row in expected.items()
            if doc_id not in skip_ids and normalize_source(row, documents[doc_id][1]) != row
        ]
        assert not wrong, f"{len(wrong)} documents of {entity.name} differ, e.g. {wrong[:2]}"
        extra_fields = {
            name
            for doc_id, (_v, source) in documents.items()
            if doc_id in expected
            for name, value in source.items()
            if name not in expected[doc_id] and value is not None
        }
        assert not extra_fields, f"fields the oracle does not know: {extra_fields}"
    return read


def silver_rows(spark: SparkSession, config: PipelineConfig, entity: str) -> dict[str, Any]:
    """Silver's current rows of ``entity`` read through Spark: document id -> row (the
    entity's columns, ``_cdc_*`` metadata left out), timestamps as aware UTC datetimes."""
    spec = config.entity(entity)
    frame = spark.read.format("delta").load(config.layout.silver(entity))
    fields = [f for f in frame.schema.fields if not f.name.startswith("_cdc_")]
    instants = {f.name for f in fields if isinstance(f.dataType, T.TimestampType)}
    rows: dict[str, Any] = {}
    for row in frame.select(*[f"`{f.name}`" for f in fields]).collect():
        values = row.asDict(recursive=True)
        for name in instants:  # collect() gives the Python process's local wall time
            if values[name] is not None:
                values[name] = values[name].astimezone(dt.UTC)
        rows[expected_id(tuple(values[k] for k in spec.key))] = values
    return rows


def index_differences(
    spark: SparkSession, config: PipelineConfig, entity: str
) -> tuple[list[str], dict[str, tuple[int, dict[str, Any]]]]:
    """How the index of ``entity`` differs from silver (every key, every value; empty when
    equal), and the documents read."""
    es = make_elasticsearch(config.elasticsearch)
    expected = silver_rows(spark, config, entity)
    assert expected, f"silver/{entity} is empty: the comparison proves nothing"
    documents = index_documents(es, config.entity(entity).es_index_name)
    problems: list[str] = []
    missing, extra = set(expected) - set(documents), set(documents) - set(expected)
    if missing or extra:
        problems.append(
            f"{len(documents)} documents for {len(expected)} silver rows: missing "
            f"{sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        )
    wrong = [
        (doc_id, row, documents[doc_id][1])
        for doc_id, row in expected.items()
        if doc_id in documents
        and (
            normalize_source(row, documents[doc_id][1]) != row
            or set(documents[doc_id][1]) - set(row)
        )
    ]
    if wrong:
        problems.append(f"{len(wrong)} documents differ from silver, e.g. {wrong[:2]}")
    return problems, documents


def assert_index_equals_silver(
    spark: SparkSession, config: PipelineConfig, entity: str
) -> dict[str, tuple[int, dict[str, Any]]]:
    """The index of ``entity`` holds exactly silver's rows; returns the documents read."""
    problems, documents = index_differences(spark, config, entity)
    assert not problems, f"index of {entity}: {'; '.join(problems)}"
    return documents
