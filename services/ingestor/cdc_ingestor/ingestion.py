"""The ingestor's stream of a group of tables: their Kafka topics -> bronze, exactly-once.

One Kafka source reads every topic of the group (source); each micro-batch is cached
once, and each table's records in it are decoded in the JVM, Avro or JSON, with contract
checks (transform); then one append writes every table's rows to bronze, the one table
of every entity's change log (``cdc_shared.contracts.bronze``), and one append the records that
could not be decoded to ``quarantine/ingestor`` (sink). Both appends carry
``txnAppId`` (the service, the group and the checkpoint's query id) and ``txnVersion``
(the batch id), so a batch run again after a crash writes nothing twice; bronze's commit
also records how far each topic is written (``cdc_ingestor.positions``), which is where
a new checkpoint starts.

A table whose records cannot be written for a reason of its own is *held*: its records
are left out of bronze from its first record of the batch on, its position stays there
(recorded with each bronze commit), it is stopped alone (``/health``, exit code 1 at the
end), and the other tables go on. The reasons: records of a writer schema the reader
cannot resolve (``ingestor.on_incompatible_schema: stop``), a schema registry that did
not answer within its retry budget, and a topic the broker refuses to read (it fails
the source for every topic: the query goes on without that topic, on a new checkpoint).
The next start of the service reads a held table again from where it was held.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cdc_shared.avro import SchemaRegistry, SchemaRegistryUnavailableError
from cdc_shared.clients.connect import spark_kafka_options
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts import bronze, quarantine
from cdc_shared.contracts.layout import INGESTOR
from cdc_shared.contracts.quarantine import QUARANTINE_SCHEMA
from cdc_shared.contracts.stream_checkpoint import kafka_initial_offsets, last_committed_batch
from cdc_shared.jvm.bridge import HadoopFiles, observation_ready
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.jvm.spark import cached_in_few_partitions
from cdc_shared.streaming.groups import TableGroup
from cdc_shared.streaming.observability import Stopwatch
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.streaming.tables import ensure_table, idempotent_append, not_quarantined_yet
from pyspark.sql import Column, DataFrame, DataFrameReader, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.streaming.readwriter import DataStreamReader

from cdc_ingestor.decode import avro_type, check_sequence_paths, decode
from cdc_ingestor.framing_headers import BatchHeaders, headers_by_topic
from cdc_ingestor.incompatible_schema import incompatible_stop, log_incompatible
from cdc_ingestor.outcomes import Outcomes, count_outcomes, outcome_metrics, outcomes
from cdc_ingestor.positions import (
    Offsets,
    batch_ends,
    commit_metadata,
    spark_starting_offsets,
    where_to_start,
)
from cdc_ingestor.projection import bronze_columns, payload_type, quarantine_rows, stamped
from cdc_ingestor.schema_learning import SchemaTracker

SERVICE = INGESTOR
log = logging.getLogger("cdc_ingestor")

#: Kafka's consumer setting for how long the broker may hold a fetch, and ours (see
#: :func:`kafka_reader`).
FETCH_MAX_WAIT = "fetch.max.wait.ms"
FETCH_MAX_WAIT_MS = "10"

#: A batch or a stream reader (:func:`kafka_reader` sets up either).
ReaderT = TypeVar("ReaderT", DataFrameReader, DataStreamReader)


@dataclass(eq=False)
class TopicTable:
    """One table of the group as the ingestor reads it: its entity and its decode plan."""

    entity: EntityConfig
    schemas: SchemaTracker


@dataclass(eq=False)
class Decoded:
    """One table's records of a batch, decoded; its outcomes observed on bronze's write.

    ``observed`` is ``frame`` under the observation (read once, by bronze's write);
    passes of their own read ``frame``.
    """

    table: TopicTable
    frame: DataFrame
    observed: DataFrame
    observation: Observation

    def outcomes(self) -> Outcomes:
        """Records per outcome and the collected quarantine rows.

        Observed on bronze's write; counted by a pass of their own when Delta skipped
        that write (the batch was written before).
        """
        if observation_ready(self.observation):
            return outcomes(self.observation.get)
        return count_outcomes(self.frame, self.table.entity)


@dataclass(eq=False)
class GroupIngestion:
    """A group's stream: every table's topic into bronze (see the module docstring)."""

    spark: SparkSession
    config: PipelineConfig
    group: TableGroup
    runner: StreamRunner
    registry: SchemaRegistry
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)

    def __post_init__(self) -> None:
        self.bronze_path = self.config.layout.bronze()
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        self.checkpoint = self.config.layout.checkpoint(SERVICE, self.group.name)
        self.tables: dict[str, TopicTable] = {}
        #: Held in this run (entity -> why), and where each held topic stays.
        self.held: dict[str, str] = {}
        self.held_at: Offsets = {}
        #: Held tables whose topic the query no longer reads (the broker refused it).
        self.unreadable: set[str] = set()
        #: Per topic and partition: below it, bronze holds the records (a new checkpoint's).
        self.floors: Offsets = {}
        self.types: dict[str, T.StructType] = {}
        for entity in self.group.entities:
            self.add(entity)

    def add(self, entity: EntityConfig) -> None:
        """Take up ``entity``: its topic is read from the query's next start."""
        schemas = SchemaTracker(self.spark, entity, self.registry)
        check_sequence_paths(self.spark, entity, schemas.plan)
        self.tables[entity.source_topic] = TopicTable(entity, schemas)

    def prepare(self, wait_s: float) -> None:
        """Bronze and quarantine, unless they exist, and each table's payload type in bronze.

        Nothing to wait for (``wait_s``): the source is Kafka, not a table.
        """
        ensure_table(
            self.spark,
            self.bronze_path,
            bronze.SCHEMA,
            bronze.properties_for(self.config),
            [bronze.ENTITY],
        )
        ensure_table(
            self.spark,
            self.quarantine_path,
            QUARANTINE_SCHEMA,
            quarantine.properties_for(self.config),
        )
        self.types = bronze.read_payload_types(self.spark, self.bronze_path)
        self._widen_types({t.entity.name: self._payload_type(t) for t in self.tables.values()})

    def _payload_type(self, table: TopicTable) -> T.StructType:
        plan = table.schemas.plan
        envelope = avro_type(self.spark, plan.value_reader)
        assert isinstance(envelope, T.StructType)
        return payload_type(avro_type(self.spark, plan.key_reader), envelope)

    def _widen_types(self, wanted: dict[str, T.StructType]) -> None:
        """Set bronze's payload type of each table whose type ``wanted`` widens (one commit)."""
        changed = {}
        for entity, wanted_type in wanted.items():
            widened = bronze.widened(self.types.get(entity), wanted_type)
            if widened != self.types.get(entity):
                changed[entity] = widened
        if not changed:
            return
        settings = ", ".join(
            f"'{bronze.TYPE_PROPERTY}{entity}' = '{json.dumps(t.jsonValue())}'"
            for entity, t in changed.items()
        )
        self.spark.sql(f"ALTER TABLE delta.`{self.bronze_path}` SET TBLPROPERTIES ({settings})")
        self.types.update(changed)
        log.info("bronze's payload types", extra={"entities": sorted(changed)})

    def source(self) -> DataFrame:
        """One Kafka source over the group's topics (all but those the broker refused).

        It resumes its checkpoint, or starts a new one where each topic stood
        (:func:`cdc_ingestor.positions.where_to_start`).
        """
        readable = [t.entity for t in self.tables.values() if t.entity.name not in self.unreadable]
        start = where_to_start(self.spark, self.config, self.checkpoint, readable)
        self.floors = start.floors
        for entity, why in start.held.items():
            log.info(
                "a table held by an earlier run is read again from where it was held",
                extra={"entity": entity, "reason": why},
            )
        topics = ",".join(sorted(entity.source_topic for entity in readable))
        offsets = spark_starting_offsets(self.config, readable, start)
        return kafka_source(self.spark, self.config, topics, offsets)

    def hold(self, entity: str, reason: str) -> bool:
        """Go on without ``entity``, whose topic the broker refuses to read (see the module).

        Its position is recorded in bronze at once (an empty commit), then the query is
        built again without its topic. False when it is the last table read, or not ours.
        """
        readable = [t for t in self.tables.values() if t.entity.name not in self.unreadable]
        refused = next((t for t in readable if t.entity.name == entity), None)
        if refused is None or len(readable) < 2:
            return False
        files = HadoopFiles(self.spark)
        committed = last_committed_batch(files, self.checkpoint)
        ends: Offsets = dict(committed.sources[0] or {}) if committed else {}
        if committed is None:
            ends = kafka_initial_offsets(files, self.checkpoint) or {}
        topic = refused.entity.source_topic
        self.held_at.setdefault(topic, {str(p): int(o) for p, o in ends.get(topic, {}).items()})
        self.held[entity] = reason
        self.unreadable.add(entity)
        positions = {t: {str(p): int(o) for p, o in o_.items()} for t, o_ in ends.items()}
        metadata = commit_metadata(self.group.name, {**positions, **self.held_at}, self.held)
        empty = frame_from_rows(self.spark, [], bronze.SCHEMA)
        empty.write.format("delta").mode("append").option("userMetadata", metadata).save(
            self.bronze_path
        )
        self.runner.stop_entity(entity, reason)
        return True

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Decode each table's records, then one bronze append and one quarantine append.

        The batch is cached (in few partitions) so that Kafka is read once, whatever the
        number of tables; the topics present, and the framing headers each uses (its
        decode plan is narrowed to them), are found on the cache in one pass.
        """
        app = f"cdc-{SERVICE}-{self.group.name}-{self.identity.get()}"
        lap = Stopwatch()
        files = HadoopFiles(self.spark)
        ends = batch_ends(files, self.checkpoint, batch_id)
        starts = (
            batch_ends(files, self.checkpoint, batch_id - 1)
            if batch_id > 0
            else kafka_initial_offsets(files, self.checkpoint) or {}
        )
        with cached_in_few_partitions(batch) as cached:
            headers = headers_by_topic(cached)
            lap("split")
            decoded = self._decode_tables(cached, headers, starts, batch_id)
            lap("decode")
            dropped = [t for t in headers if self.tables[t].entity.name in self.held]
            self._write_bronze(decoded, app, batch_id, ends, bool(dropped))
            lap("bronze")
            results = {d.table.entity.name: d.outcomes() for d in decoded}
            quarantined = self._write_quarantine(decoded, results, app, batch_id)
            if quarantined:
                lap("quarantine")
        self.runner.report(self.group.name, batch_id, self._stats(results, lap.laps))
        if set(self.held) >= {t.entity.name for t in self.tables.values()}:
            raise self.runner.stop_all_held()  # the batch is not committed

    def _decode_tables(
        self,
        cached: DataFrame,
        headers: dict[str, BatchHeaders],
        starts: Offsets,
        batch_id: int,
    ) -> list[Decoded]:
        """Each table's records decoded, but those of held tables (some held here)."""
        unknown = [topic for topic in headers if topic not in self.tables]
        if unknown:  # cannot happen with a subscription by name: never drop records
            raise RuntimeError(f"records of topics no table of the group reads: {unknown}")
        decoded: list[Decoded] = []
        wanted: dict[str, T.StructType] = {}
        for topic in sorted(headers):
            table = self.tables[topic]
            entity = table.entity
            if entity.name in self.held:
                continue
            rows = cached.where(F.col("topic") == F.lit(topic))
            try:
                plan = table.schemas.update(rows, headers[topic])
            except SchemaRegistryUnavailableError as unavailable:
                self._hold(
                    entity,
                    f"stopped: {unavailable}; nothing of the table's batch was written or "
                    "quarantined: restart once the registry answers",
                    starts,
                )
                continue
            frame = decode(self.spark, rows, plan, entity.sequence_by)
            if self.config.ingestor.on_incompatible_schema == "stop" and _meets_incompatible(
                self.spark, plan, headers[topic]
            ):
                counts, rejected = count_outcomes(frame, entity)
                count = counts.get("incompatible_schema", 0)
                self._hold(entity, incompatible_stop(entity, count, rejected), starts)
                continue
            observation = Observation(f"ingest-{entity.name}-{batch_id}")
            observed = frame.observe(observation, *outcome_metrics(entity))
            decoded.append(Decoded(table, frame, observed, observation))
            wanted[entity.name] = self._payload_type(table)
        self._widen_types(wanted)
        return decoded

    def _hold(self, entity: EntityConfig, reason: str, starts: Offsets) -> None:
        """Hold ``entity`` from its first record of this batch (see the module docstring)."""
        topic = entity.source_topic
        self.held_at.setdefault(topic, dict(starts.get(topic, {})))
        self.held[entity.name] = reason
        log.error(
            "a table's records cannot be written for a reason of its own: held, the other "
            "tables go on",
            extra={"entity": entity.name, "held_at": self.held_at[topic], "reason": reason},
        )
        self.runner.stop_entity(entity.name, reason)

    def _write_bronze(
        self, decoded: list[Decoded], app: str, batch_id: int, ends: Offsets, dropped: bool
    ) -> None:
        """One append of every table's rows, recording each topic's position (or none).

        An empty batch of a group holding tables is recorded all the same, so their
        positions never fall behind what the checkpoint committed. The tables' rows are
        written by a task per core (coalesced, no shuffle), not a task and a file per
        table and core (docs/benchmarks.md, "the bronze append in a task per core").
        """
        positions = {**ends, **self.held_at}
        metadata = commit_metadata(self.group.name, positions, self.held)
        parts = [self._bronze_part(d) for d in decoded]
        if not parts and not dropped:
            return
        rows = functools.reduce(DataFrame.union, parts) if parts else None
        if rows is None:
            rows = frame_from_rows(self.spark, [], bronze.SCHEMA)
        else:  # a task per core, not per table and core: fewer tasks and files to commit
            rows = rows.coalesce(max(1, self.spark.sparkContext.defaultParallelism))
        writer = (
            rows.write.format("delta")
            .mode("append")
            .option("txnAppId", app)
            .option("txnVersion", batch_id)
            .option("userMetadata", metadata)
        )
        writer.save(self.bronze_path)

    def _bronze_part(self, decoded: Decoded) -> DataFrame:
        """One table's bronze rows: its records that decoded, above its floor."""
        entity = decoded.table.entity
        envelope = avro_type(self.spark, decoded.table.schemas.plan.value_reader)
        assert isinstance(envelope, T.StructType)
        good = decoded.observed.where(F.col("error_kind").isNull())
        floor = self.floors.get(entity.source_topic)
        if floor:
            good = good.where(F.col("kafka_offset") >= _floor_of(floor))
        return good.select(*bronze_columns(entity.name, envelope))

    def _write_quarantine(
        self, decoded: list[Decoded], results: dict[str, Outcomes], app: str, batch_id: int
    ) -> bool:
        """The records that did not decode, of every table, in one append; whether any."""
        frames = []
        for item in decoded:
            entity = item.table.entity
            counts, rejected = results[entity.name]
            errors = {kind: n for kind, n in counts.items() if kind != "ok"}
            if not errors:
                continue
            if errors.get("incompatible_schema"):
                log_incompatible(entity, batch_id, errors["incompatible_schema"], rejected)
            collected = len(rejected) == sum(errors.values())
            frames.append(
                frame_from_rows(self.spark, stamped(rejected, batch_id), QUARANTINE_SCHEMA)
                if collected
                else quarantine_rows(item.frame, entity, batch_id)  # many: another pass
            )
        if not frames:
            return False
        rows = functools.reduce(DataFrame.union, frames)
        new = not_quarantined_yet(self.spark, rows, self.quarantine_path)
        idempotent_append(new, self.quarantine_path, app, batch_id)
        return True

    def _stats(self, results: dict[str, Outcomes], laps: dict[str, int]) -> BatchStats:
        counts: dict[str, int] = {"input_rows": 0, "bronze_rows": 0, "quarantined_rows": 0}
        errors: dict[str, int] = {}
        tables: dict[str, dict[str, Any]] = {}
        by_entity: dict[str, dict[str, int]] = {}
        for entity, (outcome, _) in results.items():
            rejected = {kind: n for kind, n in outcome.items() if kind != "ok"}
            own = {
                "input_rows": sum(outcome.values()),
                "bronze_rows": outcome.get("ok", 0),
                "quarantined_rows": sum(rejected.values()),
            }
            for name, value in own.items():
                counts[name] += value
            for kind, value in rejected.items():
                errors[kind] = errors.get(kind, 0) + value
            tables[entity] = own
            by_entity[entity] = own
        extra: dict[str, Any] = {"errors": errors, "tables": tables, **laps}
        if self.held:
            extra["held"] = sorted(self.held)
        return BatchStats(counts=counts, extra=extra, by_entity=by_entity)


def _meets_incompatible(spark: SparkSession, plan: Any, headers: BatchHeaders) -> bool:
    """Whether records of the batch use a writer schema the reader cannot resolve."""
    values, keys = headers
    return bool(values & plan.incompatible(spark, "value").keys()) or bool(
        keys & plan.incompatible(spark, "key").keys()
    )


def _floor_of(floor: dict[str, int]) -> Column:
    """The floor of each record's partition (0 for a partition the floor does not name)."""
    chosen: Column = F.lit(0).cast("long")
    for partition, offset in floor.items():
        chosen = F.when(F.col("kafka_partition") == int(partition), F.lit(offset)).otherwise(chosen)
    return chosen


def kafka_source(
    spark: SparkSession, config: PipelineConfig, topics: str, starting_offsets: str
) -> DataFrame:
    """``topics`` (comma-separated) through Spark's Kafka source (:func:`kafka_reader`).

    With the records' headers: a replayed record's ``cdc.replay.of`` gives its sequence.
    """
    settings = config.ingestor
    reader = kafka_reader(spark.readStream, config, topics, starting_offsets)
    if settings.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", settings.max_offsets_per_trigger)
    return reader.load()


def kafka_reader(
    reader: ReaderT, config: PipelineConfig, topics: str, starting_offsets: str
) -> ReaderT:
    """``reader`` (a stream's or a batch's) set to read ``topics`` as the ingestor does.

    From ``starting_offsets``, failOnDataLoss as configured (on), with the records' headers.
    The broker answers a fetch at once only with ``fetch.max.wait.ms`` short: Spark's
    consumer of each Kafka partition read waited out Kafka's default 500 ms once per
    partition and batch, so a batch of many topics spent most of its time waiting
    (docs/benchmarks.md, "Kafka fetch wait"). The pipeline's ``kafka.java_options`` can set
    it otherwise.
    """
    return (
        reader.format("kafka")
        .option(f"kafka.{FETCH_MAX_WAIT}", FETCH_MAX_WAIT_MS)
        .options(**spark_kafka_options(config.kafka))
        .option("subscribe", topics)
        .option("startingOffsets", starting_offsets)
        .option("failOnDataLoss", str(config.ingestor.fail_on_data_loss).lower())
        .option("includeHeaders", "true")
    )
