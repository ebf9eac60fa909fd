"""Operator sub-commands of ``cdc``: status, quarantine, maintenance, verify.

Each command loads the pipeline configuration, calls one function of its module (which
returns a typed result) and prints it as text, or as JSON with ``--json``. Exit codes:
0 fine, 1 a problem was found or an operation was refused, 2 bad usage or configuration.
"""

from __future__ import annotations

import datetime as dt
import inspect
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import typer
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.layout import INGESTOR, MERGER

from cdc_cli import maintenance, status
from cdc_cli.retention import RetentionTooShortError
from cdc_cli.stream_needs import SILVER_READERS
from cdc_cli.table_state import ENGINES
from cdc_cli.watch import watch as watch_status

ConfigPath = typer.Option(
    ..., "--config", envvar="CDC_CONFIG", help="Pipeline YAML (or set $CDC_CONFIG)."
)
AsJson = typer.Option(False, "--json", help="Print machine-readable JSON instead of text.")
Entities = typer.Option(
    None, "--entity", "-e", help="Entity to include (repeatable; default: all).", show_default=False
)

quarantine_app = typer.Typer(
    help="List, show and replay what the services quarantined.", no_args_is_help=True
)


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _config(path: Path) -> PipelineConfig:
    try:
        return load_pipeline(path)
    except ConfigError as exc:
        _fail(str(exc), 2)


@contextmanager
def _problems(*expected: type[Exception]) -> Iterator[None]:
    """Configuration errors exit 2; the ``expected`` operational errors exit 1."""
    try:
        yield
    except ConfigError as exc:
        _fail(str(exc), 2)
    except expected as exc:
        _fail(str(exc), 1)


def _emit(as_json: bool, data: Callable[[], dict[str, Any]], text: Callable[[], str]) -> None:
    typer.echo(json.dumps(data(), indent=2, default=str) if as_json else text())


def status_command(
    config: Path = ConfigPath,
    entity: list[str] = Entities,
    as_json: bool = AsJson,
    engine: str = typer.Option(
        "delta-rs",
        "--engine",
        hidden=True,
        help="How to read tables and checkpoints: delta-rs (no JVM) or spark.",
    ),
    watch: bool = typer.Option(
        False,
        "--watch",
        "-w",
        help="Refresh in place until Ctrl-C, with each running service's pace from /metrics.",
    ),
    interval: float = typer.Option(
        5.0, "--interval", min=0.5, help="Seconds between refreshes (with --watch)."
    ),
) -> None:
    """Per entity: its group, table versions, each service's lag, and quarantine counts.

    Lag is read from what the services persist (each table's progress in bronze's and
    silver's logs, the publishers' progress, the group checkpoints), so it is right
    whether the services run or not: ingestor in Kafka records, merger in bronze versions
    holding the table's rows, publishers in silver versions with changes. "not started"
    means the table or progress does not exist yet. With --watch, the report is drawn again every
    --interval seconds, under each service's batches per minute, rows per second and mean
    batch time since the last refresh ("not reachable" when its /metrics does not answer).
    Exit 0 unless the configuration is bad.
    """
    if engine not in ENGINES:
        _fail(f"unknown --engine {engine!r}; use one of {', '.join(ENGINES)}", 2)
    if watch and as_json:
        _fail("--watch draws text; use --json without it", 2)
    pipeline = _config(config)
    if watch:

        def report() -> str:
            with _problems():
                return status.render(status.collect_status(pipeline, entity or None, engine=engine))

        watch_status(pipeline, report, interval)
        return
    with _problems():
        report_now = status.collect_status(pipeline, entity or None, engine=engine)
    _emit(as_json, report_now.to_dict, lambda: status.render(report_now))


def quarantine_list(
    config: Path = ConfigPath,
    service: str | None = typer.Option(
        None, help="ingestor, merger or publisher_es (default: all)."
    ),
    entity: str | None = typer.Option(None, help="Only this entity."),
    as_json: bool = AsJson,
) -> None:
    """Quarantined rows counted by service, entity and error kind (and how many replayed)."""
    from cdc_cli import quarantine  # noqa: PLC0415 (imports PySpark)

    pipeline = _config(config)
    with _problems():
        groups = quarantine.list_groups(pipeline, service, entity)

    def text() -> str:
        if not groups:
            return "quarantine is empty"
        lines = [f"{'SERVICE':<14} {'ENTITY':<20} {'ERROR KIND':<22} {'ROWS':>8} {'REPLAYED':>9}"]
        lines.extend(
            f"{g.service:<14} {g.entity:<20} {g.error_kind:<22} {g.rows:>8,} {g.replayed:>9,}"
            for g in groups
        )
        return "\n".join(lines)

    _emit(as_json, lambda: {"groups": [asdict(g) for g in groups]}, text)


def quarantine_show(
    config: Path = ConfigPath,
    service: str = typer.Option(..., help="ingestor, merger or publisher_es."),
    entity: str | None = typer.Option(None, help="Only this entity."),
    limit: int = typer.Option(20, min=1, help="Rows to show, newest first."),
    where: str | None = typer.Option(
        None, help="Spark SQL filter over the quarantine columns, e.g. \"error_kind = 'corrupt'\"."
    ),
    as_json: bool = AsJson,
) -> None:
    """Quarantined rows: where they came from, the error, and a preview of the raw bytes."""
    from cdc_cli import quarantine  # noqa: PLC0415 (imports PySpark)

    pipeline = _config(config)
    with _problems():
        records = quarantine.show_records(pipeline, service, entity, limit, where)

    def text() -> str:
        if not records:
            return "no quarantined rows match"
        lines = []
        for r in records:
            replayed = "  [replayed]" if r.replayed else ""
            lines.append(f"{r.quarantined_at}  {r.entity}  {r.coordinates}{replayed}")
            lines.append(f"  {r.error_kind}: {r.error_message}")
            lines.append(f"  key   {quarantine.preview(r.raw_key)}")
            lines.append(f"  value {quarantine.preview(r.raw_value)}")
        return "\n".join(lines)

    _emit(as_json, lambda: {"records": [r.to_dict() for r in records]}, text)


def quarantine_replay(
    config: Path = ConfigPath,
    service: str = typer.Option(INGESTOR, help="Only the ingestor's quarantine replays."),
    entity: str = typer.Option(..., help="The entity whose records to replay."),
    where: str | None = typer.Option(
        None,
        help="Spark SQL filter over the quarantine columns, e.g. "
        "\"error_kind = 'unknown_schema' AND quarantined_at > '2026-01-31'\".",
    ),
    recover: bool = typer.Option(
        False,
        "--recover",
        help="Take over a replay that is still pending although younger than 10 minutes "
        "(only when you know that run crashed).",
    ),
    as_json: bool = AsJson,
) -> None:
    """Produce quarantined source records again, unchanged, so the ingestor re-reads them.

    Fix the cause first (e.g. deploy the missing writer schema). Each quarantined record
    is re-injected exactly once, however often replay runs: what was replayed is recorded
    in the Delta table quarantine/_replayed, keyed by the record's original
    topic/partition/offset, and never selected again. A run records its selection as
    pending before producing and marks it done after; a run that finds pending rows of a
    crashed run looks for them in the topic (by their header cdc.replay.of) and produces
    only what is not there. Records go back to the partition they came from, with the
    header naming where their change was first read: the ingestor orders them there, so a
    replayed old change never overwrites a newer one. A record that fails again is
    quarantined anew under its new offset.
    """
    from cdc_cli import quarantine  # noqa: PLC0415 (imports PySpark)

    pipeline = _config(config)
    with _problems(quarantine.QuarantineError):
        result = quarantine.replay(pipeline, entity, where, service=service, recover=recover)

    def text() -> str:
        return (
            f"{result.entity}: {result.selected:,} quarantined records match, "
            f"{result.already_replayed:,} already replayed, "
            f"{result.recovered:,} recovered from an interrupted run, "
            f"{result.produced:,} produced to {result.topic}"
        )

    _emit(as_json, lambda: asdict(result), text)


def maintenance_command(
    config: Path = ConfigPath,
    entity: list[str] = Entities,
    optimize: bool = typer.Option(True, "--optimize/--no-optimize", help="OPTIMIZE (compact)."),
    vacuum_hours: float = typer.Option(
        168.0,
        min=0,
        help="VACUUM retention in hours; refused below a table's "
        "delta.deletedFileRetentionDuration (default 168) and below what a stream still needs.",
    ),
    no_vacuum: bool = typer.Option(False, "--no-vacuum", help="Skip VACUUM."),
    force_short_retention: bool = typer.Option(
        False,
        "--force-short-retention",
        help="Allow --vacuum-hours below Delta's minimum: only accepted when no service "
        "shows signs of running (see --quiet-minutes).",
    ),
    quiet_minutes: float = typer.Option(
        10.0,
        min=0,
        help="With --force-short-retention: how long bronze and silver must have had no "
        "data commit and no service's group checkpoint any progress.",
    ),
    tombstone_retention_hours: float | None = typer.Option(
        None,
        min=0,
        help="Expire tombstones after this many hours of bronze ingest time; default, and "
        "minimum, merger.tombstone_retention_hours (null: tombstones are kept).",
        show_default=False,
    ),
    no_tombstones: bool = typer.Option(False, "--no-tombstone-expiry", help="Keep tombstones."),
    ignore_service: list[str] = typer.Option(
        None,
        "--ignore-service",
        help="A service that is not deployed (publisher_es, publisher_kafka, merger): its "
        "progress, or its absence, does not hold VACUUM back. Repeatable.",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check as a run would, then say what it would do (files VACUUM would delete, "
        "tombstones that would expire, files OPTIMIZE would bin-pack); change nothing. "
        "Reads without a JVM.",
    ),
    engine: str = typer.Option(
        "delta-rs",
        "--engine",
        hidden=True,
        help="How --dry-run reads tables and checkpoints: delta-rs (no JVM) or spark.",
    ),
    writers_stopped: bool = typer.Option(
        False,
        "--writers-stopped",
        help="The ingestor and merger are stopped: needed on object storage (s3a://), "
        "where maintenance's commits must not race theirs.",
    ),
    as_json: bool = AsJson,
) -> None:
    """OPTIMIZE bronze and silver, VACUUM them safely, expire tombstones as the merger does.

    Bronze, one table for every entity, is maintained with any --entity selection. The
    VACUUM retention is checked first, with exit 1 before anything runs. It may not be
    below a table's delta.deletedFileRetentionDuration (Delta's minimum, 7 days unless
    set): younger files may belong to a running writer's unfinished commit or a version a
    service is reading. --force-short-retention lifts that only when no service answers
    on its configured /health port, holds a writer lease, and no data commit on bronze or
    silver and no group checkpoint progress happened within --quiet-minutes. Nor may the
    retention delete files a service has not read: the merger reads bronze from each
    table's progress (in silver's log), both publishers read silver from theirs (the
    change topic's progress group, the progress document). A publisher that has not
    started will read silver from its starting version (default 0) and so holds VACUUM
    back, unless named with --ignore-service. Tables and checkpoints of releases before
    one bronze are left alone: the report says which exist and which can be deleted.

    Tombstones expire once the merger has merged events ingested
    merger.tombstone_retention_hours after them (bronze's ingest time, not the wall clock;
    null keeps them). --tombstone-retention-hours may only lengthen that.

    With a retention set (retention.bronze_hours, an entity's bronze_retention_hours,
    retention.quarantine_hours), bronze rows and quarantined records past it are deleted
    first: never a bronze row the merger has not merged (docs/operations.md, Retention).

    --dry-run makes the same checks (and refuses what a run would), then reports what a
    run would do, changing nothing. It starts no Spark session: it reads the tables' logs
    (delta-rs), the checkpoint files and the writer leases directly.
    """
    if engine not in ENGINES:
        _fail(f"unknown --engine {engine!r}; use one of {', '.join(ENGINES)}", 2)

    pipeline = _config(config)
    ignored = tuple(ignore_service or ())
    unknown = [s for s in ignored if s not in (MERGER, *SILVER_READERS)]
    if unknown:
        _fail(f"--ignore-service: unknown services {unknown}", 2)
    refusals = (
        RetentionTooShortError,
        maintenance.WritersMayRunError,
        maintenance.ServicesMayRunError,
    )
    with _problems(*refusals):
        report = maintenance.run_maintenance(
            pipeline,
            entity or None,
            optimize=optimize,
            vacuum_hours=None if no_vacuum else vacuum_hours,
            tombstones=not no_tombstones,
            tombstone_retention_hours=tombstone_retention_hours,
            ignore_services=ignored,
            writers_stopped=writers_stopped,
            force_short_retention=force_short_retention,
            quiet=dt.timedelta(minutes=quiet_minutes),
            dry_run=dry_run,
            engine=engine,
        )
    _emit(as_json, report.to_dict, lambda: maintenance.render(report))


def verify_command(
    config: Path = ConfigPath,
    entity: list[str] = Entities,
    target: list[str] = typer.Option(
        None,
        "--target",
        help="elasticsearch, change_topic or history (repeatable; default: every target "
        "each entity has). history named for an entity without history: skipped.",
    ),
    examples: int = typer.Option(5, min=0, help="Example keys to print per difference."),
    buckets: int | None = typer.Option(
        None,
        min=1,
        help="Key buckets per entity (default: one per 20,000 silver rows).",
    ),
    as_json: bool = AsJson,
) -> None:
    """Reconcile silver with the indexes, change topics and histories; exit 1 on a difference.

    Per entity: silver's rows against the documents behind the index alias (keys read
    from _source) and against the change topic's last committed event per key (keys whose
    last event is a delete do not count), and, for an entity with history on, against its
    history's current versions (no key silver lacks; one per key). Each row is reduced to
    a content hash of the entity's columns, so keys missing, extra or different are listed
    with examples.
    Each side is read once and spilled into key buckets in $TMPDIR; only buckets whose
    digests differ are compared key by key, so memory stays bounded by one bucket.
    Lagging publishers show as differences: run it when `cdc status` shows lag 0.
    --target history names an entity without history: that target is reported skipped
    (not compared); a run that compared nothing exits 1.
    """
    from cdc_cli import verify  # noqa: PLC0415 (imports PySpark)

    pipeline = _config(config)
    with _problems(ValueError):
        report = verify.verify(
            pipeline,
            entity or None,
            targets=tuple(target) if target else None,
            examples=examples,
            buckets=buckets,
        )
    _emit(as_json, report.to_dict, lambda: verify.render(report))
    if not report.ok:
        raise typer.Exit(1)


def erase_command(
    config: Path = ConfigPath,
    entity: str | None = typer.Option(None, "--entity", "-e", help="The entity of the keys."),
    key: list[str] = typer.Option(
        None,
        "--key",
        "-k",
        help='A key: a JSON object of the key columns ({"id": 42}), or the value of a '
        "one-column key (42). Repeatable.",
        show_default=False,
    ),
    keys_file: Path | None = typer.Option(
        None, "--keys", help="A file of keys, one per line, each as --key takes it."
    ),
    show_status: bool = typer.Option(
        False, "--status", help="Show each request and what is left to do; change nothing."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Finish every request not finished (after a stop, a kill)."
    ),
    wait_s: float = typer.Option(
        600.0, "--wait", min=0, help="Seconds to wait for the merger to apply a request."
    ),
    writers_stopped: bool = typer.Option(
        False,
        "--writers-stopped",
        help="Every service is stopped: needed on object storage (s3a://) for the deletes "
        "from bronze and the quarantine and the purge, which must not race their commits.",
    ),
    as_json: bool = AsJson,
) -> None:
    """Erase keys from every copy the pipeline keeps (docs/operations.md, "Erasure").

    The request is recorded in the erasure log first (<storage_root>/_erasure), then the
    running merger applies it to silver and the history (a tombstone at the key's newest
    sequence stops a late event; a change of the key reaching bronze after the request is
    new data), and the publishers send the delete to the change topic and the index. Then
    bronze's rows of the keys and the quarantined records whose key reads are deleted,
    and every table they were in is purged of rows deletion vectors hide (REORG ...
    PURGE). The files that held them are deleted by the first `cdc maintenance` VACUUM
    once the tables' delta.deletedFileRetentionDuration has passed (--status says when).
    Each step is recorded: a run stopped at any point is finished by --resume. On object
    storage the last steps need every service stopped (--writers-stopped). Exit 0
    when every step is done; 1 when the merger has not applied the request (it is kept
    and applied when the merger runs) or no key was found; 2 for an unknown entity or a
    key of the wrong shape.
    """
    from cdc_cli import erase  # noqa: PLC0415 (imports PySpark)

    pipeline = _config(config)
    if show_status:
        with _problems():
            found = erase.statuses(pipeline)
        _emit(
            as_json, lambda: {"requests": [s.to_dict() for s in found]}, lambda: erase.render(found)
        )
        return
    if not resume:
        if entity is None:
            _fail("--entity is required (or --status, --resume)", 2)
        texts = list(key or [])
        if keys_file is not None:
            texts += keys_file.read_text().splitlines()
        with _problems():
            chosen = pipeline.entity(entity)
        try:
            keys = erase.parse_keys(chosen, texts)
        except erase.KeyShapeError as exc:
            _fail(str(exc), 2)
    from cdc_shared.jvm.spark import build_spark_session  # noqa: PLC0415

    spark = build_spark_session(pipeline.spark, "cdc-erase")
    done: list[erase.RequestStatus] = []
    if resume:
        todo = erase.pending(pipeline)
    else:
        with _problems(erase.NothingToEraseError):
            try:
                todo = [erase.record(pipeline, spark, chosen, keys)]
            except erase.KeyShapeError as exc:
                _fail(str(exc), 2)
    for request in todo:
        running = erase.merger_running(pipeline, request.entity)
        with _problems(erase.MergerPendingError, maintenance.WritersMayRunError):
            taken = erase.wait_for_merger(pipeline, request, wait_s, running)
            done.append(erase.finish(pipeline, spark, taken, writers_stopped))
    _emit(as_json, lambda: {"requests": [s.to_dict() for s in done]}, lambda: erase.render(done))


def _help(command: Callable[..., None]) -> str:
    """The docstring with each paragraph on one line, so the terminal wraps it, not us."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def register(app: typer.Typer) -> None:
    """Add the operator commands to the ``cdc`` app."""
    for name, command in (
        ("list", quarantine_list),
        ("show", quarantine_show),
        ("replay", quarantine_replay),
    ):
        quarantine_app.command(name, help=_help(command))(command)
    app.command("status", help=_help(status_command))(status_command)
    app.add_typer(quarantine_app, name="quarantine")
    app.command("maintenance", help=_help(maintenance_command))(maintenance_command)
    app.command("verify", help=_help(verify_command))(verify_command)
    app.command("erase", help=_help(erase_command))(erase_command)
