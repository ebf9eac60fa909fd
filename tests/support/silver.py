"""Helpers for merger tests: compare silver with the oracle, inspect its change feed."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_merger.main import start as start_merger
from cdc_merger.merging import silver_layout
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import EntityConfig
from pyspark.sql import DataFrame, SparkSession

from support.pipelines import Pipeline


def _normal(value: Any) -> Any:
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def entity_oracle(
    pipeline: Pipeline, entity: EntityConfig, fingerprints: Mapping[bytes, Any]
) -> EntityOracle:
    """An empty oracle of ``entity``, with the reader schemas its JSON parts need."""
    return EntityOracle.of(entity, FileSchemaRegistry([pipeline.schema_dir]), fingerprints)


def assert_silver_equals_oracle(
    spark: SparkSession, pipeline: Pipeline, kafka: KafkaConfig
) -> None:
    """Every entity's silver holds exactly the oracle's rows, every column compared."""
    config = pipeline.config
    fingerprints = load_fingerprints([pipeline.schema_dir])
    for entity in config.entities:
        oracle = read_topic(kafka, entity_oracle(pipeline, entity, fingerprints))
        assert_silver_equals(spark, pipeline, oracle)


def assert_silver_equals(spark: SparkSession, pipeline: Pipeline, oracle: EntityOracle) -> None:
    """The oracle's entity's silver holds exactly the oracle's rows, every column compared."""
    entity = oracle.entity
    silver = spark.read.format("delta").load(silver_layout(pipeline.config, entity).silver_path)
    columns = [c for c in silver.columns if not c.startswith("_cdc_")]
    if entity.columns is not None:  # the selection: only these (and the key) reach silver
        assert set(columns) <= {*entity.columns, *entity.key}, f"silver/{entity.name}: {columns}"
    assert not set(columns) & set(entity.except_columns or []), f"silver/{entity.name}: {columns}"
    expected = {
        key: tuple(_normal(row.get(c)) for c in columns) for key, row in oracle.rows.items()
    }
    got = {
        tuple(r[k] for k in entity.key): tuple(_normal(r[c]) for c in columns)
        for r in silver.collect()
    }
    assert got == expected, f"silver/{entity.name} differs from the oracle"
    assert oracle.deleted_keys.isdisjoint(got)


def assert_change_feed_has_no_repeats(spark: SparkSession, pipeline: Pipeline) -> None:
    """No change (key, sequence, change type) appears twice in silver's Change Data Feed."""
    config = pipeline.config
    for entity in config.entities:
        feed = (
            spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load(silver_layout(config, entity).silver_path)
        )
        changes = Counter(
            (tuple(r[k] for k in entity.key), tuple(r["_cdc_seq"]), r["_change_type"])
            for r in feed.select(*entity.key, "_cdc_seq", "_change_type").collect()
        )
        repeated = [change for change, n in changes.items() if n > 1]
        assert not repeated, f"changes applied twice in silver/{entity.name}: {repeated[:5]}"


def merge_once(pipeline: Pipeline, spark: SparkSession) -> None:
    start_merger(pipeline.config, once=True, spark=spark).run()


def merge_in_slices(
    pipeline: Pipeline, spark: SparkSession, entity: str, slices: int, pause_s: float = 0.0
) -> None:
    """Apply bronze to silver in ``slices`` batches by Kafka offset: many silver versions
    quickly (the merger's own batch function, without a stream per version), each
    recorded in ``silver/_versions`` as the merger records them for the publishers;
    ``pause_s`` between two (silver changing under a running publisher)."""
    from cdc_merger.apply import apply_batch
    from cdc_merger.silver_tables import ensure_tables
    from cdc_merger.stream import SilverVersions
    from pyspark.sql import functions as F

    from support.ingestion import bronze

    config = pipeline.config
    layout = silver_layout(config, config.entity(entity))
    events = bronze(spark, pipeline, entity)
    ensure_tables(spark, events.schema, layout)
    versions = SilverVersions(spark, config)
    versions.start()
    last = events.agg(F.max("kafka_offset")).first()[0] + 1
    sliced = events.withColumn("slice", (F.col("kafka_offset") * slices / last).cast("int"))
    try:
        for number in range(slices):
            batch = sliced.where(F.col("slice") == number).drop("slice")
            apply_batch(spark, batch, layout, refuse_rejects)
            versions.note(entity)
            versions.flush()
            time.sleep(pause_s)
    finally:
        versions.stop()


def refuse_rejects(rejected: DataFrame) -> None:
    """A merger quarantine for loads where every bronze event must apply."""
    raise AssertionError(f"events rejected by the merger: {rejected.limit(5).collect()}")


@contextmanager
def without_auto_compaction(spark: SparkSession) -> Iterator[None]:
    """Writes of this session in the block leave small files as they are.

    For tests that need a fragmented table (something for OPTIMIZE to do) or as many
    streamed files as were written (a Delta stream's first batches read the table's
    current files, which compaction would have binned together).
    """
    setting = "spark.databricks.delta.autoCompact.enabled"  # overrides the table property
    spark.conf.set(setting, "false")
    try:
        yield
    finally:
        spark.conf.unset(setting)
