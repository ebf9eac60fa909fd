"""``cdc demo``: the whole pipeline on this machine, checked against the oracle.

Brings up Kafka and Elasticsearch on loopback, starts the four services (as one Spark
application, ``cdc run``, or as four processes), produces a generated Debezium-style
workload at a steady rate (duplicates, deletes, re-inserts, poison records), waits until
every output agrees with the oracle (or a deadline passes), then stops the services with
SIGTERM and summarises: volumes, delays, memory, agreement. Every run uses fresh topics,
tables and indexes. The outputs checked: silver, the change topics, the indexes and, for
an entity with ``history.enabled`` (the example's customers), its history table.
"""

from __future__ import annotations

import datetime as dt
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import INGESTOR, MERGER, PUBLISHER_ES
from cdc_shared.contracts.silver import END, START
from cdc_shared.jvm.spark import build_spark_session
from cdc_shared.streaming.tables import has_commits
from pyspark.sql import SparkSession

from cdc_devkit import infra
from cdc_devkit.checks import (
    Difference,
    Rows,
    bronze_label,
    bronze_row_count,
    change_topic_state,
    compare,
    index_rows,
)
from cdc_devkit.local_run import (
    ROOT,
    Echo,
    Progress,
    check_outputs,
    health_port,
    oracle_rows,
    produce_delays,
    unwind_on_sigterm,
    wait_until_healthy,
    write_pipeline_config,
)
from cdc_devkit.oracle import (
    EntityOracle,
    SourceEvent,
    history_versions,
    load_fingerprints,
    read_topic,
)
from cdc_devkit.processes import (
    RunMode,
    ServiceProcess,
    batches_by_service,
    launch,
    wait_a_little,
)
from cdc_devkit.report import write_report
from cdc_devkit.workload import (
    ProduceReport,
    WorkloadGenerator,
    WorkloadSpec,
    ensure_topics,
    produce,
)


@dataclass(frozen=True)
class DemoOptions:
    """How big and how fast the demo's load is, and where it keeps its files."""

    events: int = 20_000
    rate: float = 2_000.0  # messages per second offered to Kafka
    keys: int = 2_000
    workdir: Path = Path("data/demo")
    catch_up_timeout_s: float = 600.0
    seed: int = 42
    mode: RunMode = RunMode.APPLICATION


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
        return outcome_agrees(self)


class DemoOutcome(Protocol):
    """What every demo (this one, ``demo_postgres``) records of its outputs and services."""

    differences: list[Difference]
    exit_codes: dict[str, int | None]
    peak_rss: dict[str, int]
    seconds: float
    report: Path | None


Outcome = TypeVar("Outcome", bound=DemoOutcome)


def outcome_agrees(outcome: DemoOutcome) -> bool:
    """Some output was checked, every check agrees and every service exited with 0."""
    return (
        bool(outcome.differences)
        and all(d.agrees for d in outcome.differences)
        and all(code == 0 for code in outcome.exit_codes.values())
    )


def check_session(config: PipelineConfig) -> SparkSession:
    """The quiet Spark session a demo reads the outputs with."""
    spark = build_spark_session(config.spark, "cdc-demo-check")
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def catch_up(
    outcome: DemoOutcome,
    check: Callable[[], list[Difference]],
    services: list[ServiceProcess],
    timeout_s: float,
    echo: Echo,
) -> None:
    """Check the outputs into ``outcome`` until all agree, time is up or a service stops."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcome.differences = check()
        if all(d.agrees for d in outcome.differences) or time.monotonic() > deadline:
            break
        if not all(s.alive for s in services):
            echo("a service stopped early; see its log")
            break
        wait_a_little(services, 10)


def stop_services(services: list[ServiceProcess], outcome: DemoOutcome) -> None:
    """Stop every service (SIGTERM, see ``ServiceProcess.stop``); keep exit code and peak RSS."""
    for service in services:
        outcome.exit_codes[service.name] = service.stop()
        outcome.peak_rss[service.name] = service.peak_rss


def finish_report(
    outcome: Outcome,
    summary: Callable[[Outcome], list[tuple[str, str]]],
    services: list[ServiceProcess],
    workdir: Path,
    started: tuple[dt.datetime, float],
) -> None:
    """Record the run's duration, then write ``workdir/report.html`` with its summary.

    ``started`` is the wall-clock and the monotonic time the run began at.
    """
    started_wall, started_monotonic = started
    outcome.seconds = time.monotonic() - started_monotonic
    outcome.report = write_report(
        workdir / "report.html",
        batches_by_service(services),
        summary(outcome),
        started_wall,
    )


def run_demo(options: DemoOptions, echo: Echo) -> DemoResult:
    """Run the whole demo; see the module docstring."""
    started_wall, started = dt.datetime.now(dt.UTC), time.monotonic()
    unwind_on_sigterm()
    served = infra.up()
    echo(f"kafka {served.kafka_bootstrap_servers} · elasticsearch {served.elasticsearch_url}")
    if options.workdir.exists():
        shutil.rmtree(options.workdir)
    options.workdir.mkdir(parents=True)
    config_path = write_pipeline_config(options.workdir, served)
    config = load_pipeline(config_path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])

    services = launch(options.mode, config_path, options.workdir / "logs")
    for service in services:
        service.start()
    _announce(services, config, options, echo)
    result = DemoResult(produced=ProduceReport())
    progress = Progress(services, echo)
    progress.start()
    spark: SparkSession | None = None
    try:
        wait_until_healthy(services, config, options.catch_up_timeout_s)
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
        expected = oracle_rows(config)
        histories = {e.name: expected_history(config, e) for e in with_history(config)}
        spark = check_session(config)
        catch_up(
            result,
            lambda: [
                *check_outputs(spark, config, expected),
                *[
                    compare(history_label(e), histories[e.name], history_rows(spark, config, e))
                    for e in with_history(config)
                ],
            ],
            services,
            options.catch_up_timeout_s,
            echo,
        )
        result.delays_ms = produce_delays(spark, config)
        _count(spark, config, result)
    finally:
        progress.done.set()
        result.peak_machine_bytes = progress.peak_machine_bytes
        stop_services(services, result)
        if spark is not None:
            spark.stop()
    finish_report(result, summary_rows, services, options.workdir, (started_wall, started))
    return result


def with_history(config: PipelineConfig) -> list[EntityConfig]:
    """The entities whose merger keeps a history table (``history.enabled``)."""
    return [e for e in config.entities if e.history.enabled]


def history_label(entity: EntityConfig) -> str:
    """The history check's name: its table, compared version by version."""
    return f"silver_history/{entity.name} by (key, {START})"


def expected_history(config: PipelineConfig, entity: EntityConfig) -> Rows:
    """The versions ``silver_history/<entity>`` must hold, by (key, ``__start_at``).

    From the oracle's replay of the source topic: the events it applied, each key's in
    sequence order, make the history (``oracle.history_versions``). The demo's load
    writes each key's events in order and re-delivers only copies of earlier records
    (no truncates), so the events applied are every event there is. A version is
    compared on its end and its newest event's values.
    """
    fingerprints = load_fingerprints([ROOT / "schemas"])
    oracle = read_topic(config.kafka, EntityOracle.of(entity, make_registry(config), fingerprints))
    events = [SourceEvent(a.key, a.sequence, a.op, a.row) for a in oracle.applied]
    columns = sorted({c for e in events if e.row is not None for c in e.row})
    untracked = entity.history.untracked_columns(columns, list(entity.key))
    return {
        (v.key, v.start): {END: v.end, **v.row}
        for versions in history_versions(events, untracked).values()
        for v in versions
    }


def history_rows(spark: SparkSession, config: PipelineConfig, entity: EntityConfig) -> Rows:
    """The history table's versions by (key, ``__start_at``): row columns and end."""
    path = config.layout.history(entity.name)
    if not has_commits(spark, path):
        return {}
    history = spark.read.format("delta").load(path)
    columns = [c for c in history.columns if not c.startswith("_")]

    def sequence(value: Any) -> tuple[Any, ...] | None:
        return None if value is None else tuple(value)

    return {
        (tuple(r[k] for k in entity.key), sequence(r[START])): {
            END: sequence(r[END]),
            **{c: r[c] for c in columns},
        }
        for r in history.select(START, END, *columns).collect()
    }


def _announce(
    services: list[ServiceProcess], config: PipelineConfig, options: DemoOptions, echo: Echo
) -> None:
    names = [s.name for s in services]
    ports = ", ".join(f"{name} {health_port(config, name)}" for name in names)
    shape = "one Spark application" if options.mode is RunMode.APPLICATION else "four processes"
    echo(f"started {', '.join(names)} ({shape}); logs in {options.workdir / 'logs'}")
    echo(f"/metrics and /health on 127.0.0.1 ports: {ports}")


def _count(spark: SparkSession, config: PipelineConfig, result: DemoResult) -> None:
    def rows(path: str) -> int:
        try:
            return spark.read.format("delta").load(path).count()
        except Exception:  # not created: nothing landed there
            return 0

    for entity in config.entities:
        result.rows[bronze_label(entity)] = bronze_row_count(spark, config, entity)
        result.rows[f"silver/{entity.name}"] = rows(config.layout.silver(entity.name))
        if entity.history.enabled:
            result.rows[f"silver_history/{entity.name}"] = rows(config.layout.history(entity.name))
        result.change_events[entity.change_topic_name] = change_topic_state(config, entity).events
        result.documents[entity.es_index_name] = len(index_rows(config, entity))
    for service in (INGESTOR, MERGER, PUBLISHER_ES):
        result.rows[f"quarantine/{service}"] = rows(config.layout.quarantine(service))


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
