"""``cdc status``: where each table stands in each service, read from what the services persist.

Nothing here asks a running service: each table's position is what a restarted service
would resume from (``docs/design.md``, "The runtime"), so it is right whether the
services run or not. Each service runs one query per group of tables; a table's
position is its own:

- ingestor: Kafka's end offsets minus where the topic is written to bronze (the newest
  bronze commit naming it records that, ``cdc_ingestor.positions``), or, before bronze
  records it, where the group's stream checkpoint committed; a table the ingestor holds
  says so, and why;
- merger: the bronze versions after the table's progress (silver's log, app id
  ``cdc-merger``) that hold rows of the table, and how many rows, read from bronze's
  commit files (:func:`cdc_cli.checkpoints.merger_backlog`);
- publisher-kafka: silver versions with changes after the last one it published (the
  change topic's progress group, committed in the same Kafka transaction as the events);
- publisher-es: silver versions with changes after the one its progress document in
  ``publisher_es.progress_index`` names (before its first start of this release, the
  stream checkpoint of an earlier release it goes on from);
- quarantine: rows per service and entity.

A version counts only when it changes what the service reads: an OPTIMIZE, or a MERGE
that changed nothing, is not lag. A table, progress or checkpoint that does not exist
yet shows as "not started", never as an error. Each line names the table's group, and
the last batch its group's query committed.

Tables and logs are read without a JVM (delta-rs, :mod:`cdc_cli.delta_log`), so the
command answers in about a second; the Spark engine (``--engine spark``, a hidden
option) reads the same state through a Spark session, for comparison.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import (
    ALL_ENTITIES,
    INGESTOR,
    MERGER,
    MERGER_LEGACY_APP,
    MERGER_PROGRESS_APP,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    QUARANTINE_WRITERS,
    publisher_progress_group,
)
from cdc_shared.contracts.stream_checkpoint import entity_source, last_committed_batch
from confluent_kafka import KafkaException, TopicPartition
from elasticsearch import ApiError, NotFoundError, TransportError

from cdc_cli.checkpoints import (
    DeltaLog,
    StateReader,
    TopicPosition,
    change_feed_versions,
    group_checkpoints,
    kafka_ends,
    merger_backlog,
    recorded_positions,
    streams_folder,
)
from cdc_cli.table_state import DELTA_RS, SPARK, open_state

if TYPE_CHECKING:
    from elasticsearch import Elasticsearch
    from pyspark.sql import SparkSession

NOT_STARTED = "not started"
KAFKA_TIMEOUT_S = 10.0
ES_TIMEOUT_S = 10.0
ES_RETRIES = 2
#: The field of publisher-es's progress documents (``cdc_publisher_es.progress``).
ES_PROGRESS_FIELD = "silver_version"
#: Entities read side by side: each mostly waits (a Kafka round trip, a Delta log read in
#: delta-rs, which releases the GIL), so a pipeline of many tables answers in about the
#: time of its slowest few.
STATUS_THREADS = 8
#: How ``cdc status`` reads tables and checkpoints: delta-rs and plain file reads (the
#: default, no JVM), or a Spark session (the services' own view; ``--engine spark``).


@dataclass(frozen=True)
class StreamLag:
    """One service's position for one table; ``lag`` is None when it cannot be told."""

    service: str
    lag: int | None
    unit: str  # "records" (Kafka) or "versions" (Delta)
    note: str  # where it is, or why the lag is unknown ("not started", an error)
    group: str | None = None  # the group whose query runs the table
    batch: int | None = None  # the last batch that group's query committed

    @property
    def started(self) -> bool:
        """Whether the service left a position to measure from."""
        return self.lag is not None


@dataclass(frozen=True)
class EntityStatus:
    """Table versions and every service's lag for one entity."""

    entity: str
    bronze_version: int | None  # the one bronze table's, shared by every entity
    silver_version: int | None
    streams: tuple[StreamLag, ...]
    group: str | None = None  # the group the configuration gives the table

    def stream(self, service: str) -> StreamLag:
        """The lag of ``service`` (KeyError for an unknown service)."""
        for lag in self.streams:
            if lag.service == service:
                return lag
        raise KeyError(service)


@dataclass(frozen=True)
class StatusReport:
    """Everything ``cdc status`` shows."""

    entities: tuple[EntityStatus, ...]
    #: service -> entity -> rows; a service whose quarantine table does not exist is absent.
    quarantine: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``cdc status --json``)."""
        return {
            "entities": [asdict(e) for e in self.entities],
            "quarantine": self.quarantine,
        }


def kafka_end_offsets(config: PipelineConfig, topic: str) -> dict[int, tuple[int, int]]:
    """Low and high watermark per partition of ``topic`` (empty if the topic does not exist)."""
    consumer = make_consumer(config.kafka, group_id="cdc-cli-status")
    try:
        metadata = consumer.list_topics(topic, timeout=KAFKA_TIMEOUT_S).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return {}
        return {
            p: consumer.get_watermark_offsets(
                TopicPartition(topic, p), timeout=KAFKA_TIMEOUT_S, cached=False
            )
            for p in sorted(metadata.partitions)
        }
    finally:
        consumer.close()


def published_version(config: PipelineConfig, entity: EntityConfig) -> int | None:
    """The last silver version publisher-kafka committed to the change topic, if any.

    Its progress is the offset of consumer group ``cdc-publisher-kafka.<change topic>`` on
    partition 0 of the progress topic: the last published version + 1.
    """
    group = publisher_progress_group(entity.change_topic_name)
    consumer = make_consumer(config.kafka, group_id=group)
    try:
        (committed,) = consumer.committed(
            [TopicPartition(config.publisher_kafka.progress_topic, 0)], timeout=KAFKA_TIMEOUT_S
        )
    finally:
        consumer.close()
    return int(committed.offset) - 1 if committed.offset >= 1 else None


def status_client(config: PipelineConfig) -> Elasticsearch:
    """An Elasticsearch client for reading progress: the status's timeout, a few retries."""
    client = make_elasticsearch(config.elasticsearch)
    return client.options(
        request_timeout=ES_TIMEOUT_S, max_retries=ES_RETRIES, retry_on_timeout=True
    )


def indexed_version(es: Elasticsearch, config: PipelineConfig, entity: EntityConfig) -> int | None:
    """The silver version publisher-es recorded as indexed into the entity's alias, if any.

    Its progress document in ``publisher_es.progress_index``, by alias
    (``cdc_publisher_es.progress``); read only, the index is never made here.
    """
    try:
        found = es.get(index=config.publisher_es.progress_index, id=entity.es_index_name)
    except NotFoundError:  # no such document, or no progress index at all
        return None
    return int(found["_source"][ES_PROGRESS_FIELD])


def legacy_indexed_version(
    reader: StateReader, config: PipelineConfig, entity: EntityConfig
) -> int | None:
    """The silver version publisher-es's stream of an earlier release had published up to.

    What it goes on from at its first start of this release when its alias has no
    progress document (``cdc_publisher_es.progress.legacy_version``): the entity's own
    checkpoint, or their one query's. None when neither committed a batch.
    """
    for name in (entity.name, ALL_ENTITIES):
        checkpoint = config.layout.legacy_checkpoint(PUBLISHER_ES, name)
        batch = last_committed_batch(reader, checkpoint)
        if batch is None:
            continue
        offset = entity_source(batch, reader, checkpoint, entity.name)
        if isinstance(offset, dict) and not offset.get("isStartingVersion", True):
            return int(offset["reservoirVersion"]) - 1
    return None


@dataclass(frozen=True)
class IngestorCheckpoint:
    """Where a group checkpoint of the ingestor stands in one topic."""

    group: str
    batch: int
    offsets: dict[str, int]


def ingestor_checkpoint(
    config: PipelineConfig, reader: StateReader, entity: EntityConfig, planned: bool = False
) -> IngestorCheckpoint | None:
    """Where the ingestor's group checkpoint that reads the entity's topic stands in it.

    Its configured group's checkpoint first, then any other group's (an ad-hoc group of
    ``--entity``). ``planned``: the last planned batch's ends (what bronze may hold at
    most) rather than the last committed one's (where the query resumes).
    """
    first = config.group_of(entity.name)[0]
    for checkpoint in group_checkpoints(reader, streams_folder(config, INGESTOR), first):
        ends = kafka_ends(reader, checkpoint, entity.source_topic, planned)
        if ends is not None:
            return IngestorCheckpoint(checkpoint.rsplit("/", 1)[1], *ends)
    return None


class PipelineState:
    """What ``cdc status`` reads once for every table: bronze's log, the topics' positions.

    And, on first use, each group checkpoint's last batch, each silver's log (both
    publishers read it), and an Elasticsearch client.
    """

    def __init__(
        self, config: PipelineConfig, reader: StateReader, entities: list[EntityConfig]
    ) -> None:
        self.config = config
        self.reader = reader
        self.bronze = DeltaLog(reader, config.layout.bronze())
        topics = {entity.source_topic: entity.name for entity in entities}
        self.positions: dict[str, TopicPosition] = recorded_positions(self.bronze, topics)
        self._batches: dict[tuple[str, str], int | None] = {}
        self._silver: dict[str, DeltaLog] = {}
        self._es: Elasticsearch | None = None
        self._lock = threading.Lock()

    def silver(self, entity: str) -> DeltaLog:
        """The entity's silver log, read once for both publishers."""
        with self._lock:
            if entity not in self._silver:
                self._silver[entity] = DeltaLog(self.reader, self.config.layout.silver(entity))
            return self._silver[entity]

    def group_batch(self, service: str, group: str) -> int | None:
        """The last batch ``service``'s query for ``group`` committed (None: none)."""
        key = (service, group)
        if key not in self._batches:
            batch = last_committed_batch(self.reader, self.config.layout.checkpoint(*key))
            self._batches[key] = None if batch is None else batch.batch_id
        return self._batches[key]

    def elasticsearch(self) -> Elasticsearch:
        """One client for every table (thread-safe), with the status's own timeout."""
        with self._lock:
            if self._es is None:
                self._es = status_client(self.config)
            return self._es

    def close(self) -> None:
        """Release the Elasticsearch client, if one was made."""
        if self._es is not None:
            self._es.close()


def ingestor_lag(state: PipelineState, entity: EntityConfig) -> StreamLag:
    """Records in the source topic after where the ingestor has written it."""
    service = INGESTOR
    group = state.config.group_of(entity.name)[0]
    try:
        watermarks = kafka_end_offsets(state.config, entity.source_topic)
    except KafkaException as exc:
        note = f"Kafka unavailable: {exc.args[0].str()}"
        return StreamLag(service, None, "records", note, group)
    position = state.positions.get(entity.source_topic)
    if position is not None:
        group, offsets = position.group, position.offsets
        note = f"written to bronze v{position.version}"
        if position.held is not None:
            note = (
                f"held at bronze v{position.version} (taken up at the next start): " + position.held
            )
    else:
        checkpoint = ingestor_checkpoint(state.config, state.reader, entity)
        if checkpoint is None:
            waiting = sum(high - low for low, high in watermarks.values())
            note = f"{NOT_STARTED} ({waiting} records in topic)"
            return StreamLag(service, None, "records", note, group)
        group, offsets = checkpoint.group, checkpoint.offsets
        note = "not written to bronze yet"
    # A partition the position does not name is read from its start.
    lag = sum(max(0, high - int(offsets.get(str(p), low))) for p, (low, high) in watermarks.items())
    return StreamLag(service, lag, "records", note, group, state.group_batch(service, group))


def _legacy_bronze_note(state: PipelineState, entity: EntityConfig, silver_exists: bool) -> str:
    """A note when the entity's bronze table of an earlier release waits to be drained."""
    layout = state.config.layout
    if state.reader.table_version(layout.legacy_bronze(entity.name)) is None:
        return ""
    silver = layout.silver(entity.name)
    if silver_exists and state.reader.transaction_version(silver, MERGER_LEGACY_APP) is not None:
        return ""
    return (
        f"; bronze/{entity.name} of an earlier release is not drained yet (the merger "
        "drains it at its first start)"
    )


def merger_lag(state: PipelineState, entity: EntityConfig) -> StreamLag:
    """Bronze versions after the table's merger progress that hold rows of it."""
    service = MERGER
    group = state.config.group_of(entity.name)[0]
    batch = state.group_batch(service, group)
    silver = state.config.layout.silver(entity.name)
    silver_exists = state.reader.table_version(silver) is not None
    progress = (
        state.reader.transaction_version(silver, MERGER_PROGRESS_APP) if silver_exists else None
    )
    legacy = _legacy_bronze_note(state, entity, silver_exists)
    if state.bronze.latest is None or progress is None:
        return StreamLag(service, None, "versions", NOT_STARTED + legacy, group, batch)
    backlog = merger_backlog(
        state.bronze, entity.name, entity.source_topic, progress, _ingested(state, entity)
    )
    note = f"merged through bronze v{progress}"
    if backlog.count and backlog.rows is not None:
        note += f", {backlog.rows:,} rows to merge"
    return StreamLag(service, backlog.count, "versions", note + legacy, group, batch)


def _ingested(state: PipelineState, entity: EntityConfig) -> dict[str, int] | None:
    """The furthest the ingestor may have written the entity's topic to bronze (None: unknown).

    Bronze's own newest record of it; without one, the last batch its group's
    checkpoint planned (committed to bronze or not yet).
    """
    position = state.positions.get(entity.source_topic)
    if position is not None:
        return position.offsets
    checkpoint = ingestor_checkpoint(state.config, state.reader, entity, planned=True)
    return None if checkpoint is None else checkpoint.offsets


def _silver_lag(
    state: PipelineState,
    service: str,
    entity: EntityConfig,
    progress: int | None,
    note: str,
) -> StreamLag:
    """Silver versions with changes after ``progress`` (the last one the publisher holds)."""
    group = state.config.group_of(entity.name)[0]
    batch = state.group_batch(service, group)
    if progress is None:
        return StreamLag(service, None, "versions", NOT_STARTED, group, batch)
    silver = state.silver(entity.name)
    if silver.latest is None:
        return StreamLag(service, None, "versions", "silver table is missing", group, batch)
    changed, unreadable = change_feed_versions(silver, progress)
    return StreamLag(service, len(changed) + len(unreadable), "versions", note, group, batch)


def publisher_kafka_lag(state: PipelineState, entity: EntityConfig) -> StreamLag:
    """Silver versions with changes after the last one publisher-kafka published."""
    try:
        published = published_version(state.config, entity)
    except KafkaException as exc:
        note = f"Kafka unavailable: {exc.args[0].str()}"
        return StreamLag(PUBLISHER_KAFKA, None, "versions", note, None)
    note = f"published up to silver v{published}"
    return _silver_lag(state, PUBLISHER_KAFKA, entity, published, note)


def publisher_es_lag(state: PipelineState, entity: EntityConfig) -> StreamLag:
    """Silver versions with changes after the one publisher-es recorded as indexed."""
    try:
        indexed = indexed_version(state.elasticsearch(), state.config, entity)
    except (ApiError, TransportError) as exc:
        note = f"Elasticsearch unavailable: {exc}"
        return StreamLag(PUBLISHER_ES, None, "versions", note, None)
    note = f"indexed up to silver v{indexed}"
    if indexed is None:
        indexed = legacy_indexed_version(state.reader, state.config, entity)
        note = (
            f"indexed up to silver v{indexed} by an earlier release (its checkpoint): it "
            "goes on from there"
        )
    return _silver_lag(state, PUBLISHER_ES, entity, indexed, note)


def quarantine_counts(config: PipelineConfig, reader: StateReader) -> dict[str, dict[str, int]]:
    """Rows per entity in each service's quarantine table that exists."""
    counts: dict[str, dict[str, int]] = {}
    for service in QUARANTINE_WRITERS:
        per_entity = reader.count_by(config.layout.quarantine(service), "entity")
        if per_entity is not None:
            counts[service] = per_entity
    return counts


def collect_status(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    spark: SparkSession | None = None,
    engine: str = DELTA_RS,
) -> StatusReport:
    """Versions, lags and quarantine counts for the selected entities (default: all).

    ``engine`` says how tables and checkpoints are read
    (:func:`cdc_cli.table_state.open_state`); ``spark`` serves only the Spark engine.
    """
    entities = config.select_entities(entity_names)
    reader, _ = open_state(config, engine, "cdc-status", spark)
    state = PipelineState(config, reader, entities)
    try:
        if engine == SPARK:  # one Spark session: its reads queue up anyway
            statuses = [entity_status(state, entity) for entity in entities]
        else:
            with ThreadPoolExecutor(STATUS_THREADS, thread_name_prefix="cdc-status") as pool:
                statuses = list(pool.map(lambda e: entity_status(state, e), entities))
    finally:
        state.close()
    return StatusReport(tuple(statuses), quarantine_counts(config, reader))


def entity_status(state: PipelineState, entity: EntityConfig) -> EntityStatus:
    """Versions of bronze and silver and the lag of every service, for one entity."""
    streams = (
        ingestor_lag(state, entity),
        merger_lag(state, entity),
        publisher_kafka_lag(state, entity),
        publisher_es_lag(state, entity),
    )
    silver = state.reader.table_version(state.config.layout.silver(entity.name))
    group = state.config.group_of(entity.name)[0]
    return EntityStatus(entity.name, state.bronze.latest, silver, streams, group)


def _where(stream: StreamLag) -> str:
    """A stream's note, after its group and that group's last committed batch."""
    if stream.group is None:
        return stream.note
    batch = "" if stream.batch is None else f" batch {stream.batch}"
    return f"group {stream.group}{batch}: {stream.note}"


def render(report: StatusReport) -> str:
    """The report as aligned text, one block per entity."""
    lines: list[str] = []
    for status in report.entities:
        versions = ", ".join(
            f"{layer} {'v' + str(v) if v is not None else NOT_STARTED}"
            for layer, v in (("bronze", status.bronze_version), ("silver", status.silver_version))
        )
        lines.append(f"{status.entity}  (group {status.group}; {versions})")
        for stream in status.streams:
            lag = f"lag {stream.lag:,} {stream.unit}" if stream.lag is not None else "-"
            lines.append(f"  {stream.service:<16} {lag:<22} {_where(stream)}")
    lines.append("quarantine")
    for service in QUARANTINE_WRITERS:
        per_entity = report.quarantine.get(service)
        if per_entity is None:
            lines.append(f"  {service:<16} {NOT_STARTED}")
            continue
        names = [s.entity for s in report.entities]
        shown = ", ".join(f"{name} {per_entity.get(name, 0):,}" for name in names)
        lines.append(f"  {service:<16} {sum(per_entity.values()):,} rows ({shown})")
    return "\n".join(lines)


def to_json(report: StatusReport) -> str:
    """``--json`` output."""
    return json.dumps(report.to_dict(), indent=2)
