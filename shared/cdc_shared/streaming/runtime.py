"""The one stream runtime: a service runs one streaming query per group of its tables.

A service says what is its own (:class:`StreamService`: its name, settings, how to open
a group's stream, how to read its lag, which failures it knows) and keeps only its
source -> transform -> sink in its group streams (:class:`GroupStream`). A group stream
reads every table of its group at once, and each micro-batch writes the tables it
changed, usually through a :class:`cdc_shared.streaming.queue.TableQueue`.
:func:`start_service` does the rest for every service alike: the writer leases, one
checkpointed foreachBatch query per group (``cdc_shared.streaming.groups``) with the
group's trigger, run by a :class:`StreamRunner`, and the tables found while it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import StreamingServiceConfig
from cdc_shared.contracts.layout import command_name
from cdc_shared.jvm.spark import build_spark_session, with_sized_heap
from cdc_shared.streaming.discovery import EntityDiscovery
from cdc_shared.streaming.failures import OnFailure, recognising_full_storage
from cdc_shared.streaming.groups import TableGroup, table_groups
from cdc_shared.streaming.progress import LagReader, source_metric
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.streaming.writer_lease import acquire_writer_leases

#: How long a continuous service waits for its source table (the upstream service
#: creates it); ``--once`` waits for nothing.
SOURCE_WAIT_S = 3600.0


class GroupStream(Protocol):
    """A group's stream of a service: every table of the group, source -> transform -> sink."""

    identity: QueryIdentity  # its query's id, for idempotent writes (set at start)

    def prepare(self, wait_s: float) -> None:
        """Make what the group writes; wait up to ``wait_s`` for its source."""

    def source(self) -> DataFrame:
        """The streaming DataFrame it reads (every table of the group)."""

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Write the tables one micro-batch changed (foreachBatch), idempotently."""

    def add(self, entity: EntityConfig) -> None:
        """Take up a table that appeared while the service runs (read from the next start)."""

    def hold(self, entity: str, reason: str) -> bool:
        """Go on without ``entity``, whose failure stops the whole query; False if it cannot."""


#: Builds a group's stream: (spark, config, group, the service's runner) -> stream.
OpenGroup = Callable[[SparkSession, PipelineConfig, TableGroup, StreamRunner], GroupStream]


@dataclass(frozen=True)
class StreamService:
    """What makes one streaming service differ from the others.

    ``settings``: its section of the configuration (trigger, metrics endpoint, queue).
    ``open_group``: builds a group's stream (once per group; its query is built again
    from it when it must be). ``lag``: the name of a source metric (e.g. Kafka offsets
    behind), a reader of the progress event, or None when each batch reports it
    (``BatchStats.extra["lag"]``). ``on_failure``: the failures the service knows (a
    full disk is known to all).
    """

    name: str
    settings: StreamingServiceConfig
    open_group: OpenGroup
    lag: str | LagReader | None = None
    on_failure: OnFailure | None = None


def with_trigger(writer: DataStreamWriter, once: bool, interval: str) -> DataStreamWriter:
    """``--once``: process what is available then stop; else a processing-time trigger."""
    return writer.trigger(availableNow=True) if once else writer.trigger(processingTime=interval)


def start_service(
    service: StreamService,
    config: PipelineConfig,
    entity_names: list[str] | None,
    once: bool,
    spark: SparkSession | None,
    group_names: list[str] | None = None,
) -> StreamRunner:
    """Open one stream per group of the service's tables and start it; ``run()`` the result.

    Each group's stream is opened, prepared, and written with ``foreachBatch`` to its
    checkpoint (``StorageLayout.checkpoint(service, group)``). ``entity_names``
    (``--entity``) and ``group_names`` (``--group``) choose the tables
    (``cdc_shared.streaming.groups``). A continuous service running every group with
    ``entity_sets`` also takes up the tables its sets select later
    (``cdc_shared.streaming.discovery``).

    First the service takes its writer lease on each table (``cdc_shared.streaming.writer_lease``):
    WriterRunningError when another instance writes them (on object storage once its
    session is built, through which they are written). The leases are renewed while it
    runs and released when its runner closes; a lease taken over fails the runner.
    """
    groups = [
        replace(group, once=once)
        for group in table_groups(config, service.settings, entity_names, group_names)
    ]
    names = [name for group in groups for name in group.names]
    runner_of: list[StreamRunner] = []  # the runner, once made
    lost_before: list[str] = []  # a lease lost before the runner was made

    def lost(reason: str) -> None:
        lost_before.append(reason)
        for made in runner_of:
            made.fail(reason)

    on_disk = "://" not in config.storage_root  # object storage leases need the session
    leases = (
        acquire_writer_leases(config.storage_root, service.name, names, lost) if on_disk else None
    )
    try:
        session = spark or build_spark_session(
            with_sized_heap(config.spark, len(names)), command_name(service.name)
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

    queries = _GroupQueries(service, config, session, runner, once, lost)
    try:
        for group in groups:
            queries.start(group)
    except BaseException:
        runner.stop_now()
        raise
    if config.entity_sets and entity_names is None and group_names is None and not once:
        runner.on_close(EntityDiscovery(config, service.name, queries.take_up).start().stop)
    return runner


@dataclass
class _GroupQueries:
    """How a started service opens its groups' queries, and takes up tables found later."""

    service: StreamService
    config: PipelineConfig
    session: SparkSession
    runner: StreamRunner
    once: bool
    lost: Callable[[str], object]  # a writer lease was taken over

    def __post_init__(self) -> None:
        self.streams: dict[str, GroupStream] = {}
        self.groups: dict[str, TableGroup] = {}

    def build(self, name: str, wait_s: float) -> tuple[DataStreamWriter, QueryIdentity]:
        """Prepare group ``name``'s stream (its source awaited ``wait_s``); its writer."""
        stream, group = self.streams[name], self.groups[name]
        stream.prepare(wait_s)
        writer = (
            stream.source()
            .writeStream.foreachBatch(self.runner.recording_failures(name, stream.process_batch))
            .option("checkpointLocation", self.config.layout.checkpoint(self.service.name, name))
        )
        return with_trigger(writer, self.once, group.trigger_interval), stream.identity

    def start(self, group: TableGroup) -> None:
        """Open ``group``'s stream and start its query."""
        stream = self.service.open_group(self.session, self.config, group, self.runner)
        self.streams[group.name], self.groups[group.name] = stream, group
        writer, identity = self.build(group.name, 0 if self.once else SOURCE_WAIT_S)
        rebuild = functools.partial(self.build, group.name, 0)
        self.runner.start(group.name, writer, identity, rebuild, hold=stream.hold)

    def take_up(self, entity: EntityConfig) -> bool:
        """A table an entity set selected since start: its writer lease, then its group.

        Its group's query is stopped after its batch in flight and started again with
        the table (a group not running yet is started). False once the service stops.
        """
        lease = acquire_writer_leases(
            self.config.storage_root, self.service.name, [entity.name], self.lost, self.session
        )
        name, trigger = self.config.group_of(entity.name)
        try:
            if name in self.streams:
                self.groups[name] = self.groups[name].with_entity(entity)
                self.streams[name].add(entity)
                started = self.runner.restart_rebuilt(name)
            else:
                interval = trigger or self.service.settings.trigger_interval
                group = TableGroup(name, (entity,), interval)
                stream = self.service.open_group(self.session, self.config, group, self.runner)
                self.streams[name], self.groups[name] = stream, group
                writer, identity = self.build(name, 0)
                rebuild = functools.partial(self.build, name, 0)
                started = self.runner.start_while_running(
                    name, writer, identity, rebuild, hold=stream.hold
                )
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None and started:
            self.runner.on_close(lease.release)
        elif lease is not None:
            lease.release()
        return started
