"""The ingestor as one streaming query for every entity (``ingestor.one_query``).

One Kafka source subscribes to every entity's topic; each micro-batch is cached once,
split by topic, and each entity present in it is written exactly as its own stream
would write it (:class:`cdc_ingestor.ingestion.EntityIngestion`: decode, bronze and
quarantine appended idempotently, its ``txnAppId`` naming the entity and the one
query's id, its ``txnVersion`` the batch id). An entity without records in a batch runs
no Spark job, so an idle table costs nothing; the entities of a batch are written a few
side by side, to keep both cores of a small machine busy.

The query's checkpoint is ``_checkpoints/ingestor/_all``. Its first start carries on from
where the per-entity streams committed (their checkpoints' last committed offsets,
:func:`starting_offsets`), so switching a running pipeline over loses and repeats
nothing. A per-entity stream with a batch planned but not committed must finish it
first (:func:`refuse_unfinished_per_entity_batches`), and going back to one query per
entity is refused (:func:`cdc_ingestor.ingestion.refuse_per_entity_after_one_query`):
both would write records to bronze twice.

Spark's Kafka source cannot drop a topic from its checkpoint (it would report the
topic's records lost), and reads a topic added to it from its start. So when the topics
change in a way the checkpoint cannot carry (a table taken out of the pipeline, a table
put back, a table whose topic the broker refuses to read), the query starts on a new
checkpoint, every topic where the old one stood (:func:`new_checkpoint_start`); the old
one is kept aside. The new start is written beside the checkpoint first
(:func:`start_file`), so a crash before the new query plans its first batch repeats and
skips nothing.

A table whose batch fails for it alone is held back from its first record in that batch
(:mod:`cdc_shared.streaming.held`) while the others go on; the next start writes its
records from there to where the query resumes before the query starts
(:meth:`AllTopicsIngestion.take_up_held`). A table whose topic the broker refuses to
read fails the query's read of every topic: it is held back where the query stood, and
the query goes on without its topic (:meth:`AllTopicsIngestion.hold_unreadable`); the
next start reads it again from there.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from cdc_shared.avro import SchemaRegistry
from cdc_shared.clients import make_admin
from cdc_shared.config import ConfigError, EntityConfig, PipelineConfig
from cdc_shared.jvm_bridge import delete_if_exists, delta_table_bytes, write_text
from cdc_shared.layout import ALL_ENTITIES, INGESTOR
from cdc_shared.observability import Stopwatch
from cdc_shared.spark import cached_in_few_partitions
from cdc_shared.stream_checkpoint import (
    CheckpointFiles,
    HadoopFiles,
    held_tables,
    kafka_initial_offsets,
    last_committed_batch,
    move_aside,
    parse_offsets,
    planned_batches,
    start_file,
)
from cdc_shared.streaming import QueryIdentity, StreamRunner
from cdc_shared.streaming.group import MemberStreams
from cdc_shared.streaming.held import HeldTables
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_ingestor.framing_headers import headers_by_topic
from cdc_ingestor.ingestion import EntityIngestion, kafka_reader, kafka_source

log = logging.getLogger("cdc_ingestor")

#: Spark's Kafka source offsets for "from the start" and "from the end" of a partition.
EARLIEST, LATEST = -2, -1
METADATA_TIMEOUT_S = 30.0


@dataclass(eq=False)
class AllTopicsIngestion:
    """Every entity's topic through one query into each entity's bronze table."""

    spark: SparkSession
    config: PipelineConfig
    entities: list[EntityConfig]
    runner: StreamRunner
    registry: SchemaRegistry
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)
    #: The tables whose topic the broker refused to read in this run (why): not subscribed.
    unreadable: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.members = MemberStreams(self._open, lambda entity: entity.source_topic, self.identity)
        self.checkpoint = self.config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
        self.held = HeldTables(self.spark, self.checkpoint, self.runner)
        self._start_file_in_use = True  # until the query's first batch is planned
        for entity in self.entities:
            self.add(entity)
        self.runner.hold_tables_with(self.hold_unreadable)

    def _open(self, entity: EntityConfig) -> EntityIngestion:
        return EntityIngestion(self.spark, self.config, entity, self.runner, self.registry)

    @property
    def by_topic(self) -> dict[str, EntityIngestion]:
        """Each entity's own stream (its txnAppId: the entity and the one query), by topic."""
        return self.members.by_key

    def add(self, entity: EntityConfig, wait_s: float | None = None) -> None:
        """Take ``entity`` up: its topic is read from the query's next start.

        With ``wait_s``, its bronze is made first; if that raises, it is not taken up.
        """
        self.members.add(entity, wait_s)

    def prepare(self, wait_s: float) -> None:
        """Every entity's bronze (and the quarantine) unless made already; the first alone.

        An entity that cannot start alone is held (``HeldTables.refuse_at_start``). Then
        the tables an earlier run held back are taken up again (:meth:`take_up_held`).
        """
        self.held.refuse_at_start(self.members.prepare(wait_s), len(self.by_topic))
        self.take_up_held()

    def take_up_held(self) -> None:
        """Each table an earlier run held back: its records it left unwritten, written now.

        The records from its held offsets to where the query resumes (its last committed
        batch's end offsets) are read as one batch (Spark's Kafka source, as a batch
        query) and written as the table's stream writes a batch, idempotently: its
        ``txnAppId`` names the hold (``held-<query id>``), its ``txnVersion`` the batch
        it was held in, so a crash before the held file forgets the table repeats
        nothing. From there the query reads the table again. A table failing alone again
        is held again; another failure stops the start. A table whose topic the query
        did not read (the broker refused it) is left to :meth:`carry_over`, which starts
        a new checkpoint with it from its held position.
        """
        resume_at = last_committed_batch(HadoopFiles(self.spark), self.checkpoint)
        ends = resume_at.sources[0] if resume_at is not None and resume_at.sources else None
        for name, entry in list(self.held.resuming.items()):
            stream = next((s for s in self.by_topic.values() if s.entity.name == name), None)
            if stream is None or name in self.held:
                continue  # no longer configured, or could not start: kept held
            topic = stream.entity.source_topic
            if topic not in (ends or {}):
                continue  # not read by the query: ``carry_over`` starts it where held
            end = (ends or {})[topic]
            start = {p: int(entry["position"].get(p, EARLIEST)) for p in end}
            lap = Stopwatch()
            try:
                if any(start[p] == EARLIEST or start[p] < int(end[p]) for p in end):
                    records = held_records(self.spark, self.config, topic, start, end)
                    self._open_as_hold(stream.entity, str(entry["query_id"])).process_batch(
                        records, int(entry["batch_id"])
                    )
            except Exception as error:
                failure = self.held.alone(name, error)
                if failure is None:
                    raise
                self.held.resuming.pop(name)
                self.held.hold(
                    name, entry["position"], entry["batch_id"], entry["query_id"], failure.message
                )
                continue
            counts = self.runner.take_stats(name, int(entry["batch_id"])).counts
            self.held.taken_up(name)
            log.info(
                "a table held back is taken up again: its records since were written",
                extra={"entity": name, "from": start, "to": end, **counts, **lap.laps},
            )

    def _open_as_hold(self, entity: EntityConfig, held_by: str) -> EntityIngestion:
        """``entity``'s stream whose writes name the hold (``held-<query id>``)."""
        stream = self._open(entity)
        stream.identity = QueryIdentity()
        stream.identity.set(f"held-{held_by}")
        return stream

    @property
    def readable(self) -> list[EntityConfig]:
        """The entities whose topic the query reads: all but those the broker refused."""
        return [s.entity for s in self.by_topic.values() if s.entity.name not in self.unreadable]

    def source(self) -> DataFrame:
        """One Kafka source over every entity's topic the broker lets it read.

        On a new checkpoint first when the old one cannot carry these topics
        (:meth:`carry_over`); a new checkpoint starts where :func:`starting_offsets` says.
        """
        files = HadoopFiles(self.spark)
        read = self.readable
        self.carry_over(read, files)
        topics = sorted(entity.source_topic for entity in read)
        start = starting_offsets(self.config, topics, files)
        return kafka_source(self.spark, self.config, ",".join(topics), start)

    def carry_over(self, read: list[EntityConfig], files: CheckpointFiles) -> None:
        """Move the checkpoint aside when it cannot go on reading the topics of ``read``.

        Where the new one starts each topic (:func:`new_checkpoint_start`) is written
        first (:func:`start_file`): a crash after the move starts there too, and one
        before it moves the checkpoint again from the same place. The tables held back
        stay held in the new checkpoint; the positions of those an earlier run held are
        in its start.
        """
        start = new_checkpoint_start(
            self.config, read, files, ingested_ends(self.spark, self.config)
        )
        if start is None:
            return
        write_text(self.spark, start_file(self.checkpoint), json.dumps(start, sort_keys=True))
        aside = move_aside(self.spark, self.checkpoint)
        self.held.resuming.clear()
        if self.held.held:
            self.held.save()
        self._start_file_in_use = True
        log.warning(
            "the ingestor's one query cannot go on with its checkpoint's topics: it starts "
            "on a new checkpoint where the old one stood (kept aside)",
            extra={
                "checkpoint": self.checkpoint,
                "moved_to": aside,
                "starting_offsets": start,
                "not_read": sorted(self.unreadable),
            },
        )

    def hold_unreadable(self, entity: str, reason: str) -> bool:
        """Hold ``entity``, whose topic the broker refuses to read; False if it cannot be.

        Spark's Kafka source reads every topic in one job, so one refused topic fails the
        query's every batch. The table is held back where the query stood (the end of
        its last committed batch, or where it started), stopped alone (``/health``, the
        exit code), and the query, rebuilt, goes on without its topic
        (:meth:`source`). Not for the last table read, nor for a query that has not
        planned a batch.
        """
        reading = self.readable
        refused = next((e for e in reading if e.name == entity), None)
        files = HadoopFiles(self.spark)
        reached = reached_offsets(files, self.checkpoint)
        if refused is None or len(reading) < 2 or reached is None:
            return False
        _, ends = reached
        earlier = self.held.positions().get(entity)
        position = earlier if earlier is not None else ends.get(refused.source_topic, {})
        batch_id = max(planned_batches(files, self.checkpoint), default=0)  # the one failing
        self.unreadable[entity] = reason
        self.held.hold(entity, position, batch_id, self.identity.get(), reason)
        return True

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Each entity present in the batch written as its own stream would (idempotently).

        The batch is cached (in few partitions) so that Kafka is read once, whatever the
        number of entities; the topics present, and the framing headers each uses (its
        decode plan is narrowed to them), are found on the cache in one pass. A table
        that fails alone is held back from its first record in this batch
        (:mod:`cdc_shared.streaming.held`).
        """
        lap = Stopwatch()
        if self._start_file_in_use:  # a batch is planned: Spark keeps where it started
            delete_if_exists(self.spark, start_file(self.checkpoint))
            self._start_file_in_use = False
        with cached_in_few_partitions(batch) as cached:
            headers = headers_by_topic(cached)
            present = sorted(headers)
            lap("split")
            unknown = [topic for topic in present if topic not in self.by_topic]
            if unknown:  # cannot happen with a subscription by name: never drop records
                raise RuntimeError(f"records of topics no entity reads: {unknown}")
            streams = [self.by_topic[topic] for topic in present]
            entities = {stream.entity.name: stream.entity for stream in streams}
            writes = {
                stream.entity.name: functools.partial(
                    stream.process_batch,
                    cached.where(F.col("topic") == stream.entity.source_topic),
                    batch_id,
                    headers[stream.entity.source_topic],
                )
                for stream in streams
                if stream.entity.name not in self.held
            }
            written = self.held.write_each(
                writes,
                batch_id,
                self.identity.get(),
                lambda name: self.batch_start(cached, batch_id, entities[name]),
            )
            lap("tables")
        stats = self.runner.take_group_stats(written, batch_id)
        stats.extra.update(lap.laps)
        self.runner.report(ALL_ENTITIES, batch_id, stats)

    def batch_start(self, cached: DataFrame, batch_id: int, entity: EntityConfig) -> dict[str, int]:
        """The offsets of ``entity``'s first records in the batch running now, by partition.

        A partition without records of it in the batch: the batch's end offset there
        (``offsets/<batch id>``, written before the batch runs).
        """
        planned = HadoopFiles(self.spark).read_text_if_exists(
            f"{self.checkpoint.rstrip('/')}/offsets/{batch_id}"
        )
        ends = parse_offsets(planned)[0] if planned else {}
        start = {p: int(o) for p, o in (ends or {}).get(entity.source_topic, {}).items()}
        firsts = (
            cached.where(F.col("topic") == entity.source_topic)
            .groupBy("partition")
            .agg(F.min("offset"))
            .collect()
        )
        return {**start, **{str(row[0]): int(row[1]) for row in firsts}}


def held_records(
    spark: SparkSession,
    config: PipelineConfig,
    topic: str,
    start: dict[str, int],
    end: dict[str, int],
) -> DataFrame:
    """``topic``'s records from ``start`` to ``end`` (offsets by partition), as a batch."""
    reader = kafka_reader(spark.read, config, topic, json.dumps({topic: start}))
    ending = json.dumps({topic: {p: int(o) for p, o in end.items()}})
    return reader.option("endingOffsets", ending).load()


def open_all_topics(
    spark: SparkSession,
    config: PipelineConfig,
    entities: list[EntityConfig],
    runner: StreamRunner,
    registry: SchemaRegistry,
) -> AllTopicsIngestion:
    """The ingestor's one stream over ``entities`` (an ``OpenGroup``)."""
    refuse_unfinished_per_entity_batches(config, HadoopFiles(spark))
    return AllTopicsIngestion(spark, config, entities, runner, registry)


def refuse_unfinished_per_entity_batches(config: PipelineConfig, files: CheckpointFiles) -> None:
    """ConfigError when the one query would start before a batch that may be in bronze.

    Only for its first start (its checkpoint new), which carries on from each per-entity
    stream's last committed batch: a batch such a stream planned but did not commit may
    have been written to bronze already, under that stream's own ``txnAppId``.
    """
    checkpoint = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    if planned_batches(files, checkpoint):
        return  # the one query resumes from its own checkpoint
    if files.read_text_if_exists(start_file(checkpoint)) is not None:
        return  # a new checkpoint of the one query, carried over from its old one
    for entity in config.entities:
        checkpoint = config.layout.checkpoint(INGESTOR, entity.name)
        planned = planned_batches(files, checkpoint)
        committed = last_committed_batch(files, checkpoint)
        if planned and (committed is None or committed.batch_id != planned[-1]):
            raise ConfigError(
                f"the ingestor's stream for entity {entity.name!r} planned batch "
                f"{planned[-1]} but did not commit it ({checkpoint}); it may be in bronze "
                "already. Finish it first: run `cdc-ingestor --once` with "
                "ingestor.one_query off, then start with it on."
            )


#: The partitions of each of the topics that exists on the broker (``topic_partitions``).
PartitionLister = Callable[[PipelineConfig, list[str]], dict[str, list[int]]]


def starting_offsets(
    config: PipelineConfig,
    topics: list[str],
    files: CheckpointFiles,
    partitions: PartitionLister | None = None,
) -> str:
    """Where the one query starts when its checkpoint is new (Spark's ``startingOffsets``).

    A checkpoint carried over from an old one starts where its :func:`start_file` says.
    Otherwise each topic whose entity's own stream committed a batch starts at that
    batch's end offsets; the others where ``ingestor.starting_offsets`` says. Without
    any per-entity checkpoint, that setting as it is. A partition not named starts at
    its start, as Spark reads a new partition.
    """
    checkpoint = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    carried_text = files.read_text_if_exists(start_file(checkpoint))
    if carried_text is not None and not planned_batches(files, checkpoint):
        carried_over: dict[str, dict[str, int]] = json.loads(carried_text)
        listed = (partitions or topic_partitions)(config, topics)
        return json.dumps(_every_partition(carried_over, listed), sort_keys=True)
    setting = config.ingestor.starting_offsets
    carried: dict[str, dict[str, int]] = {}
    for entity in config.entities:
        if entity.source_topic not in topics:
            continue
        batch = last_committed_batch(files, config.layout.checkpoint(INGESTOR, entity.name))
        if batch is not None and batch.sources and batch.sources[0]:
            offsets = batch.sources[0].get(entity.source_topic, {})
            carried[entity.source_topic] = {p: int(o) for p, o in offsets.items()}
    if not carried:
        return setting
    given: dict[str, dict[str, int]] = (
        json.loads(setting) if setting.lstrip().startswith("{") else {}
    )
    default = LATEST if setting == "latest" else EARLIEST
    start: dict[str, dict[str, int]] = {}
    for topic, numbers in (partitions or topic_partitions)(config, topics).items():
        own = carried.get(topic) or given.get(topic, {})
        fallback = EARLIEST if topic in carried else default
        start[topic] = {str(p): int(own.get(str(p), fallback)) for p in numbers}
    return json.dumps(start, sort_keys=True)


def topic_partitions(config: PipelineConfig, topics: list[str]) -> dict[str, list[int]]:
    """The partitions of each of ``topics`` that exists on the broker."""
    admin = make_admin(config.kafka)
    metadata = admin.list_topics(timeout=METADATA_TIMEOUT_S).topics
    return {
        topic: sorted(metadata[topic].partitions)
        for topic in topics
        if topic in metadata and metadata[topic].error is None
    }


#: Where an entity's topic was ingested to: the next offset by partition, from its bronze
#: and quarantine rows (None: it holds no record of the topic).
IngestedEnds = Callable[[EntityConfig], dict[str, int] | None]


def reached_offsets(
    files: CheckpointFiles, checkpoint: str
) -> tuple[int, dict[str, dict[str, int]]] | None:
    """Where the query at ``checkpoint`` stood: its last committed batch and its ends.

    Before any batch committed, where it started (batch -1: Spark's first offsets of
    its Kafka source). None when neither is known.
    """
    committed = last_committed_batch(files, checkpoint)
    if committed is not None:
        return committed.batch_id, dict(committed.sources[0] or {})
    initial = kafka_initial_offsets(files, checkpoint)
    return None if initial is None else (-1, initial)


def new_checkpoint_start(
    config: PipelineConfig,
    entities: list[EntityConfig],
    files: CheckpointFiles,
    ingested: IngestedEnds,
    partitions: PartitionLister | None = None,
) -> dict[str, dict[str, int]] | None:
    """Where a new checkpoint must start ``entities``' topics; None: the old one goes on.

    Spark's Kafka source cannot drop a topic from a checkpoint: a table taken out of the
    pipeline (or no longer selected by an entity set, or whose topic the broker refuses
    to read) would have its topic's partitions reported lost (failOnDataLoss), as if the
    broker had deleted records. And it reads a topic added to a checkpoint from its
    start: right for a new table, but a table put back, whose records bronze holds
    already, would have them written twice. So then a new checkpoint starts each topic
    where the old one stood (its last committed batch's end, or where it started), a
    table it holds back where it was held, a table put back where it was held or where
    its records end (``ingested``), a new table from its start: nothing read twice or
    skipped. A batch planned after that was read whole before any table wrote it when a
    topic was refused; ConfigError if a table did write it (its quarantine may lack it:
    finish it first, with the pipeline as it was), or if the checkpoint does not say
    where it stood.
    """
    checkpoint = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    planned = planned_batches(files, checkpoint)
    if not planned:
        return None  # a new checkpoint: ``starting_offsets`` chooses each topic's start
    text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/offsets/{planned[-1]}")
    read: dict[str, dict[str, int]] = (parse_offsets(text)[0] if text else None) or {}
    held = {name: entry["position"] for name, entry in held_tables(files, checkpoint).items()}
    topics = [entity.source_topic for entity in entities]
    dropped = sorted(set(read) - set(topics))
    back = {
        entity.source_topic: stood
        for entity in entities
        if entity.source_topic not in read and (stood := held.get(entity.name) or ingested(entity))
    }
    if not dropped and not back:
        return None
    problem = f"the ingestor's one query ({checkpoint}) " + "; and it ".join(
        ([f"reads topic(s) {dropped} that it no longer reads"] if dropped else [])
        + ([f"would read topic(s) {sorted(back)} from their start"] if back else [])
    )
    reached = reached_offsets(files, checkpoint)
    if reached is None:
        raise ConfigError(
            f"{problem}, and its first batch is planned but it does not say where it "
            "started: run `cdc-ingestor --once` with the pipeline as it was, then start "
            "it as it is now."
        )
    stood_at, ends = reached
    if planned[-1] != stood_at:  # the next batch failed: written by none, or by some?
        planned_for = [t for t in topics if _beyond(read.get(t), ends.get(t))]
        written = sorted(
            entity.name
            for entity in entities
            if entity.source_topic in planned_for
            and _beyond(ingested(entity), ends.get(entity.source_topic))
        )
        if written:
            raise ConfigError(
                f"{problem}. Its batch {planned[-1]}, planned after the one it stood at, is "
                f"in bronze for table(s) {written} already, perhaps not in the quarantine: "
                "run `cdc-ingestor --once` with the pipeline as it was to finish it, then "
                "start it as it is now."
            )
    name = {entity.source_topic: entity.name for entity in entities}
    start = {t: {**ends[t], **held.get(name[t], {})} for t in topics if t in ends}
    start.update({t: back.get(t, {}) for t in topics if t not in ends})
    listed = (partitions or topic_partitions)(config, topics)
    return _every_partition(start, listed)


def _every_partition(
    start: dict[str, dict[str, int]], listed: dict[str, list[int]]
) -> dict[str, dict[str, int]]:
    """``start`` for every partition ``listed`` (by topic); one it does not name: its start.

    Spark's ``startingOffsets`` must name every partition of a topic it names.
    """
    return {
        topic: {str(p): int(start.get(topic, {}).get(str(p), EARLIEST)) for p in numbers}
        for topic, numbers in listed.items()
    }


def _beyond(ingested: dict[str, int] | None, committed: dict[str, int] | None) -> bool:
    """Whether records were ingested past the ``committed`` offsets (by partition)."""
    return any(int(end) > int((committed or {}).get(p, 0)) for p, end in (ingested or {}).items())


def ingested_ends(spark: SparkSession, config: PipelineConfig) -> IngestedEnds:
    """``IngestedEnds`` from bronze and the ingestor's quarantine, read with ``spark``.

    The last offset of each partition in the entity's bronze or quarantine rows, plus
    one (a poisoned record is in the quarantine, not in bronze). A bronze without data
    (a new table's) is not read; the quarantine is read once, for every topic.
    """
    quarantined: list[dict[str, dict[str, int]]] = []  # by topic, once read

    def quarantine_ends() -> dict[str, dict[str, int]]:
        if not quarantined:
            quarantine = config.layout.quarantine(INGESTOR)
            by_topic: dict[str, dict[str, int]] = {}
            if DeltaTable.isDeltaTable(spark, quarantine):
                rows = spark.read.format("delta").load(quarantine)
                for topic, partition, end in _next_offsets(rows, "kafka_topic").collect():
                    by_topic.setdefault(topic, {})[str(partition)] = int(end)
            quarantined.append(by_topic)
        return quarantined[0]

    def ends(entity: EntityConfig) -> dict[str, int] | None:
        bronze = config.layout.bronze(entity.name)
        if not DeltaTable.isDeltaTable(spark, bronze):
            return None  # never ingested (a new table): no Spark job
        found = dict(quarantine_ends().get(entity.source_topic, {}))
        if delta_table_bytes(spark, bronze):
            rows = spark.read.format("delta").load(bronze)
            for partition, end in _next_offsets(rows).collect():
                found[str(partition)] = max(int(end), found.get(str(partition), 0))
        return found or None

    return ends


def _next_offsets(rows: DataFrame, *by: str) -> DataFrame:
    """Per partition (and ``by``), the offset after the last of ``rows``' Kafka records."""
    grouped = rows.where(F.col("kafka_partition").isNotNull()).groupBy(*by, "kafka_partition")
    return grouped.agg(F.max("kafka_offset") + 1)
