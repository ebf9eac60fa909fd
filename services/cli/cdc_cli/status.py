"""``cdc status``: how far each service got, per entity, read from what the services persist.

Nothing here asks a running service: lag is computed from the same state a restarted
service would resume from, so it is right whether the services run or not.

- ingestor: Kafka end offsets minus the offsets of the checkpoint's last committed batch;
- merger: bronze versions not read completely by its checkpoint;
- publisher-kafka: silver versions after the last one it published (its progress offset,
  committed in the same Kafka transaction as the events), or after its checkpoint's
  position when that is further (versions without changes publish nothing);
- publisher-es: silver versions not read completely by its checkpoint;
- quarantine: rows per service and entity.

Versions count only when they change data: an OPTIMIZE or VACUUM commit is skipped by
streams, so it is not lag. A table or checkpoint that does not exist yet shows as "not
started", never as an error.

Tables and checkpoints are read without a JVM (delta-rs, :mod:`cdc_cli.delta_log`), so
the command answers in about a second; the Spark engine (``--engine spark``, a hidden
option) reads the same state through a Spark session, for comparison.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_shared.clients import make_consumer
from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.layout import (
    INGESTOR,
    MERGER,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    QUARANTINE_WRITERS,
    publisher_progress_group,
)
from cdc_shared.stream_checkpoint import CheckpointFiles, entity_source, held_tables
from confluent_kafka import KafkaException, TopicPartition

from cdc_cli.checkpoints import (
    StateReader,
    commit_file_counter,
    data_commits_from,
    delta_position,
    last_committed_batch,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

NOT_STARTED = "not started"
KAFKA_TIMEOUT_S = 10.0
#: Entities read side by side: each mostly waits (a Kafka round trip, a Delta log read in
#: delta-rs, which releases the GIL), so a pipeline of many tables answers in about the
#: time of its slowest few.
STATUS_THREADS = 8
#: How ``cdc status`` reads tables and checkpoints: delta-rs and plain file reads (the
#: default, no JVM), or a Spark session (the services' own view; ``--engine spark``).
DELTA_RS = "delta-rs"
SPARK = "spark"
ENGINES = (DELTA_RS, SPARK)


@dataclass(frozen=True)
class StreamLag:
    """One service's position for one entity; ``lag`` is None when it cannot be told."""

    service: str
    lag: int | None
    unit: str  # "records" (Kafka) or "versions" (Delta)
    note: str  # where it is, or why the lag is unknown ("not started", an error)

    @property
    def started(self) -> bool:
        """Whether the service left a position to measure from."""
        return self.lag is not None


@dataclass(frozen=True)
class EntityStatus:
    """Table versions and every service's lag for one entity."""

    entity: str
    bronze_version: int | None
    silver_version: int | None
    streams: tuple[StreamLag, ...]

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


def _data_versions_from(reader: StateReader, path: str, version: int) -> int:
    """How many versions of the table at ``path``, from ``version`` on, change data."""
    return len(data_commits_from(reader.history(path, version), version))


def _delta_stream_lag(
    config: PipelineConfig, reader: StateReader, service: str, entity: str, table: str
) -> StreamLag:
    """Lag of a Delta-source stream: data-changing versions of ``table`` not read completely.

    ``table`` is ``bronze`` (the merger reads its commits) or ``silver`` (the publishers
    read its Change Data Feed).
    """
    path = config.layout.bronze(entity) if table == "bronze" else config.layout.silver(entity)
    change_feed = table == "silver"
    checkpoint = config.checkpoint_path(service, entity)
    if (held := held_note(reader, checkpoint, entity)) is not None:
        return StreamLag(service, None, "versions", held)
    batch = last_committed_batch(reader, checkpoint)
    offset = None if batch is None else entity_source(batch, reader, checkpoint, entity)
    if batch is None or offset is None:
        return StreamLag(service, None, "versions", NOT_STARTED)
    if reader.table_version(path) is None:
        return StreamLag(service, None, "versions", f"{table} table is missing")
    position = delta_position(offset, commit_file_counter(reader, path, change_feed))
    lag = _data_versions_from(reader, path, position.next_version)
    note = f"batch {batch.batch_id}, next {table} version {position.next_version}"
    return StreamLag(service, lag, "versions", note)


def held_note(reader: CheckpointFiles, checkpoint: str, entity: str) -> str | None:
    """Why a one query holds ``entity`` back, and since which batch; None when it does not."""
    entry = held_tables(reader, checkpoint).get(entity)
    if entry is None:
        return None
    return f"held back since batch {entry['batch_id']} (taken up at the next start): " + str(
        entry["reason"]
    )


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


def ingestor_lag(config: PipelineConfig, entity: EntityConfig, reader: StateReader) -> StreamLag:
    """Records in the source topic after the offsets of the ingestor's last committed batch."""
    service = INGESTOR
    try:
        watermarks = kafka_end_offsets(config, entity.source_topic)
    except KafkaException as exc:
        return StreamLag(service, None, "records", f"Kafka unavailable: {exc.args[0].str()}")
    checkpoint = config.checkpoint_path(service, entity.name)
    if (held := held_note(reader, checkpoint, entity.name)) is not None:
        return StreamLag(service, None, "records", held)
    batch = last_committed_batch(reader, checkpoint)
    waiting = sum(high - low for low, high in watermarks.values())
    if batch is None or not batch.sources:
        return StreamLag(service, None, "records", f"{NOT_STARTED} ({waiting} records in topic)")
    offsets = batch.sources[0].get(entity.source_topic, {}) if batch.sources[0] else {}
    # A partition absent from the checkpoint is read from its start.
    lag = sum(max(0, high - int(offsets.get(str(p), low))) for p, (low, high) in watermarks.items())
    return StreamLag(service, lag, "records", f"batch {batch.batch_id}")


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


def publisher_kafka_lag(
    config: PipelineConfig, entity: EntityConfig, reader: StateReader
) -> StreamLag:
    """Silver versions after the furthest of the published progress and the checkpoint."""
    service = PUBLISHER_KAFKA
    silver = config.layout.silver(entity.name)
    checkpointed = _delta_stream_lag(config, reader, service, entity.name, "silver")
    try:
        published = published_version(config, entity)
    except KafkaException as exc:
        return StreamLag(service, None, "versions", f"Kafka unavailable: {exc.args[0].str()}")
    if published is None or reader.table_version(silver) is None:
        return checkpointed
    lag = _data_versions_from(reader, silver, published + 1)
    if checkpointed.lag is not None:
        lag = min(lag, checkpointed.lag)
    return StreamLag(service, lag, "versions", f"published up to silver version {published}")


def quarantine_counts(config: PipelineConfig, reader: StateReader) -> dict[str, dict[str, int]]:
    """Rows per entity in each service's quarantine table that exists."""
    counts: dict[str, dict[str, int]] = {}
    for service in QUARANTINE_WRITERS:
        per_entity = reader.count_by(config.layout.quarantine(service), "entity")
        if per_entity is not None:
            counts[service] = per_entity
    return counts


def state_reader(
    config: PipelineConfig, engine: str = DELTA_RS, spark: SparkSession | None = None
) -> StateReader:
    """The reader of tables and checkpoints for ``engine`` (one of ``ENGINES``).

    The Spark engine reads through ``spark``, or a session built from the configuration.
    """
    if engine == DELTA_RS:
        from cdc_cli.delta_log import DeltaLogState

        return DeltaLogState(config)
    if engine == SPARK:
        from cdc_shared.spark import build_spark_session

        from cdc_cli.checkpoints import SparkState

        return SparkState(spark or build_spark_session(config.spark, "cdc-status"))
    raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")


def collect_status(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    spark: SparkSession | None = None,
    engine: str = DELTA_RS,
) -> StatusReport:
    """Versions, lags and quarantine counts for the selected entities (default: all).

    ``engine`` says how tables and checkpoints are read (:func:`state_reader`); ``spark``
    serves only the Spark engine.
    """
    entities = config.select_entities(entity_names)
    reader = state_reader(config, engine, spark)
    if engine == SPARK:  # one Spark session: its reads queue up anyway
        statuses = [entity_status(config, entity, reader) for entity in entities]
    else:
        with ThreadPoolExecutor(STATUS_THREADS, thread_name_prefix="cdc-status") as pool:
            statuses = list(pool.map(lambda e: entity_status(config, e, reader), entities))
    return StatusReport(tuple(statuses), quarantine_counts(config, reader))


def entity_status(
    config: PipelineConfig, entity: EntityConfig, reader: StateReader
) -> EntityStatus:
    """Versions of bronze and silver and the lag of every service, for one entity."""
    bronze_path = config.layout.bronze(entity.name)
    silver_path = config.layout.silver(entity.name)
    streams = (
        ingestor_lag(config, entity, reader),
        _delta_stream_lag(config, reader, MERGER, entity.name, "bronze"),
        publisher_kafka_lag(config, entity, reader),
        _delta_stream_lag(config, reader, PUBLISHER_ES, entity.name, "silver"),
    )
    versions = (reader.table_version(bronze_path), reader.table_version(silver_path))
    return EntityStatus(entity.name, *versions, streams)


def render(report: StatusReport) -> str:
    """The report as aligned text, one block per entity."""
    lines: list[str] = []
    for status in report.entities:
        versions = ", ".join(
            f"{layer} {'v' + str(v) if v is not None else NOT_STARTED}"
            for layer, v in (("bronze", status.bronze_version), ("silver", status.silver_version))
        )
        lines.append(f"{status.entity}  ({versions})")
        for stream in status.streams:
            lag = f"lag {stream.lag:,} {stream.unit}" if stream.lag is not None else "-"
            lines.append(f"  {stream.service:<16} {lag:<22} {stream.note}")
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
