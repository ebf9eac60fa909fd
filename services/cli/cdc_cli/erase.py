"""``cdc erase``: forget keys from every copy the pipeline keeps, and say when it is done.

A request goes through four steps, each recorded, so a run killed at any step is finished
by running ``cdc erase --resume`` (or the same ``cdc erase`` again: a key already
requested is not requested twice):

1. **recorded**: the keys are checked (the entity's key columns, castable to silver's
   types, present in silver, its history or its tombstones: a deleted key's values
   are in bronze still) and appended to the erasure log
   (``cdc_shared.contracts.erasure``) with bronze's version then. Changes of the keys up
   to that version are erased; a change reaching bronze later is new data.
2. **silver and the history** (the merger, their only writer: ``cdc_merger.erasure``): a
   tombstone at the key's newest sequence, the rows deleted, every history version
   deleted. The command waits for it; the publishers then send the delete to the change
   topic and the index from silver's Change Data Feed.
3. **bronze and the quarantine** (here): bronze's rows of the keys up to the request's
   version, found by their key in the payload and deleted by their Kafka coordinates;
   the quarantined records whose key can be read (JSON, or Avro through the registry)
   and is one of the keys.
4. **purged**: ``REORG TABLE ... APPLY (PURGE)`` on each table the deletes touched, so no
   live file holds a deleted row behind a deletion vector. The files that held them,
   and the Change Data Feed files, are deleted by ``cdc maintenance``'s VACUUM once the
   table's ``delta.deletedFileRetentionDuration`` has passed: the request's
   ``gone_after``.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from cdc_shared.avro.framing import CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC
from cdc_shared.avro.serde import AvroDecoder
from cdc_shared.clients.delta_rs import change_feed_rows, transaction_versions
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.connections import s3a_bucket
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts import bronze
from cdc_shared.contracts.erasure import (
    BRONZE_DELETED,
    ERASURE_APP,
    LOG_PROPERTIES,
    LOG_SCHEMA,
    PURGED,
    QUARANTINE_DELETED,
    STEPS,
    ErasureRequest,
    key_text,
    requests_of,
    steps_done,
    typed_keys,
)
from cdc_shared.contracts.layout import MERGER, QUARANTINE_WRITERS
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.streaming.tables import ensure_table, on_conflict_retry
from cdc_shared.streaming.writer_lease import live_leases
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_cli.delta_log import DeltaLogState
from cdc_cli.maintenance import WritersMayRunError
from cdc_cli.retention import DEFAULT_RETENTION_HOURS, retention_minimum
from cdc_cli.spark_state import SparkTables, is_delta_table

#: How often the merger's progress on a request is looked at while waiting for it.
POLL_S = 2.0


class KeyShapeError(ValueError):
    """A key that is not one of the entity's: its columns, or values silver cannot hold."""


class NothingToEraseError(ValueError):
    """None of the keys is in silver or its history."""


class MergerPendingError(RuntimeError):
    """The merger has not applied the request (yet): recorded, to be finished later."""


@dataclass
class RequestStatus:
    """Where one request stands: each step's time (None: still to do)."""

    request: int
    entity: str
    keys: int
    recorded_at: dt.datetime
    bronze_version: int
    silver: bool
    history: bool | None  # None: the entity keeps no history
    steps: dict[str, dt.datetime | None] = field(default_factory=dict)
    gone_after: dt.datetime | None = None
    absent: list[str] = field(default_factory=list)  # keys asked for that were not there

    @property
    def done(self) -> bool:
        """Every step done (the files' deletion is VACUUM's, at ``gone_after``)."""
        return self.silver and self.history is not False and all(self.steps.values())

    def to_dict(self) -> dict[str, Any]:
        """The status as JSON-ready data."""
        return {**asdict(self), "done": self.done}


def parse_keys(entity: EntityConfig, texts: Iterable[str]) -> list[dict[str, Any]]:
    """Each ``--key`` (or line of ``--keys``): a JSON object of the key's columns, or a value.

    A bare value stands for a one-column key (``42``, ``"abc"`` or ``abc``).
    """
    keys: list[dict[str, Any]] = []
    columns = list(entity.key)
    for given in texts:
        text = given.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if not isinstance(value, dict):
            if len(columns) != 1:
                raise KeyShapeError(
                    f"key {text!r}: {entity.name!r} has a key of {len(columns)} columns "
                    f"({', '.join(columns)}); give it as a JSON object"
                )
            value = {columns[0]: value}
        if sorted(value) != sorted(columns):
            raise KeyShapeError(
                f"key {text!r}: {entity.name!r}'s key columns are {', '.join(columns)}, "
                f"not {', '.join(sorted(value)) or 'none'}"
            )
        keys.append(value)
    if not keys:
        raise KeyShapeError("no key given: --key or --keys")
    return keys


def record(
    config: PipelineConfig, spark: SparkSession, entity: EntityConfig, keys: list[dict[str, Any]]
) -> RequestStatus:
    """Check the keys and record the request (step 1); its status, with the keys absent."""
    layout = config.layout
    silver_path = layout.silver(entity.name)
    if not is_delta_table(spark, silver_path):
        raise NothingToEraseError(f"{entity.name!r} has no silver yet: nothing to erase")
    silver = spark.read.format("delta").load(silver_path)
    texts = sorted({key_text(k) for k in keys})
    typed = typed_keys(spark, texts, list(entity.key), silver.schema)
    wrong = [r["text"] for r in typed.where(_any_null(entity.key)).collect()]
    if wrong:
        types = ", ".join(f"{k} {silver.schema[k].dataType.simpleString()}" for k in entity.key)
        raise KeyShapeError(f"keys of the wrong shape for {entity.name!r} ({types}): {wrong}")
    holders = [silver]  # a deleted key is in the tombstones (and bronze) still
    for path in (layout.tombstones(entity.name), layout.history(entity.name)):
        if is_delta_table(spark, path):
            holders.append(spark.read.format("delta").load(path))
    present: set[str] = set()
    for table in holders:
        found = typed.join(table.select(*entity.key), on=list(entity.key), how="left_semi")
        present |= {r["text"] for r in found.select("text").collect()}
    absent = [t for t in texts if t not in present]
    if not present:
        raise NothingToEraseError(
            f"none of the keys is in silver, the history or the tombstones of "
            f"{entity.name!r}: {absent}; a change not merged yet is not looked for (see "
            "`cdc status`)"
        )
    ensure_log(spark, config)
    bronze_version = _newest_version(spark, layout.bronze())
    now = dt.datetime.now(dt.UTC)
    rows = [(None, entity.name, t, bronze_version, None, now) for t in sorted(present)]
    request = _append(spark, config, rows)
    status = RequestStatus(request, entity.name, len(present), now, bronze_version, False, None)
    status.absent = absent
    return status


def _any_null(key: Iterable[str]) -> Any:
    condition = F.lit(False)
    for k in key:
        condition = condition | F.col(f"`{k}`").isNull()
    return condition


def _newest_version(spark: SparkSession, path: str) -> int:
    """The table's newest version, read from its log now (not a snapshot cached before)."""
    row = DeltaTable.forPath(spark, path).history(1).select("version").first()
    return -1 if row is None else int(row[0])


def ensure_log(spark: SparkSession, config: PipelineConfig) -> None:
    """The erasure log, unless it exists."""
    ensure_table(spark, config.layout.erasure_log(), LOG_SCHEMA, LOG_PROPERTIES)


def _append(spark: SparkSession, config: PipelineConfig, rows: list[tuple[Any, ...]]) -> int:
    """Append rows to the erasure log in one commit; that commit's version."""
    path = config.layout.erasure_log()
    token = f"cdc-erase {uuid.uuid4()}"
    frame = frame_from_rows(spark, rows, LOG_SCHEMA).coalesce(1)
    frame.write.format("delta").mode("append").option("userMetadata", token).save(path)
    history = DeltaTable.forPath(spark, path).history(50).where(F.col("userMetadata") == token)
    row = history.select("version").first()
    assert row is not None, "the erasure log's commit is not in its latest history"
    return int(row[0])


def statuses(config: PipelineConfig, request: int | None = None) -> list[RequestStatus]:
    """Every request's status (or one's), from the erasure log and the tables' logs; no JVM."""
    rows = change_feed_rows(config, config.layout.erasure_log())
    done = steps_done(rows)
    retention: float | None = None  # read once, when a request has been purged
    result = []
    for r in requests_of(rows):
        if request is not None and r.request != request:
            continue
        entity = config.entity(r.entity)
        status = _status(config, r, entity)
        status.steps = {s: done.get(r.request, {}).get(s) for s in STEPS}
        purged = status.steps[PURGED]
        if purged is not None:
            retention = _retention_hours(config) if retention is None else retention
            status.gone_after = purged + dt.timedelta(hours=retention)
        result.append(status)
    return result


def _status(config: PipelineConfig, r: ErasureRequest, entity: EntityConfig) -> RequestStatus:
    layout = config.layout
    paths = {"silver": layout.silver(r.entity)}
    if entity.history.enabled:
        paths["history"] = layout.history(r.entity)
    through = transaction_versions(config, paths, ERASURE_APP)

    def took(name: str) -> bool:
        version = through.get(name)
        return version is not None and version >= r.request

    history = took("history") if entity.history.enabled else None
    return RequestStatus(
        r.request, r.entity, len(r.keys), r.recorded_at, r.bronze_version, took("silver"), history
    )


def _retention_hours(config: PipelineConfig) -> float:
    """The longest ``delta.deletedFileRetentionDuration`` of the tables an erase purges."""
    state = DeltaLogState(config)
    layout = config.layout
    paths = [layout.bronze(), *[layout.quarantine(s) for s in QUARANTINE_WRITERS]]
    for entity in config.entities:
        paths += [layout.silver(entity.name), layout.history(entity.name)]
    return max(
        (retention_minimum(state, p, p).hours for p in paths if state.table_version(p) is not None),
        default=DEFAULT_RETENTION_HOURS,
    )


def wait_for_merger(
    config: PipelineConfig, status: RequestStatus, wait_s: float, merger_running: bool
) -> RequestStatus:
    """Wait until the merger took the request in silver and the history (step 2).

    Raises MergerPendingError when it has not within ``wait_s``, or does not run.
    """
    deadline = time.monotonic() + wait_s
    while True:
        (current,) = statuses(config, status.request)
        if current.silver and current.history is not False:
            current.absent = status.absent
            return current
        if not merger_running or time.monotonic() >= deadline:
            why = "is not running" if not merger_running else f"has not within {wait_s:g} s"
            raise MergerPendingError(
                f"erasure request {status.request} of {status.entity!r} is recorded, but the "
                f"merger {why} applied it to silver and the history: it does when it runs; "
                f"then finish it with `cdc erase --resume`"
            )
        time.sleep(POLL_S)


def merger_running(config: PipelineConfig, entity: str) -> bool:
    """Whether a merger holds a live writer lease of ``entity``."""
    state = DeltaLogState(config)

    def read(path: str) -> bytes | None:
        text = state.read_text_if_exists(path)
        return None if text is None else text.encode()

    return bool(live_leases(config.storage_root, (MERGER,), [entity], read))


def finish(
    config: PipelineConfig,
    spark: SparkSession,
    status: RequestStatus,
    writers_stopped: bool = False,
) -> RequestStatus:
    """Steps 3 and 4 for a request the merger took: bronze, the quarantine, the purge.

    On object storage these commits must not race the services' (Delta's S3 log store
    orders commits within one JVM only): refused unless ``writers_stopped``.
    """
    if s3a_bucket(config.storage_root) is not None and not writers_stopped:
        raise WritersMayRunError(
            f"erasure request {status.request} is applied to silver and the history; on "
            "object storage, deleting bronze's and the quarantine's rows and purging must "
            "not commit beside the services: stop them, then run `cdc erase --resume "
            "--writers-stopped`"
        )
    entity = config.entity(status.entity)
    request = next(r for r in requests_of(_log_rows(config)) if r.request == status.request)
    silver = spark.read.format("delta").load(config.layout.silver(entity.name)).schema
    keys = typed_keys(spark, list(request.keys), list(entity.key), silver)
    tables = SparkTables(spark)
    touched: list[str] = []
    if status.steps.get(BRONZE_DELETED) is None:
        if _delete_from_bronze(config, spark, tables, entity, request, keys):
            touched.append(config.layout.bronze())
        _record_step(spark, config, request, BRONZE_DELETED)
    if status.steps.get(QUARANTINE_DELETED) is None:
        touched += _delete_from_quarantine(config, spark, tables, entity, request)
        _record_step(spark, config, request, QUARANTINE_DELETED)
    if status.steps.get(PURGED) is None:
        layout = config.layout
        paths = [layout.bronze(), layout.silver(entity.name)]
        if entity.history.enabled:
            paths.append(layout.history(entity.name))
        paths += [layout.quarantine(s) for s in QUARANTINE_WRITERS]
        for path in paths:
            if is_delta_table(spark, path):
                _purge(spark, path)
        _record_step(spark, config, request, PURGED)
    (done,) = statuses(config, status.request)
    done.absent = status.absent
    return done


def _log_rows(config: PipelineConfig) -> list[dict[str, Any]]:
    return change_feed_rows(config, config.layout.erasure_log())


def _record_step(
    spark: SparkSession, config: PipelineConfig, request: ErasureRequest, step: str
) -> None:
    now = dt.datetime.now(dt.UTC)
    _append(spark, config, [(request.request, request.entity, None, None, step, now)])


def _delete_from_bronze(
    config: PipelineConfig,
    spark: SparkSession,
    tables: SparkTables,
    entity: EntityConfig,
    request: ErasureRequest,
    keys: DataFrame,
) -> int:
    """Delete bronze's rows of the keys up to the request's version; how many."""
    path = config.layout.bronze()
    rows = bronze.entity_changes(spark, path, entity.name, until_version=request.bronze_version)
    condition = F.lit(True)
    for k in entity.key:
        condition = condition & (F.col(f"key.`{k}`") == keys[k])
    coordinates = (
        rows.join(keys, on=condition, how="left_semi")
        .select(*bronze.KAFKA_COLUMNS[:3])
        .distinct()
        .collect()
    )
    if not coordinates:
        return 0
    matches = " OR ".join(
        f"(kafka_topic = {_sql_text(r[0])} AND kafka_partition = {int(r[1])} "
        f"AND kafka_offset = {int(r[2])})"
        for r in coordinates
    )
    predicate = f"{bronze.ENTITY} = {_sql_text(entity.name)} AND ({matches})"
    return tables.delete_rows(path, predicate, {})


def _delete_from_quarantine(
    config: PipelineConfig,
    spark: SparkSession,
    tables: SparkTables,
    entity: EntityConfig,
    request: ErasureRequest,
) -> list[str]:
    """Delete the quarantined records of the keys (those whose key reads); tables touched."""
    wanted = {key_text({k: str(v) for k, v in key.items()}) for key in request.key_values()}
    decoder = KeyReader(config, entity)
    touched = []
    for service in QUARANTINE_WRITERS:
        path = config.layout.quarantine(service)
        if not is_delta_table(spark, path):
            continue
        raw_keys = (
            spark.read.format("delta")
            .load(path)
            .where(F.col("entity") == entity.name)
            .where(F.col("raw_key").isNotNull())
            .select("raw_key")
            .distinct()
            .collect()
        )
        matching = [bytes(r[0]) for r in raw_keys if decoder.text(bytes(r[0])) in wanted]
        if not matching:
            continue
        listed = ", ".join(f"X'{raw.hex()}'" for raw in matching)
        predicate = f"entity = {_sql_text(entity.name)} AND raw_key IN ({listed})"
        tables.delete_rows(path, predicate, {})
        touched.append(path)
    return touched


class KeyReader:
    """Reads a quarantined record's key: Avro (through the registry), JSON, or a bare id."""

    def __init__(self, config: PipelineConfig, entity: EntityConfig) -> None:
        self.config = config
        self.columns = list(entity.key)
        self._avro: AvroDecoder | None = None

    def text(self, raw: bytes) -> str | None:
        """The key as ``key_text`` of its values as text; None when it does not read."""
        value: Any
        if raw.startswith((CONFLUENT_MAGIC, SINGLE_OBJECT_MAGIC)):
            try:
                if self._avro is None:
                    self._avro = AvroDecoder(make_registry(self.config), is_key=True)
                value = self._avro.decode(raw)
            except Exception:  # not a key this registry reads
                return None
        else:
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                value = raw.decode(errors="replace")
        if isinstance(value, dict) and isinstance(value.get("payload"), dict):
            value = value["payload"]  # JSON with its schema (Debezium's JsonConverter)
        if not isinstance(value, dict):
            if len(self.columns) != 1:
                return None
            value = {self.columns[0]: value}
        if not set(self.columns) <= set(value):
            return None
        return key_text({k: str(value[k]) for k in self.columns})


@on_conflict_retry
def _purge(spark: SparkSession, path: str) -> None:
    """Rewrite the files whose rows a deletion vector hides (Delta's REORG ... PURGE)."""
    spark.sql(f"REORG TABLE delta.`{path}` APPLY (PURGE)")


def _sql_text(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def pending(config: PipelineConfig) -> list[RequestStatus]:
    """The requests not finished yet (what ``--resume`` finishes)."""
    return [s for s in statuses(config) if not s.done]


def render(items: list[RequestStatus]) -> str:
    """The requests' statuses as text."""
    if not items:
        return "no erasure request"
    lines = []
    for s in items:
        history = {None: "no history", True: "done", False: "waiting for the merger"}[s.history]
        lines.append(
            f"request {s.request}: {s.entity}, {s.keys} key(s), recorded "
            f"{s.recorded_at.isoformat(timespec='seconds')} at bronze version {s.bronze_version}"
        )
        lines.append(f"  silver and tombstones: {'done' if s.silver else 'waiting for the merger'}")
        lines.append(f"  history: {history}")
        for step in STEPS:
            at = s.steps.get(step)
            lines.append(f"  {step}: {'to do' if at is None else at.isoformat(timespec='seconds')}")
        if s.gone_after is not None:
            lines.append(
                f"  files holding the rows deleted by the first `cdc maintenance` VACUUM after "
                f"{s.gone_after.isoformat(timespec='seconds')}"
            )
        if s.absent:
            lines.append(f"  not found (nothing to erase): {', '.join(s.absent)}")
        lines.append(f"  {'done' if s.done else 'not finished'}")
    return "\n".join(lines)
