"""The ``cdc`` entry point: one command, a subcommand per operator task."""

from __future__ import annotations

from pathlib import Path

import typer
from cdc_shared.config import ElasticsearchConfig, KafkaConfig

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
