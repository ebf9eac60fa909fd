"""The whole pipeline on S3-compatible object storage (``storage_root: s3a://...``).

A generated workload goes through the real services with ``--once`` (ingestor, merger,
both publishers) into tables and checkpoints on a local S3 server (S3Proxy); silver, the
change topics and the indexes must equal the oracle. Then ``cdc status``, ``cdc verify``
and ``cdc maintenance`` run against the same root. The secret key is given as a
``${file:...}`` reference and must appear in nothing the run printed or logged.

The session's one SparkSession is shared with other tests: the S3A settings are per
bucket (``fs.s3a.bucket.<bucket>.*``), set on its Hadoop configuration, so nothing else
in the session is affected.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import yaml
from cdc_devkit import infra
from cdc_devkit.oracle import EntityOracle
from cdc_devkit.workload import produce
from cdc_publisher_es.main import start as start_publisher_es
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.jvm import bridge as jvm_bridge
from pyspark.sql import SparkSession
from support.change_topics import read_change_topic
from support.cluster import write_change_schemas
from support.erasure import ERASED, marker_places, with_markers
from support.es import assert_index_equals_oracle, oracle_of
from support.ingestion import generate, ingest_once
from support.ops import cdc
from support.pipelines import Pipeline, write_pipeline
from support.publishing import publish_once
from support.silver import _normal, assert_silver_equals, assert_silver_equals_oracle, merge_once

pytestmark = [pytest.mark.integration, pytest.mark.s3]


def _s3_pipeline(
    folder: Path, kafka: KafkaConfig, es: ElasticsearchConfig, endpoint: str
) -> Pipeline:
    """The usual test pipeline, rooted at a fresh prefix of the local S3 bucket."""
    secret_file = folder / "s3-secret"
    secret_file.write_text(infra.S3_SECRET_KEY + "\n")
    pipeline = write_pipeline(
        folder,
        kafka,
        es,
        ingestor={"metrics_port": 0},
        merger={"metrics_port": 0},
        publisher_kafka={"metrics_port": 0},
        publisher_es={"metrics_port": 0},
    )
    document = yaml.safe_load(pipeline.path.read_text())
    document["storage_root"] = f"s3a://{infra.S3_BUCKET}/pytest-{uuid.uuid4().hex[:8]}"
    document["object_storage"] = {
        "endpoint": endpoint,
        "path_style_access": True,
        "region": infra.S3_REGION,
        "access_key": infra.S3_ACCESS_KEY,
        "secret_key": f"${{file:{secret_file}}}",
    }
    pipeline.path.write_text(yaml.safe_dump(document))
    return pipeline


def _bucket(endpoint: str) -> pafs.S3FileSystem:
    """The local S3 server's bucket, read as delta-rs and the tests read it (path style)."""
    return pafs.S3FileSystem(
        access_key=infra.S3_ACCESS_KEY,
        secret_key=infra.S3_SECRET_KEY,
        endpoint_override=endpoint,
        region=infra.S3_REGION,
    )


def erase_on_object_storage(
    spark: SparkSession, pipeline: Pipeline, kafka: KafkaConfig
) -> EntityOracle:
    """``cdc erase`` of the marked keys on S3; the customers oracle without them.

    With no merger running the request is recorded and left; the merger applies it; on
    object storage the last steps wait for --writers-stopped (Delta's S3 log store orders
    commits within one JVM only).
    """
    args = ("--config", str(pipeline.path))
    keys = [a for k in ERASED for a in ("--key", str(k))]
    recorded = cdc("erase", *args, "--entity", "customers", *keys)
    assert recorded.exit_code == 1 and "merger is not running" in recorded.output
    merge_once(pipeline, spark)
    refused = cdc("erase", *args, "--resume")
    assert refused.exit_code == 1 and "--writers-stopped" in refused.output, refused.output
    resumed = cdc("erase", *args, "--resume", "--writers-stopped", "--json")
    assert resumed.exit_code == 0, resumed.output
    (status,) = json.loads(resumed.stdout)["requests"]
    assert status["done"], status
    publish_once(pipeline, spark)  # the deletes to the change topic and the index
    start_publisher_es(pipeline.config, once=True, spark=spark).run()
    oracle = oracle_of(pipeline, kafka, "customers")
    for key in ERASED:
        oracle.rows.pop((key,), None)
    return oracle


def _assert_change_topics_equal_oracle(pipeline: Pipeline, kafka: KafkaConfig) -> None:
    """Each change topic's last event per key is the oracle's row (deleted keys: none)."""
    for entity in pipeline.config.entities:
        records = read_change_topic(
            kafka.bootstrap_servers, entity.change_topic_name, pipeline.schema_dir
        )
        last: dict[tuple[Any, ...], dict[str, Any] | None] = {}
        for record in records:
            if record.event is not None:
                key = tuple(record.key[k] for k in entity.key)
                last[key] = None if record.event["op"] == "d" else record.event["after"]
        live = {key: after for key, after in last.items() if after is not None}
        oracle = oracle_of(pipeline, kafka, entity.name)
        assert set(live) == set(oracle.rows), f"change topic of {entity.name}: other keys"
        for key, row in oracle.rows.items():
            got = live[key]
            assert {c: _normal(got.get(c)) for c in row} == {
                c: _normal(v) for c, v in row.items()
            }, f"change topic of {entity.name}: key {key} differs"


def test_pipeline_and_operator_commands_on_object_storage(
    tmp_path: Path,
    spark: SparkSession,
    kafka_config: KafkaConfig,
    es_config: ElasticsearchConfig,
    s3_endpoint: str,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    pipeline = _s3_pipeline(tmp_path, kafka_config, es_config, s3_endpoint)
    write_change_schemas(pipeline)
    config: PipelineConfig = pipeline.config
    assert config.storage_root.startswith(f"s3a://{infra.S3_BUCKET}/")
    assert infra.S3_SECRET_KEY not in repr(config)
    # The shared session was built before this test: give it this root's bucket settings.
    jvm_bridge.set_hadoop_options(spark, config.spark.hadoop_options())

    load = generate(pipeline, events=600, keys=100, delete_share=0.15, redelivery_share=0.02)
    messages = with_markers(pipeline, load)  # the keys erased below carry a marker
    produce(kafka_config, iter(messages))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    publish_once(pipeline, spark)
    start_publisher_es(config, once=True, spark=spark).run()

    # Everything landed under the root, in the bucket.
    streams = config.layout.checkpoint("ingestor", "default").rsplit("/", 2)[0]  # <root>/_streams
    fs, checkpoints = jvm_bridge.hadoop_path(spark, streams)
    assert str(fs.getScheme()) == "s3a"
    assert sorted(str(s.getPath().getName()) for s in fs.listStatus(checkpoints)) == [
        "ingestor",
        "merger",
        "publisher_es",
        "publisher_kafka",
    ]

    assert_silver_equals_oracle(spark, pipeline, kafka_config)
    _assert_change_topics_equal_oracle(pipeline, kafka_config)
    assert_index_equals_oracle(pipeline, kafka_config)

    args = ("--config", str(pipeline.path))
    status = cdc("status", *args, "--json")
    assert status.exit_code == 0, status.output
    for entity in json.loads(status.stdout)["entities"]:
        assert entity["bronze_version"] is not None and entity["silver_version"] is not None
        assert {s["service"]: s["lag"] for s in entity["streams"]} == {
            "ingestor": 0,
            "merger": 0,
            "publisher_kafka": 0,
            "publisher_es": 0,
        }
    assert cdc("status", *args).exit_code == 0  # the human form too

    verified = cdc("verify", *args, "--json")
    assert verified.exit_code == 0, verified.output
    for entity in json.loads(verified.stdout)["entities"]:
        oracle = oracle_of(pipeline, kafka_config, entity["entity"])
        assert entity["silver_rows"] == len(oracle.rows)
        assert {t["target"]: t["rows"] for t in entity["targets"]} == {
            "elasticsearch": len(oracle.rows),
            "change_topic": len(oracle.rows),
        }

    erased = erase_on_object_storage(spark, pipeline, kafka_config)

    refused = cdc("maintenance", *args, "--json", "--vacuum-hours", "0")
    assert refused.exit_code == 1 and "--writers-stopped" in refused.output, refused.output
    # Below Delta's minimum: the services ran in this process and are stopped, so no quiet
    # period is needed.
    forced = ("--force-short-retention", "--quiet-minutes", "0")
    maintained = cdc(
        "maintenance", *args, "--json", "--vacuum-hours", "0", "--writers-stopped", *forced
    )
    assert maintained.exit_code == 0, maintained.output
    tables = {t["table"] for t in json.loads(maintained.stdout)["tables"]}
    assert {"bronze", "silver/customers", "silver/orders"} <= tables  # one bronze, shared
    # Still whole after VACUUM 0 (but the keys erased), and the erased keys' values are in
    # no object under the root.
    assert_silver_equals(spark, pipeline, erased)
    assert_silver_equals(spark, pipeline, oracle_of(pipeline, kafka_config, "orders"))
    assert marker_places(_bucket(s3_endpoint), config.storage_root.split("://", 1)[1]) == []

    es = make_elasticsearch(es_config)
    for entity in config.entities:
        es.indices.delete(index=f"{entity.es_index_name}-*", ignore_unavailable=True)
    es.close()

    captured = capfd.readouterr()
    printed = (
        captured.out
        + captured.err
        + status.output
        + verified.output
        + maintained.output
        + "\n".join(r.getMessage() + str(r.__dict__) for r in caplog.records)
    )
    assert printed, "nothing captured: the secret check would prove nothing"
    assert infra.S3_SECRET_KEY not in printed
