"""The ``cdc`` entry point: one command, a subcommand per operator task.

Development commands (``cdc demo``, ``chaos``, ``generate``, ``infra``) come from the
development kit (devkit/, package ``cdc_devkit``) when it is installed: each entry point
of the group ``cdc.commands`` is a ``register(app)`` function. The service images do
not install the kit, so there ``cdc`` has only the operator commands.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import typer
from cdc_shared.streaming.observability import configure_logging

from cdc_cli.commands import register

COMMANDS_GROUP = "cdc.commands"

app = typer.Typer(
    help="Operate the CDC replication pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.command("run")
def run(
    config: Path = typer.Option(None, "--config", envvar="CDC_CONFIG", help="Pipeline YAML."),
    service: list[str] = typer.Option(
        None, "--service", help="Service to run (repeatable; default all four)."
    ),
    entity: list[str] = typer.Option(
        None, "--entity", help="Run these tables as one group of their own (repeatable)."
    ),
    group: list[str] = typer.Option(
        None, "--group", help="Run only this group of tables (repeatable)."
    ),
    once: bool = typer.Option(
        False, "--once", help="Carry what the sources hold through each service, then exit."
    ),
) -> None:
    """Run services as streaming queries of one Spark application (small deployments).

    Each service keeps its own checkpoints, tables and guarantees: any of them can move
    to its own process (`cdc-<service>`) on the same storage, and back. Exit codes: 0
    done or stopped (SIGTERM drains every query), 1 a service failed, 2 bad configuration.
    """
    from cdc_cli.application import run_application  # noqa: PLC0415 (imports every service)

    configure_logging()
    code = run_application(
        str(config) if config else None, service or None, entity or None, once, group or None
    )
    raise typer.Exit(code)


def _register_installed_commands() -> None:
    """Add the commands that installed distributions declare in ``cdc.commands``."""
    for entry in entry_points(group=COMMANDS_GROUP):
        register: Callable[[typer.Typer], None] = entry.load()
        register(app)


def _register_operator_commands() -> None:
    """Add status, quarantine, maintenance and verify (cdc_cli.commands)."""
    register(app)


_register_installed_commands()
_register_operator_commands()
