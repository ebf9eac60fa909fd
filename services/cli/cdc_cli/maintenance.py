"""``cdc maintenance``: OPTIMIZE, VACUUM that never breaks a table or a service, tombstone expiry.

The tables: ``bronze`` (one table for every entity, shared: maintained whatever entities
are selected), the quarantine tables, and per entity ``silver/<entity>``, its history
and its tombstones (``silver/_tombstones/<entity>``). The VACUUM of each is what makes
an erasure's rows physically gone (``cdc_cli.erase``).

VACUUM deletes data files that left the table (replaced by a MERGE or an OPTIMIZE, or
change-data files) longer ago than the retention. Two limits keep it safe:

- **Delta's minimum**, the table's ``delta.deletedFileRetentionDuration`` (Delta's
  default when unset: ``DEFAULT_RETENTION_HOURS``): a writer's files are unreferenced
  until its commit lands, and a reader may still be reading a version whose files a later
  commit removed; a shorter retention can delete either, corrupting a commit or failing a
  read. Below it VACUUM is refused, unless ``force_short_retention`` is given and no
  service shows signs of running: no live writer lease, no configured ``/health``
  endpoint that answers, and no data commit on bronze or silver and no progress in any
  service's group checkpoint within the quiet period (:func:`cdc_cli.liveness.signs_of_life`).
- **What the services still need**: a service that still has to read table version
  ``v`` needs every file that version ``v`` or a later one added or referenced; such a
  file can only have left the table at a commit after ``v``. So the retention is safe
  when ``now - retention`` is not later than the commit time of ``v``, the oldest
  version a service still has to read, not counting versions that hold nothing it reads
  (an OPTIMIZE, a VACUUM, a MERGE that changed nothing). Each table's progress is read
  where the service keeps it (see :mod:`cdc_cli.checkpoints`):

  - bronze is read by the merger, each table from its own progress (silver's log, app id
    ``cdc-merger``) through bronze's Change Data Feed: per table, the oldest version
    after its progress that holds rows of it (a table without progress is read from
    bronze's start). Bronze keeps what every table still needs: the oldest of them;
  - ``silver/<entity>`` is read by publisher-kafka (its change topic's progress group)
    and publisher-es (its progress document), each from the last version it published
    through silver's Change Data Feed. A publisher that has not started yet will read
    from its configured ``starting_version`` (default 0) or ``starting_timestamp``, so it
    holds VACUUM back to that point unless it is ignored as not deployed; a progress that
    cannot be read (Kafka, Elasticsearch down) refuses VACUUM of silver;
  - ``silver/_tombstones/<entity>``, the history and the quarantine are read whole, never
    by version: no stream needs an older version of them.

Both are checked before anything runs, and again right before each VACUUM. Reading a
version also needs its commit in the table's log, which Delta removes after
``delta.logRetentionDuration`` (30 days unless set) at a log checkpoint, whoever
writes it: a version needed for longer is reported (``notices``), never fixed here.

The tables of the releases before one bronze (``bronze/<entity>``) and their stream
checkpoints (``_checkpoints/``) are left alone: the services read them only at their
first start of this release (the merger drains each old bronze table into silver then).
Maintenance says which exist, and which can be deleted (``notices``).

A dry run (``dry_run``) makes the same checks, refuses what a run would refuse, and
changes nothing: it lists the files each VACUUM would delete (by Delta's own rules for
``VACUUM ... DRY RUN``, so the count is the one a VACUUM right then would delete,
OPTIMIZE aside), the tombstones that would expire (counted by the same cutoff), and each
table's file count for OPTIMIZE, which Delta cannot plan without running it. It reads
through a :class:`TableState`: without a JVM by default
(:class:`cdc_cli.delta_log.DeltaLogState`: delta-rs, the tables' logs and the
checkpoint files read directly), or through Spark
(:class:`cdc_cli.spark_state.SparkTables`), as a run does.

Tombstones (deleted keys and the sequence of their delete) stop a late, older event
from resurrecting a deleted row. They expire as the merger expires them
(``merger.tombstone_retention_hours``; ``null`` keeps them): once the merger has merged
bronze events of the entity ingested that many hours after the tombstone, counted in
bronze's ingest time, not the wall clock, so a quiet or lagging pipeline keeps what its
late events may still need. A retention given here may only lengthen the configured one.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_shared.config.connections import s3a_bucket
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import MERGER, QUARANTINE_WRITERS

from cdc_cli import log_retention
from cdc_cli.checkpoints import (
    BRONZE,
    StateReader,
)
from cdc_cli.liveness import DEFAULT_QUIET, signs_of_life
from cdc_cli.retention import (
    DEFAULT_RETENTION_HOURS,
    ProgressUnknownError,
    RetentionMinimum,
    check_vacuum_minimum,
    retention_minimum,
)
from cdc_cli.stream_needs import (
    StreamNeed,
    bronze_needs,
    check_vacuum_retention,
    legacy_notices,
    log_retention_notices,
    merger_log_notices,
    silver_needs,
    stream_needs,
)
from cdc_cli.table_state import DELTA_RS, SPARK, TableState, TableWrites, open_state
from cdc_cli.tombstone_expiry import (
    expire_by_ingest_time,
    merged_ingest_times,
    tombstone_retention,
)

if TYPE_CHECKING:  # a dry run reads without PySpark: it is imported where a session is used
    from pyspark.sql import SparkSession


class WritersMayRunError(RuntimeError):
    """Maintenance would commit to object-storage tables another process may write."""


class ServicesMayRunError(RuntimeError):
    """A retention below Delta's minimum was forced while a service may still run."""


@dataclass(frozen=True)
class TableResult:
    """What maintenance did to one table (a dry run: what it would do)."""

    table: str
    files: int | None = None  # a dry run's data files now, in place of OPTIMIZE's figures
    optimized_files_removed: int | None = None
    optimized_files_added: int | None = None
    vacuum_retention_hours: float | None = None
    vacuumed_files: int | None = None
    tombstones_expired: int | None = None
    tombstones_note: str | None = None  # which tombstones expired, or why none did
    retention_deleted: int | None = None  # rows past the log's retention (a dry run: would)
    retention_note: str | None = None  # whose rows, before when, and which were kept


@dataclass(frozen=True)
class MaintenanceReport:
    """Every table touched, and the services' needs the retention was checked against."""

    tables: list[TableResult] = field(default_factory=list)
    needs: list[StreamNeed] = field(default_factory=list)
    dry_run: bool = False  # nothing was changed: the figures are what a run would do
    #: What an operator should know and maintenance left alone (earlier releases' tables
    #: and checkpoints, versions needed beyond the log's retention).
    notices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``cdc maintenance --json``)."""
        return {
            "dry_run": self.dry_run,
            "notices": self.notices,
            "tables": [asdict(t) for t in self.tables],
            "needs": [
                {**asdict(n), "since": n.since.isoformat(timespec="seconds")} for n in self.needs
            ],
        }


def _data_tables(config: PipelineConfig, entities: list[EntityConfig]) -> dict[str, str]:
    """The tables a running service commits data to: bronze and each entity's silver."""
    tables = {BRONZE: config.layout.bronze()}
    tables.update({f"silver/{e.name}": config.layout.silver(e.name) for e in entities})
    return tables


def check_services_stopped(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    short: list[RetentionMinimum],
    hours: float,
    quiet: dt.timedelta,
) -> None:
    """Raise ServicesMayRunError, with every sign, if a service may run (forced VACUUM)."""
    signs = signs_of_life(config, entities, _data_tables(config, entities), state, quiet)
    if signs:
        raise ServicesMayRunError(
            f"refusing --force-short-retention (VACUUM {hours:g} hours, below Delta's "
            f"minimum of {', '.join(str(m) for m in short)}): a service may be running:\n"
            + "\n".join(f"  {s}" for s in signs)
            + "\nstop every service (ingestor, merger, both publishers, `cdc run`) and retry "
            "once the quiet period has passed, or VACUUM with the table's minimum"
        )


def _tables(config: PipelineConfig, entities: list[EntityConfig]) -> dict[str, str]:
    """The tables maintenance touches, by name: bronze, the quarantine, each entity's tables.

    Silver, its history and tombstones; the history and the quarantine are read whole.
    """
    tables = {BRONZE: config.layout.bronze()}
    tables |= {f"quarantine/{s}": config.layout.quarantine(s) for s in QUARANTINE_WRITERS}
    for entity in entities:
        tables[f"silver/{entity.name}"] = config.layout.silver(entity.name)
        tables[f"silver_history/{entity.name}"] = config.layout.history(entity.name)
        tables[f"silver/_tombstones/{entity.name}"] = config.layout.tombstones(entity.name)
    return tables


def _table_needs(
    config: PipelineConfig,
    table: str,
    entity: EntityConfig | None,
    state: StateReader,
    ignore_services: tuple[str, ...],
) -> list[StreamNeed]:
    """What the services need of one table now (tombstones: nothing, they are read whole)."""
    if table == BRONZE:
        return [] if MERGER in ignore_services else bronze_needs(config, state)
    if entity is None or not table.startswith("silver/") or "/_tombstones/" in table:
        return []
    return silver_needs(config, entity, state, ignore_services)


def _needs_and_notices(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    tables: Mapping[str, str],
    ignore_services: tuple[str, ...],
    vacuum_hours: float | None,
) -> tuple[list[StreamNeed], list[str]]:
    """What the services need of the tables (checked against ``vacuum_hours``), and notices.

    Without VACUUM the needs only inform: a progress that cannot be read is a notice.
    """
    notices = legacy_notices(config, state)
    try:
        needs = stream_needs(config, entities, state, ignore_services)
    except ProgressUnknownError as unknown:
        if vacuum_hours is not None:
            raise
        needs = []
        notices.append(str(unknown))
    if vacuum_hours is not None:
        check_vacuum_retention(needs, vacuum_hours)
    now = dt.datetime.now(dt.UTC)
    notices += log_retention_notices(needs, state, tables, now)
    if MERGER not in ignore_services:
        notices += merger_log_notices(config, state, now)
    return needs, notices


def _check_minimums(
    config: PipelineConfig,
    entities: list[EntityConfig],
    state: TableState,
    minimums: list[RetentionMinimum],
    vacuum_hours: float,
    force_short_retention: bool,
    quiet: dt.timedelta,
) -> None:
    """Refuse a VACUUM retention below a table's Delta minimum.

    With ``force_short_retention`` it is allowed, and then only with every service
    stopped (``check_services_stopped``, with its ``quiet`` period).
    """
    short = [m for m in minimums if vacuum_hours < m.hours]
    if not force_short_retention:
        check_vacuum_minimum(minimums, vacuum_hours)
    elif short:
        check_services_stopped(config, entities, state, short, vacuum_hours, quiet)


def run_maintenance(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    *,
    optimize: bool = True,
    vacuum_hours: float | None = DEFAULT_RETENTION_HOURS,
    tombstones: bool = True,
    tombstone_retention_hours: float | None = None,
    ignore_services: tuple[str, ...] = (),
    writers_stopped: bool = False,
    force_short_retention: bool = False,
    quiet: dt.timedelta = DEFAULT_QUIET,
    dry_run: bool = False,
    spark: SparkSession | None = None,
    engine: str = DELTA_RS,
) -> MaintenanceReport:
    """Check every retention first, then OPTIMIZE, VACUUM, expire tombstones.

    Bronze, shared by every entity, then each selected entity's silver and tombstones.
    ``dry_run``: the same checks and refusals, then what each step would do, changing
    nothing (see the module docstring). It reads as ``engine`` says (one of
    ``cdc_cli.table_state.ENGINES``): delta-rs, without a JVM, or spark, through ``spark`` or
    a session built from the configuration. A run reads and writes through Spark.

    ``vacuum_hours`` None skips VACUUM; ``tombstones`` False skips the tombstone tables.
    Tombstones expire by ``merger.tombstone_retention_hours`` or by a longer
    ``tombstone_retention_hours``. Before changing anything it raises
    RetentionTooShortError when a retention is below a table's Delta minimum (unless
    ``force_short_retention``), would delete what a service still has to read (or that
    cannot be told: ProgressUnknownError), or shortens the tombstone retention;
    ServicesMayRunError when a forced short retention meets signs of a running service.
    The needs and the service checks are repeated right before each VACUUM (OPTIMIZE may
    have taken long). On an ``s3a://`` root it needs ``writers_stopped`` (else
    WritersMayRunError, before anything runs).
    """
    entities = config.select_entities(entity_names)
    if s3a_bucket(config.storage_root) is not None and not writers_stopped and not dry_run:
        # Delta's S3 log store orders commits within one JVM only (docs/operations.md): a
        # commit of ours (OPTIMIZE, VACUUM's log entries, tombstone expiry) racing the
        # ingestor's or merger's could overwrite theirs.
        raise WritersMayRunError(
            "the storage root is on object storage, where maintenance must not commit "
            "beside the ingestor and merger: stop them, then pass --writers-stopped"
        )
    expiry_hours = tombstone_retention(
        config.merger.tombstone_retention_hours, tombstone_retention_hours
    )
    # A dry run reads as ``engine`` says; a run reads and writes through Spark.
    state, writes = open_state(config, engine if dry_run else SPARK, "cdc-maintenance", spark)
    if dry_run:
        writes = None  # a dry run changes nothing, whichever engine reads
    tables = {
        name: path
        for name, path in _tables(config, entities).items()
        if (tombstones or "/_tombstones/" not in name) and state.table_version(path) is not None
    }
    every_entity = list(config.entities)  # a forced VACUUM of bronze concerns every writer
    minimums: dict[str, RetentionMinimum] = {}
    short: list[RetentionMinimum] = []
    if vacuum_hours is not None:
        minimums = {name: retention_minimum(state, name, path) for name, path in tables.items()}
        short = [m for m in minimums.values() if vacuum_hours < m.hours]
        _check_minimums(
            config,
            every_entity,
            state,
            [*minimums.values()],
            vacuum_hours,
            force_short_retention,
            quiet,
        )
    all_needs, notices = _needs_and_notices(
        config, entities, state, tables, ignore_services, vacuum_hours
    )
    expiring = [e for e in entities if f"silver/_tombstones/{e.name}" in tables]
    merged = merged_ingest_times(config, expiring, state) if expiry_hours is not None else {}

    below = {m.table for m in short}

    def vacuum(table: str, entity: EntityConfig | None) -> int | None:
        assert vacuum_hours is not None
        check_vacuum_retention(
            _table_needs(config, table, entity, state, ignore_services), vacuum_hours
        )
        if table in below:
            check_services_stopped(config, every_entity, state, short, vacuum_hours, quiet)
        if dry_run:
            return state.vacuum_dry_run(tables[table], vacuum_hours, minimums[table].hours)
        assert writes is not None
        return writes.vacuum(tables[table], vacuum_hours, table in below)

    def optimized(table: str) -> tuple[int | None, int | None, int | None]:
        """OPTIMIZE's files removed and added, or (dry run) the data files it would read."""
        if not optimize:
            return None, None, None
        if dry_run:
            return None, None, state.data_file_count(tables[table])
        assert writes is not None
        return (*writes.compact(tables[table]), None)

    def maintain(table: str, entity: EntityConfig | None) -> None:
        removed, added, files = optimized(table)
        vacuumed = None if vacuum_hours is None else vacuum(table, entity)
        report.tables.append(TableResult(table, files, removed, added, vacuum_hours, vacuumed))

    report = MaintenanceReport(needs=all_needs, dry_run=dry_run, notices=notices)
    report.tables.extend(_retention(config, state, writes))  # first: OPTIMIZE packs the rest
    by_name = {e.name: e for e in entities}
    for name in tables:  # bronze, the quarantine, silver and the history
        if "/_tombstones/" not in name:
            silver = name.startswith("silver")
            maintain(name, by_name.get(name.split("/", 1)[1]) if silver else None)
    for entity in entities:
        table = f"silver/_tombstones/{entity.name}"
        if table in tables:
            expired, note = expire_by_ingest_time(
                config, entity, state, expiry_hours, merged.get(entity.name, (None, "")), writes
            )
            vacuumed = None if vacuum_hours is None else vacuum(table, entity)
            report.tables.append(
                TableResult(
                    table,
                    vacuum_retention_hours=vacuum_hours,
                    vacuumed_files=vacuumed,
                    tombstones_expired=expired,
                    tombstones_note=note,
                )
            )
    return report


def _retention(
    config: PipelineConfig, state: TableState, writes: TableWrites | None
) -> list[TableResult]:
    """Bronze's and the quarantine's rows past their retention, deleted; one result per log.

    ``writes`` None (a dry run): counted (``cdc_cli.log_retention``).
    """
    return [
        TableResult(done.table, retention_deleted=done.deleted, retention_note=done.note)
        for done in log_retention.apply(config, state, writes, dt.datetime.now(dt.UTC))
    ]


def render(report: MaintenanceReport) -> str:
    """The report as text: notices, the services' needs, then one line per table."""
    now = dt.datetime.now(dt.UTC)
    lines = ["dry run: nothing was changed"] if report.dry_run else []
    lines.extend(f"note: {notice}" for notice in report.notices)
    lines.append("services still reading older versions:" if report.needs else "no service lags")
    lines.extend(
        f"  {n.table:<28} {n.service:<16} version {n.version} ({n.note}), "
        f"needs >= {math.ceil(n.hours(now))} h retention"
        for n in report.needs
    )
    for t in report.tables:
        parts = []
        if t.files is not None:
            parts.append(f"optimize would bin-pack {t.files} files")
        if t.optimized_files_removed is not None:
            parts.append(f"optimize {t.optimized_files_removed} -> {t.optimized_files_added} files")
        if t.tombstones_expired is not None:
            verb = "would expire" if report.dry_run else "expired"
            parts.append(f"{verb} {t.tombstones_expired} tombstones")
        if t.vacuum_retention_hours is not None:
            files = "?" if t.vacuumed_files is None else str(t.vacuumed_files)
            deleted = "would be deleted" if report.dry_run else "deleted"
            parts.append(f"vacuum {t.vacuum_retention_hours:g} h: {files} files {deleted}")
        if t.retention_deleted is not None:
            verb = "would delete" if report.dry_run else "deleted"
            parts.append(f"retention: {verb} {t.retention_deleted} rows")
        lines.append(f"{t.table:<30} {'; '.join(parts) or 'nothing to do'}")
        if t.retention_note:
            lines.append(f"{'':<30} retention: {t.retention_note}")
        if t.tombstones_note is not None:
            lines.append(f"{'':<30} tombstones {t.tombstones_note}")
    return "\n".join(lines)
