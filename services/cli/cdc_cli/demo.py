"""``cdc demo``: the whole pipeline on this machine, checked against the oracle.

Brings up Kafka and Elasticsearch on loopback, starts the four services as separate
processes, produces a generated Debezium-style workload at a steady rate (duplicates,
deletes, re-inserts, poison records), waits until every output agrees with the oracle
(or a deadline passes), then stops the services with SIGTERM and summarises: volumes,
delays, memory, agreement. Every run uses fresh topics, tables and indexes.
"""

from __future__ import annotations

import datetime as dt
import shutil
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cdc_shared.config import PipelineConfig, load_config
from cdc_shared.schemas import make_registry
from cdc_shared.spark import build_spark_session
from cdc_shared.tables import has_commits
from pyspark.sql import SparkSession

from cdc_cli import infra
from cdc_cli.checks import (
    Difference,
    Key,
    change_topic_state,
    compare,
    index_rows,
    silver_rows,
)
from cdc_cli.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_cli.processes import SERVICES, ServiceProcess, wait_a_little
from cdc_cli.report import write_report
from cdc_cli.workload import ProduceReport, WorkloadGenerator, WorkloadSpec, ensure_topics, produce

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE_CONFIG = ROOT / "deploy" / "local" / "pipeline.yaml"
Echo = Callable[[str], None]


@dataclass(frozen=True)
class DemoOptions:
    """How big and how fast the demo's load is, and where it keeps its files."""

    events: int = 20_000
    rate: float = 2_000.0  # messages per second offered to Kafka
    keys: int = 2_000
    workdir: Path = Path("data/demo")
    catch_up_timeout_s: float = 600.0
    seed: int = 42


@dataclass
class DemoResult:
    """What the demo saw; ``agrees`` is the verdict."""

    produced: ProduceReport
    rows: dict[str, int] = field(default_factory=dict)
    change_events: dict[str, dict[str, int]] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)
    delays_ms: dict[str, list[float]] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    peak_machine_bytes: int = 0
    seconds: float = 0.0
    report: Path | None = None

    @property
    def agrees(self) -> bool:
        """Every output equals the oracle and every service stopped cleanly."""
        return (
            bool(self.differences)
            and all(d.agrees for d in self.differences)
            and all(code == 0 for code in self.exit_codes.values())
        )


def write_demo_config(options: DemoOptions, served: infra.Endpoints) -> Path:
    """The example pipeline on fresh topics, tables and indexes under ``workdir``."""
    run = uuid.uuid4().hex[:6]
    document: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    document["storage_root"] = str(options.workdir / "store")
    document["kafka"]["bootstrap_servers"] = served.kafka_bootstrap_servers
    document["elasticsearch"]["hosts"] = [served.elasticsearch_url]
    document["schema_registry"]["dirs"] = [str(ROOT / "schemas")]
    document["spark"]["conf"] = {
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "1g",
    }
    for entity in document["entities"]:
        source = entity["source_topic"]
        # Pinned schemas: topics named per run still find their schemas.
        entity["key_schema"] = str(ROOT / "schemas" / f"{source}-key.avsc")
        entity["value_schema"] = str(ROOT / "schemas" / f"{source}-value.avsc")
        entity["source_topic"] = f"demo{run}.{source}"
        entity["change_topic"] = f"demo{run}.{entity['change_topic']}"
        entity["es_index"] = f"demo{run}-{entity['es_index']}"
    for section in ("ingestor", "merger", "publisher_kafka", "publisher_es"):
        document[section] = {"trigger_interval": "1 second"}
    document["ingestor"]["max_offsets_per_trigger"] = 20_000
    path = options.workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _machine_used_bytes() -> int:
    info = dict(
        (line.split(":")[0], int(line.split()[1]) * 1024)
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.split()[1:2] and line.split()[1].isdigit()
    )
    return info.get("MemTotal", 0) - info.get("MemAvailable", 0)


class _Progress(threading.Thread):
    """Prints one line per service every few seconds while the demo runs."""

    def __init__(self, services: list[ServiceProcess], echo: Echo, result: DemoResult) -> None:
        super().__init__(daemon=True)
        self.services, self.echo, self.result = services, echo, result
        self.done = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.done.wait(5.0):
            for service in self.services:
                service.poll()
            self.result.peak_machine_bytes = max(
                self.result.peak_machine_bytes, _machine_used_bytes()
            )
            lines = " | ".join(s.summary_line() for s in self.services)
            self.echo(f"[{time.monotonic() - started:5.0f} s] {lines}")


def _wait_until_healthy(
    services: list[ServiceProcess], config: PipelineConfig, timeout_s: float
) -> None:
    """Wait until every service serves /health 200.

    The load starts after that, so the delays measure the pipeline, not four JVM starts.
    """
    ports = {
        "ingestor": config.ingestor.metrics_port,
        "merger": config.merger.metrics_port,
        "publisher-kafka": config.publisher_kafka.metrics_port,
        "publisher-es": config.publisher_es.metrics_port,
    }
    deadline = time.monotonic() + timeout_s
    waiting = list(services)
    while waiting:
        dead = [s.name for s in waiting if not s.alive]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} stopped during start-up; see its log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(s.name for s in waiting)} not healthy in time")
        waiting = [s for s in waiting if not s.healthy(ports[s.name])]
        wait_a_little(services, 2)


def _oracle_rows(config: PipelineConfig) -> dict[str, dict[Key, dict[str, Any]]]:
    fingerprints = load_fingerprints([ROOT / "schemas"])
    return {
        e.name: read_topic(config.kafka, EntityOracle(e, list(e.key), fingerprints)).rows
        for e in config.entities
    }


def _check(
    spark: SparkSession, config: PipelineConfig, expected: dict[str, dict[Key, dict[str, Any]]]
) -> list[Difference]:
    differences = []
    for entity in config.entities:
        want = expected[entity.name]
        differences.append(
            compare(f"silver/{entity.name}", want, silver_rows(spark, config, entity))
        )
        topic = change_topic_state(config, entity)
        differences.append(compare(f"topic {entity.change_topic_name}", want, topic.rows))
        differences.append(
            compare(f"index {entity.es_index_name}", want, index_rows(config, entity))
        )
    return differences


def _delays(spark: SparkSession, config: PipelineConfig) -> dict[str, list[float]]:
    """Produce -> silver commit, and produce -> change event published, per key's last change.

    The start is the source record's Kafka timestamp (producer time), found in bronze by
    key and sequence.
    """
    to_silver: list[float] = []
    to_topic: list[float] = []
    for entity in config.entities:
        if not has_commits(spark, config.table_path("silver", entity.name)):
            continue
        bronze = spark.read.format("delta").load(config.table_path("bronze", entity.name))
        produced: dict[tuple[Key, tuple[int, ...]], float] = {}
        for r in bronze.select("key", "sequence", "kafka_timestamp").collect():
            mark = (tuple(r["key"][k] for k in entity.key), tuple(r["sequence"]))
            at = r["kafka_timestamp"].replace(tzinfo=dt.UTC).timestamp()
            produced[mark] = min(at, produced.get(mark, at))
        silver = spark.read.format("delta").load(config.table_path("silver", entity.name))
        for r in silver.select(*entity.key, "_cdc_seq", "_cdc_commit_ts").collect():
            mark = (tuple(r[k] for k in entity.key), tuple(r["_cdc_seq"]))
            if mark in produced:
                committed = r["_cdc_commit_ts"].replace(tzinfo=dt.UTC).timestamp()
                to_silver.append((committed - produced[mark]) * 1000)
        for mark, published in change_topic_state(config, entity).publish_times.items():
            if mark in produced:
                to_topic.append((published - produced[mark]) * 1000)
    return {"silver commit": to_silver, "change topic": to_topic}


def run_demo(options: DemoOptions, echo: Echo) -> DemoResult:
    """Run the whole demo; see the module docstring."""
    started_wall, started = dt.datetime.now(dt.UTC), time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so the services are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    served = infra.up()
    echo(f"kafka {served.kafka_bootstrap_servers} · elasticsearch {served.elasticsearch_url}")
    if options.workdir.exists():
        shutil.rmtree(options.workdir)
    options.workdir.mkdir(parents=True)
    config_path = write_demo_config(options, served)
    config = load_config(config_path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])

    services = [
        ServiceProcess(name, config_path, options.workdir / "logs" / f"{name}.log")
        for name in SERVICES
    ]
    for service in services:
        service.start()
    echo(f"started {', '.join(SERVICES)}; logs in {options.workdir / 'logs'}")
    result = DemoResult(produced=ProduceReport())
    progress = _Progress(services, echo, result)
    progress.start()
    spark: SparkSession | None = None
    try:
        _wait_until_healthy(services, config, options.catch_up_timeout_s)
        generator = WorkloadGenerator(
            config.entities,
            make_registry(config),
            WorkloadSpec(
                events=options.events, keys=options.keys, seed=options.seed, poison_share=0.002
            ),
        )
        echo(f"producing {options.events:,} change events at {options.rate:,.0f} msgs/s")
        result.produced = produce(config.kafka, generator.messages(), rate=options.rate)
        echo(
            f"produced {result.produced.produced:,} messages in {result.produced.seconds:.0f} s; "
            "waiting for the pipeline to catch up"
        )
        expected = _oracle_rows(config)
        spark = build_spark_session(config.spark, "cdc-demo-check")
        spark.sparkContext.setLogLevel("ERROR")
        deadline = time.monotonic() + options.catch_up_timeout_s
        while True:
            result.differences = _check(spark, config, expected)
            if all(d.agrees for d in result.differences) or time.monotonic() > deadline:
                break
            if not all(s.alive for s in services):
                echo("a service stopped early; see its log")
                break
            wait_a_little(services, 10)
        result.delays_ms = _delays(spark, config)
        _count(spark, config, result)
    finally:
        progress.done.set()
        for service in services:
            result.exit_codes[service.name] = service.stop()
            result.peak_rss[service.name] = service.peak_rss
        if spark is not None:
            spark.stop()
    result.seconds = time.monotonic() - started
    result.report = write_report(
        options.workdir / "report.html",
        {s.name: s.batches for s in services},
        summary_rows(result),
        started_wall,
    )
    return result


def _count(spark: SparkSession, config: PipelineConfig, result: DemoResult) -> None:
    def rows(path: str) -> int:
        try:
            return spark.read.format("delta").load(path).count()
        except Exception:  # not created: nothing landed there
            return 0

    for entity in config.entities:
        result.rows[f"bronze/{entity.name}"] = rows(config.table_path("bronze", entity.name))
        result.rows[f"silver/{entity.name}"] = rows(config.table_path("silver", entity.name))
        result.change_events[entity.change_topic_name] = change_topic_state(config, entity).events
        result.documents[entity.es_index_name] = len(index_rows(config, entity))
    for service in ("ingestor", "merger", "publisher_es"):
        result.rows[f"quarantine/{service}"] = rows(config.table_path("quarantine", service))


def _percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {cuts[49]:,.0f} ms · p95 {cuts[94]:,.0f} ms · p99 {cuts[98]:,.0f} ms"


def summary_rows(result: DemoResult) -> list[tuple[str, str]]:
    """The summary as (label, value) rows, for the terminal and the report."""
    poison = sum(1 for _ in result.produced.poison)
    rows = [
        ("events produced", f"{result.produced.produced:,} ({poison} poison records)"),
        *[(table, f"{count:,} rows") for table, count in result.rows.items()],
        *[
            (f"topic {topic}", ", ".join(f"{op}={n:,}" for op, n in events.items()))
            for topic, events in result.change_events.items()
        ],
        *[(f"index {index}", f"{n:,} documents") for index, n in result.documents.items()],
        *[
            (f"delay produce -> {stage}", _percentiles(values))
            for stage, values in result.delays_ms.items()
        ],
        *[(f"peak RSS {name}", f"{rss / 2**20:,.0f} MiB") for name, rss in result.peak_rss.items()],
        ("peak memory in use (machine)", f"{result.peak_machine_bytes / 2**30:,.1f} GiB"),
        *[(f"exit code {name}", str(code)) for name, code in result.exit_codes.items()],
        *[("check", d.describe()) for d in result.differences],
        ("wall time", f"{result.seconds:,.0f} s"),
        ("verdict", "everything agrees with the oracle" if result.agrees else "DISAGREEMENT"),
    ]
    return rows
