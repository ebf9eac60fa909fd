"""The kit's subcommands of ``cdc``: demo, chaos, generate, infra up|down|status.

Declared in the entry-point group ``cdc.commands`` (devkit/pyproject.toml), which
``cdc_cli.main`` loads: installed for development, absent from the service images.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import typer
from cdc_shared.avro import ConfluentSchemaRegistry
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.values import ConfigError

from cdc_devkit import infra, secured_kafka
from cdc_devkit.processes import RunMode
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, produce, register_source_schemas

T = TypeVar("T")


class DemoSource(StrEnum):
    """What feeds the demo's pipeline."""

    GENERATED = "generated"  # a Debezium-style load produced straight to Kafka
    POSTGRES = "postgres"  # a SQL workload on PostgreSQL, captured by Debezium


infra_app = typer.Typer(
    help="Local Kafka, Elasticsearch, and on demand a schema registry, an S3 server, "
    "PostgreSQL, Kafka Connect and a Spark standalone cluster, on loopback (no Docker).",
    no_args_is_help=True,
)


@infra_app.command("up")
def infra_up(
    with_registry: bool = typer.Option(
        False,
        "--with-registry",
        help="Also start a schema registry (Apicurio, Confluent-compatible API, in memory).",
    ),
    with_postgres: bool = typer.Option(
        False,
        "--with-postgres",
        help="Also start PostgreSQL (wal_level=logical) and Kafka Connect with Debezium's "
        "PostgreSQL connector (standalone; add connectors over its REST API).",
    ),
    with_s3: bool = typer.Option(
        False,
        "--with-s3",
        help="Also start an S3-compatible server (S3Proxy, in memory) with the bucket "
        f"{infra.S3_BUCKET!r}, for storage_root: s3a://{infra.S3_BUCKET}/<prefix>.",
    ),
    with_spark_cluster: bool = typer.Option(
        False,
        "--with-spark-cluster",
        help="Also start a Spark standalone cluster (a master and CDC_INFRA_SPARK_WORKERS "
        "workers, default 1), for spark.master: spark://127.0.0.1:<port>.",
    ),
    secure: bool = typer.Option(
        False,
        "--secure",
        help="Also start a secured Kafka broker (SASL_SSL, SCRAM-SHA-512, ACLs enforced, "
        "certificates made at its first start) with the topics and ACLs of "
        "deploy/local/pipeline-secured.yaml; print what that file needs.",
    ),
) -> None:
    """Start Kafka (KRaft) and Elasticsearch if they are not running; print their addresses."""
    try:
        settings = infra.InfraSettings()
        served = infra.up(
            settings,
            with_registry=with_registry,
            with_postgres=with_postgres,
            with_s3=with_s3,
            with_spark_cluster=with_spark_cluster,
        )
        secured = secured_kafka.start_local(settings) if secure else None
    except infra.InfraError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"kafka bootstrap servers: {served.kafka_bootstrap_servers}")
    typer.echo(f"elasticsearch url:       {served.elasticsearch_url}")
    if served.registry_url:
        typer.echo(f"schema registry url:     {served.registry_url}")
    if served.postgres:
        typer.echo(
            f"postgres:                {served.postgres} (user {infra.POSTGRES_SUPERUSER}, "
            f"password in {settings.state_dir / 'postgres.password'})"
        )
    if served.connect_url:
        typer.echo(f"kafka connect url:       {served.connect_url}")
    if served.s3_endpoint:
        typer.echo(
            f"s3 endpoint:             {served.s3_endpoint} (bucket {infra.S3_BUCKET}, "
            f"path-style, region {infra.S3_REGION}; fixed local credentials: access key "
            f"{infra.S3_ACCESS_KEY}, secret key {infra.S3_SECRET_KEY})"
        )
    if served.spark_master:
        typer.echo(
            f"spark master:            {served.spark_master} (web UI "
            f"http://127.0.0.1:{settings.spark_master_webui_port}, "
            f"{settings.spark_workers} worker(s))"
        )
    if secured is not None:
        _print_secured(settings, secured)


def _print_secured(settings: infra.InfraSettings, broker: secured_kafka.SecuredBroker) -> None:
    """Print what a pipeline file needs for the secured broker.

    The passwords' files are named; a password itself is never printed.
    """
    user = secured_kafka.APPLICATION
    env = secured_kafka.LOCAL_PASSWORD_ENV
    typer.echo(
        f"secured kafka:           {broker.bootstrap_servers} (SASL_SSL, "
        f"{secured_kafka.MECHANISM}, ACLs enforced, no topic auto-creation)"
    )
    typer.echo(f"  CA certificate (PEM):  {broker.ca_file.resolve()}")
    typer.echo(
        f"  users:                 {user} (cdc run), {secured_kafka.INGESTOR}, "
        f"{secured_kafka.PUBLISHER}, {secured_kafka.OPERATOR} (cdc status, verify), "
        f"{secured_kafka.ADMIN} (super user)"
    )
    passwords = secured_kafka.password_file(settings, user).parent.resolve()
    typer.echo(f"  passwords:             {passwords}/<user> (mode 0600)")
    typer.echo("  a pipeline file's kafka: block (deploy/local/pipeline-secured.yaml has it):")
    typer.echo(f'    bootstrap_servers: "{broker.bootstrap_servers}"')
    typer.echo("    security_protocol: SASL_SSL")
    typer.echo(
        f"    sasl: {{mechanism: {secured_kafka.MECHANISM}, username: {user}, "
        f'password: "${{env:{env}}}"}}'
    )
    typer.echo(f"    tls: {{ca_file: {broker.ca_file.resolve()}}}")
    typer.echo(f'  then: export {env}="$(cat {passwords}/{user})"')


@infra_app.command("down")
def infra_down() -> None:
    """Stop the local servers that `cdc infra up` started."""
    try:
        stopped = infra.down()
    except infra.InfraError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@infra_app.command("status")
def infra_status() -> None:
    """Say which local servers are running."""
    settings = infra.InfraSettings()
    for name, is_running in infra.running(settings).items():
        typer.echo(f"{name}: {'running' if is_running else 'stopped'}")
    state = infra.spark_master_state(settings)
    if state is not None:
        workers = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
        typer.echo(
            f"spark cluster: {infra.spark_master_url(settings)} {state.get('status')}, "
            f"{len(workers)} ALIVE worker(s), {len(state.get('activeapps', []))} active and "
            f"{len(state.get('completedapps', []))} completed application(s)"
        )


def _run_or_exit(run: Callable[[], T]) -> T:
    """``run()``; a server or run failure becomes one red line and exit 1."""
    try:
        return run()
    except (infra.InfraError, RuntimeError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _print_summary(rows: list[tuple[str, str]]) -> None:
    """A run's summary table, one ``label  value`` line per row."""
    typer.echo("")
    for label, value in rows:
        typer.echo(f"  {label:<34} {value}")


def demo(
    source: DemoSource = typer.Option(
        DemoSource.GENERATED,
        "--source",
        help="generated: a Debezium-style load produced straight to Kafka; postgres: a SQL "
        "workload on a real PostgreSQL, captured by Debezium (Avro and JSON connectors).",
    ),
    events: int | None = typer.Option(
        None,
        min=10,
        help="Change events to generate (default 20,000); with --source postgres, SQL "
        "transactions to run (default 300).",
    ),
    rate: float | None = typer.Option(
        None,
        min=0.1,
        help="Messages per second offered to Kafka (default 2,000); with --source postgres, "
        "transactions per second (default 10).",
    ),
    keys: int = typer.Option(2_000, min=10, help="Key space per entity."),
    workdir: Path = typer.Option(Path("data/demo"), help="Tables, logs and report (wiped)."),
    timeout: float = typer.Option(600.0, min=10, help="Seconds to wait for the catch-up."),
    down: bool = typer.Option(
        False, "--down", help="Stop the servers at the end (Kafka, Elasticsearch, ...)."
    ),
    mode: RunMode = typer.Option(
        RunMode.APPLICATION,
        "--mode",
        help="application: the four services in one Spark application (`cdc run`); "
        "services: four processes, as deployed apart.",
    ),
) -> None:
    """Run the four services on a generated load and check every output against the oracle.

    By default the services run as one Spark application (`cdc run`): on a small machine
    it starts sooner and keeps up better; `--mode services` runs them as four processes.
    `--source postgres` feeds them from a real PostgreSQL through Debezium instead, and
    checks every output against the database's tables.

    Exits 0 when silver, the change topics and the indexes all equal the oracle (or the
    database) and every service stopped cleanly on SIGTERM; 1 otherwise.
    """
    # The demo imports PySpark: `cdc` loads this module for every command.
    from cdc_devkit import demo_postgres  # noqa: PLC0415
    from cdc_devkit.demo import DemoOptions, run_demo, summary_rows  # noqa: PLC0415

    postgres = source is DemoSource.POSTGRES
    options = DemoOptions(
        events=events if events is not None else (300 if postgres else 20_000),
        rate=rate if rate is not None else (10.0 if postgres else 2_000.0),
        keys=keys,
        workdir=workdir,
        catch_up_timeout_s=timeout,
        mode=mode,
    )
    if postgres:
        found = _run_or_exit(lambda: demo_postgres.run_postgres_demo(options, typer.echo))
        _print_summary(demo_postgres.summary_rows(found))
        report, agrees = found.report, found.agrees
    else:
        result = _run_or_exit(lambda: run_demo(options, typer.echo))
        _print_summary(summary_rows(result))
        report, agrees = result.report, result.agrees
    typer.echo(f"\nreport: {report}")
    if down:
        infra.down()
    else:
        typer.echo(
            f"servers left running. Look around: `cdc status --config {workdir}/pipeline.yaml`, "
            "then `cdc infra down`"
        )
    if not agrees:
        raise typer.Exit(1)


def chaos(
    events: int = typer.Option(200_000, min=100, help="Change events to generate."),
    rate: float = typer.Option(500.0, min=1, help="Messages per second offered to Kafka."),
    keys: int = typer.Option(5_000, min=10, help="Key space per entity."),
    seed: int = typer.Option(42, help="Same seed, same load, same fault plan."),
    kills: int = typer.Option(50, min=0, help="Service SIGKILLs (each restarted)."),
    broker_restarts: int = typer.Option(3, min=0, help="Kafka broker restarts."),
    es_outages: int = typer.Option(3, min=0, help="Elasticsearch stops (then starts)."),
    es_slowdowns: int = typer.Option(3, min=0, help="Elasticsearch freezes in bursts."),
    registry_outages: int = typer.Option(
        0,
        min=0,
        help="Schema-registry outages: HTTP 503 while a service restarts, then --outage "
        "seconds more. Above 0, the pipeline reads its schemas from the registry `cdc infra "
        "up --with-registry` serves (started if need be), through a loopback proxy.",
    ),
    pause: float = typer.Option(10.0, min=0, help="Mean seconds between two faults."),
    outage: float = typer.Option(
        20.0, min=1, help="Seconds an ES outage or slowdown, or a registry outage, lasts."
    ),
    window_timeout: float = typer.Option(
        60.0,
        min=1,
        help="Seconds an aimed kill waits for its moment (e.g. just after a silver commit) "
        "before it fires anyway.",
    ),
    workdir: Path = typer.Option(Path("data/chaos"), help="Tables and logs (wiped)."),
    timeout: float = typer.Option(1800.0, min=10, help="Seconds to wait for the catch-up."),
    mode: list[RunMode] = typer.Option(
        [RunMode.SERVICES],
        "--mode",
        help="services: four processes, each killed alone; application: one "
        "(`cdc run`), each kill takes every service down. Given more than once (e.g. "
        "services, application, services), the run kills every process at once at equal "
        "shares of the kills and goes on in the next mode.",
    ),
    tables: int | None = typer.Option(
        None,
        min=1,
        help="That many tables, copies of the example's (a whole database); default: "
        "the example's own.",
    ),
) -> None:
    """Run the pipeline under SIGKILLs, broker restarts, Elasticsearch and registry outages.

    Exits 0 when nothing diverged (offsets, silver, change topics, indexes, quarantine,
    logs free of secrets) and every service stopped cleanly at the end; 1 otherwise.
    """
    # The chaos run imports PySpark: `cdc` loads this module for every command.
    from cdc_devkit.chaos import ChaosOptions, run_chaos, summary_rows  # noqa: PLC0415

    options = ChaosOptions(
        events=events,
        rate=rate,
        keys=keys,
        seed=seed,
        kills=kills,
        broker_restarts=broker_restarts,
        es_outages=es_outages,
        es_slowdowns=es_slowdowns,
        registry_outages=registry_outages,
        pause_s=pause,
        outage_s=outage,
        window_timeout_s=window_timeout,
        workdir=workdir,
        catch_up_timeout_s=timeout,
        modes=tuple(mode),
        tables=tables,
    )
    result = _run_or_exit(lambda: run_chaos(options, typer.echo))
    _print_summary(summary_rows(result))
    if not result.passed:
        raise typer.Exit(1)


def generate(
    config: Path = typer.Option(..., "--config", envvar="CDC_CONFIG", help="Pipeline YAML."),
    entity: list[str] = typer.Option(None, "--entity", help="Entity to generate (repeatable)."),
    events: int = typer.Option(10_000, min=0, help="Change events after the snapshots."),
    keys: int = typer.Option(1_000, min=1, help="Key space per entity."),
    rate: float = typer.Option(0.0, min=0, help="Messages per second; 0 = as fast as possible."),
    seed: int = typer.Option(42, help="Same seed, same bytes."),
    poison_share: float = typer.Option(0.001, min=0, max=1, help="Share of poison records."),
    redelivery_share: float = typer.Option(0.02, min=0, max=1, help="Share of re-deliveries."),
    delete_share: float = typer.Option(0.1, min=0, max=1, help="Share of changes that delete."),
    partitions: int = typer.Option(3, min=1, help="Partitions of topics it creates."),
) -> None:
    """Write a realistic, deterministic Debezium-style CDC stream to the source topics."""
    try:
        pipeline = load_pipeline(config)
        entities = pipeline.select_entities(entity)
        registry = make_registry(pipeline)
        if isinstance(registry, ConfluentSchemaRegistry):
            for subject in register_source_schemas(entities, registry, registry.files):
                typer.echo(f"registered {subject} from its schema files")
        generator = WorkloadGenerator(
            entities,
            registry,
            WorkloadSpec(
                events=events,
                keys=keys,
                seed=seed,
                poison_share=poison_share,
                redelivery_share=redelivery_share,
                delete_share=delete_share,
            ),
        )
    except (ConfigError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"generating to {', '.join(e.source_topic for e in entities)} "
        f"at {pipeline.kafka.bootstrap_servers}"
    )
    report = produce(
        pipeline.kafka,
        generator.messages(),
        rate=rate or None,
        partitions=partitions,
        progress=lambda n, r: typer.echo(f"  {n:>10,} messages  {r:>10,.0f}/s", err=True),
    )
    kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(report.by_kind.items()))
    typer.echo(
        f"produced {report.produced:,} messages in {report.seconds:.1f} s "
        f"({report.rate:,.0f}/s): {kinds}"
    )


def register(app: typer.Typer) -> None:
    """Add demo, chaos, generate and the infra group to the ``cdc`` app."""
    app.command("demo")(demo)
    app.command("chaos")(chaos)
    app.command("generate")(generate)
    app.add_typer(infra_app, name="infra")
