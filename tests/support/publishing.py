"""Checks for publisher-kafka tests: change topics against silver's feed and the oracle."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_publisher_kafka.main import start
from cdc_shared.clients.connect import librdkafka_security
from cdc_shared.config.connections import KafkaConfig
from pyspark.sql import SparkSession

from support.change_topics import ChangeRecord, read_change_topic
from support.pipelines import Pipeline
from support.silver import _normal

OPS = {"insert": "c", "update_postimage": "u", "delete": "d"}


def publish_once(pipeline: Pipeline, spark: SparkSession) -> None:
    start(pipeline.config, once=True, spark=spark).run()


def change_records(pipeline: Pipeline, kafka: KafkaConfig, entity: str) -> list[ChangeRecord]:
    topic = pipeline.config.entity(entity).change_topic_name
    schema_dir = Path(pipeline.config.storage_root) / "_schemas"
    return read_change_topic(
        kafka.bootstrap_servers, topic, schema_dir, security=librdkafka_security(kafka)
    )


def _row(values: dict[str, Any] | None, columns: list[str]) -> tuple[Any, ...] | None:
    return None if values is None else tuple(_normal(values.get(c)) for c in columns)


def assert_change_topics_exactly_once(
    spark: SparkSession,
    pipeline: Pipeline,
    kafka: KafkaConfig,
    left_out: Mapping[str, set[tuple[tuple[Any, ...], int]]] | None = None,
    entities: Collection[str] | None = None,
) -> dict[str, int]:
    """Each change topic holds silver's change feed exactly once, in order per key, and
    its last event per key is the oracle's final state. Returns events per entity.

    ``left_out``: per entity, the (key, commit version) of changes that must not be in
    its topic (quarantined instead). ``entities``: only these (default: all)."""
    config = pipeline.config
    fingerprints = load_fingerprints([pipeline.schema_dir])
    counts = {}
    for entity in config.entities:
        if entities is not None and entity.name not in entities:
            continue
        feed = (
            spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load(config.layout.silver(entity.name))
            .where("_change_type != 'update_preimage'")
        )
        columns = [c for c in feed.columns if not c.startswith("_")]
        expected = sorted(
            (
                tuple(r[k] for k in entity.key),
                r["_commit_version"],
                OPS[r["_change_type"]],
                None if r["_change_type"] == "delete" else _row(r.asDict(), columns),
            )
            for r in feed.collect()
            if (tuple(r[k] for k in entity.key), r["_commit_version"])
            not in (left_out or {}).get(entity.name, set())
        )
        records = [r for r in change_records(pipeline, kafka, entity.name) if r.event]
        got = [
            (
                tuple(r.key[k] for k in entity.key),
                r.event["commit_version"],
                r.event["op"],
                _row(r.event["after"], columns),
            )
            for r in records
            if r.event is not None
        ]
        assert len(got) == len(set(got)), f"duplicate change events in {entity.name}"
        assert sorted(got) == expected, f"change topic of {entity.name} != silver's feed"

        per_key: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        last: dict[tuple[Any, ...], tuple[str, Any]] = {}
        for key, version, op, after in got:  # partition order: one key, one partition
            per_key[key].append(version)
            last[key] = (op, after)
        assert all(v == sorted(set(v)) for v in per_key.values()), "out-of-order versions"

        oracle = read_topic(kafka, EntityOracle(entity, list(entity.key), fingerprints))
        final = {k: after for k, (op, after) in last.items() if op != "d"}
        assert final == {k: _row(row, columns) for k, row in oracle.rows.items()}
        counts[entity.name] = len(got)
    return counts
