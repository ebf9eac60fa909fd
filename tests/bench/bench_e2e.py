"""Benchmark: the whole pipeline at steady offered loads, beside the seed-style baseline.

Figures, not a test: nothing here asserts a time. Needs nothing running: it starts the
local servers (``cdc infra up``, ports from ``CDC_INFRA_*``), then, for each pipeline in
turn (never both at once, so they do not share the CPU):

- cdc: the four services as separate processes (``cdc_cli.processes``) on fresh topics,
  tables and indexes (``cdc_cli.local_run.write_pipeline_config``);
- cdc-app: the same four services as one Spark application (``cdc run``);
- baseline (``--baseline``, the default): one Spark process with three queries per entity,
  the seed-style way: Spark's Kafka source -> ``from_avro`` with the one writer schema ->
  Delta append; bronze stream -> ``foreachBatch`` newest-per-key + plain MERGE into a
  silver table with Change Data Feed; silver CDF -> ``to_avro`` -> Spark's Kafka sink.

Load: the workload generator (``cdc_cli.workload``) in ``--producers`` worker processes,
each on its own share of the key space; in-order inserts, updates and deletes with
tombstones, no re-deliveries, poison or schema change (so the plain MERGE of the
baseline is correct on it and the comparison is about speed only). The snapshot goes
first (warm-up, not measured); then each rate of ``--rates`` (Kafka messages per second,
tombstones included) for ``--seconds-per-rate``, after which production pauses until the
pipeline has drained (``--drain-timeout``).

Delay is measured on probe keys (``--probe-share`` of the key space, hot keys left out):
from the source record's Kafka timestamp (bronze ``kafka_timestamp``) to (a) the silver
commit that applied it (silver's Change Data Feed, ``_commit_timestamp``), (b) the moment
a read_committed consumer in this process reads its change event, (c) the moment a search
for the probe documents (every 0.5 s; ids query, versions only) returns its version.
Events superseded inside one micro-batch never reach an output and are not counted;
deletes are not counted (their change events carry the removed row's sequence).

Sustainable: a rate step is sustainable when (1) the producers offered at least 95% of
the rate, (2) every probe key's last change reached every output within the drain timeout
after the step, and (3) the backlog did not grow: for each output, the median delay of
the events produced in the last quarter of the step exceeds that of the second quarter
by at most max(2 s, 25% of it, 5% of the step length). A step whose median delay is
over half its length shows no trend ("step too short"). The backlog itself is estimated
from the samples: events produced but not yet in the output, in the middle and at the
end of the step (sampled events that never reach an output, superseded in a batch, are
left out, so it is a lower bound). The highest sustainable load is the highest
sustainable rate; after a step that does not drain, higher rates are not run.

Writes ``results.json``, ``results.md`` and ``plot.svg`` (delay percentiles and lag over
time) under ``--workdir``, and prints the tables.

    .venv/bin/python tests/bench/bench_e2e.py [--rates 1000,5000,20000]
        [--seconds-per-rate 180] [--keys 100000] [--workdir data/bench-e2e]
        [--pipelines cdc,cdc-app,baseline]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import itertools
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fastavro
import yaml
from cdc_cli import infra
from cdc_cli.local_run import Progress, wait_until_healthy, write_pipeline_config
from cdc_cli.oracle import load_fingerprints
from cdc_cli.processes import (
    RunMode,
    ServiceProcess,
    launch,
    owns_its_memory,
    process_snapshot,
    wait_a_little,
)
from cdc_cli.workload import (
    GeneratedMessage,
    WorkloadGenerator,
    WorkloadSpec,
    ensure_topics,
    produce,
)
from cdc_shared.avro import SchemaRegistry
from cdc_shared.clients import make_consumer, make_elasticsearch
from cdc_shared.config import EntityConfig, PipelineConfig, load_config
from cdc_shared.schemas import make_registry
from pyspark.sql.streaming.listener import StreamingQueryListener

ROOT = Path(__file__).resolve().parents[2]
Key = tuple[Any, ...]
Seq = tuple[int, ...]
Mark = tuple[str, Key, Seq]  # entity, key, sequence: one change event
STAGES = ("silver", "topic", "index")
#: The pipelines the bench can run: ours as four processes, ours as one application.
CDC_MODES = {"cdc": RunMode.SERVICES, "cdc-app": RunMode.APPLICATION}
PIPELINES = ("cdc", "cdc-app", "baseline")
ES_POLL_S = 0.5
_TICK = os.sysconf("SC_CLK_TCK")


# --- probe keys ------------------------------------------------------------------------


class ShardGenerator(WorkloadGenerator):
    """The workload on every ``shards``-th key from ``shard``: producers never share a key.

    Per-key order then holds across producer processes, since each key has one producer.
    """

    def __init__(
        self,
        shard: int,
        shards: int,
        entities: Sequence[EntityConfig],
        registry: SchemaRegistry,
        spec: WorkloadSpec,
    ) -> None:
        self.shard, self.shards = shard, shards
        super().__init__(entities, registry, spec)

    def _key(self, state: Any, k: int) -> dict[str, Any]:
        return super()._key(state, k * self.shards + self.shard)

    def global_key(self, entity_index: int, k: int) -> dict[str, Any]:
        """The key of global key number ``k`` of the ``entity_index``-th entity."""
        return WorkloadGenerator._key(self, self.entities[entity_index], k)


def probe_numbers(keys: int, share: float, hot_keys: float, shards: int) -> list[int]:
    """Global key numbers that are probes: every n-th key, the hot keys left out.

    Hot keys change several times per micro-batch, so most of their changes never reach
    an output; their few survivors would skew the delay.
    """
    stride = max(1, round(1 / share))
    first_cold = (max(1, int(keys // shards * hot_keys)) + 1) * shards
    last = keys // shards * shards
    return [k for k in range(stride // 2, last, stride) if k >= first_cold]


def probe_keys(config: PipelineConfig, numbers: Sequence[int]) -> dict[str, dict[Key, int]]:
    """Per entity: probe key tuple -> global key number."""
    generator = ShardGenerator(
        0, 1, config.entities, make_registry(config), WorkloadSpec(events=0, keys=1)
    )
    out: dict[str, dict[Key, int]] = {}
    for index, entity in enumerate(config.entities):
        out[entity.name] = {
            tuple(generator.global_key(index, k)[f] for f in entity.key): k for k in numbers
        }
    return out


def sequence_of(envelope: dict[str, Any], paths: Sequence[str]) -> Seq:
    """The entity's ``sequence_by`` values of a decoded envelope."""
    values = []
    for path in paths:
        value: Any = envelope
        for part in path.split("."):
            value = value[part]
        values.append(int(value))
    return tuple(values)


# --- load: producer processes ------------------------------------------------------------


def producer_main(
    shard: int,
    shards: int,
    config_path: str,
    keys: int,
    events: int,
    seed: int,
    probes: dict[str, dict[Key, int]],
    commands: Any,
    results: Any,
) -> None:
    """One producer process: takes ("produce", count, rate) commands, answers with marks.

    A mark is (entity, key, sequence, op, time) of a probe key's change, taken as the
    message goes to the producer (its Kafka timestamp is set in the same call).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    config = load_config(config_path)
    spec = WorkloadSpec(
        events=events,
        keys=max(1, keys // shards),
        seed=seed + shard,
        poison_share=0.0,
        redelivery_share=0.0,
        schema_change_at=None,
    )
    generator = ShardGenerator(shard, shards, config.entities, make_registry(config), spec)
    wanted = {e.name: set(probes[e.name]) for e in config.entities}
    paths = {e.name: list(e.sequence_by) for e in config.entities}
    fingerprints = load_fingerprints([ROOT / "schemas"])
    marks: list[tuple[str, Key, Seq, str, float]] = []
    key_cache: dict[tuple[str, bytes], Key | None] = {}

    def watched(messages: Iterator[GeneratedMessage]) -> Iterator[GeneratedMessage]:
        for message in messages:
            if message.value is not None and message.key is not None:
                cached = (message.entity, message.key)
                if cached not in key_cache:
                    key = _decode_single_object(message.key, fingerprints)
                    entity = next(e for e in config.entities if e.name == message.entity)
                    parts = tuple(key[f] for f in entity.key)
                    key_cache[cached] = parts if parts in wanted[message.entity] else None
                probe = key_cache[cached]
                if probe is not None:
                    envelope = _decode_single_object(message.value, fingerprints)
                    marks.append(
                        (
                            message.entity,
                            probe,
                            sequence_of(envelope, paths[message.entity]),
                            str(envelope["op"]),
                            time.time(),
                        )
                    )
            yield message

    stream = watched(generator.messages())
    snapshot = sum(min(spec.keys // 2, spec.keys) for _ in config.entities)
    while True:
        command = commands.get()
        if command[0] == "stop":
            return
        _, count, rate = command
        count = snapshot if count is None else count
        report = produce(config.kafka, itertools.islice(stream, count), rate=rate)
        results.put((shard, report.produced, report.seconds, list(marks)))
        marks.clear()


class Load:
    """The producer processes, driven one step at a time."""

    def __init__(
        self, config_path: Path, args: argparse.Namespace, probes: dict[str, dict[Key, int]]
    ) -> None:
        context = mp.get_context("spawn")
        self.shards = args.producers
        total = sum(int(r * args.seconds_per_rate) for r in args.rates)
        events = total // self.shards + 10_000
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(self.shards)]
        self.workers = [
            context.Process(
                target=producer_main,
                args=(
                    shard,
                    self.shards,
                    str(config_path),
                    args.keys,
                    events,
                    args.seed,
                    probes,
                    self.commands[shard],
                    self.results,
                ),
                daemon=True,
            )
            for shard in range(self.shards)
        ]
        for worker in self.workers:
            worker.start()

    def run(
        self, count: int | None, rate: float | None
    ) -> tuple[int, float, list[tuple[str, Key, Seq, str, float]]]:
        """Produce ``count`` messages (None: the snapshot) at ``rate`` in all; wait for it."""
        for queue in self.commands:
            share = None if count is None else count // self.shards
            queue.put(("produce", share, None if rate is None else rate / self.shards))
        produced, seconds, marks = 0, 0.0, []
        for _ in self.workers:
            _, n, s, m = self.results.get()
            produced, seconds = produced + n, max(seconds, s)
            marks.extend(m)
        return produced, seconds, marks

    def pids(self) -> dict[str, int]:
        """The producers' process ids (they share the bench's process group)."""
        return {f"producer-{i}": w.pid for i, w in enumerate(self.workers) if w.pid}

    def stop(self) -> None:
        """Ask every worker to end, then make sure it did."""
        for queue in self.commands:
            queue.put(("stop",))
        for worker in self.workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()


# --- the baseline: one Spark process ---------------------------------------------------


class BaselineProcess(ServiceProcess):
    """The seed-style pipeline as one process, watched like a service (log, RSS, stop)."""

    def start(self) -> None:
        """Launch this file with ``--run-baseline`` in its own process group."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--run-baseline", str(self.config)],
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
    from cdc_shared.clients import spark_kafka_options
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
    bronze_path = config.table_path("bronze", entity.name)
    silver_path = config.table_path("silver", entity.name)
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

    checkpoints = f"{config.storage_root}/_checkpoints/baseline"
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
    from cdc_shared.spark import build_spark_session

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


# --- watching the outputs ----------------------------------------------------------------


def _decode_single_object(data: bytes, schemas: dict[bytes, Any]) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), schemas[bytes(data[2:10])], None)


class TopicWatcher(threading.Thread):
    """Reads the change topics (read_committed) as they grow; notes when probes appear.

    Only probe keys' values are decoded: a key's bytes are looked up once, then cached.
    ``headers``: the baseline's messages carry key, sequence and op as headers.
    """

    def __init__(
        self, config: PipelineConfig, probes: dict[str, dict[Key, int]], headers: bool
    ) -> None:
        super().__init__(daemon=True)
        self.config, self.probes, self.headers = config, probes, headers
        self.entity_of = {e.change_topic_name: e for e in config.entities}
        self.seen: dict[Mark, float] = {}
        self.last: dict[tuple[str, Key], tuple[Seq, str]] = {}
        self.commit_seq: dict[tuple[str, Key, int], Seq] = {}
        self.read = 0
        self.done = threading.Event()
        self._schemas: dict[bytes, Any] = {}
        self._keys: dict[tuple[str, bytes], Key | None] = {}

    def _schema_table(self, fingerprint: bytes) -> dict[bytes, Any]:
        if fingerprint not in self._schemas:
            self._schemas = load_fingerprints(
                [Path(self.config.storage_root) / "_schemas", ROOT / "schemas" / "changes"]
            )
        return self._schemas

    def _decode(self, data: bytes) -> Any:
        return _decode_single_object(data, self._schema_table(bytes(data[2:10])))

    def run(self) -> None:
        """Consume until ``done``."""
        consumer = make_consumer(
            self.config.kafka,
            f"bench-e2e-{uuid.uuid4().hex[:8]}",
            **{
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "topic.metadata.refresh.interval.ms": 2000,
            },
        )
        consumer.subscribe(list(self.entity_of))
        try:
            while not self.done.is_set():
                messages = consumer.consume(5000, timeout=0.2)
                now = time.time()
                for message in messages:
                    if message.error() is None and message.value() is not None:
                        self._note(message, now)
                self.read += len(messages)
        finally:
            consumer.close()

    def _note(self, message: Any, now: float) -> None:
        entity = self.entity_of[message.topic()]
        if self.headers:
            fields = {k: v for k, v in message.headers() or []}
            raw_key = fields["key"]
        else:
            raw_key = message.key()
        cached = (entity.name, raw_key)
        if cached not in self._keys:
            decoded = json.loads(raw_key) if self.headers else self._decode(raw_key)
            parts = tuple(decoded[k] for k in entity.key)
            self._keys[cached] = parts if parts in self.probes[entity.name] else None
        key = self._keys[cached]
        if key is None:
            return
        if self.headers:
            op = {"insert": "c", "update_postimage": "u", "delete": "d"}[fields["op"].decode()]
            seq = tuple(json.loads(fields["seq"]))
            version = int(fields["v"])
        else:
            event = self._decode(message.value())
            op, seq, version = event["op"], tuple(event["source_sequence"]), event["commit_version"]
        self.last[(entity.name, key)] = (seq, op)
        if op != "d":
            self.seen.setdefault((entity.name, key, seq), now)
            self.commit_seq[(entity.name, key, int(version))] = seq


class IndexWatcher(threading.Thread):
    """Searches the probe documents every ``ES_POLL_S`` (ids query, versions only).

    A search sees a document after the index's refresh, so the first search that returns
    a version is when that change became searchable (to within the polling interval).
    """

    def __init__(self, config: PipelineConfig, probes: dict[str, dict[Key, int]]) -> None:
        from cdc_publisher_es.documents import document_id

        super().__init__(daemon=True)
        self.config = config
        self.ids = {
            e.name: {document_id(list(k)): k for k in probes[e.name]} for e in config.entities
        }
        self.seen: dict[tuple[str, Key, int], float] = {}
        self.current: dict[tuple[str, Key], int | None] = {}
        self.searches = 0
        self.done = threading.Event()

    def run(self) -> None:
        """Poll until ``done``."""
        client = make_elasticsearch(self.config.elasticsearch)
        try:
            while not self.done.wait(ES_POLL_S):
                for entity in self.config.entities:
                    self._poll(client, entity)
        finally:
            client.close()

    def _poll(self, client: Any, entity: EntityConfig) -> None:
        ids = self.ids[entity.name]
        try:
            answer = client.search(
                index=entity.es_index_name,
                query={"ids": {"values": list(ids)}},
                size=len(ids),
                version=True,
                source=False,
            )
        except Exception:  # the index is not there yet
            return
        now = time.time()
        self.searches += 1
        found = {h["_id"]: int(h["_version"]) for h in answer["hits"]["hits"]}
        for doc_id, key in ids.items():
            version = found.get(doc_id)
            if self.current.get((entity.name, key)) != version:
                self.current[(entity.name, key)] = version
                if version is not None:
                    self.seen.setdefault((entity.name, key, version), now)


def index_sequence(
    entity: EntityConfig, key: Key, version: int, commit_seq: dict[tuple[str, Key, int], Seq]
) -> Seq | None:
    """The sequence a document version stands for (``cdc_shared.changefeed.external_version``).

    One-column sequences: version = 2 x sequence (+1 for a delete); otherwise the silver
    commit version, resolved through what silver's change feed or the topic showed.
    """
    if len(entity.sequence_by) == 1:
        return None if version % 2 else (version // 2,)
    return commit_seq.get((entity.name, key, version))


# --- resources -------------------------------------------------------------------------


class Meter(threading.Thread):
    """CPU seconds and peak RSS per process group (or single process), sampled every second.

    CPU per process is the largest total seen (user + system, with reaped children), so
    a process that ends keeps its share.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.groups: dict[int, str] = {}  # process group id -> name
        self.single: dict[int, str] = {}  # process id -> name (its children not included)
        self.cpu_ticks: dict[str, dict[int, int]] = {}
        self.peak_rss: dict[str, int] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def watch(self, name: str, pid: int, *, group: bool = True) -> None:
        """Meter process group ``pid`` (or only process ``pid``) as ``name``."""
        with self.lock:
            (self.groups if group else self.single)[pid] = name
            self.cpu_ticks.setdefault(name, {})
            self.peak_rss.setdefault(name, 0)

    def run(self) -> None:
        """Sample until ``done``."""
        while not self.done.wait(1.0):
            self.sample()

    def sample(self) -> None:
        """One pass over /proc."""
        snapshot = process_snapshot()
        with self.lock:
            rss = dict.fromkeys(self.peak_rss, 0)
            for process in snapshot.values():
                name = self.single.get(process.pid) or self.groups.get(process.group)
                if name is None:
                    continue
                seen = self.cpu_ticks[name]
                seen[process.pid] = max(seen.get(process.pid, 0), process.cpu_ticks)
                if owns_its_memory(process, snapshot):
                    rss[name] += process.resident_bytes
            for name, value in rss.items():
                self.peak_rss[name] = max(self.peak_rss[name], value)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far per name."""
        self.sample()
        with self.lock:
            return {n: sum(t.values()) / _TICK for n, t in self.cpu_ticks.items()}


# --- one pipeline, all rates --------------------------------------------------------------


@dataclass
class StepResult:
    """One rate step of one pipeline."""

    rate: float
    seconds: float
    produced: int = 0
    produce_seconds: float = 0.0
    drained: bool = False
    drain_seconds: float = 0.0
    delays_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> p50..
    samples: dict[str, int] = field(default_factory=dict)
    growth_s: dict[str, float] = field(default_factory=dict)
    allowed_s: dict[str, float] = field(default_factory=dict)
    backlog_events: dict[str, tuple[float, float]] = field(default_factory=dict)  # mid, end
    cpu_s: dict[str, float] = field(default_factory=dict)
    verdict: str = ""

    @property
    def achieved(self) -> float:
        """Messages per second the producers reached."""
        return self.produced / self.produce_seconds if self.produce_seconds else 0.0

    @property
    def sustainable(self) -> bool:
        """The rule of the module docstring."""
        return self.verdict == "sustainable"


@dataclass
class PipelineResult:
    """Everything measured for one pipeline."""

    name: str
    stages: list[str]
    steps: list[StepResult] = field(default_factory=list)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    lags: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    step_bounds: list[tuple[float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)  # the pipeline's own, not servers

    @property
    def highest_sustainable(self) -> float | None:
        """The highest sustainable offered rate, if any."""
        rates = [s.rate for s in self.steps if s.sustainable]
        return max(rates) if rates else None


def _wait_for_group_coordinator(config: PipelineConfig, timeout_s: float = 120.0) -> None:
    """Wait until the broker answers offset requests (a fresh broker first says NOT_COORDINATOR).

    publisher-kafka reads its progress with such a request at start-up and exits on that
    error, so on a just-started broker the bench waits for the coordinator first.
    """
    from confluent_kafka import KafkaException, TopicPartition

    consumer = make_consumer(config.kafka, f"bench-e2e-{uuid.uuid4().hex[:8]}")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                consumer.committed([TopicPartition(config.entities[0].source_topic, 0)], 10)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
    finally:
        consumer.close()


def _configure(workdir: Path, served: infra.Endpoints, prefix: str, port_base: int) -> Path:
    path = write_pipeline_config(workdir, served, prefix=prefix)
    document = yaml.safe_load(path.read_text())
    sections = ("ingestor", "merger", "publisher_kafka", "publisher_es", "application")
    for offset, section in enumerate(sections):
        document[section]["metrics_port"] = port_base + offset
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


class PipelineRun:
    """One pipeline (``cdc`` or ``baseline``) from start to stop, one rate step at a time."""

    def __init__(
        self, kind: str, args: argparse.Namespace, served: infra.Endpoints, started: float
    ) -> None:
        self.kind, self.args, self.started = kind, args, started
        self.is_cdc = kind in CDC_MODES
        self.workdir = args.workdir / kind
        self.workdir.mkdir(parents=True)
        prefix = {"cdc": "e2e", "cdc-app": "app"}.get(kind, "base")
        self.config_path = _configure(self.workdir, served, prefix, args.port_base)
        self.config = load_config(self.config_path)
        self.result = PipelineResult(kind, list(STAGES) if self.is_cdc else ["silver", "topic"])
        numbers = probe_numbers(
            args.keys, args.probe_share, WorkloadSpec().hot_keys, args.producers
        )
        self.probes = probe_keys(self.config, numbers)
        logs = self.workdir / "logs"
        self.services: list[ServiceProcess] = (
            launch(CDC_MODES[kind], self.config_path, logs)
            if self.is_cdc
            else [BaselineProcess("baseline", self.config_path, logs / "baseline.log")]
        )
        self.result.processes = [s.name for s in self.services]
        self.meter = Meter()
        self.progress = Progress(self.services, lambda line: print(f"  {kind}: {line}", flush=True))
        self.topic = TopicWatcher(self.config, self.probes, headers=not self.is_cdc)
        self.index = IndexWatcher(self.config, self.probes) if self.is_cdc else None
        self.load: Load | None = None
        self.expected: dict[tuple[str, Key], tuple[Seq, str]] = {}
        self.produced_at: dict[Mark, tuple[float, int]] = {}  # first time, step (-1: warm-up)

    def start(self) -> None:
        """Topics, processes, watchers and producers; returns when all are ready."""
        topics = [e.source_topic for e in self.config.entities]
        if not self.is_cdc:
            topics += [e.change_topic_name for e in self.config.entities]
        ensure_topics(self.config.kafka, topics)
        _wait_for_group_coordinator(self.config)
        print(f"{self.kind}: starting; logs in {self.workdir / 'logs'}", flush=True)
        for service in self.services:
            service.start()
            assert service.process is not None
            self.meter.watch(service.name, service.process.pid)
        for name in ("kafka", "elasticsearch"):
            pid_file = infra.InfraSettings().state_dir / f"{name}.pid"
            if pid_file.exists():
                self.meter.watch(name, int(pid_file.read_text().strip()))
        self.meter.watch("bench (this process)", os.getpid(), group=False)
        self.progress.start()
        if isinstance(self.services[0], BaselineProcess):
            baseline = self.services[0]
            deadline = time.monotonic() + self.args.start_timeout
            while not baseline.ready():
                if not baseline.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"the baseline did not start; see {baseline.log_path}")
                wait_a_little(self.services, 2)
        else:
            wait_until_healthy(self.services, self.config, self.args.start_timeout)
        self.meter.start()
        self.topic.start()
        if self.index is not None:
            self.index.start()
        self.load = Load(self.config_path, self.args, self.probes)
        for shard, pid in self.load.pids().items():
            self.meter.watch(shard, pid, group=False)

    def _note(self, marks: list[tuple[str, Key, Seq, str, float]], step: int) -> None:
        for entity, key, seq, op, at in marks:
            if (entity, key) not in self.expected or self.expected[(entity, key)][0] < seq:
                self.expected[(entity, key)] = (seq, op)
            if op != "d":
                self.produced_at.setdefault((entity, key, seq), (at, step))

    def _drain(self, timeout: float) -> tuple[bool, float]:
        """Wait until every probe key's last change is in every output; (done, seconds)."""
        begun = time.monotonic()
        while time.monotonic() - begun < timeout:
            if not all(s.alive for s in self.services):
                raise RuntimeError("a service stopped; see its log")
            if not _pending(self.config, self.expected, self.topic, self.index):
                return True, time.monotonic() - begun
            wait_a_little(self.services, 1)
        return False, time.monotonic() - begun

    def warm_up(self) -> None:
        """The snapshot, unthrottled, until it is everywhere (not measured)."""
        assert self.load is not None
        print(f"{self.kind}: warm-up: the snapshot, unthrottled", flush=True)
        produced, _, marks = self.load.run(None, None)
        self._note(marks, -1)
        drained, took = self._drain(self.args.drain_timeout * 2)
        print(f"{self.kind}: warm-up {produced:,} messages, drained={drained} in {took:.0f} s")

    def step(self, number: int, rate: float) -> StepResult:
        """Offer ``rate`` for the step's length, then wait for the pipeline to drain."""
        assert self.load is not None
        step = StepResult(rate, self.args.seconds_per_rate)
        cpu_before = self.meter.cpu_seconds()
        begun = time.time()
        print(f"{self.kind}: {rate:,.0f} events/s for {step.seconds:.0f} s", flush=True)
        step.produced, step.produce_seconds, marks = self.load.run(int(rate * step.seconds), rate)
        ended = time.time()
        self._note(marks, number)
        step.drained, step.drain_seconds = self._drain(self.args.drain_timeout)
        cpu_after = self.meter.cpu_seconds()
        step.cpu_s = {n: cpu_after[n] - cpu_before.get(n, 0.0) for n in cpu_after}
        self.result.steps.append(step)
        self.result.step_bounds.append((begun - self.started, ended - self.started))
        print(
            f"{self.kind}: {rate:,.0f}/s offered, {step.achieved:,.0f}/s produced; "
            f"drained={step.drained} after {step.drain_seconds:.0f} s",
            flush=True,
        )
        return step

    def stop(self) -> None:
        """Stop watchers, producers and processes (SIGTERM: the batch in flight finishes)."""
        self.topic.done.set()
        if self.index is not None:
            self.index.done.set()
        if self.load is not None:
            self.load.stop()
        self.progress.done.set()
        for service in self.services:
            code = service.stop()
            if code not in (0, None):
                self.result.notes.append(f"{service.name} exited {code}")
        self.meter.done.set()

    def measure(self) -> PipelineResult:
        """Lag series from the logs, peak RSS, and the delays (``_measure``)."""
        for service in self.services:
            service.poll()
            for batch in service.batches:
                if batch.get("lag") is None:
                    continue
                at = dt.datetime.fromisoformat(str(batch["ts"]).replace("Z", "+00:00"))
                name = f"{batch.get('service') or service.name}/{batch.get('entity')}"
                self.result.lags.setdefault(name, []).append(
                    (at.timestamp() - self.started, float(batch["lag"]))
                )
        self.result.peak_rss_mib = {n: v / 2**20 for n, v in self.meter.peak_rss.items()}
        _measure(self.config, self.result, self.produced_at, self.topic, self.index, self.started)
        return self.result


def run_pipeline(
    kind: str, args: argparse.Namespace, served: infra.Endpoints, started: float
) -> PipelineResult:
    """Start ``kind`` (cdc or baseline), offer every rate, stop it, measure the delays."""
    run = PipelineRun(kind, args, served, started)
    try:
        run.start()
        run.warm_up()
        for number, rate in enumerate(args.rates):
            if not run.step(number, rate).drained:
                run.result.notes.append(
                    f"{rate:,.0f}/s did not drain in {args.drain_timeout:.0f} s: "
                    "higher rates not run"
                )
                break
    finally:
        run.stop()
    return run.measure()


def _pending(
    config: PipelineConfig,
    expected: dict[tuple[str, Key], tuple[Seq, str]],
    topic: TopicWatcher,
    index: IndexWatcher | None,
) -> int:
    """Probe keys whose last produced change is not yet in the topic (and the index)."""
    entities = {e.name: e for e in config.entities}
    waiting = 0
    for (name, key), (seq, op) in list(expected.items()):
        last = topic.last.get((name, key))
        if op == "d":
            in_topic = last is None or last[1] == "d"
        else:
            in_topic = last is not None and last[0] == seq and last[1] != "d"
        in_index = True
        if index is not None:
            version = index.current.get((name, key))
            if op == "d":
                in_index = version is None
            else:
                in_index = version is not None and (
                    index_sequence(entities[name], key, version, topic.commit_seq) == seq
                )
        waiting += not (in_topic and in_index)
    return waiting


# --- turning observations into figures -------------------------------------------------------


def _silver_times(
    config: PipelineConfig, probes: set[tuple[str, Key]]
) -> tuple[dict[Mark, float], dict[Mark, float], dict[tuple[str, Key, int], Seq]]:
    """Kafka timestamps from bronze; silver commit times and commit versions from its CDF."""
    from cdc_shared.spark import build_spark_session
    from pyspark.sql import functions as F

    spark = build_spark_session(config.spark, "bench-e2e-measure")
    spark.sparkContext.setLogLevel("ERROR")
    produced: dict[Mark, float] = {}
    committed: dict[Mark, float] = {}
    commit_seq: dict[tuple[str, Key, int], Seq] = {}
    try:
        for entity in config.entities:
            first = entity.key[0]
            firsts = sorted({k[0] for name, k in probes if name == entity.name})
            bronze = spark.read.format("delta").load(config.table_path("bronze", entity.name))
            rows = (
                bronze.where(F.col(f"key.{first}").isin(firsts))
                .groupBy("key", "sequence")
                .agg(F.min("kafka_timestamp").alias("at"))
                .collect()
            )
            for r in rows:
                key = tuple(r["key"][k] for k in entity.key)
                if (entity.name, key) in probes:
                    at = r["at"].replace(tzinfo=dt.UTC).timestamp()
                    produced[(entity.name, key, tuple(r["sequence"]))] = at
            feed = (
                spark.read.format("delta")
                .option("readChangeFeed", "true")
                .option("startingVersion", 0)
                .load(config.table_path("silver", entity.name))
                .where(F.col("_change_type").isin("insert", "update_postimage"))
                .where(F.col(first).isin(firsts))
                .select(*entity.key, "_cdc_seq", "_commit_version", "_commit_timestamp")
                .collect()
            )
            for r in feed:
                key = tuple(r[k] for k in entity.key)
                seq = tuple(r["_cdc_seq"])
                at = r["_commit_timestamp"].replace(tzinfo=dt.UTC).timestamp()
                mark = (entity.name, key, seq)
                committed[mark] = min(at, committed.get(mark, at))
                commit_seq[(entity.name, key, int(r["_commit_version"]))] = seq
    finally:
        spark.stop()
    return produced, committed, commit_seq


def _cuts(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "max": max(values)}


def _measure(
    config: PipelineConfig,
    result: PipelineResult,
    produced_at: dict[Mark, tuple[float, int]],
    topic: TopicWatcher,
    index: IndexWatcher | None,
    started: float,
) -> None:
    """Delays per step and stage, the growth rule, and the delay series for the plot."""
    probes = {(name, key) for name, key, _ in produced_at}
    kafka_ts, committed, commit_seq = _silver_times(config, probes)
    arrived: dict[str, dict[Mark, float]] = {"silver": committed, "topic": topic.seen}
    if index is not None:
        entities = {e.name: e for e in config.entities}
        in_index: dict[Mark, float] = {}
        for (name, key, version), at in index.seen.items():
            seq = index_sequence(entities[name], key, version, commit_seq)
            if seq is not None:
                in_index[(name, key, seq)] = min(at, in_index.get((name, key, seq), at))
        arrived["index"] = in_index
    missing_ts = sum(1 for m in produced_at if m not in kafka_ts)
    if missing_ts:
        result.notes.append(f"{missing_ts} probe events not found in bronze (producer time used)")
    for number, step in enumerate(result.steps):
        begun, ended = result.step_bounds[number]
        quarter = (ended - begun) / 4
        for stage in result.stages:
            all_, mid, end = [], [], []
            points = []
            for mark, (wrapper_at, at_step) in produced_at.items():
                if at_step != number or mark not in arrived[stage]:
                    continue
                at = kafka_ts.get(mark, wrapper_at)
                delay = arrived[stage][mark] - at
                all_.append(delay * 1000)
                offset = at - started - begun
                if quarter <= offset < 2 * quarter:
                    mid.append(delay)
                elif offset >= 3 * quarter:
                    end.append(delay)
                points.append((at - started, delay))
            step.delays_ms[stage] = _cuts(all_)
            step.samples[stage] = len(all_)
            result.series.setdefault(stage, []).extend(_bins(points, 10.0))
            if mid and end:
                m, e = statistics.median(mid), statistics.median(end)
                step.growth_s[stage] = e - m
                step.allowed_s[stage] = max(2.0, 0.25 * m, 0.05 * step.seconds)
                scale = step.produced / len(points)  # events per sampled event
                step.backlog_events[stage] = (
                    scale * _in_flight(points, (begun + ended) / 2),
                    scale * _in_flight(points, ended),
                )
        step.verdict = _verdict(step, result.stages)


def _in_flight(points: list[tuple[float, float]], t: float) -> int:
    """Sampled events produced by ``t`` that reached the output after ``t``."""
    return sum(1 for at, delay in points if at <= t < at + delay)


def _bins(points: list[tuple[float, float]], width: float) -> list[tuple[float, float, float]]:
    """(bin start, p50, p99) of the delays, by produce time."""
    bins: dict[int, list[float]] = {}
    for at, delay in points:
        bins.setdefault(int(at // width), []).append(delay)
    out = []
    for b, values in sorted(bins.items()):
        values.sort()
        p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
        out.append((b * width, statistics.median(values), p99))
    return out


def _verdict(step: StepResult, stages: list[str]) -> str:
    if step.achieved < 0.95 * step.rate:
        return "producer-bound"
    if not step.drained:
        return "did not drain"
    if any(s not in step.growth_s for s in stages):
        return "too few samples"
    if any(step.delays_ms[s]["p50"] / 1000 > step.seconds / 2 for s in stages):
        return "step too short"  # events wait longer than half the step: no trend to see
    if any(step.growth_s[s] > step.allowed_s[s] for s in stages):
        return "backlog grows"
    return "sustainable"


# --- output ----------------------------------------------------------------------------


def _ms(cuts: dict[str, float]) -> str:
    if not cuts:
        return "n/a"
    return f"{cuts['p50'] / 1000:.1f} / {cuts['p95'] / 1000:.1f} / {cuts['p99'] / 1000:.1f}"


def markdown(results: list[PipelineResult], args: argparse.Namespace) -> str:
    """The figures as Markdown tables."""
    lines = [
        f"# End-to-end benchmark, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"{os.cpu_count()} cores; {args.keys:,} keys per entity; {args.producers} producer "
        f"process(es); {args.seconds_per_rate:.0f} s per rate. Delays in seconds "
        "(p50 / p95 / p99) from the source record's Kafka timestamp.",
        "",
        "| pipeline | offered/s | produced/s | to silver commit | to change topic "
        "| to searchable | samples | backlog before silver, mid -> end "
        "| delay growth s (allowed) | verdict |",
        "|---|---:|---:|---|---|---|---:|---|---|---|",
    ]
    for r in results:
        for s in r.steps:
            growth = ", ".join(
                f"{stage} {s.growth_s[stage]:+.1f} ({s.allowed_s[stage]:.1f})"
                for stage in r.stages
                if stage in s.growth_s
            )
            mid, end = s.backlog_events.get("silver", (math.nan, math.nan))
            backlog = f"{mid:,.0f} -> {end:,.0f}"
            lines.append(
                f"| {r.name} | {s.rate:,.0f} | {s.achieved:,.0f} "
                f"| {_ms(s.delays_ms.get('silver', {}))} | {_ms(s.delays_ms.get('topic', {}))} "
                f"| {_ms(s.delays_ms.get('index', {})) if 'index' in r.stages else '-'} "
                f"| {min(s.samples.values(), default=0):,} | {backlog} | {growth or 'n/a'} "
                f"| {s.verdict} |"
            )
    lines += ["", "| pipeline | highest sustainable load |", "|---|---|"]
    for r in results:
        best = r.highest_sustainable
        lines.append(f"| {r.name} | {'none of the rates' if best is None else f'{best:,.0f}/s'} |")
    lines += [
        "",
        "CPU seconds over each step and its drain (per 1,000 events produced), and peak RSS "
        "per process group:",
        "",
    ]
    for r in results:
        names = sorted({n for s in r.steps for n in s.cpu_s})
        header = " | ".join(f"{s.rate:,.0f}/s" for s in r.steps)
        lines += [
            f"| {r.name} | {header} | peak RSS MiB |",
            "|---|" + "---:|" * (len(r.steps) + 1),
        ]
        for n in names:
            cells = " | ".join(
                f"{s.cpu_s.get(n, 0):,.0f} ({s.cpu_s.get(n, 0) / max(s.produced, 1) * 1000:.2f})"
                for s in r.steps
            )
            lines.append(f"| {n} | {cells} | {r.peak_rss_mib.get(n, 0):,.0f} |")
        own = [n for n in names if n in r.processes]
        cells = " | ".join(
            f"{sum(s.cpu_s.get(n, 0) for n in own) / max(s.produced, 1) * 1000:.2f}"
            for s in r.steps
        )
        rss = sum(r.peak_rss_mib.get(n, 0) for n in own)
        lines.append(f"| **pipeline** ({', '.join(own)}) per 1k | {cells} | {rss:,.0f} (sum) |")
        lines.append("")
    notes = [f"{r.name}: {n}" for r in results for n in r.notes]
    if notes:
        lines += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def svg(results: list[PipelineResult]) -> str:
    """Delay p50/p99 per stage over time, then each service's reported lag, per pipeline."""
    width, height, pad = 760, 230, 50
    panels: list[tuple[str, dict[str, list[tuple[float, float]]], list[tuple[float, float]]]] = []
    for r in results:
        delay: dict[str, list[tuple[float, float]]] = {}
        for stage, bins in r.series.items():
            delay[f"{stage} p50"] = [(t, p50) for t, p50, _ in bins]
            delay[f"{stage} p99"] = [(t, p99) for t, _, p99 in bins]
        panels.append((f"{r.name}: delay from produce (s), by produce time", delay, r.step_bounds))
        panels.append(
            (f"{r.name}: lag per micro-batch (Kafka records; silver versions)", r.lags, [])
        )
    parts = []
    for number, (title, series, bounds) in enumerate(panels):
        top = number * (height + 30)
        points = [p for values in series.values() for p in values]
        max_x = max((x for x, _ in points), default=1.0) or 1.0
        max_y = max((y for _, y in points), default=1.0) or 1.0
        x0 = min((x for x, _ in points), default=0.0)

        def xy(
            x: float,
            y: float,
            x0: float = x0,
            max_x: float = max_x,
            m: float = max_y,
            top: int = top,
        ) -> str:
            px = pad + (x - x0) / max(max_x - x0, 1e-9) * (width - 2 * pad)
            py = top + height - pad - y / m * (height - 2 * pad)
            return f"{px:.1f},{py:.1f}"

        parts.append(
            f'<text x="{pad}" y="{top + 18}" font-size="13" font-weight="bold">{title}</text>'
            f'<line x1="{pad}" y1="{top + height - pad}" x2="{width - pad}" '
            f'y2="{top + height - pad}" stroke="#888"/>'
            f'<line x1="{pad}" y1="{top + pad}" x2="{pad}" y2="{top + height - pad}" '
            'stroke="#888"/>'
            f'<text x="{pad - 4}" y="{top + pad}" font-size="11" text-anchor="end">{max_y:,.0f}'
            f"</text>"
            f'<text x="{width - pad}" y="{top + height - pad + 14}" font-size="11" '
            f'text-anchor="end">{max_x:,.0f} s since start</text>'
        )
        for begun, ended in bounds:
            for at in (begun, ended):
                if x0 <= at <= max_x:
                    a, b = xy(at, 0).split(",")[0], xy(at, max_y).split(",")[1]
                    parts.append(
                        f'<line x1="{a}" y1="{b}" x2="{a}" y2="{top + height - pad}" '
                        'stroke="#ccc" stroke-dasharray="4"/>'
                    )
        for i, (name, values) in enumerate(sorted(series.items())):
            colour = _COLOURS[i % len(_COLOURS)]
            path = " ".join(xy(x, y) for x, y in sorted(values))
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>'
                f'<text x="{width - pad + 4}" y="{top + pad + 12 * i}" font-size="10" '
                f'fill="{colour}">{name}</text>'
            )
    total = len(panels) * (height + 30)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 120}" height="{total}" '
        f'font-family="sans-serif">{"".join(parts)}</svg>\n'
    )


# --- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=[1000.0, 5000.0, 20000.0],
        help="offered loads in events/s, comma-separated (default 1000,5000,20000)",
    )
    parser.add_argument("--seconds-per-rate", type=float, default=180.0)
    parser.add_argument("--keys", type=int, default=100_000, help="key space per entity")
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench-e2e")
    parser.add_argument(
        "--pipelines",
        type=lambda text: [p for p in text.split(",") if p],
        default=list(PIPELINES),
        help="which to run, one after another (default cdc,cdc-app,baseline)",
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-baseline leaves the baseline out of --pipelines",
    )
    parser.add_argument(
        "--producers",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 4),
        help="producer processes (one reaches about 5,000 events/s per core)",
    )
    parser.add_argument("--probe-share", type=float, default=0.02)
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--port-base", type=int, default=49101, help="metrics ports from here")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--down", action="store_true", help="stop the servers at the end")
    parser.add_argument("--run-baseline", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run both pipelines at every rate; write and print the figures."""
    args = parse_args(argv)
    if args.run_baseline:
        run_baseline(args.run_baseline)
        return
    unknown = set(args.pipelines) - set(PIPELINES)
    if unknown:
        raise SystemExit(f"unknown pipelines {sorted(unknown)}; known: {', '.join(PIPELINES)}")
    if not args.baseline:
        args.pipelines = [p for p in args.pipelines if p != "baseline"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    args.workdir.mkdir(parents=True)
    served = infra.up()
    print(f"kafka {served.kafka_bootstrap_servers} · es {served.elasticsearch_url}", flush=True)
    started = time.time()
    results = [run_pipeline(kind, args, served, started) for kind in args.pipelines]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    document = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bench_cpu_s": usage.ru_utime + usage.ru_stime,
        "pipelines": [
            {
                **asdict(r),
                "highest_sustainable": r.highest_sustainable,
                "steps": [{**asdict(s), "achieved": s.achieved} for s in r.steps],
            }
            for r in results
        ],
    }
    (args.workdir / "results.json").write_text(json.dumps(document, indent=1, default=str))
    table = markdown(results, args)
    (args.workdir / "results.md").write_text(table)
    (args.workdir / "plot.svg").write_text(svg(results))
    print("\n" + table)
    print(f"written: {args.workdir}/results.json, results.md, plot.svg", flush=True)
    if args.down:
        infra.down()


if __name__ == "__main__":
    main()
