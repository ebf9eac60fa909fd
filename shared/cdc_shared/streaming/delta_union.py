"""One streaming query over many entities' Delta tables (``<service>.one_query``).

The merger (every bronze table) and the publishers (every silver table's change feed)
can each run as one query: a Delta stream per table, each projected to one shape (the
entity's name, and its row as Avro bytes: the tables' rows differ in shape, a union
needs one) and the streams unioned. Each micro-batch is cached once, split by entity,
and each entity present in it is handed, as its own rows, to that entity's own stream
(``process_batch``), a few side by side. An entity without new rows in a batch runs no
Spark job.

Replaying a Delta source is harmless to these services (the merger compares sequences,
publisher-kafka skips versions its progress covers, Elasticsearch refuses versions it
holds), so where the one query starts needs no exactness, only to never skip: each
table's stream starts at the version its previous stream had reached
(:func:`position_version`), and rows of that version read again are written again, to
no effect. Spark cannot add a source to a query's checkpoint, so when the set of
entities changes (a table taken up while running, a table added to the pipeline file)
the query starts on a new checkpoint, each table carried over from the old one's last
committed batch; the old checkpoint is kept aside (``_all.<time>``). The tables, in the
order of the query's sources, and each one's start are written in the checkpoint
(:data:`cdc_shared.stream_checkpoint.SOURCES_FILE`, which ``cdc status`` reads) before
the query's first batch is planned: Spark plans that batch again from the same options
after a crash. A table whose write fails for it alone is held back
(:mod:`cdc_shared.streaming.held`); the next start takes it up on a new checkpoint the
same way, from the version its failed batch started at.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro, to_avro

from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.jvm_bridge import avro_schema_of_spark_type, delete_if_exists, write_text
from cdc_shared.layout import ALL_ENTITIES, StorageLayout
from cdc_shared.observability import Stopwatch
from cdc_shared.spark import cached_in_few_partitions
from cdc_shared.stream_checkpoint import (
    SOURCES_FILE,
    CheckpointFiles,
    HadoopFiles,
    last_committed_batch,
    move_aside,
    planned_batches,
    recorded_sources,
    start_file,
)
from cdc_shared.streaming.group import MemberStream, MemberStreams
from cdc_shared.streaming.held import HeldTables
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner

log = logging.getLogger("cdc_shared.streaming")

#: The columns of the one query's rows: their entity's name, and the entity's row itself
#: (Avro: the tables' rows differ in shape, and a union needs one).
ENTITY_COLUMN, ROW = "__entity", "__row"


class DeltaMember(MemberStream, Protocol):
    """An entity's stream over one Delta table, as the one query uses it."""

    def stream_from(self, version: int | None) -> DataFrame:
        """Its Delta stream from ``version`` (None: where a stream with no position starts)."""

    def first_start(self) -> int | None:
        """The version a stream of it that read nothing before starts at (None: its default)."""

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Write its rows of a micro-batch, idempotently."""


Member = TypeVar("Member", bound=DeltaMember)


@dataclass(eq=False)
class DeltaTablesQuery(Generic[Member]):
    """Every entity's Delta table through one query into each entity's own stream.

    ``open_member`` builds an entity's stream; ``table_path`` names the Delta table an
    entity's stream reads (to clamp a start to its latest version).
    """

    spark: SparkSession
    config: PipelineConfig
    service: str
    entities: list[EntityConfig]
    runner: StreamRunner
    open_member: Callable[[EntityConfig], Member]
    table_path: Callable[[str], str]
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)

    def __post_init__(self) -> None:
        self.members = MemberStreams(self.open_member, lambda entity: entity.name, self.identity)
        self.row_schemas: dict[str, str] = {}  # entity -> the Avro schema of its rows in ROW
        self.held = HeldTables(self.spark, self.checkpoint(), self.runner)
        for entity in self.entities:
            self.add(entity)

    @property
    def streams(self) -> dict[str, Member]:
        """Each entity's own stream (its idempotent writes name the entity and this query)."""
        return self.members.by_key

    def add(self, entity: EntityConfig, wait_s: float | None = None) -> None:
        """Take ``entity`` up: its table is read from the query's next start.

        With ``wait_s``, what it writes is made first (its table awaited ``wait_s``); if
        that raises, the entity is not taken up.
        """
        self.members.add(entity, wait_s)

    def prepare(self, wait_s: float) -> None:
        """What every entity writes, unless made already; the first alone.

        An entity that cannot start alone is held (``HeldTables.refuse_at_start``).
        """
        self.held.refuse_at_start(self.members.prepare(wait_s), len(self.streams))

    def source(self) -> DataFrame:
        """Every entity's Delta stream, as one union (see the module docstring)."""
        names = sorted(self.streams)
        starts = starting_versions(self, names, HadoopFiles(self.spark))
        parts = []
        for name in names:
            stream = self.streams[name].stream_from(starts[name])
            self.row_schemas[name] = avro_schema_of_spark_type(self.spark, stream.schema)
            row = F.struct(*[F.col(f"`{column}`") for column in stream.columns])
            parts.append(stream.select(F.lit(name).alias(ENTITY_COLUMN), to_avro(row).alias(ROW)))
        return functools.reduce(DataFrame.union, parts[1:], parts[0])

    def rows_of(self, batch: DataFrame, name: str) -> DataFrame:
        """``name``'s rows in ``batch``, as its own stream reads them."""
        row = from_avro(F.col(ROW), self.row_schemas[name])
        return batch.where(F.col(ENTITY_COLUMN) == name).select(row.alias(ROW)).select(f"{ROW}.*")

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Each entity present in the batch written as its own stream would write it.

        The batch is cached (in few partitions) so that each table is read once, whatever
        the number of entities; the entities present are found on the cache. A table that
        fails alone is held back from this batch's start (:mod:`cdc_shared.streaming.held`).
        """
        lap = Stopwatch()
        with cached_in_few_partitions(batch) as cached:
            present = sorted(row[0] for row in cached.select(ENTITY_COLUMN).distinct().collect())
            lap("split")
            writes = {
                name: functools.partial(
                    self.streams[name].process_batch, self.rows_of(cached, name), batch_id
                )
                for name in present
                if name not in self.held
            }
            written = self.held.write_each(writes, batch_id, self.identity.get(), self.batch_start)
            lap("tables")
        stats = self.runner.take_group_stats(written, batch_id)
        stats.extra.update(lap.laps)
        self.runner.report(ALL_ENTITIES, batch_id, stats)

    def batch_start(self, name: str) -> int | None:
        """The version ``name``'s rows of the batch running now start at (its position)."""
        files = HadoopFiles(self.spark)
        recorded = recorded_sources(files, self.checkpoint()) or {"entities": []}
        return carried_positions(files, self.checkpoint(), recorded["entities"]).get(name)

    def checkpoint(self) -> str:
        """The one query's checkpoint, ``_checkpoints/<service>/_all``."""
        return self.config.layout.checkpoint(self.service, ALL_ENTITIES)

    def own_start(self, name: str, files: CheckpointFiles) -> int | None:
        """Where an entity's stream starts that the one query did not read before.

        Where its own stream committed, if it had one (the service ran a query per
        entity before); else where a new stream of it starts.
        """
        batch = last_committed_batch(files, self.config.layout.checkpoint(self.service, name))
        if batch is not None and batch.sources:
            return position_version(batch.sources[0])
        return self.streams[name].first_start()

    def latest_version(self, name: str) -> int:
        """The latest version of the Delta table ``name``'s stream reads."""
        from delta.tables import DeltaTable

        table = DeltaTable.forPath(self.spark, self.table_path(name))
        (latest,) = table.history(1).select("version").collect()
        return int(latest[0])


def delta_tables_group(
    service: str,
    open_member: Callable[[SparkSession, PipelineConfig, EntityConfig, StreamRunner], Member],
    table_path: Callable[[StorageLayout, str], str],
) -> Callable[
    [SparkSession, PipelineConfig, list[EntityConfig], StreamRunner], DeltaTablesQuery[Member]
]:
    """A service's ``OpenGroup``: one query over every entity's Delta table.

    ``table_path`` names an entity's table (e.g. ``StorageLayout.bronze``); each entity's
    rows go to the stream ``open_member`` builds for it.
    """

    def open_group(
        spark: SparkSession,
        config: PipelineConfig,
        entities: list[EntityConfig],
        runner: StreamRunner,
    ) -> DeltaTablesQuery[Member]:
        return DeltaTablesQuery(
            spark,
            config,
            service,
            entities,
            runner,
            open_member=lambda entity: open_member(spark, config, entity, runner),
            table_path=functools.partial(table_path, config.layout),
        )

    return open_group


def starting_versions(
    query: DeltaTablesQuery[Any], names: list[str], files: CheckpointFiles
) -> dict[str, int | None]:
    """The version each entity's stream of the one query starts at (None: its default).

    Kept as recorded in the checkpoint while its entities stay the same and it holds no
    table back from an earlier run. Otherwise each entity carries on from the
    checkpoint's last committed batch (a held table from its held position), or else
    from where its own stream stood (``DeltaTablesQuery.own_start``). A checkpoint that
    planned a batch is moved aside first; tables held in this run stay held. The starts
    are written beside the checkpoint before it is moved (``start_file``), so a start
    killed after the move carries on from them rather than from each table's own start.
    """
    checkpoint = query.checkpoint()
    recorded = recorded_sources(files, checkpoint)
    held = query.held
    if recorded is not None and recorded["entities"] == names and not held.resuming:
        return dict(recorded["starting_versions"])
    carried: dict[str, int | None] = {}
    moving = recorded is not None and bool(planned_batches(files, checkpoint))
    if recorded is not None and moving:
        carried = {
            **carried_positions(files, checkpoint, recorded["entities"]),
            **held.positions(),
        }
    elif recorded is not None:  # chosen, but no batch planned yet: keep what was chosen
        carried = dict(recorded["starting_versions"])
    elif (interrupted := files.read_text_if_exists(start_file(checkpoint))) is not None:
        carried = dict(json.loads(interrupted)["starting_versions"])  # killed after a move
    starts = {
        name: carried[name] if name in carried else query.own_start(name, files) for name in names
    }
    for name, version in starts.items():  # a stream that read to the end is at the next one
        if version:
            starts[name] = min(version, query.latest_version(name))
    record = json.dumps({"entities": names, "starting_versions": starts}, indent=1)
    if moving:
        write_text(query.spark, start_file(checkpoint), record)
        aside = move_aside(query.spark, checkpoint)
        log.warning(
            "a one query reads other tables than its checkpoint, or takes up tables it "
            "held back: it starts on a new checkpoint, each table carried over from the "
            "old one (kept aside)",
            extra={
                "checkpoint": checkpoint,
                "moved_to": aside,
                "entities": len(names),
                "taken_up": sorted(held.resuming),
            },
        )
        held.resuming.clear()
        if held.held:
            held.save()
    write_text(query.spark, f"{checkpoint.rstrip('/')}/{SOURCES_FILE}", record)
    delete_if_exists(query.spark, start_file(checkpoint))
    return starts


def position_version(offset: Any) -> int | None:
    """The version a stream at Delta source ``offset`` can start at and skip nothing.

    The offset's own version (its rows read again are written again, to no effect; one
    not written yet is the stream's next: the caller starts at the latest instead); None
    (the stream's default start) for a stream still inside its first snapshot, which no
    version can resume.
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
