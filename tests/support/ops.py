"""Helpers for the operator CLI tests: a module-wide pipeline, ES documents, replay headers."""

from __future__ import annotations

import base64
import datetime as dt
import json
import shutil
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from cdc_cli.main import app
from cdc_shared.clients import make_consumer, make_elasticsearch
from cdc_shared.config import ElasticsearchConfig, KafkaConfig, PipelineConfig
from confluent_kafka import TopicPartition
from elasticsearch import helpers
from pyspark.sql import SparkSession
from typer.testing import CliRunner, Result

from support.pipelines import ENTITIES, SCHEMAS, Pipeline


def build_pipeline(
    folder: Path,
    kafka: KafkaConfig,
    es: ElasticsearchConfig,
    entities: tuple[str, ...] = ("customers",),
    **sections: object,
) -> Pipeline:
    """The same pipeline as the ``make_pipeline`` fixture, in a folder a module fixture owns."""
    run = uuid.uuid4().hex[:8]
    schema_dir = folder / f"schemas-{run}"
    schema_dir.mkdir(parents=True)
    pipeline = Pipeline(folder / f"pipeline-{run}.yaml", folder / f"data-{run}", schema_dir, run)
    for name in entities:
        source = ENTITIES[name]["source"]
        for part in ("key", "value"):
            shutil.copy(
                SCHEMAS / f"dbserver1.inventory.{source}-{part}.avsc",
                schema_dir / f"{pipeline.topic(name)}-{part}.avsc",
            )
    document = {
        "storage_root": str(pipeline.root),
        "spark": {"master": "local[2]", "conf": {"spark.ui.enabled": "false"}},
        "kafka": {"bootstrap_servers": kafka.bootstrap_servers},
        "elasticsearch": {"hosts": es.hosts},
        "schema_registry": {"dirs": [str(schema_dir)]},
        "entities": [
            {
                "name": name,
                "source_topic": pipeline.topic(name),
                "key": ENTITIES[name]["key"],
                "sequence_by": ENTITIES[name]["sequence_by"],
                "change_topic": f"pytest_{run}.changes.{name}",
                "es_index": f"pytest_{run}_{name}",
            }
            for name in entities
        ],
        **sections,
    }
    pipeline.path.write_text(yaml.safe_dump(document))
    return pipeline


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
    rows = spark.read.format("delta").load(config.table_path("silver", entity)).collect()
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
