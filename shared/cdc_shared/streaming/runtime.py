"""The one stream runtime: a service is a set of entity streams, opened the same way.

A service says what is its own (:class:`StreamService`: its name, settings, how to open
an entity's :class:`EntityStream`, how to read its lag, which failures it knows) and
keeps only its source -> transform -> sink in its streams (usually subclasses of
:class:`EntityStreamBase`). :func:`start_service` does the rest for every service alike:
one checkpointed foreachBatch query per entity, with the service's trigger, run by a
:class:`StreamRunner` that can open a stream again to rebuild its query.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_shared.config import ConfigError, EntityConfig, PipelineConfig, StreamingServiceConfig
from cdc_shared.layout import ALL_ENTITIES, command_name
from cdc_shared.spark import (
    BATCH_PARALLELISM,
    START_PARALLELISM,
    build_spark_session,
    side_by_side,
    with_sized_heap,
)
from cdc_shared.streaming.discovery import EntityDiscovery
from cdc_shared.streaming.failures import (
    EntityStoppedError,
    OnFailure,
    StreamFailedError,
    recognising_full_storage,
)
from cdc_shared.streaming.gate import BatchGate
from cdc_shared.streaming.progress import BatchStats, LagReader, source_metric
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.writer_lease import acquire_writer_leases

#: How long a continuous service waits for its source table (the upstream service
#: creates it); ``--once`` waits for nothing.
SOURCE_WAIT_S = 3600.0


class EntityStream(Protocol):
    """One entity's stream of a service: source -> transform -> sink, per micro-batch."""

    identity: QueryIdentity  # its query's id, for idempotent writes (set at start)

    def prepare(self, wait_s: float) -> None:
        """Create the tables (or indexes) it writes; wait up to ``wait_s`` for its source."""

    def source(self) -> DataFrame:
        """The streaming DataFrame it reads."""

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Transform and write one micro-batch (foreachBatch), idempotently."""


#: Builds an entity's stream: (spark, config, entity, the service's runner) -> stream.
OpenEntity = Callable[[SparkSession, PipelineConfig, EntityConfig, StreamRunner], EntityStream]


class GroupStream(EntityStream, Protocol):
    """One stream over many entities: a service's one query for all its tables.

    ``prepare`` makes what its entities write (those not made yet); ``add`` takes up one
    more entity, read from the next start of the query.
    """

    def add(self, entity: EntityConfig, wait_s: float | None = None) -> None:
        """Take ``entity`` up from the query's next start.

        With ``wait_s``, first make what it writes (its source awaited ``wait_s``): if
        that raises, the group is left as it was (the running query untouched).
        """


#: Builds the one stream of a service over ``entities``: (spark, config, entities, runner).
OpenGroup = Callable[[SparkSession, PipelineConfig, list[EntityConfig], StreamRunner], GroupStream]


@dataclass(eq=False)
class EntityStreamBase:
    """What every entity stream holds; a service's stream adds its own in ``__post_init__``.

    Its fields are the arguments of ``OpenEntity``, so a subclass adding none is its own
    factory. ``identity`` is filled in when the runner starts the query.
    """

    spark: SparkSession
    config: PipelineConfig
    entity: EntityConfig
    runner: StreamRunner
    identity: QueryIdentity = field(default_factory=QueryIdentity, init=False)

    def __post_init__(self) -> None:
        """A service's stream sets up its own state here (the generated ``__init__`` calls it)."""

    def report(self, batch_id: int, stats: BatchStats) -> None:
        """Hand what a batch did to the runner, for the batch's progress log."""
        self.runner.report(self.entity.name, batch_id, stats)

    def set_problem(self, problem: str | None) -> None:
        """Report (None: clear) what keeps the entity from progressing, for ``/health``."""
        self.runner.set_problem(self.entity.name, problem)


@dataclass(frozen=True)
class StreamService:
    """What makes one streaming service differ from the others.

    ``settings``: its section of the configuration (trigger, metrics endpoint).
    ``open_entity``: builds an entity's stream (called again to rebuild its query).
    ``lag``: the name of a source metric (e.g. Kafka offsets behind), a reader of the
    progress event, or None when each batch reports it (``BatchStats.extra["lag"]``).
    ``on_failure``: the failures the service knows (a full disk is known to all).
    ``open_group``: when set, the service runs one query for all its entities, the
    stream it builds, named ``ALL_ENTITIES`` in the runner and the checkpoints.
    """

    name: str
    settings: StreamingServiceConfig
    open_entity: OpenEntity
    lag: str | LagReader | None = None
    on_failure: OnFailure | None = None
    open_group: OpenGroup | None = None


def with_trigger(writer: DataStreamWriter, once: bool, interval: str) -> DataStreamWriter:
    """``--once``: process what is available then stop; else a processing-time trigger."""
    return writer.trigger(availableNow=True) if once else writer.trigger(processingTime=interval)


def foreach_batch_writer(
    source: DataFrame,
    process: Callable[[DataFrame, int], None],
    checkpoint: str,
    once: bool,
    interval: str,
) -> DataStreamWriter:
    """source -> foreachBatch(process), checkpointed, with the service's trigger."""
    writer = source.writeStream.foreachBatch(process).option("checkpointLocation", checkpoint)
    return with_trigger(writer, once, interval)


def refuse_some_entities_in_one_query(
    config: PipelineConfig, service: str, entity_names: list[str] | None
) -> None:
    """ConfigError when ``service`` runs one query for all entities and some are asked for."""
    if config.runs_one_query(service) and entity_names is not None:
        raise ConfigError(
            f"{service}.one_query runs every entity in one query: it cannot be started "
            f"for some entities only ({', '.join(entity_names)}); leave out --entity"
        )


def start_service(
    service: StreamService,
    config: PipelineConfig,
    entity_names: list[str] | None,
    once: bool,
    spark: SparkSession | None,
) -> StreamRunner:
    """Open one stream per selected entity and start it; ``run()`` the result.

    Each entity's stream is opened, prepared, and written with ``foreachBatch`` to its
    checkpoint (``config.checkpoint_path``); the runner opens it again to rebuild the
    query. An entity whose stream raises EntityStoppedError while it is prepared is
    reported stopped and the others start; if any other error stops an entity's start (or
    every entity stopped), the ones started are stopped and the error raised. A
    continuous service over all its entities with ``entity_sets`` also starts the streams
    of tables its sets select later (``cdc_shared.streaming.discovery``).

    First the service takes its writer lease on each entity (``cdc_shared.writer_lease``):
    WriterRunningError when another instance writes them (on object storage once its
    session is built, through which they are written). The leases are renewed while it
    runs and released when its runner closes; a lease taken over fails the runner.
    """
    refuse_some_entities_in_one_query(config, service.name, entity_names)
    entities = config.select_entities(entity_names)
    if not entities:
        raise ConfigError(f"the configuration defines no entities for the {service.name}")
    runner_of: list[StreamRunner] = []  # the runner, once made
    lost_before: list[str] = []  # a lease lost before the runner was made

    def lost(reason: str) -> None:
        lost_before.append(reason)
        for made in runner_of:
            made.fail(reason)

    names = [e.name for e in entities]
    on_disk = "://" not in config.storage_root  # object storage leases need the session
    leases = (
        acquire_writer_leases(config.storage_root, service.name, names, lost) if on_disk else None
    )
    try:
        # A service alone sizes its driver's heap for its tables (one query each).
        session = spark or build_spark_session(
            with_sized_heap(config.spark, len(entities)), command_name(service.name)
        )
        if not on_disk:
            leases = acquire_writer_leases(config.storage_root, service.name, names, lost, session)
        lag = service.lag
        runner = StreamRunner(
            session,
            service.name,
            service.settings.metrics_host,
            service.settings.metrics_port,
            source_metric(lag) if isinstance(lag, str) else lag,
            recognising_full_storage(config.storage_root, service.on_failure),
        )
    except BaseException:
        if leases is not None:
            leases.release()
        raise
    if leases is not None:
        runner.on_close(leases.release)
        runner_of.append(runner)
        if lost_before:
            runner.fail(lost_before[0])

    gate = BatchGate(int(session.conf.get(BATCH_PARALLELISM, "0") or "0"))
    streams = _ServiceStreams(service, config, session, runner, once, lost, gate)
    try:
        if service.open_group is not None:
            streams.start_group(service.open_group, entities)
        else:
            streams.start_all(entities)
    except BaseException:
        runner.stop_now()
        raise
    if config.entity_sets and entity_names is None and not once:
        runner.on_close(
            EntityDiscovery(config, service.name, streams.start_discovered).start().stop
        )
    return runner


@dataclass(frozen=True)
class _ServiceStreams:
    """How a started service opens its entities' streams: at start, and when found later."""

    service: StreamService
    config: PipelineConfig
    session: SparkSession
    runner: StreamRunner
    once: bool
    lost: Callable[[str], object]  # a writer lease was taken over
    gate: BatchGate  # how many of its tables' batches run at once
    group: list[GroupStream] = field(default_factory=list)  # the one stream, if so run

    def open_query(
        self, entity: EntityConfig, wait_s: float | None = None
    ) -> tuple[DataStreamWriter, QueryIdentity]:
        """Open and prepare ``entity``'s stream (its source awaited ``wait_s``); its writer."""
        stream = self.service.open_entity(self.session, self.config, entity, self.runner)
        stream.prepare((0 if self.once else SOURCE_WAIT_S) if wait_s is None else wait_s)
        writer = foreach_batch_writer(
            stream.source(),
            self.gate.around(stream.process_batch),
            self.config.checkpoint_path(self.service.name, entity.name),
            self.once,
            self.service.settings.batch_interval(entity.freshness),
        )
        return writer, stream.identity

    def start_all(self, entities: list[EntityConfig]) -> None:
        """Open and start every entity's stream, a few side by side.

        Each query starts as soon as its stream is open (a merger waiting for one table's
        bronze holds back only the tables opened beside it). One stopped alone
        (EntityStoppedError) lets the rest start; any other error stops the start once
        the opens under way have ended.
        """

        def start(entity: EntityConfig) -> None:
            try:
                writer, identity = self.open_query(entity)
            except EntityStoppedError as stopped:  # that entity alone: the others start
                self.runner.stop_entity(entity.name, str(stopped))
                return
            rebuild = functools.partial(self.open_query, entity)
            self.runner.start(entity.name, writer, identity, rebuild)

        # The first alone: it also makes what the service's streams share (its quarantine
        # table), which two opens side by side would both try to create.
        at_once = max(1, int(self.session.conf.get(START_PARALLELISM, "1") or "1"))
        rest = range(1, len(entities), at_once)
        for group in [entities[:1], *(entities[i : i + at_once] for i in rest)]:
            side_by_side([functools.partial(start, entity) for entity in group])
        if not self.runner.queries:  # every entity stopped: the service cannot run at all
            raise StreamFailedError(self.runner.stopped_message())

    def open_group_query(
        self, wait_s: float | None = None
    ) -> tuple[DataStreamWriter, QueryIdentity]:
        """Prepare the one stream over every entity (sources awaited ``wait_s``); its writer."""
        (stream,) = self.group
        stream.prepare((0 if self.once else SOURCE_WAIT_S) if wait_s is None else wait_s)
        writer = foreach_batch_writer(
            stream.source(),
            stream.process_batch,
            self.config.layout.checkpoint(self.service.name, ALL_ENTITIES),
            self.once,
            self.service.settings.trigger_interval,
        )
        return writer, stream.identity

    def start_group(self, open_group: OpenGroup, entities: list[EntityConfig]) -> None:
        """Open the one stream over ``entities`` and start its query (``ALL_ENTITIES``)."""
        self.group.append(open_group(self.session, self.config, entities, self.runner))
        writer, identity = self.open_group_query()
        rebuild = functools.partial(self.open_group_query, wait_s=0)
        self.runner.start(ALL_ENTITIES, writer, identity, rebuild)

    def start_discovered(self, entity: EntityConfig) -> bool:
        """A table an entity set selected since start: its writer lease, then its stream.

        Run as one query, the service takes the table into it and starts the query
        again (after the batch in flight), from its checkpoint.
        SourceTableMissingError (from ``prepare``) while its upstream table is not there.
        """
        lease = acquire_writer_leases(
            self.config.storage_root, self.service.name, [entity.name], self.lost, self.session
        )
        try:
            if self.group:  # its tables made before the running query stops
                self.group[0].add(entity, wait_s=0)
                started = self.runner.restart_rebuilt(ALL_ENTITIES)
            else:
                writer, identity = self.open_query(entity, wait_s=0)
                rebuild = functools.partial(self.open_query, entity)
                started = self.runner.start_while_running(entity.name, writer, identity, rebuild)
        except EntityStoppedError as stopped:
            self.runner.stop_entity(entity.name, str(stopped))
            started = True
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None and started:
            self.runner.on_close(lease.release)
        elif lease is not None:
            lease.release()
        return started
