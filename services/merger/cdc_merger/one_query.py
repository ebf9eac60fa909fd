"""The merger as one streaming query for every entity (``merger.one_query``).

One query reads every entity's bronze table: a Delta stream per table, each projected
to one shape (the entity's name, and its bronze row as Avro bytes) and the streams
unioned. Each micro-batch is cached once, split by entity, and each entity present in
it is applied exactly as its own stream would apply it
(:class:`cdc_merger.merging.EntityMerge`), a few side by side. An entity without new
bronze rows in a batch runs no Spark job.

Replaying bronze is harmless to the merger (every step compares sequences), so where
the one query starts needs no exactness, only to never skip: each table's stream starts
at the bronze version its previous stream had reached (:func:`position_version`), and
rows of that version read again are applied again, to no effect. Spark cannot add a
source to a query's checkpoint, so when the set of entities changes (a table taken up
while running, a table added to the pipeline file) the query starts on a new
checkpoint, each table carried over from the old one's last committed batch; the old
checkpoint is kept aside (``_all.<time>``). The tables, in the order of the query's
sources, and the choice of each one's start are written in the checkpoint
(``cdc_shared.stream_checkpoint.SOURCES_FILE``, which ``cdc status`` reads) before the
query's first batch is planned: Spark plans that batch again from the same options after
a crash.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.jvm_bridge import avro_schema_of_spark_type, hadoop_path, write_text
from cdc_shared.layout import ALL_ENTITIES, MERGER
from cdc_shared.observability import Stopwatch
from cdc_shared.spark import TABLES_AT_ONCE, side_by_side_in_groups
from cdc_shared.stream_checkpoint import (
    SOURCES_FILE,
    CheckpointFiles,
    HadoopFiles,
    last_committed_batch,
    planned_batches,
    recorded_sources,
)
from cdc_shared.streaming import QueryIdentity, StreamRunner
from cdc_shared.streaming.group import MemberStreams
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro, to_avro

from cdc_merger.bronze_start import replayable_from_first_commit
from cdc_merger.merging import EntityMerge

log = logging.getLogger("cdc_merger")

#: The columns of the one query's rows: their entity's name, and the bronze row itself
#: (Avro: the tables' rows differ in shape, and a union needs one).
ENTITY_COLUMN, ROW = "__entity", "__row"


@dataclass(eq=False)
class AllTablesMerge:
    """Every entity's bronze through one query into each entity's silver."""

    spark: SparkSession
    config: PipelineConfig
    entities: list[EntityConfig]
    runner: StreamRunner
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)

    def __post_init__(self) -> None:
        self.members = MemberStreams(self._open, lambda entity: entity.name, self.identity)
        self.row_schemas: dict[str, str] = {}  # entity -> the Avro schema of its rows in ROW
        for entity in self.entities:
            self.add(entity)

    def _open(self, entity: EntityConfig) -> EntityMerge:
        return EntityMerge(self.spark, self.config, entity, self.runner)

    @property
    def streams(self) -> dict[str, EntityMerge]:
        """Each entity's own stream (its quarantine's txnAppId: the entity and this query)."""
        return self.members.by_key

    def add(self, entity: EntityConfig, wait_s: float | None = None) -> None:
        """Take ``entity`` up: its bronze is read from the query's next start.

        With ``wait_s``, its silver and side tables are made first (bronze awaited
        ``wait_s``); if that raises, the entity is not taken up.
        """
        self.members.add(entity, wait_s)

    def prepare(self, wait_s: float) -> None:
        """Every entity's silver and side tables unless made already; the first alone."""
        self.members.prepare(wait_s)

    def source(self) -> DataFrame:
        """Every entity's bronze stream, as one union (see the module docstring)."""
        names = sorted(self.streams)
        starts = bronze_starts(self.spark, self.config, names, HadoopFiles(self.spark))
        parts = []
        for name in names:
            bronze = self.streams[name].bronze_stream(starts[name])
            self.row_schemas[name] = avro_schema_of_spark_type(self.spark, bronze.schema)
            row = F.struct(*[F.col(f"`{column}`") for column in bronze.columns])
            parts.append(bronze.select(F.lit(name).alias(ENTITY_COLUMN), to_avro(row).alias(ROW)))
        return functools.reduce(DataFrame.union, parts[1:], parts[0])

    def rows_of(self, batch: DataFrame, name: str) -> DataFrame:
        """``name``'s bronze rows in ``batch``, as its own stream reads them."""
        row = from_avro(F.col(ROW), self.row_schemas[name])
        return batch.where(F.col(ENTITY_COLUMN) == name).select(row.alias(ROW)).select(f"{ROW}.*")

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Each entity present in the batch applied as its own stream would.

        The batch is cached so that bronze is read once, whatever the number of entities;
        the entities present are found on the cache.
        """
        lap = Stopwatch()
        batch.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            present = sorted(row[0] for row in batch.select(ENTITY_COLUMN).distinct().collect())
            lap("split")
            applies = [
                functools.partial(
                    self.streams[name].process_batch,
                    self.rows_of(batch, name),
                    batch_id,
                )
                for name in present
            ]
            side_by_side_in_groups(applies, TABLES_AT_ONCE)
            lap("tables")
        finally:
            batch.unpersist()
        stats = self.runner.take_group_stats(present, batch_id)
        stats.extra.update(lap.laps)
        self.runner.report(ALL_ENTITIES, batch_id, stats)


def open_all_tables(
    spark: SparkSession,
    config: PipelineConfig,
    entities: list[EntityConfig],
    runner: StreamRunner,
) -> AllTablesMerge:
    """The merger's one stream over ``entities`` (an ``OpenGroup``)."""
    return AllTablesMerge(spark, config, entities, runner)


def bronze_starts(
    spark: SparkSession, config: PipelineConfig, names: list[str], files: CheckpointFiles
) -> dict[str, int | None]:
    """The bronze version each entity's stream of the one query starts at (None: snapshot).

    Kept as recorded in the checkpoint while its entities stay the same. Otherwise each
    entity carries on from the checkpoint's last committed batch, or else from its own
    stream's checkpoint (the merger run a query per entity before), or else from bronze's
    first commit when bronze can replay it (``cdc_merger.bronze_start``), else from its
    snapshot. A checkpoint that planned a batch with other entities is moved aside first.
    """
    checkpoint = config.layout.checkpoint(MERGER, ALL_ENTITIES)
    recorded = recorded_sources(files, checkpoint)
    if recorded is not None and recorded["entities"] == names:
        return dict(recorded["starting_versions"])
    carried: dict[str, int | None] = {}
    if recorded is not None and planned_batches(files, checkpoint):
        carried = carried_positions(files, checkpoint, recorded["entities"])
        aside = f"{checkpoint.rstrip('/')}.{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        _rename(spark, checkpoint, aside)
        log.warning(
            "the merger's one query reads other tables than its checkpoint: it starts on a "
            "new checkpoint, each table carried over from the old one (kept aside)",
            extra={"checkpoint": checkpoint, "moved_to": aside, "entities": len(names)},
        )
    elif recorded is not None:  # chosen, but no batch planned yet: keep what was chosen
        carried = dict(recorded["starting_versions"])
    starts = {
        name: carried[name] if name in carried else _own_start(spark, config, name, files)
        for name in names
    }
    for name, version in starts.items():  # a stream that read to the end is at the next one
        if version:
            starts[name] = min(version, _latest_version(spark, config.layout.bronze(name)))
    record = {"entities": names, "starting_versions": starts}
    write_text(spark, f"{checkpoint.rstrip('/')}/{SOURCES_FILE}", json.dumps(record, indent=1))
    return starts


def position_version(offset: Any) -> int | None:
    """The bronze version a stream at Delta source ``offset`` can start at and skip nothing.

    The offset's own version (its rows read again are applied again, to no effect; one not
    written yet is the stream's next: the caller starts at the latest instead); None
    (bronze's snapshot) for a stream still inside its first snapshot, which no version
    can resume.
    """
    if not isinstance(offset, dict) or offset.get("isStartingVersion", True):
        return None
    return int(offset["reservoirVersion"])


def carried_positions(
    files: CheckpointFiles, checkpoint: str, entities: list[str]
) -> dict[str, int | None]:
    """Each entity's start from the one query's last committed batch (sources in order)."""
    batch = last_committed_batch(files, checkpoint)
    if batch is None:  # planned, never committed: its recorded starts still hold
        recorded = recorded_sources(files, checkpoint) or {}
        return dict(recorded.get("starting_versions", {}))
    return {name: position_version(batch.sources[i]) for i, name in enumerate(entities)}


def _own_start(
    spark: SparkSession, config: PipelineConfig, name: str, files: CheckpointFiles
) -> int | None:
    """Where an entity's stream starts that the one query did not read before.

    Where its own stream committed, if it had one; else its bronze from the start (the
    first commit when bronze can replay it, else the snapshot).
    """
    batch = last_committed_batch(files, config.layout.checkpoint(MERGER, name))
    if batch is not None and batch.sources:
        return position_version(batch.sources[0])
    return 0 if replayable_from_first_commit(spark, config.layout.bronze(name)) else None


def _latest_version(spark: SparkSession, path: str) -> int:
    from delta.tables import DeltaTable

    (latest,) = DeltaTable.forPath(spark, path).history(1).select("version").collect()
    return int(latest[0])


def _rename(spark: SparkSession, source: str, target: str) -> None:
    fs, path = hadoop_path(spark, source)
    _, moved = hadoop_path(spark, target)
    if not fs.rename(path, moved):
        raise OSError(f"could not move the checkpoint {source} aside to {target}")
