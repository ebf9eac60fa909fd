"""The seed-style baseline: one Spark process, three queries per entity."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from cdc_devkit.processes import ServiceProcess
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig, load_config
from pyspark.sql.streaming.listener import StreamingQueryListener

#: The bench's command; the baseline's process is this command with ``--run-baseline``.
ENTRY_POINT = Path(__file__).resolve().parents[1] / "bench_e2e.py"


def baseline_bronze(config: PipelineConfig, entity: EntityConfig) -> str:
    """The baseline's bronze table of ``entity``: a table per entity, as the seed kept it."""
    return f"{config.storage_root.rstrip('/')}/baseline/bronze/{entity.name}"


class BaselineProcess(ServiceProcess):
    """The seed-style pipeline as one process, watched like a service (log, RSS, stop)."""

    def start(self) -> None:
        """Launch the bench (``ENTRY_POINT``) with ``--run-baseline`` in its own process group."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(ENTRY_POINT), "--run-baseline", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )

    def ready(self) -> bool:
        """Whether every query started (the process logs ``ready``)."""
        try:
            return '"msg": "ready"' in self.log_path.read_text(errors="replace")
        except OSError:
            return False


class JsonProgress(StreamingQueryListener):
    """The baseline's micro-batches as JSON lines on stderr, like the services log them."""

    def onQueryStarted(self, event: Any) -> None:
        """Nothing to log."""

    def onQueryProgress(self, event: Any) -> None:
        """Log the batch (batches with rows only)."""
        p = event.progress
        if p.numInputRows == 0:
            return
        lag = None
        for source in p.sources:
            value = (source.metrics or {}).get("maxOffsetsBehindLatest")
            lag = float(value) if value is not None else lag
        name = str(p.name or "")
        line = {
            "ts": dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"),
            "level": "info",
            "msg": "batch",
            "service": "baseline",
            "entity": name,
            "batch_id": p.batchId,
            "input_rows": p.numInputRows,
            "duration_ms": int(p.batchDuration),
            "input_rows_per_s": round(p.numInputRows / max(p.batchDuration, 1) * 1000, 1),
            "lag": lag,
        }
        print(json.dumps(line), file=sys.stderr, flush=True)

    def onQueryIdle(self, event: Any) -> None:
        """Nothing to log."""

    def onQueryTerminated(self, event: Any) -> None:
        """Nothing to log."""


def baseline_queries(spark: Any, config: PipelineConfig, entity: EntityConfig) -> list[Any]:
    """The baseline's three queries for ``entity``: to bronze, to silver, to the topic."""
    from cdc_shared.clients.connect import spark_kafka_options
    from delta.tables import DeltaTable
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro, to_avro

    kafka = spark_kafka_options(config.kafka)
    queries = []
    if any(p.startswith("kafka.") for p in entity.sequence_by):
        raise SystemExit("the baseline takes sequences from the envelope only")
    assert entity.key_schema is not None and entity.value_schema is not None
    key_schema = Path(entity.key_schema).read_text()
    value_schema = Path(entity.value_schema).read_text()
    bronze_path = baseline_bronze(config, entity)
    silver_path = config.layout.silver(entity.name)
    trigger = config.ingestor.trigger_interval
    raw = (
        spark.readStream.format("kafka")
        .options(**kafka)
        .option("subscribe", entity.source_topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", config.ingestor.max_offsets_per_trigger or 20_000)
        .load()
    )
    decoded = (
        raw.where("value IS NOT NULL")
        .select(
            F.col("timestamp").alias("kafka_timestamp"),
            "partition",
            "offset",
            from_avro(F.expr("substring(key, 11)"), key_schema).alias("key"),
            from_avro(F.expr("substring(value, 11)"), value_schema, {"mode": "PERMISSIVE"}).alias(
                "v"
            ),
        )
        .select(
            "kafka_timestamp",
            "partition",
            "offset",
            "key",
            F.col("v.op").alias("op"),
            F.col("v.after").alias("after"),
            F.array(*[F.col(f"v.{p}").cast("long") for p in entity.sequence_by]).alias("sequence"),
        )
    )
    keys = list(entity.key)
    after_type = decoded.schema["after"].dataType
    non_key = [f.name for f in after_type.fields if f.name not in keys]

    def flat(frame: DataFrame) -> DataFrame:
        return frame.select(
            *[F.col(f"key.{k}").alias(k) for k in keys],
            *[F.col(f"after.{c}").alias(c) for c in non_key],
            F.col("sequence").alias("_cdc_seq"),
            F.col("op").alias("_cdc_op"),
        )

    if not DeltaTable.isDeltaTable(spark, bronze_path):
        spark.createDataFrame([], decoded.schema).write.format("delta").save(bronze_path)
    if not DeltaTable.isDeltaTable(spark, silver_path):
        empty = flat(spark.createDataFrame([], decoded.schema))
        empty.write.format("delta").option("delta.enableChangeDataFeed", "true").save(silver_path)

    def merge(batch: DataFrame, _batch_id: int) -> None:
        rows = flat(batch)
        rest = [c for c in rows.columns if c not in keys]
        latest = (
            rows.groupBy(*keys)
            .agg(F.max_by(F.struct(*rest), F.col("_cdc_seq")).alias("n"))
            .select(*keys, "n.*")
        )
        (
            DeltaTable.forPath(spark, silver_path)
            .alias("t")
            .merge(latest.alias("s"), " AND ".join(f"t.`{k}` = s.`{k}`" for k in keys))
            .whenMatchedDelete(condition="s._cdc_op = 'd'")
            .whenMatchedUpdateAll(condition="s._cdc_op != 'd'")
            .whenNotMatchedInsertAll(condition="s._cdc_op != 'd'")
            .execute()
        )

    checkpoints = f"{config.storage_root.rstrip('/')}/baseline/_checkpoints"
    queries.append(
        decoded.writeStream.format("delta")
        .queryName(f"bronze/{entity.name}")
        .option("checkpointLocation", f"{checkpoints}/bronze-{entity.name}")
        .trigger(processingTime=trigger)
        .start(bronze_path)
    )
    queries.append(
        spark.readStream.format("delta")
        .option("maxFilesPerTrigger", config.merger.max_files_per_trigger or 1000)
        .load(bronze_path)
        .writeStream.foreachBatch(merge)
        .queryName(f"silver/{entity.name}")
        .option("checkpointLocation", f"{checkpoints}/silver-{entity.name}")
        .trigger(processingTime=trigger)
        .start()
    )
    feed = (
        spark.readStream.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 0)
        .load(silver_path)
        .where("_change_type != 'update_preimage'")
    )
    key_struct = F.struct(*[F.col(f"`{k}`") for k in keys])
    row = F.struct(*[F.col(f"`{c}`") for c in feed.columns if not c.startswith("_")])

    def header(name: str, value: Any) -> Any:
        return F.struct(F.lit(name).alias("key"), value.cast("binary").alias("value"))

    out = feed.select(
        to_avro(key_struct).alias("key"),
        to_avro(
            F.struct(
                F.col("_change_type").alias("op"),
                row.alias("after"),
                F.col("_cdc_seq").alias("source_sequence"),
                F.col("_commit_version").alias("commit_version"),
                F.col("_commit_timestamp").alias("commit_timestamp"),
            )
        ).alias("value"),
        # Only so this benchmark can find its probes without an Avro schema.
        F.array(
            header("key", F.to_json(key_struct)),
            header("seq", F.to_json(F.col("_cdc_seq"))),
            header("op", F.col("_change_type")),
            header("v", F.col("_commit_version").cast("string")),
        ).alias("headers"),
    )
    queries.append(
        out.writeStream.format("kafka")
        .options(**kafka)
        .option("topic", entity.change_topic_name)
        .queryName(f"topic/{entity.name}")
        .option("checkpointLocation", f"{checkpoints}/topic-{entity.name}")
        .trigger(processingTime=config.publisher_kafka.trigger_interval)
        .start()
    )
    return queries


def run_baseline(config_path: str) -> None:
    """The baseline process: Kafka -> bronze -> MERGE -> silver CDF -> Kafka, until SIGTERM."""
    from cdc_shared.jvm.spark import build_spark_session

    config = load_config(config_path)
    spark = build_spark_session(config.spark, "bench-e2e-baseline")
    spark.sparkContext.setLogLevel("ERROR")
    spark.streams.addListener(JsonProgress())
    queries = [q for entity in config.entities for q in baseline_queries(spark, config, entity)]
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    print(json.dumps({"msg": "ready"}), file=sys.stderr, flush=True)
    while not stopping.is_set():
        if spark.streams.awaitAnyTermination(1):
            raise SystemExit("a baseline query stopped; see above")
    for query in queries:
        query.stop()
    spark.stop()
