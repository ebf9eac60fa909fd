"""Running Structured Streaming queries as a service: triggers, graceful stop, progress.

A service builds one query per entity and hands them to :class:`StreamRunner`, which
serves health and metrics, logs one JSON line per micro-batch from the query listener,
stops after the batch in flight on SIGTERM (exit 0), and surfaces a failed query as
an error naming the entity, or restarts it from its checkpoint when the service's
``on_failure`` calls the error transient (e.g. its source is unreachable).
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ClassVar

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_shared.config import (
    ConfigError,
    EntityConfig,
    PipelineConfig,
    StreamingServiceConfig,
)
from cdc_shared.layout import command_name
from cdc_shared.observability import BATCH_SECONDS, BATCHES, HEALTHY, LAG, ROWS, HealthServer
from cdc_shared.retry import backoff_s, log_retry
from cdc_shared.spark import build_spark_session

log = logging.getLogger(__name__)


class StreamFailedError(RuntimeError):
    """A stream stopped with an error; the message names the service and entity."""


@dataclass(frozen=True)
class Failure:
    """A service's reading of a failed query's error (see ``StreamRunner(on_failure=)``).

    ``transient``: restart the query from its checkpoint after a backoff (forever, while
    the error stays transient); else stop the service with ``message``. ``rebuild``: build
    the query again before restarting it (its source's schema changed, and a query keeps
    the schema it was built with). ``entity_only``: stop this entity's stream but keep the
    others running (``/health`` says so; the service exits 1 when it stops).
    """

    message: str
    transient: bool = False
    rebuild: bool = False
    entity_only: bool = False


#: Reads a failed query's error: (entity, error text) -> Failure, or None (not recognised).
OnFailure = Callable[[str, str], Failure | None]

#: How the JVM and the OS say a write failed for want of space (ENOSPC, EDQUOT).
NO_SPACE = re.compile(r"No space left on device|ENOSPC|Disk quota exceeded")


def no_space_message(storage_root: str, error: str = "") -> str:
    """What to tell the operator when a write under ``storage_root`` found the disk full.

    Names the path being written when the JVM's ``error`` shows it.
    """
    written = re.search(rf"{re.escape(storage_root.rstrip('/'))}[^\s'\",;]*", error)
    return (
        f"stopped: no space left on device under the storage root {storage_root}"
        + (f" (writing {written.group(0).rstrip('.')})" if written else "")
        + ". Delta commits and the stream's checkpoint are atomic, so the failed micro-batch "
        "committed nothing (at most unreferenced files remain); free space or grow the "
        "volume, then restart: the stream resumes from its checkpoint and writes nothing twice"
    )


def recognising_full_storage(storage_root: str, on_failure: OnFailure | None) -> OnFailure:
    """``on_failure``, after recognising a full disk.

    A full disk stops the service with a one-line message naming the storage root, not
    the JVM's stack trace.
    """

    def read(entity: str, error: str) -> Failure | None:
        if NO_SPACE.search(error):
            return Failure(no_space_message(storage_root, error))
        return on_failure(entity, error) if on_failure else None

    return read


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


@dataclass
class BatchStats:
    """What a micro-batch did, reported by the service's foreachBatch function."""

    counts: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


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


class _ProgressDispatch(StreamingQueryListener):
    """The one Python listener of a Spark session; each event goes to its query's runner.

    Spark calls every Python listener for every event of every query, and each call
    crosses into Python: with ``cdc run``'s four runners, one listener per runner cost
    about 12% of the JVM's CPU (a JFR profile of the application at 1,000 events/s).
    """

    _by_session: ClassVar[dict[int, _ProgressDispatch]] = {}
    _sessions_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._loggers: list[_ProgressLogger] = []

    @classmethod
    def attach(cls, spark: SparkSession, logger: _ProgressLogger) -> None:
        """Send ``logger``'s queries' events to it (the session's listener made on first use)."""
        with cls._sessions_lock:
            dispatch = cls._by_session.get(id(spark))
            if dispatch is None:
                dispatch = cls._by_session[id(spark)] = cls()
                spark.streams.addListener(dispatch)
            dispatch._loggers = [*dispatch._loggers, logger]

    @classmethod
    def detach(cls, spark: SparkSession, logger: _ProgressLogger) -> None:
        """Stop sending events to ``logger``; the last one out removes the listener."""
        with cls._sessions_lock:
            dispatch = cls._by_session.get(id(spark))
            if dispatch is None:
                return
            dispatch._loggers = [x for x in dispatch._loggers if x is not logger]
            if not dispatch._loggers:
                spark.streams.removeListener(dispatch)
                del cls._by_session[id(spark)]

    def _owner(self, query_id: str) -> _ProgressLogger | None:
        return next((x for x in self._loggers if query_id in x.runner.entity_of), None)

    def onQueryStarted(self, event: Any) -> None:
        """Nothing to do: the runners log starts."""

    def onQueryProgress(self, event: Any) -> None:
        """Hand the progress to the runner of its query."""
        owner = self._owner(str(event.progress.id))
        if owner is not None:
            owner.progress(event.progress)

    def onQueryIdle(self, event: Any) -> None:
        """Hand the idle trigger to the runner of its query."""
        owner = self._owner(str(event.id))
        if owner is not None:
            owner.runner.saw_idle(str(event.id))

    def onQueryTerminated(self, event: Any) -> None:
        """The runners report terminations."""


class _ProgressLogger:
    """Logs a runner's batches, with the counts its foreachBatch reported."""

    def __init__(self, runner: StreamRunner) -> None:
        self.runner = runner

    def progress(self, progress: Any) -> None:
        """Log the batch with the counts its foreachBatch reported."""
        try:
            self._log(progress)
        finally:
            self.runner.saw_progress(str(progress.id), progress.batchId)

    def _log(self, progress: Any) -> None:
        entity = self.runner.entity_of.get(str(progress.id))
        if entity is None or (progress.numInputRows == 0 and progress.batchId > 0):
            return
        stats = self.runner.take_stats(entity, progress.batchId)
        lag = stats.extra.pop("lag", None)  # a foreachBatch may know better than the source
        if lag is None:
            lag = self.runner.lag_of(progress)
        duration_ms = int(progress.batchDuration)
        # Spark counts every read of the source; a foreachBatch reading its batch twice
        # reports the true count itself.
        input_rows = stats.counts.pop("input_rows", progress.numInputRows)
        BATCH_SECONDS.labels(self.runner.service, entity).observe(duration_ms / 1000)
        BATCHES.labels(self.runner.service, entity).inc()
        if lag is not None:
            LAG.labels(self.runner.service, entity).set(lag)
        for outcome, count in stats.counts.items():
            ROWS.labels(self.runner.service, entity, outcome).inc(count)
        log.info(
            "batch",
            extra={
                "service": self.runner.service,
                "entity": entity,
                "batch_id": progress.batchId,
                "input_rows": input_rows,
                **stats.counts,
                **stats.extra,
                "duration_ms": duration_ms,
                "input_rows_per_s": round(input_rows / max(duration_ms, 1) * 1000, 1),
                "lag": lag,
            },
        )


class StreamRunner:
    """Owns a service's queries: health, progress logs, SIGTERM, failures."""

    def __init__(
        self,
        spark: SparkSession,
        service: str,
        metrics_host: str = "0.0.0.0",
        metrics_port: int = 0,
        lag: Callable[[Any], float | None] | None = None,
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
        self._max_restart_backoff_s = max_restart_backoff_s
        self._writers: dict[str, tuple[DataStreamWriter, QueryIdentity]] = {}
        self._rebuilders: dict[str, Callable[[], tuple[DataStreamWriter, QueryIdentity]]] = {}
        self._to_rebuild: set[str] = set()
        # entity -> (failures since its last progress, restart time or None once restarted, why)
        self._restarts: dict[str, tuple[int, float | None, str]] = {}
        self._on_close: list[Callable[[], object]] = []
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
        rebuild: Callable[[], tuple[DataStreamWriter, QueryIdentity]] | None = None,
    ) -> None:
        """Start one entity's query; ``rebuild`` builds it anew (see ``Failure.rebuild``)."""
        writer = writer.queryName(f"{self.service}-{entity}")
        query = writer.start()
        identity.set(str(query.id))
        self._writers[entity] = (writer, identity)
        if rebuild is not None:
            self._rebuilders[entity] = rebuild
        self.queries[entity] = query
        self.entity_of[str(query.id)] = entity
        log.info(
            "stream started",
            extra={"service": self.service, "entity": entity, "query_id": str(query.id)},
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
        for entity, query in self.queries.items():
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
        for query in self.queries.values():
            if query.isActive:
                query.stop()
        self.close()

    def run(self) -> None:
        """Wait until every query ends (``--once``) or a stop is requested, then stop them.

        Raises StreamFailedError if a query failed.
        """
        try:
            while not self._stop.is_set():
                for entity, query in list(self.queries.items()):
                    self._raise_if_failed(entity, query)
                if not self._restarts_due() and all(not q.isActive for q in self.queries.values()):
                    break
                self._stop.wait(0.5)
            self._stop_gracefully()
            for entity, query in self.queries.items():
                self._raise_if_failed(entity, query)
            self._wait_for_progress_logs()
            if self._stopped:
                raise StreamFailedError(
                    "; ".join(
                        f"{self.service} stream for entity {entity!r} {message}"
                        for entity, message in self._stopped.items()
                    )
                )
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
        if error is None or entity in self._stopped:
            return
        failure = self._on_failure(entity, str(error)) if self._on_failure else None
        if failure is not None and failure.entity_only and not failure.transient:
            self._stopped[entity] = failure.message
            self.set_problem(entity, f"stopped: {failure.message}")
            log.error(
                "stream stopped; the other entities go on",
                extra={"service": self.service, "entity": entity, "reason": failure.message},
            )
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
        message = failure.message if failure else f"failed: {error}"
        raise StreamFailedError(f"{self.service} stream for entity {entity!r} {message}")

    def _restarts_due(self) -> bool:
        with self._lock:
            return any(at is not None for _, at, _ in self._restarts.values())

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


def source_metric(name: str) -> Callable[[Any], float | None]:
    """A lag reader: the named metric of the query's source (e.g. Kafka offsets behind)."""

    def read(progress: Any) -> float | None:
        for source in progress.sources:
            value = (source.metrics or {}).get(name)
            if value is not None:
                return float(value)
        return None

    return read


OpenStream = Callable[
    [SparkSession, EntityConfig, StreamRunner], tuple[DataStreamWriter, QueryIdentity]
]


def start_streams(
    service: str,
    config: PipelineConfig,
    settings: StreamingServiceConfig,
    entity_names: list[str] | None,
    spark: SparkSession | None,
    lag: str | Callable[[Any], float | None] | None,
    open_stream: OpenStream,
    on_failure: OnFailure | None = None,
) -> StreamRunner:
    """Start one stream per selected entity (``open_stream`` builds each); ``run()`` the result.

    ``on_failure`` reads a failed query's error (transient: restarted; see StreamRunner);
    a full disk is recognised for every service.
    """
    entities = config.select_entities(entity_names)
    if not entities:
        raise ConfigError(f"the configuration defines no entities for the {service}")
    spark = spark or build_spark_session(config.spark, command_name(service))
    runner = StreamRunner(
        spark,
        service,
        settings.metrics_host,
        settings.metrics_port,
        source_metric(lag) if isinstance(lag, str) else lag,  # None: foreachBatch reports it
        recognising_full_storage(config.storage_root, on_failure),
    )
    try:
        for entity in entities:
            writer, identity = open_stream(spark, entity, runner)
            rebuild = functools.partial(open_stream, spark, entity, runner)
            runner.start(entity.name, writer, identity, rebuild)
    except BaseException:
        runner.stop_now()
        raise
    return runner


def rebuilding_on_schema_change(layer: str) -> OnFailure:
    """Reads a Delta source's schema change as "build the stream again".

    Delta ends a stream whose source table gained a column (``DELTA_SCHEMA_CHANGED*``,
    "try restarting the query"), and a query keeps the schema it was built with; rebuilt,
    it reads the new schema. ``layer`` names the source in the log (bronze, silver).
    """

    def read(entity: str, error: str) -> Failure | None:
        if "DELTA_SCHEMA_CHANGED" in error:
            return Failure(
                f"{layer}/{entity} changed its schema; rebuilding the stream to read it",
                transient=True,
                rebuild=True,
            )
        return None

    return read
