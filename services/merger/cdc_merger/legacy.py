"""The first start after the releases before one bronze: their bronze tables, drained.

Those releases kept a bronze table per entity (``bronze/<entity>``) and a merger stream
per entity (or one over all of them) with its own checkpoint. The ingestor now writes
one bronze, starting each topic where those tables end (``cdc_ingestor.positions``), so
what remains of an old table is the part its merger had not merged yet. At the first
start, each table reads its old table from where its old stream stood to its end, with a
stream of its own run to the end (``availableNow``, a checkpoint of its own so that a
kill resumes it), and applies it as any batch (replaying what was merged before changes
nothing); silver's log then records the drain (app id ``MERGER_LEGACY_APP``), and the old table
is never read again. Nothing is lost: the old tables' rows are merged whatever their
order with the new bronze's, since every step compares sequences.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cdc_shared.clients.delta_rs import transaction_versions
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts import bronze
from cdc_shared.contracts.layout import ALL_ENTITIES, MERGER_LEGACY_APP
from cdc_shared.contracts.stream_checkpoint import entity_source, last_committed_batch
from cdc_shared.jvm.bridge import HadoopFiles, delete_tree
from cdc_shared.streaming.tables import idempotent_append, not_quarantined_yet, record_progress
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from cdc_merger.apply import apply_batch, apply_history
from cdc_merger.merging import SERVICE, quarantine_rows

if TYPE_CHECKING:
    from cdc_merger.merging import TableMerge

log = logging.getLogger("cdc_merger")


def drain_legacy_bronze(spark: SparkSession, config: PipelineConfig, table: TableMerge) -> None:
    """Merge what ``bronze/<entity>`` holds that its old stream had not (see the module)."""
    old = config.layout.legacy_bronze(table.name)
    silver = config.layout.silver(table.name)
    if not DeltaTable.isDeltaTable(spark, old):
        return
    if (
        transaction_versions(config, {table.name: silver}, MERGER_LEGACY_APP)[table.name]
        is not None
    ):
        return
    start = old_position(spark, config, table.name)
    if table.payload_type is None:
        table.typed_as(_payload_type(spark.read.format("delta").load(old).schema))
    checkpoint = config.layout.checkpoint(SERVICE, f"_legacy.{table.name}")
    reader = spark.readStream.format("delta")
    if start is not None:
        reader = reader.option("startingVersion", start)
    if config.merger.max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", config.merger.max_files_per_trigger)

    def apply(batch: DataFrame, batch_id: int) -> None:
        table._tables(batch)

        def quarantine(rejected: DataFrame) -> None:
            rows = quarantine_rows(rejected, table.name, batch_id)
            new = not_quarantined_yet(spark, rows, config.layout.quarantine(SERVICE))
            app = f"{MERGER_LEGACY_APP}-{table.name}"
            idempotent_append(new, config.layout.quarantine(SERVICE), app, batch_id)

        dropped, nulls = table.dropped_columns(), table._null_update_columns()
        apply_batch(
            spark, batch, table.layout, quarantine, table.state, table.placeholder, dropped, nulls
        )
        if table.layout.history is not None:
            apply_history(
                spark, batch, table.layout, table.state, table.placeholder, dropped, nulls
            )

    query = (
        reader.load(old)
        .writeStream.foreachBatch(apply)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"draining {old} failed: {query.exception()}")
    record_progress(spark, silver, (MERGER_LEGACY_APP, 1))
    if table.layout.history is not None:
        record_progress(spark, table.layout.history.path, (MERGER_LEGACY_APP, 1))
    delete_tree(spark, checkpoint)
    log.info(
        "an entity's bronze table of the releases before one bronze is drained into silver",
        extra={"entity": table.name, "table": old, "from_version": start},
    )


def old_position(spark: SparkSession, config: PipelineConfig, entity: str) -> int | None:
    """The version of ``bronze/<entity>`` its old merger stream stood at (None: the start).

    From its own checkpoint's last committed batch, else from the one query's; a stream
    still inside its first snapshot (or none) starts from the table's start.
    """
    files = HadoopFiles(spark)
    for name in (entity, ALL_ENTITIES):
        checkpoint = config.layout.legacy_checkpoint(SERVICE, name)
        batch = last_committed_batch(files, checkpoint)
        if batch is None:
            continue
        offset: Any = entity_source(batch, files, checkpoint, entity)
        if isinstance(offset, dict) and not offset.get("isStartingVersion", True):
            return int(offset["reservoirVersion"])
    return None


def _payload_type(schema: T.StructType) -> T.StructType:
    """An old bronze table's rows as one bronze's payload type (what is not shared)."""
    shared = set(bronze.SHARED_COLUMNS)
    return T.StructType([f for f in schema.fields if f.name not in shared])
