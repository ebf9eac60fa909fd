"""Erasure of keys from silver and the history: ``cdc erase``'s requests, applied by the merger.

The merger is the only writer of silver, its history and its tombstones, and keeps their
guards in memory (``cdc_merger.guards``), so a request is applied here, never by the CLI
behind its back. The group stream's :class:`ErasureWatch` looks at the erasure log
(``cdc_shared.contracts.erasure``) every few seconds without a JVM; a table with a
request it has not taken is offered to the queue, and the table's next write applies it
(:meth:`cdc_merger.merging.TableMerge.write`), once it has merged bronze up to the
request's ``bronze_version``:

- silver: a tombstone per erased key at the sequence of its row (the newest the merger
  knows: a key without a row has its tombstone already), then the rows deleted (one
  MERGE), recording the request in silver's log (``ERASURE_APP``); the in-memory
  tombstone index takes the tombstones, so a late event not newer stays out and one
  newer is new data;
- the history: every version of the keys deleted (one MERGE), recording the request in
  the history's log; applied once the history has caught up to the same bronze version.

Silver's delete reaches the publishers through its Change Data Feed as any delete does:
a delete event on the change topic, the document deleted from the index. Each step is
idempotent (Delta skips a write whose request its log holds), so a crash in between is
repaired by the next write.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from cdc_shared.clients.delta_rs import change_feed_rows, transaction_versions
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.erasure import ERASURE_APP, ErasureRequest, requests_of, typed_keys
from cdc_shared.contracts.silver import DELETED_AT, SEQUENCE
from cdc_shared.jvm.driver_frames import frame_from_rows
from cdc_shared.streaming.tables import idempotent_dml, on_conflict_retry, record_progress
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_merger.apply import MergeState
from cdc_merger.silver_tables import SilverLayout

log = logging.getLogger("cdc_merger")
#: How often the erasure log is looked at (a listing of its log, no Spark job).
ERASURE_POLL_S = 5.0
ERASED_AT = "_cdc_erased_at"


def key_frame(
    spark: SparkSession, requests: Iterable[ErasureRequest], key: list[str], silver: T.StructType
) -> DataFrame:
    """The requests' keys as a DataFrame of silver's key columns (typed as silver's)."""
    texts = sorted({text for r in requests for text in r.keys})
    return typed_keys(spark, texts, key, silver).select(*[f"`{k}`" for k in key])


def _on(key: list[str]) -> str:
    return " AND ".join(f"t.`{k}` = s.`{k}`" for k in key)


@on_conflict_retry
def delete_from_silver(
    spark: SparkSession, layout: SilverLayout, state: MergeState, keys: DataFrame, request: int
) -> int:
    """Tombstone the keys at their rows' sequences, delete the rows; how many went.

    Records ``request`` in silver's log (with the delete, or alone when no row matched).
    """
    key = layout.key
    silver = DeltaTable.forPath(spark, layout.silver_path)
    rows = silver.toDF().join(keys, on=key, how="left_semi").select(*key, SEQUENCE).toArrow()
    if rows.num_rows:
        now = dt.datetime.now(dt.UTC)
        tombstones = [(*(r[k] for k in key), r[SEQUENCE], now) for r in rows.to_pylist()]
        schema = DeltaTable.forPath(spark, layout.tombstone_path).toDF().schema
        frame = frame_from_rows(spark, tombstones, schema).select(*key, SEQUENCE, DELETED_AT)
        frame.coalesce(1).write.format("delta").mode("append").save(layout.tombstone_path)
        state.tombstones.record(rows, rows.slice(0, 0))
        state.newest_delete.raise_to(max(list(s) for s in rows.column(SEQUENCE).to_pylist()))
    with idempotent_dml(spark, (ERASURE_APP, request)):
        silver.alias("t").merge(keys.alias("s"), _on(key)).whenMatchedDelete().execute()
    return int(rows.num_rows)


@on_conflict_retry
def delete_from_history(
    spark: SparkSession, path: str, keys: DataFrame, key: list[str], request: int
) -> None:
    """Delete every version of the keys from the history, recording ``request`` in its log."""
    history = DeltaTable.forPath(spark, path)
    if history.toDF().join(keys, on=key, how="left_semi").isEmpty():
        record_progress(spark, path, (ERASURE_APP, request))
        return
    with idempotent_dml(spark, (ERASURE_APP, request)):
        history.alias("t").merge(keys.alias("s"), _on(key)).whenMatchedDelete().execute()


def erased_sequences(spark: SparkSession, keys: DataFrame, layout: SilverLayout) -> DataFrame:
    """The newest tombstone of each erased key: its erasure's (or a later delete's).

    One read of the tombstones; the result is small (the erased keys), kept on the driver.
    """
    key = layout.key
    tombstones = spark.read.format("delta").load(layout.tombstone_path)
    erased = tombstones.join(keys, on=key, how="left_semi").groupBy(*key)
    return erased.agg(F.max(SEQUENCE).alias(ERASED_AT)).select(
        *[F.col(f"`{k}`").alias(f"_cdc_erased_{i}") for i, k in enumerate(key)], ERASED_AT
    )


def without_erased(events: DataFrame, erased: DataFrame, key: list[str]) -> DataFrame:
    """Bronze ``events`` without those of erased keys not newer than their tombstone.

    ``erased``: :func:`erased_sequences`. An event not newer than an erased key's
    tombstone is from before the erasure, arriving late.
    """
    condition = F.lit(True)
    for i, k in enumerate(key):
        condition = condition & (F.col(f"key.`{k}`") == F.col(f"_cdc_erased_{i}"))
    joined = events.join(F.broadcast(erased), on=condition, how="left")
    kept = F.col(ERASED_AT).isNull() | (F.col("sequence") > F.col(ERASED_AT))
    return joined.where(kept).select(*[F.col(f"`{c}`") for c in events.columns])


class Erasures:
    """One table's erasure requests not applied yet, and how far silver and the history are.

    Set by the :class:`ErasureWatch`'s thread, applied by the table's writes: the lists
    are replaced whole, never changed in place.
    """

    def __init__(self) -> None:
        self.pending: tuple[ErasureRequest, ...] = ()
        self.silver_through: int | None = None  # the last request silver took (-1: none)
        self.history_through: int | None = None
        #: ``erased_sequences`` of ``pending`` as read (the requests, schema, rows).
        self.erased: tuple[tuple[ErasureRequest, ...], T.StructType, list[tuple[Any, ...]]] | None
        self.erased = None

    def due(self, through: int | None, progress: int) -> list[ErasureRequest]:
        """The requests after ``through`` that ``progress`` (a bronze version) reached, in order."""
        due = []
        for request in self.pending:
            if through is not None and request.request <= through:
                continue
            if request.bronze_version > progress:
                break
            due.append(request)
        return due


class ErasureWatch:
    """Looks at the erasure log every ``ERASURE_POLL_S``; offers the tables with new requests.

    ``offer(entity, request)``: the group's way to have the table written (and erased).
    """

    def __init__(
        self,
        config: PipelineConfig,
        tables: dict[str, Erasures],
        histories: set[str],
        offer: Callable[[str, ErasureRequest], None],
    ) -> None:
        self.config = config
        self.path = config.layout.erasure_log()
        self.tables = tables
        self.histories = histories
        self.offer = offer
        self._seen = -1
        self._stop = threading.Event()

    def look(self) -> None:
        """Read the log if it has new requests; note each table's and offer it."""
        rows = change_feed_rows(self.config, self.path)
        newest = max((int(r["_commit_version"]) for r in rows), default=-1)
        if newest <= self._seen:
            return
        self._seen = newest
        by_entity: dict[str, list[ErasureRequest]] = {}
        for request in requests_of(rows):
            if request.entity in self.tables:
                by_entity.setdefault(request.entity, []).append(request)
        for entity, requests in by_entity.items():
            erasures = self.tables[entity]
            self._read_through(entity, erasures)
            erasures.pending = tuple(requests)
            history_through = erasures.history_through if entity in self.histories else None
            todo = [
                r
                for r in requests
                if r.request > (erasures.silver_through or -1)
                or (entity in self.histories and r.request > (history_through or -1))
            ]
            if todo:
                log.info(
                    "erasure requested: the table is written to apply it",
                    extra={"entity": entity, "requests": [r.request for r in todo]},
                )
                self.offer(entity, todo[-1])

    def _read_through(self, entity: str, erasures: Erasures) -> None:
        """The last request silver's (and the history's) log holds, read once per process."""
        if erasures.silver_through is not None:
            return
        layout = self.config.layout
        paths = {"silver": layout.silver(entity)}
        if entity in self.histories:
            paths["history"] = layout.history(entity)
        through = transaction_versions(self.config, paths, ERASURE_APP)
        erasures.history_through = _or_none(through.get("history"))
        erasures.silver_through = _or_none(through["silver"])

    def start(self, runner_close: Callable[[Callable[[], None]], Any]) -> None:
        """Look now, then every ``ERASURE_POLL_S`` in a thread until the service closes."""
        self.look()

        def loop() -> None:
            while not self._stop.wait(ERASURE_POLL_S):
                try:
                    self.look()
                except Exception:  # the log unreadable for a moment: looked at again
                    log.exception("reading the erasure log failed; looking again later")

        threading.Thread(target=loop, name="erasure-watch", daemon=True).start()
        runner_close(self._stop.set)


def _or_none(version: int | None) -> int:
    return -1 if version is None else version
