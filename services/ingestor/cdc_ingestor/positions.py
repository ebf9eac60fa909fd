"""How far each topic is written to bronze, and where a group's query starts reading.

Every bronze commit of the ingestor records, in its commit's ``userMetadata``, where the
batch it wrote ends in each topic of its group (the next offset per partition), and the
tables it holds back (:func:`commit_metadata`): bronze's own log then says how far each
topic is written, atomically with the rows. A held table's position stays where it was
held while the query reads on.

A group's query resumes its checkpoint when the checkpoint reads the same topics and no
table is held. Otherwise (a table added to or taken out of the group, a table held by an
earlier run to take up again, the first start after the releases that ran a query per
table) it starts on a new checkpoint, the old one kept aside, each topic where it stood
(:func:`where_to_start`): where bronze's log says it is written, or where the old
checkpoint committed if that is earlier, or for a topic bronze never held: where the
earlier releases' checkpoints and bronze tables say, else ``ingestor.starting_offsets``.
Records read again below what bronze holds (the *floor*) are not written to bronze again,
and the quarantine writes each record once whatever reads it
(``cdc_ingestor.ingestion``): nothing is read twice into bronze, nothing skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cdc_shared.clients.connect import make_admin
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import (
    ALL_ENTITIES,
    INGESTOR,
    INGESTOR_COMMIT_KEY,
    POSITIONS_COMMITS_READ,
)
from cdc_shared.contracts.stream_checkpoint import (
    CheckpointFiles,
    last_committed_batch,
    parse_offsets,
    planned_batches,
)
from cdc_shared.jvm.bridge import HadoopFiles, move_aside
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

log = logging.getLogger("cdc_ingestor")

#: Offsets by topic, then partition (as Spark's Kafka source writes them): the next one.
Offsets = dict[str, dict[str, int]]
#: Spark's Kafka source offsets for "from the start" and "from the end" of a partition.
EARLIEST, LATEST = -2, -1
METADATA_TIMEOUT_S = 30.0


def commit_metadata(group: str, positions: Offsets, held: Mapping[str, str]) -> str:
    """A bronze commit's ``userMetadata``: the group's topics' positions, its held tables."""
    return json.dumps(
        {INGESTOR_COMMIT_KEY: {"group": group, "positions": positions, "held": dict(held)}},
        sort_keys=True,
        separators=(",", ":"),
    )


@dataclass
class Recorded:
    """What bronze's latest commits say of some topics: their positions, the held tables."""

    positions: Offsets = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)  # entity -> why


def recorded_positions(
    spark: SparkSession, bronze: str, entities: Iterable[EntityConfig]
) -> Recorded:
    """Each topic's position and held state as the newest bronze commit naming it says.

    Reads the commit information of bronze's latest ``POSITIONS_COMMITS_READ`` commits (no data).
    """
    wanted = {entity.source_topic: entity.name for entity in entities}
    recorded = Recorded()
    if not DeltaTable.isDeltaTable(spark, bronze):
        return recorded
    history = DeltaTable.forPath(spark, bronze).history(POSITIONS_COMMITS_READ)
    rows = history.where(F.col("userMetadata").isNotNull()).select("version", "userMetadata")
    for row in sorted(rows.collect(), key=lambda r: -int(r["version"])):
        try:
            record = json.loads(row["userMetadata"]).get(INGESTOR_COMMIT_KEY)
        except (ValueError, AttributeError):
            continue
        if not isinstance(record, dict):
            continue
        held = record.get("held", {})
        for topic, offsets in record.get("positions", {}).items():
            if topic in wanted and topic not in recorded.positions:
                recorded.positions[topic] = {str(p): int(o) for p, o in offsets.items()}
                if wanted[topic] in held:
                    recorded.held[wanted[topic]] = str(held[wanted[topic]])
        if len(recorded.positions) == len(wanted):
            break
    return recorded


@dataclass(frozen=True)
class Start:
    """Where a group's query starts: its checkpoint goes on, or a new one at ``offsets``.

    ``floors``: per topic and partition, the offset below which bronze holds the records
    already (a record read again below it is not written again). ``held``: the tables an
    earlier run held, read again from their held position.
    """

    resume: bool
    offsets: Offsets
    floors: Offsets
    held: dict[str, str]


def where_to_start(
    spark: SparkSession,
    config: PipelineConfig,
    checkpoint: str,
    entities: list[EntityConfig],
) -> Start:
    """Where the query over ``entities``' topics starts (see the module docstring).

    A new start moves the checkpoint aside first (it is kept beside, with the time).
    """
    files = HadoopFiles(spark)
    bronze = config.layout.bronze()
    recorded = recorded_positions(spark, bronze, entities)
    topics = sorted(entity.source_topic for entity in entities)
    held_topics = {e.source_topic for e in entities if e.name in recorded.held}
    floors = {t: o for t, o in recorded.positions.items() if t not in held_topics}
    planned = planned_batches(files, checkpoint)
    if planned:
        text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/offsets/{planned[-1]}")
        read = (parse_offsets(text)[0] if text else None) or {}
        if sorted(read) == topics and not recorded.held:
            return Start(True, {}, floors, {})
    committed = last_committed_batch(files, checkpoint)
    committed_ends: Offsets = dict(committed.sources[0] or {}) if committed else {}
    offsets: Offsets = {}
    for entity in entities:
        topic = entity.source_topic
        known = [o for o in (recorded.positions.get(topic), committed_ends.get(topic)) if o]
        if known:
            offsets[topic] = _earliest(known)
        elif (legacy := legacy_position(spark, config, entity)) is not None:
            offsets[topic] = legacy
    if planned:
        aside = move_aside(spark, checkpoint)
        log.warning(
            "the group's query starts on a new checkpoint where each topic stood (the old "
            "one kept aside): its tables changed, or tables held by an earlier run are "
            "taken up again",
            extra={"checkpoint": checkpoint, "moved_to": aside, "held": recorded.held},
        )
    return Start(False, offsets, floors, recorded.held)


def _earliest(known: list[dict[str, Any]]) -> dict[str, int]:
    """Per partition, the earliest of the positions (a partition named by one of them only: its)."""
    merged: dict[str, int] = {}
    for offsets in known:
        for partition, given in offsets.items():
            offset = int(given)
            merged[str(partition)] = min(offset, merged.get(str(partition), offset))
    return merged


def spark_starting_offsets(
    config: PipelineConfig, entities: list[EntityConfig], start: Start
) -> str:
    """Spark's ``startingOffsets`` for a new checkpoint: every partition of every topic.

    A topic without a position starts as ``ingestor.starting_offsets`` says; a partition
    the position does not name, from its start (as Spark reads a new partition).
    """
    setting = config.ingestor.starting_offsets
    if not start.offsets:
        return setting
    given: Offsets = json.loads(setting) if setting.lstrip().startswith("{") else {}
    default = LATEST if setting == "latest" else EARLIEST
    topics = [entity.source_topic for entity in entities]
    chosen: Offsets = {}
    for topic, partitions in topic_partitions(config, topics).items():
        own = start.offsets.get(topic)
        fallback = EARLIEST if own is not None else default
        offsets = own if own is not None else given.get(topic, {})
        chosen[topic] = {str(p): int(offsets.get(str(p), fallback)) for p in partitions}
    return json.dumps(chosen, sort_keys=True)


def topic_partitions(config: PipelineConfig, topics: list[str]) -> dict[str, list[int]]:
    """The partitions of each of ``topics`` that exists on the broker."""
    admin = make_admin(config.kafka)
    metadata = admin.list_topics(timeout=METADATA_TIMEOUT_S).topics
    return {
        topic: sorted(metadata[topic].partitions)
        for topic in topics
        if topic in metadata and metadata[topic].error is None
    }


def batch_ends(files: CheckpointFiles, checkpoint: str, batch_id: int) -> Offsets:
    """Where batch ``batch_id`` of the query at ``checkpoint`` ends, by topic and partition."""
    text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/offsets/{batch_id}")
    ends = (parse_offsets(text)[0] if text else None) or {}
    return {topic: {str(p): int(o) for p, o in offsets.items()} for topic, offsets in ends.items()}


# --- the releases before one bronze -------------------------------------------------------


def legacy_position(
    spark: SparkSession, config: PipelineConfig, entity: EntityConfig
) -> dict[str, int] | None:
    """Where the releases before one bronze had ingested ``entity``'s topic to, if they had.

    The latest of: what its own query's checkpoint committed, what their one query's
    checkpoint committed, and (a batch planned but not committed may be in bronze
    already) the next offset after the last record of the topic in its table
    ``bronze/<entity>`` or in the ingestor's quarantine. None when none of them exists.
    """
    files = HadoopFiles(spark)
    topic = entity.source_topic
    found: list[dict[str, int]] = []
    for name in (entity.name, ALL_ENTITIES):
        batch = last_committed_batch(files, config.layout.legacy_checkpoint(INGESTOR, name))
        offsets = (batch.sources[0] or {}).get(topic) if batch and batch.sources else None
        if offsets:
            found.append({str(p): int(o) for p, o in offsets.items()})
    ingested = _legacy_ingested(spark, config, entity)
    if ingested:
        found.append(ingested)
    if not found:
        return None
    latest: dict[str, int] = {}
    for offsets in found:
        for partition, offset in offsets.items():
            latest[partition] = max(offset, latest.get(partition, offset))
    log.info(
        "a topic continues where the releases before one bronze ingested it",
        extra={"entity": entity.name, "topic": topic, "offsets": latest},
    )
    return latest


def _legacy_ingested(
    spark: SparkSession, config: PipelineConfig, entity: EntityConfig
) -> dict[str, int]:
    """The next offset after the topic's last record in ``bronze/<entity>`` or quarantine."""
    found: dict[str, int] = {}
    sources: list[DataFrame] = []
    table = config.layout.legacy_bronze(entity.name)
    if DeltaTable.isDeltaTable(spark, table):
        sources.append(spark.read.format("delta").load(table))
    quarantine = config.layout.quarantine(INGESTOR)
    if DeltaTable.isDeltaTable(spark, quarantine):
        rows = spark.read.format("delta").load(quarantine)
        sources.append(rows.where(F.col("kafka_topic") == entity.source_topic))
    for rows in sources:
        grouped = rows.where(F.col("kafka_partition").isNotNull()).groupBy("kafka_partition")
        for partition, end in grouped.agg(F.max("kafka_offset") + 1).collect():
            found[str(partition)] = max(int(end), found.get(str(partition), 0))
    return found
