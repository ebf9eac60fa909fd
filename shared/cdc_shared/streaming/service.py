"""The command line every streaming service shares: --config, --entity, --group, --once."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.layout import command_name
from cdc_shared.streaming.failures import NO_SPACE, StreamFailedError, no_space_message
from cdc_shared.streaming.observability import configure_logging
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.writer_lease import WriterRunningError

#: A service's start: (config, --entity names, --once, a session to share, --group names).
StartStreams = Callable[..., StreamRunner]


def service_main(
    service: str, description: str, start: StartStreams, argv: list[str] | None = None
) -> int:
    """Parse the arguments, start the service's streams, run them until done or SIGTERM.

    Exit codes: 0 done or stopped, 1 a stream failed, 2 bad configuration or schemas.
    """
    parser = argparse.ArgumentParser(prog=command_name(service), description=description)
    parser.add_argument("--config", help="pipeline YAML (default: $CDC_CONFIG)")
    parser.add_argument(
        "--entity",
        action="append",
        help="run these tables as one group of their own (repeatable; default: every group)",
    )
    parser.add_argument(
        "--group", action="append", help="run only this group of tables (repeatable)"
    )
    parser.add_argument("--once", action="store_true", help="process what is available, then exit")
    args = parser.parse_args(argv)
    configure_logging()

    def run(config: PipelineConfig) -> None:
        runner = start(config, args.entity, args.once, group_names=args.group)
        runner.install_signal_handlers()
        runner.run()

    return run_to_exit_code(service, args.config, run)


def run_to_exit_code(
    service: str, config_path: str | None, run: Callable[[PipelineConfig], None]
) -> int:
    """Load the configuration, ``run`` with it, and turn how it ended into an exit code.

    0 done or stopped, 1 a stream failed (or the disk under the storage root is full: one
    line instead of the JVM's trace; or another instance holds a writer lease), 2 bad
    configuration or schemas. Shared by each service's command and ``cdc run``.
    """
    log = logging.getLogger(f"cdc_{service}")
    config: PipelineConfig | None = None
    try:
        config = load_pipeline(config_path)
        run(config)
    except (ConfigError, ValueError) as exc:  # includes the typed Avro schema errors
        log.error("cannot start: %s", exc, extra={"service": service})
        return 2
    except StreamFailedError as exc:
        log.error("%s", exc, extra={"service": service})
        return 1
    except WriterRunningError as exc:  # another instance writes the same tables
        log.error("%s", exc, extra={"service": service})
        return 1
    except Exception as exc:  # e.g. creating a table at start on a full disk
        if config is None or not NO_SPACE.search(str(exc)):
            raise
        log.error(
            "cannot start: %s",
            no_space_message(config.storage_root, str(exc)),
            extra={"service": service},
        )
        return 1
    return 0
