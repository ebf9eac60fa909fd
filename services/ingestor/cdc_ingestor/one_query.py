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
both would write records to bronze twice. A table taken out of the pipeline
or put back is refused too, with where a new checkpoint starts
(:func:`refuse_topics_the_checkpoint_cannot_carry`): Spark cannot drop a topic from the
query's checkpoint, and would read a table put back from its start.

A table whose batch fails for it alone is held back from its first record in that batch
(:mod:`cdc_shared.streaming.held`) while the others go on; the next start writes its
records from there to where the query resumes before the query starts
(:meth:`AllTopicsIngestion.take_up_held`).
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
from cdc_shared.layout import ALL_ENTITIES, INGESTOR
from cdc_shared.observability import Stopwatch
from cdc_shared.spark import cached_in_few_partitions
from cdc_shared.stream_checkpoint import (
    CheckpointFiles,
    CommittedBatch,
    HadoopFiles,
    held_tables,
    last_committed_batch,
    parse_offsets,
    planned_batches,
)
from cdc_shared.streaming import QueryIdentity, StreamRunner
from cdc_shared.streaming.group import MemberStreams
from cdc_shared.streaming.held import HeldTables
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_ingestor.decode import headers_by_topic
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

    def __post_init__(self) -> None:
        self.members = MemberStreams(self._open, lambda entity: entity.source_topic, self.identity)
        self.checkpoint = self.config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
        self.held = HeldTables(self.spark, self.checkpoint, self.runner)
        for entity in self.entities:
            self.add(entity)

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
        is held again; another failure stops the start.
        """
        resume_at = last_committed_batch(HadoopFiles(self.spark), self.checkpoint)
        ends = resume_at.sources[0] if resume_at is not None and resume_at.sources else None
        for name, entry in list(self.held.resuming.items()):
            stream = next((s for s in self.by_topic.values() if s.entity.name == name), None)
            if stream is None or name in self.held:
                continue  # no longer configured, or could not start: kept held
            topic = stream.entity.source_topic
            end = (ends or {}).get(topic, {})
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

    def source(self) -> DataFrame:
        """One Kafka source over every entity's topic (see :func:`starting_offsets`)."""
        topics = sorted(self.by_topic)
        start = starting_offsets(self.config, topics, HadoopFiles(self.spark))
        return kafka_source(self.spark, self.config, ",".join(topics), start)

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Each entity present in the batch written as its own stream would (idempotently).

        The batch is cached (in few partitions) so that Kafka is read once, whatever the
        number of entities; the topics present, and the framing headers each uses (its
        decode plan is narrowed to them), are found on the cache in one pass. A table
        that fails alone is held back from its first record in this batch
        (:mod:`cdc_shared.streaming.held`).
        """
        lap = Stopwatch()
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
    files = HadoopFiles(spark)
    refuse_unfinished_per_entity_batches(config, files)
    refuse_topics_the_checkpoint_cannot_carry(config, entities, files, ingested_ends(spark, config))
    return AllTopicsIngestion(spark, config, entities, runner, registry)


def refuse_unfinished_per_entity_batches(config: PipelineConfig, files: CheckpointFiles) -> None:
    """ConfigError when the one query would start before a batch that may be in bronze.

    Only for its first start (its checkpoint new), which carries on from each per-entity
    stream's last committed batch: a batch such a stream planned but did not commit may
    have been written to bronze already, under that stream's own ``txnAppId``.
    """
    if planned_batches(files, config.layout.checkpoint(INGESTOR, ALL_ENTITIES)):
        return  # the one query resumes from its own checkpoint
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

    Each topic whose entity's own stream committed a batch starts at that batch's end
    offsets (its partitions not in them from their start, as Spark reads a new
    partition); the others where ``ingestor.starting_offsets`` says. Without any
    per-entity checkpoint, that setting as it is.
    """
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


def refuse_topics_the_checkpoint_cannot_carry(
    config: PipelineConfig,
    entities: list[EntityConfig],
    files: CheckpointFiles,
    ingested: IngestedEnds,
    partitions: PartitionLister | None = None,
) -> None:
    """ConfigError when the one query's checkpoint cannot go on with ``entities``' topics.

    Spark's Kafka source cannot drop a topic from a checkpoint: a table taken out of the
    pipeline (or no longer selected by an entity set) would have its topic's partitions
    reported lost (failOnDataLoss), as if the broker had deleted records. And it reads a
    topic added to a checkpoint from its start: right for a new table, but a table put
    back, whose records bronze holds already, would have them written twice. The error
    says how to go on: a new checkpoint starting where this one committed (a table it
    holds back where it was held), a table put back where its records end (``ingested``),
    a new table from its start; nothing read twice or skipped. A batch planned after the
    last committed one failed before any table wrote it when a topic was refused (the
    batch is read whole before any write); if a table did write it, the error asks to
    finish it first, with the pipeline as it was.
    """
    checkpoint = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    planned = planned_batches(files, checkpoint)
    if not planned:
        return  # a new checkpoint: ``starting_offsets`` chooses each topic's start
    text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/offsets/{planned[-1]}")
    read = (parse_offsets(text)[0] if text else None) or {}
    topics = [entity.source_topic for entity in entities]
    dropped = sorted(set(read) - set(topics))
    back = {
        entity.source_topic: ingested_to
        for entity in entities
        if entity.source_topic not in read and (ingested_to := ingested(entity))
    }
    if not dropped and not back:
        return
    problems = []
    if dropped:
        problems.append(
            f"reads topic(s) {dropped} that no table of the pipeline reads any more (taken "
            "out of the file, or no longer selected by an entity set): Spark's Kafka "
            "source cannot drop a topic from its checkpoint (it would report the topic's "
            "records lost)"
        )
    if back:
        problems.append(
            f"would read topic(s) {sorted(back)} from their start, though bronze holds "
            "their records already (tables put back): Spark's Kafka source reads a topic "
            "added to its checkpoint from its start, and bronze would hold them twice"
        )
    problem = f"the ingestor's one query ({checkpoint}) " + "; and it ".join(problems)
    committed = last_committed_batch(files, checkpoint)
    if committed is None:
        raise ConfigError(
            f"{problem}. Its first batch is planned but not committed (it may be in bronze "
            "already): run `cdc-ingestor --once` with the pipeline as it was, then start it "
            "as it is now."
        )
    if planned[-1] != committed.batch_id:  # the next batch failed: written by none, or some?
        written = sorted(
            entity.name
            for entity in entities
            if _beyond(ingested(entity), (committed.sources[0] or {}).get(entity.source_topic))
        )
        if written:
            raise ConfigError(
                f"{problem}. Its batch {planned[-1]}, planned after the last committed one, "
                f"is in bronze for table(s) {written} already, perhaps not in the quarantine: "
                "run `cdc-ingestor --once` with the pipeline as it was to finish it, then "
                "start it as it is now."
            )
    start = carried_over_start(config, entities, files, committed, back, partitions)
    raise ConfigError(
        f"{problem}. To go on, start the one query on a new checkpoint: move {checkpoint} "
        f"aside and set ingestor.starting_offsets to '{json.dumps(start, sort_keys=True)}' "
        f"(where the query committed its batch {committed.batch_id}, a table it holds back "
        "where it was held; a table put back where its records in bronze end; a new "
        "table's topic from its start), then start the ingestor. Per-table checkpoints "
        "(_checkpoints/ingestor/<table>) left from before the one query would take "
        "precedence: delete them first."
    )


def _beyond(ingested: dict[str, int] | None, committed: dict[str, int] | None) -> bool:
    """Whether records were ingested past the ``committed`` offsets (by partition)."""
    return any(int(end) > int((committed or {}).get(p, 0)) for p, end in (ingested or {}).items())


def carried_over_start(
    config: PipelineConfig,
    entities: list[EntityConfig],
    files: CheckpointFiles,
    committed: CommittedBatch,
    put_back: dict[str, dict[str, int]],
    partitions: PartitionLister | None = None,
) -> dict[str, dict[str, int]]:
    """Where a new checkpoint of the one query starts ``entities``' topics (by partition).

    Carried over from the old one: where it ``committed``, a table it holds back where it
    was held. A topic the old one did not read: where its records end when bronze holds
    some (a table ``put_back``), else from its start (a new table).
    """
    checkpoint = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    ends: dict[str, dict[str, int]] = committed.sources[0] or {}
    for name, entry in held_tables(files, checkpoint).items():  # read, left unwritten
        held = next((e.source_topic for e in entities if e.name == name), None)
        if held in ends:
            ends[held] = {**ends[held], **entry["position"]}
    topics = [entity.source_topic for entity in entities]
    start = {t: {p: int(o) for p, o in ends[t].items()} for t in topics if t in ends}
    new = [t for t in topics if t not in ends]
    for topic, numbers in (partitions or topic_partitions)(config, new).items():
        start[topic] = {str(p): put_back.get(topic, {}).get(str(p), EARLIEST) for p in numbers}
    return start


def ingested_ends(spark: SparkSession, config: PipelineConfig) -> IngestedEnds:
    """``IngestedEnds`` from bronze and the ingestor's quarantine, read with ``spark``.

    The last offset of each partition in the entity's bronze or quarantine rows, plus
    one (a poisoned record is in the quarantine, not in bronze).
    """

    def ends(entity: EntityConfig) -> dict[str, int] | None:
        bronze = config.layout.bronze(entity.name)
        if not DeltaTable.isDeltaTable(spark, bronze):
            return None  # never ingested (a new table): no Spark job
        coordinates = ["kafka_partition", "kafka_offset"]
        rows = [spark.read.format("delta").load(bronze).select(*coordinates)]
        quarantine = config.layout.quarantine(INGESTOR)
        if DeltaTable.isDeltaTable(spark, quarantine):
            quarantined = spark.read.format("delta").load(quarantine)
            of_topic = quarantined.where(F.col("kafka_topic") == entity.source_topic)
            rows.append(of_topic.select(*coordinates))
        last = functools.reduce(DataFrame.unionByName, rows).groupBy("kafka_partition")
        maxima = last.agg(F.max("kafka_offset")).where(F.col("kafka_partition").isNotNull())
        return {str(partition): int(offset) + 1 for partition, offset in maxima.collect()} or None

    return ends
