"""Helpers for the operator CLI tests: a module-wide pipeline, ES documents, replay headers."""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from cdc_cli.main import app
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig
from confluent_kafka import TopicPartition
from elasticsearch import helpers
from pyspark.sql import SparkSession
from typer.testing import CliRunner, Result

from support.pipelines import Pipeline, write_pipeline


def build_pipeline(
    folder: Path,
    kafka: KafkaConfig,
    es: ElasticsearchConfig,
    entities: tuple[str, ...] = ("customers",),
    **sections: object,
) -> Pipeline:
    """The same pipeline as the ``make_pipeline`` fixture, in a folder a module fixture owns."""
    return write_pipeline(folder, kafka, es, entities, **sections)


def cdc(*args: str) -> Result:
    """Run ``cdc <args>`` in-process (the test's SparkSession is reused by getOrCreate)."""
    return CliRunner().invoke(app, list(args))


def cdc_json(*args: str) -> Any:
    """Run ``cdc <args> --json``; the parsed output (asserts exit 0)."""
    result = cdc(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _json_value(value: Any) -> Any:
    """A silver value as publisher-es writes it into ``_source`` (UTC ISO times, base64)."""
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat(timespec="microseconds")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def silver_documents(
    spark: SparkSession, config: PipelineConfig, entity: str
) -> dict[str, dict[str, Any]]:
    """Silver's rows as ES documents: id (the key joined by ``|``) -> full row."""
    key = config.entity(entity).key
    rows = spark.read.format("delta").load(config.layout.silver(entity)).collect()
    documents = {}
    for row in rows:
        source = _json_value(row.asDict(recursive=True))
        documents["|".join(str(source[k]) for k in key)] = source
    return documents


def index_documents(
    es_config: ElasticsearchConfig, index: str, documents: dict[str, dict[str, Any]]
) -> None:
    """Index ``documents`` by id into ``index`` and make them searchable."""
    es = make_elasticsearch(es_config)
    try:
        helpers.bulk(
            es,
            ({"_index": index, "_id": i, "_source": d} for i, d in documents.items()),
            refresh=True,
        )
    finally:
        es.close()


def replay_origins(kafka: KafkaConfig, topic: str) -> list[str]:
    """The ``cdc.replay.of`` header of every record in ``topic`` that has one."""
    consumer = make_consumer(kafka, group_id=f"replay-origins-{uuid.uuid4().hex[:8]}")
    origins: list[str] = []
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        }
        assigned = [TopicPartition(topic, p, 0) for p in partitions if ends[p]]
        consumer.assign(assigned)
        while True:
            for message in consumer.consume(1000, timeout=0.5):
                assert message.error() is None, message.error()
                origins.extend(
                    bytes(v).decode() for k, v in message.headers() or [] if k == "cdc.replay.of"
                )
            if all(tp.offset >= ends[tp.partition] for tp in consumer.position(assigned)):
                return origins
    finally:
        consumer.close()
