"""One entity's merger stream: ``bronze/<entity>`` -> ``silver/<entity>``, order-safe, idempotent.

A Delta stream over bronze (source) -> latest event per key, tombstone filter (transform)
-> one MERGE into silver plus tombstones, truncates and history (sink). The merger runs
one per entity, or all of them inside its one query (:mod:`cdc_merger.one_query`).
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.layout import MERGER
from cdc_shared.retry import retrying
from cdc_shared.spark import counting_jobs
from cdc_shared.streaming import (
    BatchStats,
    EntityStreamBase,
)
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    app_id,
    ensure_table,
    idempotent_append,
    quarantine_columns,
    wait_for_table,
)
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_merger.apply import (
    ERROR_KIND,
    ERROR_MESSAGE,
    MergeState,
    SilverLayout,
    apply_batch,
    ensure_tables,
    expire_tombstones,
    lost_local_checkpoint,
    without_columns,
)
from cdc_merger.bronze_start import reads_from_first_commit, replayable_from_first_commit
from cdc_merger.history import HistoryTable
from cdc_merger.unavailable import Placeholder
from cdc_merger.write_mode import WriteMode

SERVICE = MERGER
log = logging.getLogger("cdc_merger")


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
            source_table=F.lit(f"bronze/{entity}"),
            batch_id=F.lit(batch_id),
            quarantined_at=F.current_timestamp(),
        )
    )


#: The quarantine's columns that name one bronze event: its entity and Kafka coordinates
#: (bronze holds each Kafka record once).
QUARANTINED_EVENT = ("entity", "kafka_topic", "kafka_partition", "kafka_offset")


def not_quarantined_yet(
    spark: SparkSession, rows: DataFrame, quarantine_path: str, entity: str
) -> DataFrame:
    """``rows`` (``quarantine_rows``) less the events the quarantine holds already.

    A batch read again under a new checkpoint rejects its events again under a new
    ``txnAppId``, which the idempotent append cannot recognise: a one query carried over
    onto a new checkpoint (a table taken up) reads each table's last version again
    (``cdc_shared.streaming.delta_union``). Read only when a batch rejects events.
    """
    held = (
        spark.read.format("delta")
        .load(quarantine_path)
        .where(F.col("entity") == entity)
        .select(*QUARANTINED_EVENT)
    )
    new = rows.join(held, on=list(QUARANTINED_EVENT), how="left_anti")
    return new.select(*rows.columns)  # the join puts its columns first


def _row_columns(bronze: DataFrame) -> list[str]:
    """The source row's columns in bronze events (their ``after`` image)."""
    after = bronze.schema["after"].dataType
    assert isinstance(after, T.StructType)
    return after.fieldNames()


class EntityMerge(EntityStreamBase):
    """One entity's stream: ``bronze/<entity>`` into ``silver/<entity>``."""

    def __post_init__(self) -> None:
        self.bronze_path = self.config.layout.bronze(self.entity.name)
        self.layout = silver_layout(self.config, self.entity)
        self.state = MergeState(self.spark, self.layout)
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        self.next_expiry = 0.0  # monotonic time of the next tombstone expiry
        self.placeholder = Placeholder.of(self.config.merger.unavailable_value_placeholder)
        self.write_mode = WriteMode(
            self.spark, self.layout.silver_path, self.config.merger.deletion_vectors_from_mib
        )

    def prepare(self, wait_s: float) -> None:
        """Silver and tombstones, shaped by bronze (waits for the ingestor to create it).

        The guards (tombstones, truncate floor) are read by the first batch that needs
        them, not here: a table that stays idle never loads them, and a start with many
        tables does not read every table's tombstones before its streams run.
        """
        hint = f"start the ingestor for entity {self.entity.name!r} first"
        wait_for_table(self.spark, self.bronze_path, wait_s, hint, log)
        bronze = self.spark.read.format("delta").load(self.bronze_path)
        dropped = self.dropped_columns(bronze)  # checks the selection's names
        self.null_update_columns(bronze)  # and ignore_null_updates' names
        if self.entity.history.enabled:  # and history's
            kept = [c for c in _row_columns(bronze) if c not in dropped]
            self.entity.history_untracked_columns(kept)
        schema = without_columns(bronze, dropped).schema
        always = self.config.merger.deletion_vectors_from_mib == 0
        ensure_tables(self.spark, schema, self.layout, deletion_vectors=always)
        self.write_mode.open()  # deletion vectors or rewriting, by silver's size
        self.warn_selection_narrowed(dropped)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)

    def dropped_columns(self, bronze: DataFrame) -> list[str]:
        """The row columns of bronze that the entity's column selection leaves out of silver."""
        return self.entity.dropped_columns(_row_columns(bronze))

    def null_update_columns(self, bronze: DataFrame) -> list[str]:
        """The row columns whose null in an update keeps silver's value (ignore_null_updates)."""
        return self.entity.null_update_columns(_row_columns(bronze))

    def warn_selection_narrowed(self, dropped: list[str]) -> None:
        """Silver made before the selection keeps its columns: say so, once, at start."""
        silver = self.spark.read.format("delta").load(self.layout.silver_path).columns
        stale = [c for c in dropped if c in silver]
        if stale:
            log.warning(
                "silver has columns its column selection leaves out: they are no longer "
                "written (new rows hold null); rebuild silver to drop them",
                extra={"entity": self.entity.name, "columns": stale},
            )

    def source(self) -> DataFrame:
        """Bronze as a Delta stream, limited per micro-batch, from its first commit if it can.

        A new stream reads bronze from version 0 when bronze can replay every row from its
        commits (``cdc_merger.bronze_start``), else from bronze's snapshot.
        """
        checkpoint = self.config.checkpoint_path(SERVICE, self.entity.name)
        first = reads_from_first_commit(self.spark, self.bronze_path, checkpoint)
        return self.stream_from(0 if first else None)

    def first_start(self) -> int | None:
        """Where a stream of bronze starts in the one query, having read nothing before.

        Bronze's first commit when bronze can replay it, else (None) its snapshot.
        """
        return 0 if replayable_from_first_commit(self.spark, self.bronze_path) else None

    def stream_from(self, starting_version: int | None) -> DataFrame:
        """Bronze as a Delta stream from ``starting_version`` (None: its snapshot), limited."""
        settings = self.config.merger
        reader = self.spark.readStream.format("delta")
        if starting_version is not None:
            reader = reader.option("startingVersion", starting_version)
        if settings.max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", settings.max_files_per_trigger)
        if settings.max_bytes_per_trigger:
            reader = reader.option("maxBytesPerTrigger", settings.max_bytes_per_trigger)
        return reader.load(self.bronze_path)

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Apply the batch; replaying it changes nothing (every step compares sequences).

        Rejected events go to ``quarantine/merger`` idempotently (txnAppId + batch id),
        each event once whatever checkpoint read it (``not_quarantined_yet``).
        """
        started = time.monotonic()
        app = app_id(SERVICE, self.entity.name, self.identity.get())

        def quarantine(rejected: DataFrame) -> None:
            rows = quarantine_rows(rejected, self.entity.name, batch_id)
            new = not_quarantined_yet(self.spark, rows, self.quarantine_path, self.entity.name)
            idempotent_append(new, self.quarantine_path, app, batch_id)

        # Every step of a batch is idempotent, so a batch whose MERGE source went with a
        # lost executor is applied again here instead of failing the stream.
        applying = retrying(
            lost_local_checkpoint,
            initial_s=1,
            max_s=10,
            attempts=4,
            log=log,
            describe=lambda error, attempt: (
                f"batch {batch_id}: its MERGE source was lost with an executor; "
                f"applying the batch again, attempt {attempt}"
            ),
            fields={"entity": self.entity.name, "batch_id": batch_id},
        )
        with counting_jobs(self.spark) as spark_jobs:
            result = applying(
                apply_batch,
                self.spark,
                batch,
                self.layout,
                quarantine,
                self.state,
                self.placeholder,
                self.dropped_columns(batch),
                self.null_update_columns(batch),
            )
            expired = self.expire_tombstones(result.ingested_until)
            self.write_mode.check()
        counts = {
            # Spark does not count rows a MERGE reads: counted here for the batch log.
            "input_rows": result.events,
            "applied_keys": result.keys,
            "deletes": result.deletes,
            "quarantined_rows": result.rejected,
            "truncates": int(result.truncated),
        }
        if expired is not None:
            counts["tombstones_expired"] = expired
        if result.unavailable:
            counts["unavailable_values"] = sum(result.unavailable.values())
            self.warn_unavailable(batch_id, result.unavailable)
        self.report(
            batch_id,
            BatchStats(
                counts=counts,
                extra={
                    "apply_ms": int((time.monotonic() - started) * 1000),  # the whole batch
                    **result.step_ms,
                    "spark_jobs": spark_jobs(),
                },
            ),
        )

    def warn_unavailable(self, batch_id: int, columns: dict[str, int]) -> None:
        """One warning per column: values the source did not send and nothing held."""
        for column, count in sorted(columns.items()):
            log.warning(
                "values the source did not send (its unavailable-value placeholder, or a null "
                "update under ignore_null_updates) and no earlier event nor silver held: "
                "stored null; REPLICA IDENTITY FULL on the source table makes PostgreSQL "
                "send unchanged large values",
                extra={
                    "entity": self.entity.name,
                    "column": column,
                    "unavailable_values": count,
                    "batch_id": batch_id,
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
