"""The runner: owns a service's queries from start to stop.

:class:`StreamRunner` starts each entity's query, serves ``/health`` and ``/metrics``,
stops after the batch in flight on SIGTERM (exit 0), and surfaces a failed query as an
error naming the entity, or restarts it from its checkpoint (built anew if need be) when
the service's ``on_failure`` calls the error transient.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_shared.clients.retry import backoff_s, log_retry
from cdc_shared.streaming.failures import (
    Failure,
    KnownFailureError,
    OnFailure,
    StreamFailedError,
    read_failure,
)
from cdc_shared.streaming.observability import HEALTHY, INPUT_ROWS, ROWS, HealthServer
from cdc_shared.streaming.progress import (
    BatchStats,
    LagReader,
    _ProgressDispatch,
    _ProgressLogger,
)

# One logger for the whole package: the name the logs show stays "cdc_shared.streaming".
log = logging.getLogger("cdc_shared.streaming")


class QueryIdentity:
    """The query id of a stream, known once the query started (read by foreachBatch).

    The id is kept in the checkpoint, so it is stable across restarts and new for a
    new checkpoint: the right basis for Delta's idempotent-write ``txnAppId``.
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._id = ""

    def set(self, query_id: str) -> None:
        """Record the id (called right after ``start()``)."""
        self._id = query_id
        self._ready.set()

    def get(self, timeout_s: float = 60.0) -> str:
        """The id; waits for ``start()`` to return when the first batch is quick."""
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the streaming query id was not known within 60 s")
        return self._id


#: Builds a group's query (again): its writer and the identity ``start()`` fills in.
BuildQuery = Callable[[], tuple[DataStreamWriter, QueryIdentity]]
#: Holds back one table of a group's query, alone (table, why): False when it cannot.
HoldTable = Callable[[str, str], bool]
#: A group's foreachBatch function: (micro-batch, batch id).
BatchFunction = Callable[[DataFrame, int], None]


class StreamRunner:
    """Owns a service's queries: health, progress logs, SIGTERM, failures."""

    def __init__(
        self,
        spark: SparkSession,
        service: str,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 0,
        lag: LagReader | None = None,
        on_failure: OnFailure | None = None,
        max_restart_backoff_s: float = 60.0,
    ) -> None:
        self.spark = spark
        self.service = service
        self.queries: dict[str, StreamingQuery] = {}
        self.entity_of: dict[str, str] = {}
        self._stats: dict[tuple[str, int], BatchStats] = {}
        self._logged: dict[str, int] = {}  # query id -> last batch id the listener saw
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lag = lag
        self._problems: dict[str, str] = {}  # entity -> what keeps it from progressing
        self._stopped: dict[str, str] = {}  # entity -> why its stream alone was stopped
        self._on_failure = on_failure
        self._raised: dict[str, KnownFailureError] = {}  # group -> what its batch raised
        self._max_restart_backoff_s = max_restart_backoff_s
        self._writers: dict[str, tuple[DataStreamWriter, QueryIdentity]] = {}
        self._rebuilders: dict[str, BuildQuery] = {}
        self._to_rebuild: set[str] = set()
        self._holders: dict[str, HoldTable] = {}  # query -> how it goes on without a table
        self._holding: dict[str, str] = {}  # query -> why, restarting without a held table
        self._replacing: set[str] = set()  # queries stopped to start again (``restart_rebuilt``)
        # entity -> (failures since its last progress, restart time or None once restarted, why)
        self._restarts: dict[str, tuple[int, float | None, str]] = {}
        self._on_close: list[Callable[[], object]] = []
        self._failed: str | None = None  # why the service as a whole must stop (``fail``)
        self._accepting = True  # new queries may start (``start_while_running``)
        self._accepting_lock = threading.Lock()
        self._listener: _ProgressLogger | None = _ProgressLogger(self)
        _ProgressDispatch.attach(spark, self._listener)
        self._server = (
            HealthServer(metrics_host, metrics_port, self.health).start() if metrics_port else None
        )
        if self._server is not None:
            log.info("serving /metrics and /health", extra={"port": self._server.port})

    # --- wiring --------------------------------------------------------------------

    def start(
        self,
        entity: str,
        writer: DataStreamWriter,
        identity: QueryIdentity,
        rebuild: BuildQuery | None = None,
        hold: HoldTable | None = None,
    ) -> None:
        """Start one group's query (``entity``: the group's name).

        ``rebuild`` builds it anew (see ``Failure.rebuild``); ``hold`` lets it go on
        without one of its tables when a failure of that table's fails the query
        (``Failure.table``).
        """
        writer = writer.queryName(f"{self.service}-{entity}")
        query = writer.start()
        identity.set(str(query.id))
        self._writers[entity] = (writer, identity)
        if rebuild is not None:
            self._rebuilders[entity] = rebuild
        if hold is not None:
            self._holders[entity] = hold
        self.queries[entity] = query
        self.entity_of[str(query.id)] = entity
        log.info(
            "stream started",
            extra={"service": self.service, "entity": entity, "query_id": str(query.id)},
        )

    def start_while_running(
        self,
        entity: str,
        writer: DataStreamWriter,
        identity: QueryIdentity,
        rebuild: BuildQuery | None = None,
        hold: HoldTable | None = None,
    ) -> bool:
        """``start`` from another thread while ``run()`` runs; False once it is stopping."""
        with self._accepting_lock:
            if not self._accepting or self._stop.is_set():
                return False
            self.start(entity, writer, identity, rebuild, hold)
            return True

    def restart_rebuilt(self, entity: str, timeout_s: float = 600.0) -> bool:
        """Stop ``entity``'s query after its batch in flight, then start it rebuilt.

        For a query whose sources change while it runs (a service's one query taking up
        a new table); it resumes from its checkpoint. Called from another thread while
        ``run()`` runs; False once the runner is stopping.
        """
        with self._accepting_lock:
            if not self._accepting or self._stop.is_set():
                return False
            with self._lock:
                self._replacing.add(entity)
            try:
                self._stop_after_batch(entity, self.queries[entity], time.monotonic() + timeout_s)
                rebuild = self._rebuilders[entity]
                try:
                    writer, identity = rebuild()
                    self.start(entity, writer, identity, rebuild, self._holders.get(entity))
                except Exception as error:  # stopped, not started again: ``run()`` raises
                    self._failed = (
                        f"{self.service} stopped: its stream {entity!r} was stopped to start "
                        f"again with a new table, which failed: {error}"
                    )
                    self._stop.set()  # (``fail`` would wait for the lock held here)
                    raise
            finally:
                with self._lock:
                    self._replacing.discard(entity)
            return True

    def _refuse_new_queries(self) -> None:
        with self._accepting_lock:
            self._accepting = False

    @property
    def stopping(self) -> bool:
        """Whether the service is stopping (SIGTERM, ``--once`` done, or failed)."""
        return self._stop.is_set()

    def hold_table(self, table: str, reason: str) -> bool:
        """Stop ``table`` alone (``stop_entity``) unless the service is stopping; whether held.

        A write that fails while the service stops (its jobs cancelled) is no failure of
        the table's own.
        """
        if self._stop.is_set():
            return False
        self.stop_entity(table, reason)
        return True

    def stop_entity(self, entity: str, reason: str) -> None:
        """Stop ``entity`` alone, for ``reason``, while the others go on.

        For a stream that failed while running (``Failure.entity_only``) or could not
        start (EntityStoppedError): ``/health`` lists it as stopped and ``run()`` ends with
        ``reason``.
        """
        self._stopped[entity] = reason
        self.set_problem(entity, f"stopped: {reason}")
        log.error(
            "stream stopped; the other entities go on",
            extra={"service": self.service, "entity": entity, "reason": reason},
        )

    def failure_of(self, entity: str, error: BaseException | str) -> Failure | None:
        """What ``entity``'s ``error`` calls for (``failures.read_failure``); None: unknown."""
        return read_failure(entity, error, self._on_failure)

    def recording_failures(self, group: str, process: BatchFunction) -> BatchFunction:
        """``process``, keeping the KnownFailureError a batch of ``group`` raises.

        The failed query's error reaches the runner as Spark's text; the exception object
        says what it calls for (:meth:`failure_of`).
        """

        def run(batch: DataFrame, batch_id: int) -> None:
            try:
                process(batch, batch_id)
            except KnownFailureError as error:
                self._raised[group] = error
                raise

        return run

    def stopped_message(self) -> str:
        """Why the entities stopped alone did, one clause per entity ("" when none did)."""
        return "; ".join(
            f"{self.service} table {entity!r} {message}"
            for entity, message in self._stopped.items()
        )

    def report(self, entity: str, batch_id: int, stats: BatchStats) -> None:
        """Called by foreachBatch: counts to log with the batch's progress."""
        with self._lock:
            self._stats[(entity, batch_id)] = stats

    def saw_progress(self, query_id: str, batch_id: int) -> None:
        """The listener got the progress of ``batch_id``."""
        with self._lock:
            self._logged[query_id] = max(batch_id, self._logged.get(query_id, -1))
        self.saw_idle(query_id)

    def saw_idle(self, query_id: str) -> None:
        """The query ran a trigger: if it was restarted, it has recovered."""
        with self._lock:
            entity = self.entity_of.get(query_id)
            if entity is None or self._restarts.get(entity, (0, 0.0, ""))[1] is not None:
                return  # not restarted, or its restart is still to come
            del self._restarts[entity]
        log.info("stream recovered", extra={"service": self.service, "entity": entity})

    def take_stats(self, entity: str, batch_id: int) -> BatchStats:
        """The counts reported for a batch (empty when none were)."""
        with self._lock:
            return self._stats.pop((entity, batch_id), BatchStats())

    def report_between_batches(self, group: str, stats: BatchStats) -> None:
        """Log and count what a group wrote between its batches (``TableQueue``)."""
        for name, counts in stats.by_entity.items():
            rows = dict(counts)
            INPUT_ROWS.labels(self.service, name).inc(rows.pop("input_rows", 0))
            for outcome, count in rows.items():
                ROWS.labels(self.service, name, outcome).inc(count)
        log.info(
            "tables written between batches",
            extra={"service": self.service, "entity": group, **stats.counts, **stats.extra},
        )

    def set_problem(self, entity: str, problem: str | None) -> None:
        """Report (or clear, with None) what keeps an entity from progressing.

        While a problem is set, ``/health`` answers 503 with it (e.g. "Elasticsearch
        unavailable, retrying"), although the stream itself is still running.
        """
        with self._lock:
            if problem is None:
                self._problems.pop(entity, None)
            else:
                self._problems[entity] = problem

    def lag_of(self, progress: Any) -> float | None:
        """The service-specific lag of a progress event, if it can tell."""
        return self._lag(progress) if self._lag else None

    def health(self) -> dict[str, Any]:
        """Status of every query, for ``/health``."""
        streams = {}
        for entity, query in list(self.queries.items()):
            error = query.exception()
            with self._lock:
                restart = self._restarts.get(entity)
                problem = self._problems.get(entity) or (restart and restart[2])
            streams[entity] = {
                "active": query.isActive,
                "error": str(error)[:500] if error else None,
                "problem": problem,
                "message": query.status.get("message"),
            }
        for entity in [e for e in self._stopped if e not in streams]:  # held tables
            with self._lock:
                problem = self._problems.get(entity)
            streams[entity] = {"active": False, "error": None, "problem": problem, "message": None}
        with self._lock:  # a table's own problem (e.g. its index unreachable, retrying)
            problems = {t: p for t, p in self._problems.items() if t not in streams}
        for table, problem in problems.items():
            streams[table] = {"active": True, "error": None, "problem": problem, "message": None}
        ok = bool(streams) and all(
            s["active"] and not s["error"] and not s["problem"] for s in streams.values()
        )
        HEALTHY.labels(self.service).set(1 if ok else 0)
        return {"status": "ok" if ok else "failing", "service": self.service, "streams": streams}

    # --- running ---------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT ask for a stop after the micro-batch in flight."""

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("stop requested", extra={"service": self.service, "signal": signum})
            self._stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def request_stop(self) -> None:
        """Ask ``run()`` to stop after the micro-batches in flight (what SIGTERM does)."""
        self._stop.set()

    def stop_now(self) -> None:
        """Stop every query at once and release the server (start-up failed)."""
        self._refuse_new_queries()
        for query in list(self.queries.values()):
            if query.isActive:
                query.stop()
        self.close()

    def fail(self, reason: str) -> None:
        """Stop every query now, not after its batch: ``run()`` raises StreamFailedError.

        For a service that must not write another batch (e.g. its writer lease was taken
        over); may be called from any thread.
        """
        self._stop_every_query(f"{self.service} stopped: {reason}")

    def fail_group(self, group: str, error: BaseException) -> None:
        """``group``'s tables failed outside a batch (written between batches): stop all.

        Said as the group's query failing with ``error`` in a batch would say it, so a
        failure reads the same whichever of the two wrote the table.
        """
        self._stop_every_query(self._group_failed(group, error, self.failure_of(group, error)))

    def _group_failed(self, group: str, error: BaseException | str, failure: Failure | None) -> str:
        message = failure.message if failure else f"failed: {error}"
        return f"{self.service} group {group!r} {message}"

    def _stop_every_query(self, message: str) -> None:
        self._failed = message
        self._stop.set()
        self._refuse_new_queries()
        for query in list(self.queries.values()):
            if query.isActive:
                query.stop()

    def stop_all_held(self) -> StreamFailedError:
        """Every table is held: ``run()`` stops the queries and raises why each was held.

        Called from a batch, which raises the error returned (so its offsets are not
        committed), or between batches; stops no query itself, since a batch cannot stop
        its own query.
        """
        self._failed = self.stopped_message()
        self._stop.set()
        return StreamFailedError(self._failed)

    def run(self) -> None:
        """Wait until every query ends (``--once``) or a stop is requested, then stop them.

        Raises StreamFailedError if a query failed.
        """
        try:
            while not self._stop.is_set():
                for entity, query in list(self.queries.items()):
                    self._raise_if_failed(entity, query)
                queries = list(self.queries.values())
                if not self._restarts_due() and all(not q.isActive for q in queries):
                    break
                self._stop.wait(0.5)
            self._refuse_new_queries()  # from here on the set of queries is fixed
            if self._failed is not None:
                self.stop_now()  # also any query started after ``fail``
                raise StreamFailedError(self._failed)
            self._stop_gracefully()
            for entity, query in self.queries.items():
                self._raise_if_failed(entity, query)
            self._wait_for_progress_logs()
            if self._stopped:
                raise StreamFailedError(self.stopped_message())
        finally:
            self.close()

    def _wait_for_progress_logs(self, timeout_s: float = 10.0) -> None:
        """Progress events arrive on Spark's listener bus after the batch: let the last log."""
        deadline = time.monotonic() + timeout_s
        for query in self.queries.values():
            last = query.lastProgress
            while last is not None and time.monotonic() < deadline:
                with self._lock:
                    if self._logged.get(str(query.id), -1) >= last["batchId"]:
                        break
                time.sleep(0.1)

    def _stop_gracefully(self, timeout_s: float = 600.0) -> None:
        """Let each query finish the micro-batch in flight, then stop it.

        Under a backlog the next batch starts at once, so "no trigger active" may never be
        seen: wait for the batch that was in flight to be reported complete instead. A
        batch begun after that is interrupted, and replayed idempotently on restart.
        """
        deadline = time.monotonic() + timeout_s
        for entity, query in self.queries.items():
            self._stop_after_batch(entity, query, deadline)

    def _stop_after_batch(self, entity: str, query: StreamingQuery, deadline: float) -> None:
        """Stop ``query`` once the batch in flight is reported complete (or at ``deadline``)."""
        if query.isActive and query.status.get("isTriggerActive"):
            last = query.lastProgress
            in_flight = (last["batchId"] if last else -1) + 1
            while query.isActive and time.monotonic() < deadline:
                last = query.lastProgress
                if (last and last["batchId"] >= in_flight) or not query.status.get(
                    "isTriggerActive"
                ):
                    break
                time.sleep(0.2)
        if query.isActive:
            query.stop()
            log.info("stream stopped", extra={"service": self.service, "entity": entity})

    def _raise_if_failed(self, entity: str, query: StreamingQuery) -> None:
        error = query.exception()
        if error is None or entity in self._stopped or self._failed is not None:
            return
        if entity in self._holding:  # failed, and the table it failed on held already
            if not self._stop.is_set():  # stopping: the next start reads without the table
                self._restart_later(entity, self._holding[entity])
            return
        raised = self._raised.pop(entity, None)  # what our code raised, if it did
        failure = self.failure_of(entity, raised if raised is not None else str(error))
        if failure is not None and failure.table is not None and self._held(entity, failure):
            self._holding[entity] = f"went on without table {failure.table!r}, held back"
            self._to_rebuild.add(entity)
            self._restart_later(entity, self._holding[entity])
            return
        if failure is not None and failure.entity_only and not failure.transient:
            self.stop_entity(entity, failure.message)
            return
        if failure is not None and failure.transient:
            if not self._stop.is_set():  # stopping: the next start resumes from the checkpoint
                if failure.rebuild:
                    self._to_rebuild.add(entity)
                self._restart_later(entity, failure.message)
            return
        for other in self.queries.values():
            if other.isActive:
                other.stop()
        raise StreamFailedError(self._group_failed(entity, error, failure))

    def _held(self, query: str, failure: Failure) -> bool:
        """Whether ``query`` goes on without the table ``failure`` is about (its ``hold``)."""
        hold = self._holders.get(query)
        if hold is None or failure.table is None or self._stop.is_set():
            return False
        return hold(failure.table, failure.message)

    def _restarts_due(self) -> bool:
        """A query stopped or failed is to start again: ``run()`` must not end yet."""
        with self._lock:
            return bool(self._replacing) or any(
                at is not None for _, at, _ in self._restarts.values()
            )

    def _restart_later(self, entity: str, reason: str) -> None:
        """Restart a transiently failed query from its checkpoint, after a backoff.

        The backoff doubles with each failure since the entity last made progress (1 s,
        2 s, 4 s, ... up to ``max_restart_backoff_s``, with jitter); ``/health`` says why.
        """
        now = time.monotonic()
        with self._lock:
            failures, restart_at, _ = self._restarts.get(entity, (0, None, ""))
        if restart_at is None:  # newly failed: schedule the restart
            delay = backoff_s(failures + 1, 1.0, self._max_restart_backoff_s)
            with self._lock:
                self._restarts[entity] = (failures + 1, now + delay, f"{reason}; restarting")
            log_retry(log, reason, failures + 1, delay, service=self.service, entity=entity)
        elif restart_at <= now:
            if entity in self._to_rebuild and entity in self._rebuilders:
                writer, identity = self._rebuilders[entity]()
                writer = writer.queryName(f"{self.service}-{entity}")
                self._writers[entity] = (writer, identity)
                self._to_rebuild.discard(entity)
            writer, identity = self._writers[entity]
            query = writer.start()
            identity.set(str(query.id))
            self._holding.pop(entity, None)
            with self._lock:
                self.queries[entity] = query
                self._restarts[entity] = (failures, None, f"{reason}; restarted")
            log.info(
                "stream restarted from its checkpoint",
                extra={"service": self.service, "entity": entity, "failures": failures},
            )

    def on_close(self, release: Callable[[], object]) -> None:
        """Run ``release`` (e.g. close a producer) when the runner closes."""
        self._on_close.append(release)

    def close(self) -> None:
        """Stop serving health and drop the listener (idempotent)."""
        while self._on_close:
            try:
                self._on_close.pop()()
            except Exception:
                log.exception("releasing a resource failed", extra={"service": self.service})
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._listener is not None:
            _ProgressDispatch.detach(self.spark, self._listener)
            self._listener = None
