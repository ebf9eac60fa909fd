"""``cdc quarantine``: what the services could not process, and re-injecting it once fixed.

Each service that can reject input appends it to ``quarantine/<service>`` with its raw
bytes, the error, and where it came from (Kafka coordinates, or source table/version).
Listing and showing only read those tables.

Replay (ingestor only) produces quarantined source records again, unchanged, to the
partition they came from, so the ingestor reads them once more, e.g. after the missing
writer schema was deployed. It re-injects each quarantined record **exactly once**, across
repeated runs and crashes, by keeping a ledger, the Delta table ``quarantine/_replayed``,
keyed by the record's original (service, topic, partition, offset):

1. rows already in the ledger are never selected again;
2. before producing, the run records its selection as ``pending`` (one MERGE that inserts
   only keys absent from the ledger; a concurrent run's MERGE conflicts and fails), with
   the topic's end offsets at that moment;
3. it produces the records (idempotent producer), each with a header
   ``cdc.replay.of = <topic>/<partition>/<offset>`` naming where its change was first
   read, and then marks them ``done`` with the coordinates they landed at;
4. a later run that finds ``pending`` rows (a run that crashed between 2 and 3) reads the
   topic from the recorded end offsets and looks for those headers: what it finds is
   marked ``done``, what it does not was never produced and is selected again.

A replayed record keeps the sequence of its change: the ingestor takes the sequence's
Kafka coordinates (the default ``sequence_by``) from the header
(``cdc_shared.contracts.replay_origin``), and sequence paths into the envelope come from the
payload, which replay keeps. So a replayed old change never overwrites a newer change of
its key.

Pending rows younger than a lease (10 minutes) belong to a run that may still be going;
replay refuses to touch them unless told the run crashed (``recover=True``).

A replayed record that fails again is quarantined anew at its new coordinates; it is a
new record and a later replay may select it. Its header then still names where the
change was first read: the ledger leads from the new coordinates back to the first.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from cdc_shared.clients.connect import make_consumer, make_producer
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.layout import INGESTOR, QUARANTINE_WRITERS
from cdc_shared.contracts.replay_origin import REPLAY_HEADER, Origin, origin_header, parse_origin
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.jvm.spark import build_spark_session
from cdc_shared.streaming.tables import ensure_table
from confluent_kafka import KafkaError, Message, TopicPartition
from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_cli.delta_log import DeltaLogState
from cdc_cli.spark_state import is_delta_table
from cdc_cli.status import kafka_end_offsets

REPLAYABLE = (INGESTOR,)
RUN_HEADER = "cdc.replay.run"
DEFAULT_LEASE = dt.timedelta(minutes=10)
PENDING, DONE = "pending", "done"
KAFKA_TIMEOUT_S = 30.0

#: The replay ledger: one row per quarantined record that was (or is being) replayed.
LEDGER_SCHEMA = T.StructType(
    [
        T.StructField("service", T.StringType(), False),
        T.StructField("entity", T.StringType(), False),
        T.StructField("kafka_topic", T.StringType(), False),
        T.StructField("kafka_partition", T.IntegerType(), False),
        T.StructField("kafka_offset", T.LongType(), False),
        T.StructField("run_id", T.StringType(), False),
        T.StructField("state", T.StringType(), False),
        T.StructField("scan_from", T.StringType(), False),  # JSON: partition -> end offset
        T.StructField("requested_at", T.TimestampType(), False),
        T.StructField("replayed_partition", T.IntegerType(), True),
        T.StructField("replayed_offset", T.LongType(), True),
        T.StructField("replayed_at", T.TimestampType(), True),
    ]
)
_COORDINATES = ("service", "kafka_topic", "kafka_partition", "kafka_offset")


class QuarantineError(RuntimeError):
    """A quarantine operation cannot go ahead; the message says why and what to do."""


@dataclass(frozen=True)
class QuarantineGroup:
    """Quarantined rows of one service, entity and error kind; ``replayed`` of them."""

    service: str
    entity: str
    error_kind: str
    rows: int
    replayed: int


@dataclass(frozen=True)
class QuarantinedRecord:
    """One quarantined row as ``cdc quarantine show`` prints it."""

    service: str
    entity: str
    error_kind: str
    error_message: str
    coordinates: str  # topic/partition@offset, or table@version
    quarantined_at: str
    raw_key: bytes | None
    raw_value: bytes | None
    replayed: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: raw bytes as hex."""
        data = asdict(self)
        data["raw_key"] = None if self.raw_key is None else self.raw_key.hex()
        data["raw_value"] = None if self.raw_value is None else self.raw_value.hex()
        return data


@dataclass(frozen=True)
class ReplayResult:
    """What a replay run did for one entity."""

    entity: str
    topic: str
    selected: int  # quarantined rows matching the filter
    already_replayed: int  # of those, replayed by an earlier run
    recovered: int  # pending rows of a crashed run found in the topic (marked done)
    produced: int  # records this run produced


def preview(data: bytes | None, width: int = 32) -> str:
    """A short, printable view of raw bytes: length, hex and escaped forms of the start."""
    if data is None:
        return "<null>"
    head = data[:width]
    more = "..." if len(data) > width else ""
    return f"{len(data)} bytes  hex {head.hex(' ')}{more}  {head!r}{more}"


def _spark(config: PipelineConfig, spark: SparkSession | None) -> SparkSession:
    return spark or build_spark_session(config.spark, "cdc-quarantine")


def _check_service(service: str) -> None:
    if service not in QUARANTINE_WRITERS:
        raise ConfigError(
            f"unknown service {service!r}; quarantine exists for {QUARANTINE_WRITERS}"
        )


def _check_replayable(service: str) -> None:
    _check_service(service)
    if service not in REPLAYABLE:
        raise ConfigError(
            f"replay supports only the ingestor's quarantine (source records); "
            f"{service!r} rows are not Kafka source records"
        )


def _quarantine(
    config: PipelineConfig, spark: SparkSession, service: str, entity: str | None
) -> DataFrame | None:
    path = config.layout.quarantine(service)
    if not is_delta_table(spark, path):
        return None
    frame = spark.read.format("delta").load(path)
    return frame if entity is None else frame.where(F.col("entity") == entity)


def _ledger_path(config: PipelineConfig) -> str:
    return config.layout.replay_ledger()


def _ledger(config: PipelineConfig, spark: SparkSession) -> DataFrame:
    path = _ledger_path(config)
    if not is_delta_table(spark, path):
        return frame_from_rows(spark, [], LEDGER_SCHEMA)
    return spark.read.format("delta").load(path)


def _with_replayed(frame: DataFrame, ledger: DataFrame) -> DataFrame:
    """``frame`` with a boolean ``replayed``: its coordinates are done in the ledger."""
    done = ledger.where(F.col("state") == DONE).select(*_COORDINATES, F.lit(True).alias("_done"))
    return (
        frame.join(done, on=list(_COORDINATES), how="left")
        .withColumn("replayed", F.coalesce(F.col("_done"), F.lit(False)))
        .drop("_done")
    )


#: Quarantined rows per service, entity and error kind, and how many of them the ledger
#: marks replayed ({join}: the ledger's done rows joined on the coordinates, or nothing).
_GROUPS_SQL = """
SELECT q.service, q.entity, q.error_kind, count(*) AS n_rows, {done} AS n_done
FROM quarantine q {join}
{where}
GROUP BY q.service, q.entity, q.error_kind
ORDER BY q.service, q.entity, q.error_kind
"""
_DONE_JOIN = (
    f"LEFT JOIN (SELECT {', '.join(_COORDINATES)} FROM ledger WHERE state = '{DONE}') d ON "
    + " AND ".join(f"q.{name} = d.{name}" for name in _COORDINATES)
)


def _sql_text(value: str) -> str:
    """``value`` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def list_groups(
    config: PipelineConfig, service: str | None = None, entity: str | None = None
) -> list[QuarantineGroup]:
    """Row counts by service, entity and error kind (and how many were replayed).

    Read without a JVM (delta-rs, :class:`cdc_cli.delta_log.DeltaLogState`): counting
    needs no Spark session, so the command answers in about a second.
    """
    if service is not None:
        _check_service(service)
    if entity is not None:
        config.entity(entity)
    reader = DeltaLogState(config)
    ledger = _ledger_path(config)
    replays = reader.table_version(ledger) is not None
    sql = _GROUPS_SQL.format(
        done="sum(CASE WHEN d.service IS NULL THEN 0 ELSE 1 END)" if replays else "0",
        join=_DONE_JOIN if replays else "",
        where="" if entity is None else f"WHERE q.entity = {_sql_text(entity)}",
    )
    groups: list[QuarantineGroup] = []
    for name in [service] if service else QUARANTINE_WRITERS:
        tables = {"quarantine": config.layout.quarantine(name)}
        rows = reader.query(sql, **tables, **({"ledger": ledger} if replays else {}))
        groups.extend(
            QuarantineGroup(
                str(r["service"]),
                str(r["entity"]),
                str(r["error_kind"]),
                int(r["n_rows"]),
                int(r["n_done"] or 0),
            )
            for r in rows or []
        )
    return groups


def show_records(
    config: PipelineConfig,
    service: str,
    entity: str | None = None,
    limit: int = 20,
    where: str | None = None,
    spark: SparkSession | None = None,
) -> list[QuarantinedRecord]:
    """The most recently quarantined rows of ``service`` (optionally one entity, a filter)."""
    _check_service(service)
    if entity is not None:
        config.entity(entity)
    spark = _spark(config, spark)
    frame = _quarantine(config, spark, service, entity)
    if frame is None:
        return []
    frame = _filtered(frame, where)
    rows = (
        _with_replayed(frame, _ledger(config, spark))
        .orderBy(F.col("quarantined_at").desc(), "kafka_partition", "kafka_offset")
        .limit(limit)
        .collect()
    )
    return [_record(r) for r in rows]


def _filtered(frame: DataFrame, where: str | None) -> DataFrame:
    if not where:
        return frame
    try:
        filtered = frame.where(where)
        filtered.schema  # noqa: B018 - analyses the expression now, for a clear error
    except AnalysisException as exc:
        raise ConfigError(f"--where {where!r} is not a valid filter: {exc}") from None
    return filtered


def _record(row: Any) -> QuarantinedRecord:
    if row["kafka_topic"] is not None:
        coordinates = f"{row['kafka_topic']}/{row['kafka_partition']}@{row['kafka_offset']}"
    else:
        coordinates = f"{row['source_table']}@{row['source_version']}"
    at = row["quarantined_at"]
    return QuarantinedRecord(
        service=str(row["service"]),
        entity=str(row["entity"]),
        error_kind=str(row["error_kind"]),
        error_message=str(row["error_message"]),
        coordinates=coordinates,
        quarantined_at=at.astimezone(dt.UTC).isoformat(timespec="seconds"),
        raw_key=None if row["raw_key"] is None else bytes(row["raw_key"]),
        raw_value=None if row["raw_value"] is None else bytes(row["raw_value"]),
        replayed=bool(row["replayed"]),
    )


# --- replay ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    partition: int
    offset: int  # where it was quarantined: its key in the ledger
    key: bytes | None
    value: bytes | None
    first_offset: int  # where its change was first read (same partition): the header's


class Replay:
    """One replay run for one entity, step by step (``replay()`` runs them all).

    The steps are public so a test can stop between them, as a crash would.
    """

    def __init__(
        self,
        config: PipelineConfig,
        entity: str,
        spark: SparkSession,
        where: str | None = None,
        service: str = INGESTOR,
    ) -> None:
        _check_replayable(service)
        self.config = config
        self.entity = config.entity(entity)
        self.topic = self.entity.source_topic
        self.spark = spark
        self.where = where
        self.service = service
        self.run_id = uuid.uuid4().hex
        self.ledger_path = _ledger_path(config)

    # step 0 ------------------------------------------------------------------------
    def ensure_ledger(self) -> None:
        """Create the ledger table unless it exists."""
        ensure_table(self.spark, self.ledger_path, LEDGER_SCHEMA, {})

    def _mine(self, frame: DataFrame) -> DataFrame:
        return frame.where(
            (F.col("service") == self.service) & (F.col("kafka_topic") == self.topic)
        )

    # step 1 ------------------------------------------------------------------------
    def recover(self, *, force: bool, lease: dt.timedelta = DEFAULT_LEASE) -> int:
        """Settle pending rows of earlier runs: found in the topic -> done, else forgotten.

        Returns how many were found. Raises QuarantineError when a pending run is younger
        than ``lease`` and ``force`` is not set (it may still be producing).
        """
        ledger = DeltaTable.forPath(self.spark, self.ledger_path)
        pending = (
            self._mine(ledger.toDF())
            .where(F.col("state") == PENDING)
            .select("run_id", "scan_from", "requested_at", "kafka_partition", "kafka_offset")
            .collect()
        )
        if not pending:
            return 0
        newest = max(r["requested_at"].astimezone(dt.UTC) for r in pending)
        if not force and dt.datetime.now(dt.UTC) - newest < lease:
            raise QuarantineError(
                f"a replay of {self.entity.name!r} started at {newest.isoformat()} has not "
                f"finished (run {pending[0]['run_id']}); if it is still running, wait for it; "
                "if it crashed, run replay again with --recover"
            )
        scan_from: dict[int, int] = {}
        for row in pending:
            for partition, offset in json.loads(row["scan_from"]).items():
                p = int(partition)
                scan_from[p] = min(scan_from.get(p, offset), offset)
        landed = self._scan_for_replays(scan_from)
        coordinates = {(int(r["kafka_partition"]), int(r["kafka_offset"])) for r in pending}
        first = self.first_read(coordinates)
        found = [
            (partition, offset, *landed[origin])
            for partition, offset in sorted(coordinates)
            if (origin := (partition, first[(partition, offset)])) in landed
        ]
        if found:
            self._mark_done(found, pending_only=True)
        # What was not found was never produced: forget it, so it is selected again.
        ledger.delete(
            (F.col("service") == self.service)
            & (F.col("kafka_topic") == self.topic)
            & (F.col("state") == PENDING)
        )
        return len(found)

    def _scan_for_replays(
        self, scan_from: dict[int, int]
    ) -> dict[tuple[int, int], tuple[int, int]]:
        """Replays in the topic after ``scan_from``: first read -> landing coordinates.

        Keyed by the header's (partition, offset); headers of another topic or not of the
        header's form are not this topic's replays and are passed over.
        """
        consumer = make_consumer(self.config.kafka, group_id=f"cdc-replay-scan-{self.run_id}")
        found: dict[tuple[int, int], tuple[int, int]] = {}
        try:
            ends = {
                p: consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=KAFKA_TIMEOUT_S, cached=False
                )[1]
                for p in scan_from
            }
            todo = {p: start for p, start in scan_from.items() if start < ends[p]}
            if not todo:
                return found
            assigned = [TopicPartition(self.topic, p, o) for p, o in todo.items()]
            consumer.assign(assigned)
            deadline = time.monotonic() + 300
            while True:
                for message in consumer.consume(1000, timeout=0.5):
                    if message.error() is not None:
                        raise QuarantineError(f"reading {self.topic}: {message.error()}")
                    origin = parse_origin(_header(message, REPLAY_HEADER))
                    if origin is not None and origin.topic == self.topic:
                        found[(origin.partition, origin.offset)] = (
                            int(message.partition() or 0),
                            int(message.offset() or 0),
                        )
                positions = consumer.position(assigned)
                if all(tp.offset >= ends[tp.partition] for tp in positions):
                    break
                if time.monotonic() > deadline:
                    raise QuarantineError(f"could not read {self.topic} to its end in 300 s")
        finally:
            consumer.close()
        return found

    def first_read(self, coordinates: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """Quarantined records' (partition, offset) -> the offset their change was first read at.

        A record that is itself a replay landed where a ``done`` ledger row says; that
        row's key is the record it replayed, and so on back to the first (a replay lands
        after what it replays, so this ends). The partition is the same all along.
        """
        done = (
            self._mine(DeltaTable.forPath(self.spark, self.ledger_path).toDF())
            .where((F.col("state") == DONE) & F.col("replayed_offset").isNotNull())
            .select("kafka_partition", "kafka_offset", "replayed_partition", "replayed_offset")
        )
        schema = T.StructType(
            [
                T.StructField("replayed_partition", T.IntegerType(), False),
                T.StructField("replayed_offset", T.LongType(), False),
            ]
        )
        first = {c: c[1] for c in coordinates}
        frontier = {c: c for c in coordinates}  # landing coordinates -> the record asked about
        while frontier:
            landings = frame_from_rows(self.spark, list(frontier), schema)
            rows = done.join(
                F.broadcast(landings), on=["replayed_partition", "replayed_offset"]
            ).collect()
            following: dict[tuple[int, int], tuple[int, int]] = {}
            for r in rows:
                asked = frontier[(int(r["replayed_partition"]), int(r["replayed_offset"]))]
                replayed = (int(r["kafka_partition"]), int(r["kafka_offset"]))
                first[asked] = replayed[1]
                following[replayed] = asked
            frontier = following
        return first

    # step 2 ------------------------------------------------------------------------
    def select(self) -> tuple[int, int, list[_Candidate]]:
        """(matching rows, of them already replayed, the rest to replay in offset order)."""
        frame = _quarantine(self.config, self.spark, self.service, self.entity.name)
        if frame is None:
            return 0, 0, []
        frame = _filtered(frame, self.where).where(F.col("kafka_topic") == self.topic)
        ledger = self._mine(DeltaTable.forPath(self.spark, self.ledger_path).toDF())
        keyed = frame.select(*_COORDINATES, "raw_key", "raw_value").dropDuplicates(
            list(_COORDINATES)
        )
        selected = keyed.count()
        fresh = keyed.join(ledger.select(*_COORDINATES), on=list(_COORDINATES), how="left_anti")
        rows = fresh.orderBy("kafka_partition", "kafka_offset").collect()
        coordinates = [(int(r["kafka_partition"]), int(r["kafka_offset"])) for r in rows]
        first = self.first_read(set(coordinates)) if coordinates else {}
        candidates = [
            _Candidate(
                partition,
                offset,
                None if r["raw_key"] is None else bytes(r["raw_key"]),
                None if r["raw_value"] is None else bytes(r["raw_value"]),
                first[(partition, offset)],
            )
            for (partition, offset), r in zip(coordinates, rows, strict=True)
        ]
        return selected, selected - len(candidates), candidates

    def record_intent(self, candidates: list[_Candidate]) -> list[_Candidate]:
        """Insert the candidates as ``pending`` under this run; the ones this run owns."""
        ends = {p: high for p, (_, high) in kafka_end_offsets(self.config, self.topic).items()}
        if not ends:
            raise QuarantineError(f"source topic {self.topic} does not exist")
        now = dt.datetime.now(dt.UTC)
        rows = [
            (
                self.service,
                self.entity.name,
                self.topic,
                c.partition,
                c.offset,
                self.run_id,
                PENDING,
                json.dumps({str(p): o for p, o in ends.items()}),
                now,
                None,
                None,
                None,
            )
            for c in candidates
        ]
        intent = frame_from_rows(self.spark, rows, LEDGER_SCHEMA)
        (
            DeltaTable.forPath(self.spark, self.ledger_path)
            .alias("t")
            .merge(intent.alias("s"), " AND ".join(f"t.{c} = s.{c}" for c in _COORDINATES))
            .whenNotMatchedInsertAll()
            .execute()
        )
        owned = {
            (int(r["kafka_partition"]), int(r["kafka_offset"]))
            for r in self._mine(DeltaTable.forPath(self.spark, self.ledger_path).toDF())
            .where(F.col("run_id") == self.run_id)
            .select("kafka_partition", "kafka_offset")
            .collect()
        }
        return [c for c in candidates if (c.partition, c.offset) in owned]

    # step 3 ------------------------------------------------------------------------
    def produce(self, candidates: list[_Candidate]) -> list[tuple[int, int, int, int]]:
        """Produce the records to their original partitions, in offset order.

        Returns (origin partition, origin offset, landing partition, landing offset).
        """
        producer = make_producer(self.config.kafka, **{"enable.idempotence": True})
        landed: list[tuple[int, int, int, int]] = []
        failures: list[str] = []

        def delivered(origin: _Candidate, error: KafkaError | None, message: Message) -> None:
            if error is not None:
                failures.append(f"{origin.partition}@{origin.offset}: {error}")
                return
            landed.append(
                (
                    origin.partition,
                    origin.offset,
                    int(message.partition() or 0),
                    int(message.offset() or 0),
                )
            )

        for c in candidates:
            origin = Origin(self.topic, c.partition, c.first_offset)
            headers: list[tuple[str, str | bytes | None]] = [
                (REPLAY_HEADER, origin_header(origin)),
                (RUN_HEADER, self.run_id.encode()),
            ]
            while True:
                try:
                    producer.produce(
                        self.topic,
                        key=c.key,
                        value=c.value,
                        partition=c.partition,
                        headers=headers,
                        on_delivery=functools.partial(delivered, c),
                    )
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
        remaining = producer.flush(KAFKA_TIMEOUT_S * 4)
        if remaining or failures:
            raise QuarantineError(
                f"{remaining} replayed records undelivered and {len(failures)} failed "
                f"(first: {failures[:1]}); run replay again later: it finds what was "
                "delivered and produces only the rest"
            )
        return landed

    def confirm(self, landed: list[tuple[int, int, int, int]]) -> None:
        """Mark the produced records ``done`` with where they landed."""
        if landed:
            self._mark_done(landed, pending_only=False)

    def _mark_done(
        self, landed: Iterable[tuple[int, int, int, int]], *, pending_only: bool
    ) -> None:
        schema = T.StructType(
            [
                T.StructField("kafka_partition", T.IntegerType(), False),
                T.StructField("kafka_offset", T.LongType(), False),
                T.StructField("replayed_partition", T.IntegerType(), False),
                T.StructField("replayed_offset", T.LongType(), False),
            ]
        )
        updates = frame_from_rows(self.spark, landed, schema)
        condition = (
            f"t.service = '{self.service}' AND t.kafka_topic = s.kafka_topic "
            "AND t.kafka_partition = s.kafka_partition AND t.kafka_offset = s.kafka_offset"
        )
        matched = "t.state = 'pending'" if pending_only else f"t.run_id = '{self.run_id}'"
        (
            DeltaTable.forPath(self.spark, self.ledger_path)
            .alias("t")
            .merge(updates.withColumn("kafka_topic", F.lit(self.topic)).alias("s"), condition)
            .whenMatchedUpdate(
                condition=matched,
                set={
                    "state": F.lit(DONE),
                    "replayed_partition": F.col("s.replayed_partition"),
                    "replayed_offset": F.col("s.replayed_offset"),
                    "replayed_at": F.current_timestamp(),
                },
            )
            .execute()
        )


def _header(message: Message, name: str) -> str | None:
    headers: Any = message.headers() or []
    for key, value in headers:
        if key == name and value is not None:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def replay(
    config: PipelineConfig,
    entity: str,
    where: str | None = None,
    *,
    service: str = INGESTOR,
    recover: bool = False,
    spark: SparkSession | None = None,
) -> ReplayResult:
    """Re-inject the entity's quarantined source records (matching ``where``) exactly once.

    See the module docstring for how repeated runs and crashes are made safe.
    """
    _check_replayable(service)
    config.entity(entity)
    run = Replay(config, entity, _spark(config, spark), where, service)
    run.ensure_ledger()
    recovered = run.recover(force=recover)
    selected, already, candidates = run.select()
    produced = 0
    if candidates:
        owned = run.record_intent(candidates)
        landed = run.produce(owned)
        run.confirm(landed)
        produced = len(landed)
    return ReplayResult(run.entity.name, run.topic, selected, already, recovered, produced)
