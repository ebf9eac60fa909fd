"""One table's writes: its bronze rows of a range of versions -> silver, then its history.

The merger's group stream (:mod:`cdc_merger.stream`) hands each table the bronze version
its changes reach; the table reads its own rows since its progress (bronze's Change Data
Feed, typed: ``cdc_shared.contracts.bronze.entity_changes``) and applies them
(:func:`cdc_merger.apply.apply_batch`: latest event per key, tombstone and truncate
guards, one MERGE into silver). The MERGE's commit records the bronze version reached
(Delta's idempotent writes, app id ``MERGER_PROGRESS_APP``): silver's own log says how far the
table is merged, so the table can be written in any later batch, and a write run again
writes nothing twice. The history, when the entity keeps one, is brought up to silver's
progress after silver's step committed, with a progress of its own in its own log.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cdc_shared.clients.retry import retrying
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts import bronze, quarantine
from cdc_shared.contracts.layout import MERGER, MERGER_PROGRESS_APP, RETENTION_PROPERTY
from cdc_shared.contracts.quarantine import (
    QUARANTINE_SCHEMA,
    quarantine_columns,
)
from cdc_shared.contracts.unavailable import Placeholder
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.jvm.spark import counting_jobs
from cdc_shared.streaming.failures import KnownFailureError
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.tables import (
    ensure_table,
    expire_tombstones,
    idempotent_append,
    not_quarantined_yet,
    record_progress,
)
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_merger.apply import (
    ERROR_KIND,
    ERROR_MESSAGE,
    MergeState,
    apply_batch,
    apply_history,
    lost_local_checkpoint,
    without_columns,
)
from cdc_merger.erasure import (
    Erasures,
    delete_from_history,
    delete_from_silver,
    erased_sequences,
    key_frame,
    without_erased,
)
from cdc_merger.history import HistoryTable
from cdc_merger.silver_tables import SilverLayout, ensure_tables
from cdc_merger.write_mode import WriteMode

SERVICE = MERGER
log = logging.getLogger("cdc_merger")
#: The app id of the merger's progress in silver's (and the history's) log.


def silver_layout(config: PipelineConfig, entity: EntityConfig) -> SilverLayout:
    """Where one entity's silver and side tables live.

    ``silver/<entity>``, its tombstones and truncates under ``silver/_*/<entity>``, and
    its history (``silver_history/<entity>``) when the entity has one.
    """
    history = None
    if entity.history.enabled:
        history = HistoryTable(config.layout.history(entity.name), entity.history)
    return SilverLayout(
        silver_path=config.layout.silver(entity.name),
        tombstone_path=config.layout.tombstones(entity.name),
        truncate_path=config.layout.truncates(entity.name),
        key=list(entity.key),
        history=history,
    )


def quarantine_rows(rejected: DataFrame, entity: str, batch_id: int) -> DataFrame:
    """Bronze events the merger could not apply, as ``quarantine/merger`` rows.

    The event itself is kept as JSON (key and the whole bronze row) with its Kafka
    coordinates, so it can be inspected and traced back to the source record.
    ``batch_id`` is the bronze version the write reached.
    """
    row = F.struct(*[F.col(c) for c in rejected.columns if c not in (ERROR_KIND, ERROR_MESSAGE)])
    return rejected.select(
        *quarantine_columns(
            SERVICE,
            entity,
            error_kind=F.col(ERROR_KIND),
            error_message=F.col(ERROR_MESSAGE),
            kafka_topic=F.col("kafka_topic"),
            kafka_partition=F.col("kafka_partition"),
            kafka_offset=F.col("kafka_offset"),
            kafka_timestamp=F.col("kafka_timestamp"),
            raw_key=F.to_json(F.col("key")),
            raw_value=F.to_json(row),
            source_table=F.lit("bronze"),
            batch_id=F.lit(batch_id),
            quarantined_at=F.current_timestamp(),
        )
    )


def _row_columns(payload_type: T.StructType) -> list[str]:
    """The source row's columns in an entity's bronze payload (its ``after`` image)."""
    after = payload_type["after"].dataType
    assert isinstance(after, T.StructType)
    return after.fieldNames()


class BronzeRetainedError(KnownFailureError):
    """A table would be built from bronze after retention deleted some of its rows.

    Silver (or its history) with no progress is written from every row bronze holds of
    the entity; once ``cdc maintenance`` deleted rows by retention, that would make a
    table missing them, so the table is held instead (the others go on).
    """

    entity_only = True

    def __init__(self, entity: str, table: str, deleted_before: dt.datetime) -> None:
        super().__init__(
            f"{table} of {entity!r} has no progress, so it would be built from bronze, but "
            f"bronze's retention deleted its rows ingested before "
            f"{deleted_before.isoformat(timespec='seconds')}: restore {table} (with its "
            "_delta_log) from a backup, or take a new snapshot of the source table and "
            f"remove bronze's table property {RETENTION_PROPERTY}{entity} "
            '(docs/operations.md, "Retention")'
        )


@dataclass(eq=False)
class TableMerge:
    """One entity's writes (see the module docstring); its progress kept in memory.

    ``progress`` / ``history_progress``: the bronze version silver and the history are
    merged through (-1: nothing yet), read from their logs at start, then kept here (the
    merger is their only writer). ``announce`` is told after each write of silver.
    """

    spark: SparkSession
    config: PipelineConfig
    entity: EntityConfig
    announce: Callable[[str], None]
    progress: int = -1
    history_progress: int = -1
    layout: SilverLayout = field(init=False)

    def __post_init__(self) -> None:
        self.layout = silver_layout(self.config, self.entity)
        self.bronze_path = self.config.layout.bronze()
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        self.state = MergeState(self.spark, self.layout)
        self.placeholder = Placeholder.of(self.config.merger.unavailable_value_placeholder)
        self.write_mode = WriteMode(
            self.spark, self.layout.silver_path, self.config.merger.deletion_vectors_from_mib
        )
        self.payload_type: T.StructType | None = None
        #: Before when bronze's retention may have deleted the entity's rows (None: never).
        self.deleted_before: dt.datetime | None = None
        self._made = False
        self.next_expiry = 0.0  # monotonic time of the next tombstone expiry
        self.erasures = Erasures()  # ``cdc erase``'s requests, set by the group's watch

    @property
    def name(self) -> str:
        """The entity's name."""
        return self.entity.name

    def typed_as(self, payload_type: T.StructType) -> None:
        """Bronze's payload type of the entity (read by the group stream); checks names.

        The names the entity's column selection, ``ignore_null_updates`` and history give
        must be columns of its rows: a configuration error otherwise.
        """
        if payload_type == self.payload_type:
            return
        row = _row_columns(payload_type)
        dropped = self.entity.dropped_columns(row)
        self.entity.null_update_columns(row)
        if self.entity.history.enabled:
            self.entity.history_untracked_columns([c for c in row if c not in dropped])
        self.payload_type = payload_type

    def _tables(self, events: DataFrame) -> None:
        """Silver, its tombstones, truncates (and history), shaped by bronze, unless made."""
        if self._made:
            return
        schema = without_columns(events, self.dropped_columns()).schema
        always = self.config.merger.deletion_vectors_from_mib == 0
        ensure_tables(self.spark, schema, self.layout, deletion_vectors=always)
        self.write_mode.open()
        self._warn_selection_narrowed()
        self._made = True

    def dropped_columns(self) -> list[str]:
        """The row columns bronze holds that the entity's column selection leaves out."""
        assert self.payload_type is not None
        return self.entity.dropped_columns(_row_columns(self.payload_type))

    def _null_update_columns(self) -> list[str]:
        assert self.payload_type is not None
        return self.entity.null_update_columns(_row_columns(self.payload_type))

    def _warn_selection_narrowed(self) -> None:
        """Silver made before the selection keeps its columns: say so, once."""
        silver = self.spark.read.format("delta").load(self.layout.silver_path).columns
        stale = [c for c in self.dropped_columns() if c in silver]
        if stale:
            log.warning(
                "silver has columns its column selection leaves out: they are no longer "
                "written (new rows hold null); rebuild silver to drop them",
                extra={"entity": self.name, "columns": stale},
            )

    def events(self, spark: SparkSession, since: int, until: int) -> DataFrame:
        """The entity's bronze rows after version ``since`` up to ``until``, typed."""
        assert self.payload_type is not None, f"bronze holds no type of {self.name!r}"
        return bronze.entity_changes(
            spark, self.bronze_path, self.name, since, until, self.payload_type
        )

    def write(self, spark: SparkSession, until: int) -> BatchStats:
        """Merge the entity's bronze rows up to version ``until`` into silver (idempotent).

        Rejected events go to ``quarantine/merger``, each once whatever reads it again.
        """
        if until <= self.progress:
            self.announce(self.name)  # written before (a batch run again): say so again
            erased = self.erase(spark)
            return BatchStats(counts={"skipped": 1, **({"erased_keys": erased} if erased else {})})
        started = time.monotonic()
        self._refuse_a_rebuild(self.progress, "silver")
        events = self.events(spark, self.progress, until)
        self._tables(events)

        def quarantine(rejected: DataFrame) -> None:
            rows = quarantine_rows(rejected, self.name, until)
            new = not_quarantined_yet(spark, rows, self.quarantine_path)
            idempotent_append(
                new, self.quarantine_path, f"{MERGER_PROGRESS_APP}-{self.name}", until
            )

        # Every step is idempotent, so a batch whose MERGE source went with a lost
        # executor is applied again here instead of failing.
        applying = retrying(
            lost_local_checkpoint,
            initial_s=1,
            max_s=10,
            attempts=4,
            log=log,
            describe=lambda error, attempt: (
                f"bronze up to version {until}: the MERGE source was lost with an "
                f"executor; applying it again, attempt {attempt}"
            ),
            fields={"entity": self.name, "until": until},
        )
        with counting_jobs(spark) as spark_jobs:
            result = applying(
                apply_batch,
                spark,
                events,
                self.layout,
                quarantine,
                self.state,
                self.placeholder,
                self.dropped_columns(),
                self._null_update_columns(),
                (MERGER_PROGRESS_APP, until),
            )
            self.progress = until
            self.announce(self.name)
            expired = self.expire_tombstones(result.ingested_until)
            self.write_mode.check()
            erased = self.erase(spark)
        counts = {
            "input_rows": result.events,
            "applied_keys": result.keys,
            "deletes": result.deletes,
            "quarantined_rows": result.rejected,
            "truncates": int(result.truncated),
        }
        if expired is not None:
            counts["tombstones_expired"] = expired
        if erased:
            counts["erased_keys"] = erased
        if result.unavailable:
            counts["unavailable_values"] = sum(result.unavailable.values())
            self.warn_unavailable(until, result.unavailable)
        extra = {
            "apply_ms": int((time.monotonic() - started) * 1000),
            **result.step_ms,
            "spark_jobs": spark_jobs(),
            "bronze_version": until,
        }
        return BatchStats(counts=counts, extra=extra)

    def write_history(self, spark: SparkSession, until: int) -> BatchStats:
        """Bring the entity's history up to bronze version ``until`` (merged into silver)."""
        if until <= self.history_progress:
            erased = self.erase_history(spark)
            return BatchStats(counts={"skipped": 1, **({"erased_keys": erased} if erased else {})})
        assert until <= self.progress, "the history runs after silver's step, never ahead"
        started = time.monotonic()
        self._refuse_a_rebuild(self.history_progress, "its history")
        events = self._without_erased(spark, self.events(spark, self.history_progress, until))
        with counting_jobs(spark) as spark_jobs:
            applicable = apply_history(
                spark,
                events,
                self.layout,
                self.state,
                self.placeholder,
                self.dropped_columns(),
                self._null_update_columns(),
                (MERGER_PROGRESS_APP, until),
            )
        self.history_progress = until
        erased = self.erase_history(spark)
        extra = {
            "history_ms": int((time.monotonic() - started) * 1000),
            "spark_jobs": spark_jobs(),
            "bronze_version": until,
        }
        counts = {"history_events": applicable, **({"erased_keys": erased} if erased else {})}
        return BatchStats(counts=counts, extra=extra)

    def _without_erased(self, spark: SparkSession, events: DataFrame) -> DataFrame:
        """The events but those of erased keys not newer than their erasure's tombstone.

        Silver's tombstone index keeps such a late event out of silver; the history would
        record it as a version the tombstone ended, bringing erased values back. The
        erased keys' tombstones are read once per set of requests.
        """
        erasures = self.erasures
        if not erasures.pending:
            return events
        if erasures.erased is None or erasures.erased[0] is not erasures.pending:
            pending = erasures.pending
            schema = spark.read.format("delta").load(self.layout.silver_path).schema
            keys = key_frame(spark, pending, self.layout.key, schema)
            erased = erased_sequences(spark, keys, self.layout)
            erasures.erased = (pending, erased.schema, [tuple(r) for r in erased.collect()])
        _, erased_schema, rows = erasures.erased
        erased_frame = frame_from_rows(spark, rows, erased_schema)
        return without_erased(events, erased_frame, self.layout.key)

    def erase(self, spark: SparkSession) -> int:
        """Apply to silver the erasure requests its progress has reached; keys erased.

        Runs within the table's write, so nothing else writes silver meanwhile.
        """
        due = self.erasures.due(self.erasures.silver_through, self.progress)
        if not due or self.progress < 0:
            return 0
        schema = spark.read.format("delta").load(self.layout.silver_path).schema
        keys = key_frame(spark, due, self.layout.key, schema)
        erased = delete_from_silver(spark, self.layout, self.state, keys, due[-1].request)
        self.erasures.silver_through = due[-1].request
        self.erasures.erased = None  # the keys' tombstones changed: read again
        self.announce(self.name)
        log.info(
            "erasure applied to silver: the keys' rows deleted, a tombstone at their sequence",
            extra={"entity": self.name, "requests": [r.request for r in due], "rows": erased},
        )
        return erased

    def erase_history(self, spark: SparkSession) -> int:
        """Apply to the history the erasure requests its progress has reached; requests."""
        history = self.layout.history
        due = self.erasures.due(self.erasures.history_through, self.history_progress)
        if history is None or not due or self.history_progress < 0:
            return 0
        schema = spark.read.format("delta").load(self.layout.silver_path).schema
        keys = key_frame(spark, due, self.layout.key, schema)
        delete_from_history(spark, history.path, keys, self.layout.key, due[-1].request)
        self.erasures.history_through = due[-1].request
        log.info(
            "erasure applied to the history: every version of the keys deleted",
            extra={"entity": self.name, "requests": [r.request for r in due]},
        )
        return len(due)

    def _refuse_a_rebuild(self, progress: int, table: str) -> None:
        """BronzeRetainedError when ``table`` would be built from rows retention deleted."""
        if progress < 0 and self.deleted_before is not None:
            raise BronzeRetainedError(self.name, table, self.deleted_before)

    def note_progress(self, until: int) -> None:
        """Record that the table (and its history) is merged through ``until``: no rows since.

        Only for a table bronze holds nothing new of (the group stream knows): a commit
        of the progress alone, so that a start need not look as far back.
        """
        if self.progress < 0:  # no silver yet: nothing to record in
            return
        history = self.layout.history
        caught_up = history is not None and self.history_progress == self.progress
        record_progress(self.spark, self.layout.silver_path, (MERGER_PROGRESS_APP, until))
        self.progress = until
        if history is not None and caught_up:
            record_progress(self.spark, history.path, (MERGER_PROGRESS_APP, until))
            self.history_progress = until

    def warn_unavailable(self, until: int, columns: dict[str, int]) -> None:
        """One warning per column: values the source did not send and nothing held."""
        for column, count in sorted(columns.items()):
            log.warning(
                "values the source did not send (its unavailable-value placeholder, or a null "
                "update under ignore_null_updates) and no earlier event nor silver held: "
                "stored null; REPLICA IDENTITY FULL on the source table makes PostgreSQL "
                "send unchanged large values",
                extra={
                    "entity": self.name,
                    "column": column,
                    "unavailable_values": count,
                    "bronze_version": until,
                },
            )

    def expire_tombstones(self, ingested_until: dt.datetime | None) -> int | None:
        """Expire tombstones older than the retention, counted in bronze's ingest time.

        Runs at most every ``tombstone_expiry_interval_s``; None when it did not run.
        """
        settings = self.config.merger
        hours = settings.tombstone_retention_hours
        if hours is None or ingested_until is None or time.monotonic() < self.next_expiry:
            return None
        self.next_expiry = time.monotonic() + settings.tombstone_expiry_interval_s
        cutoff = ingested_until - dt.timedelta(hours=hours)
        expired = expire_tombstones(self.spark, self.layout.tombstone_path, cutoff)
        if expired:
            self.state.tombstones.forget()  # reloaded by the next batch, without them
        return expired


def ensure_quarantine(spark: SparkSession, config: PipelineConfig) -> None:
    """``quarantine/merger``, unless it exists."""
    ensure_table(
        spark,
        config.layout.quarantine(SERVICE),
        QUARANTINE_SCHEMA,
        quarantine.properties_for(config),
    )
