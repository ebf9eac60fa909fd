"""``cdc demo --source postgres``: the demo fed by a real PostgreSQL through Debezium.

Brings up Kafka, Elasticsearch, the schema registry, PostgreSQL and Kafka Connect on
loopback; makes a fresh database with the demo's tables and a snapshot's worth of rows;
adds three Debezium connectors on them, one per source format the pipeline reads (Avro
through the registry, JSON without and with schemas); starts the four services on one
pipeline covering the three; then runs the SQL workload at a steady pace, printing each
statement. It waits until silver, the change topics and the indexes of every entity equal
the database's tables, stops the services with SIGTERM and prints a summary whose
verdict compares the outputs with PostgreSQL itself.
"""

from __future__ import annotations

import datetime as dt
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import INGESTOR
from cdc_shared.streaming.tables import has_commits
from pyspark.sql import SparkSession

from cdc_devkit import infra
from cdc_devkit.checks import Difference, bronze_label, bronze_row_count, index_rows
from cdc_devkit.debezium import (
    Capture,
    ConnectClient,
    start_captures,
    stop_captures,
    wait_captured,
    wait_snapshot,
)
from cdc_devkit.demo import (
    DemoOptions,
    catch_up,
    check_session,
    finish_report,
    outcome_agrees,
    stop_services,
)
from cdc_devkit.local_run import Echo, Progress, unwind_on_sigterm, wait_until_healthy
from cdc_devkit.postgres import Database, SqlWorkload, Step, local_server
from cdc_devkit.postgres_pipeline import outputs_against_database, write_postgres_pipeline
from cdc_devkit.processes import ServiceProcess, launch


@dataclass
class PostgresDemoResult:
    """What the demo saw; ``agrees`` is the verdict."""

    database: str
    captures: list[Capture]
    statements: int = 0
    transactions: int = 0
    records: int = 0  # what the connectors wrote to Kafka
    rows: dict[str, int] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    report: Path | None = None

    @property
    def agrees(self) -> bool:
        """Every output equals PostgreSQL's tables and every service stopped cleanly."""
        return outcome_agrees(self)


def demo_captures(run: str) -> list[Capture]:
    """One connector per source format (each with its own decimal handling)."""
    return [
        Capture(f"{run}-avro", f"{run}.avro", "avro", "precise"),
        Capture(f"{run}-json", f"{run}.json", "json", "string"),
        Capture(f"{run}-json-schemas", f"{run}.jsons", "json-schemas", "double"),
    ]


def run_postgres_demo(options: DemoOptions, echo: Echo) -> PostgresDemoResult:
    """Run the whole demo; see the module docstring."""
    started_wall, started = dt.datetime.now(dt.UTC), time.monotonic()
    unwind_on_sigterm()
    settings = infra.InfraSettings()
    served = infra.up(settings, with_registry=True, with_postgres=True)
    assert served.registry_url is not None and served.connect_url is not None
    echo(
        f"kafka {served.kafka_bootstrap_servers} · elasticsearch {served.elasticsearch_url} · "
        f"registry {served.registry_url}\npostgres {served.postgres} · "
        f"kafka connect {served.connect_url}"
    )
    if options.workdir.exists():
        shutil.rmtree(options.workdir)
    options.workdir.mkdir(parents=True)
    run = f"demo{uuid.uuid4().hex[:6]}"
    server = local_server(settings)
    connect = ConnectClient(served.connect_url)
    result = PostgresDemoResult(run, demo_captures(run))
    workload = SqlWorkload(
        seed=options.seed,
        customers=max(10, options.keys // 10),
        orders=max(10, options.keys // 7),
        changes=options.events,
        run=run,
    )
    database = server.create_database(run)
    echo(f"database {run}: the demo's tables and the rows that exist before capture starts")
    services: list[ServiceProcess] = []
    progress: Progress | None = None
    try:
        for step in [*workload.schema(), *workload.snapshot()]:
            _run_step(database.execute, step, echo, result)
        start_captures(connect, database, result.captures, infra.registry_core_url(settings))
        for capture in result.captures:
            echo(
                f"debezium connector {capture.name}: topics {capture.topic_prefix}.public.*, "
                f"{capture.source_format}, decimal.handling.mode={capture.decimal_handling}"
            )
        config_path = write_postgres_pipeline(
            options.workdir, served, served.registry_url, result.captures, run
        )
        config = load_pipeline(config_path)
        wait_snapshot(config.kafka, result.captures)
        services = launch(options.mode, config_path, options.workdir / "logs")
        for service in services:
            service.start()
        echo(f"started {', '.join(s.name for s in services)}; logs in {options.workdir / 'logs'}")
        progress = Progress(services, echo)
        progress.start()
        wait_until_healthy(services, config, options.catch_up_timeout_s)
        echo(f"running {options.events} transactions, {options.rate:g} a second")
        for step in [*workload.changes_steps(), workload.marker()]:
            _run_step(database.execute, step, echo, result)
            time.sleep(1.0 / options.rate)
        result.records = wait_captured(config.kafka, result.captures)
        echo(f"captured: {result.records:,} records; waiting for the pipeline to catch up")
        _catch_up(config, database, services, options, echo, result)
    finally:
        if progress is not None:
            progress.done.set()
        stop_services(services, result)
        # The tables stay to look at; the connectors and their slots go (no WAL kept).
        stop_captures(connect, server, run, result.captures, drop_database=False)
    finish_report(result, summary_rows, services, options.workdir, (started_wall, started))
    return result


def _catch_up(
    config: PipelineConfig,
    database: Database,
    services: list[ServiceProcess],
    options: DemoOptions,
    echo: Echo,
    result: PostgresDemoResult,
) -> None:
    """Compare every output with the database until all agree (or time is up); count."""
    spark = check_session(config)
    try:
        catch_up(
            result,
            lambda: outputs_against_database(spark, config, database),
            services,
            options.catch_up_timeout_s,
            echo,
        )
        _count(spark, config, result)
    finally:
        spark.stop()


def _run_step(
    execute: Callable[[str], None], step: Step, echo: Echo, result: PostgresDemoResult
) -> None:
    """Print a transaction's SQL, then run it."""
    echo(f"-- {step.phase}: {step.what}\n{step.display()}")
    execute(step.sql)
    result.transactions += 1
    result.statements += sum(
        1
        for line in step.sql.splitlines()
        if line.rstrip().endswith(";") and line not in ("BEGIN;", "COMMIT;")
    )


def _count(spark: SparkSession, config: PipelineConfig, result: PostgresDemoResult) -> None:
    for entity in config.entities:
        result.rows[bronze_label(entity)] = bronze_row_count(spark, config, entity)
        silver = config.layout.silver(entity.name)
        if has_commits(spark, silver):
            result.rows[f"silver/{entity.name}"] = spark.read.format("delta").load(silver).count()
        result.documents[entity.es_index_name] = len(index_rows(config, entity))
    quarantine = config.layout.quarantine(INGESTOR)
    result.rows["quarantine/ingestor"] = (
        spark.read.format("delta").load(quarantine).count() if has_commits(spark, quarantine) else 0
    )


def summary_rows(result: PostgresDemoResult) -> list[tuple[str, str]]:
    """The summary as (label, value) rows, for the terminal and the report."""
    return [
        ("database", f"{result.database} (kept; connectors and slots removed)"),
        ("sql run", f"{result.transactions:,} transactions, {result.statements:,} statements"),
        *[
            (f"connector {c.name}", f"{c.source_format}, decimals {c.decimal_handling}")
            for c in result.captures
        ],
        ("records captured", f"{result.records:,}"),
        *[(table, f"{count:,} rows") for table, count in result.rows.items()],
        *[(f"index {index}", f"{n:,} documents") for index, n in result.documents.items()],
        *[(f"peak RSS {name}", f"{rss / 2**20:,.0f} MiB") for name, rss in result.peak_rss.items()],
        *[(f"exit code {name}", str(code)) for name, code in result.exit_codes.items()],
        *[("check", d.describe()) for d in result.differences],
        ("wall time", f"{result.seconds:,.0f} s"),
        (
            "verdict",
            "every output equals the PostgreSQL tables" if result.agrees else "DISAGREEMENT",
        ),
    ]
