"""The ``cdc`` entry point: one command, a subcommand per operator task."""

from __future__ import annotations

from pathlib import Path

import typer
from cdc_shared.config import ConfigError, ElasticsearchConfig, KafkaConfig, load_config

from cdc_cli import infra

app = typer.Typer(
    help="Operate the CDC replication pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
infra_app = typer.Typer(
    help="Local Kafka and Elasticsearch on loopback (no Docker).", no_args_is_help=True
)
app.add_typer(infra_app, name="infra")


@infra_app.command("up")
def infra_up() -> None:
    """Start Kafka (KRaft) and Elasticsearch if they are not running; print their addresses."""
    try:
        served = infra.up()
    except infra.InfraError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"kafka bootstrap servers: {served.kafka_bootstrap_servers}")
    typer.echo(f"elasticsearch url:       {served.elasticsearch_url}")


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
    for name, is_running in infra.running().items():
        typer.echo(f"{name}: {'running' if is_running else 'stopped'}")


@app.command("demo")
def demo(
    events: int = typer.Option(2000, help="Events to push through the smoke pipeline."),
    storage_root: Path = typer.Option(Path("data"), help="Where the demo's tables go."),
    down: bool = typer.Option(False, "--down", help="Stop the local servers afterwards."),
) -> None:
    """Bring up the local servers and push events Kafka -> Delta -> Elasticsearch.

    Until the four services exist this runs the smoke pipeline (cdc_cli.smoke).
    """
    from cdc_cli.smoke import run_smoke

    try:
        served = infra.up()
    except infra.InfraError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"kafka {served.kafka_bootstrap_servers}, elasticsearch {served.elasticsearch_url}")
    result = run_smoke(
        KafkaConfig(bootstrap_servers=served.kafka_bootstrap_servers),
        ElasticsearchConfig(hosts=[served.elasticsearch_url]),
        storage_root,
        events,
    )
    typer.echo(f"events produced      {result.produced}")
    typer.echo(f"bronze rows          {result.bronze_rows}")
    typer.echo(
        f"silver rows          {result.silver_rows} (expected {result.expected_silver_rows})"
    )
    typer.echo(f"change feed rows     {result.change_feed_rows}")
    typer.echo(f"indexed documents    {result.indexed_documents}")
    typer.echo(f"wall time            {result.seconds:.1f} s")
    typer.echo("all stages agree" if result.ok else "MISMATCH between stages")
    if down:
        infra.down()
    else:
        typer.echo("servers left running; stop them with `cdc infra down`")
    if not result.ok:
        raise typer.Exit(1)


@app.command("generate")
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
    from cdc_shared.schemas import make_registry

    from cdc_cli.workload import WorkloadGenerator, WorkloadSpec, produce

    try:
        pipeline = load_config(config)
        entities = pipeline.select_entities(entity)
        generator = WorkloadGenerator(
            entities,
            make_registry(pipeline),
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


def _register_operator_commands() -> None:
    """Add status, quarantine, maintenance and verify (cdc_cli.commands)."""
    from cdc_cli.commands import register

    register(app)


_register_operator_commands()
