"""Progress: one JSON log line and the metrics of each micro-batch, from Spark's listener.

A service's foreachBatch reports what it did (:class:`BatchStats`) to its runner; the
query listener, told by Spark when the batch is done, logs it with Spark's own figures
(duration, input rows) and the service's lag.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pyspark import SparkContext
from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import (
    JStreamingQueryListener,
    QueryProgressEvent,
    StreamingQueryListener,
)

from cdc_shared.streaming.observability import BATCH_SECONDS, BATCHES, INPUT_ROWS, LAG, ROWS

# One logger for the whole package: the name the logs show stays "cdc_shared.streaming".
log = logging.getLogger("cdc_shared.streaming")

#: Reads a service's lag from a query's progress event (None: it cannot tell).
LagReader = Callable[[Any], float | None]


class ProgressOwner(Protocol):
    """What the progress log needs of the runner whose queries it logs (a StreamRunner)."""

    service: str
    entity_of: dict[str, str]  # query id -> entity

    def saw_progress(self, query_id: str, batch_id: int) -> None:
        """A batch of the query finished."""

    def saw_idle(self, query_id: str) -> None:
        """The query triggered and found no new data."""

    def take_stats(self, entity: str, batch_id: int) -> BatchStats:
        """What the entity's foreachBatch reported for the batch (and forget it)."""

    def lag_of(self, progress: Any) -> float | None:
        """The service's lag, read from a progress event."""


@dataclass
class BatchStats:
    """What a micro-batch did, reported by the service's foreachBatch function."""

    counts: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # A query over many entities: the counts of each (``counts`` holds their sums). The
    # rows metrics are then labelled by entity, not by the query.
    by_entity: dict[str, dict[str, int]] = field(default_factory=dict)


def source_metric(name: str) -> LagReader:
    """A lag reader: the named metric of the query's sources, summed (e.g. files behind).

    A service's one query over many tables has a source per table: its lag is theirs
    together. None when no source reports the metric.
    """

    def read(progress: Any) -> float | None:
        values = [(source.metrics or {}).get(name) for source in progress.sources]
        known = [float(value) for value in values if value is not None]
        return sum(known) if known else None

    return read


class _JsonProgressListener(JStreamingQueryListener):
    """pyspark's bridge of listener calls, taking each progress event as one JSON string.

    pyspark reads a progress event field by field, one Py4J call each, and looks up
    ``PythonSQLUtils`` anew for every observed metric (``Observation``): a class lookup
    that tries pyspark's imported packages first, each failure a scan of every jar on the
    classpath. That was about 5% of the application's JVM CPU at 1,000 events/s (JFR);
    the event's JSON is two calls, and pyspark reads ``lastProgress`` the same way.
    """

    def onQueryProgress(self, jevent: Any) -> None:
        """Hand the progress, read from its JSON, to the Python listener."""
        progress = json.loads(jevent.progress().json())
        self.pylistener.onQueryProgress(QueryProgressEvent.fromJson({"progress": progress}))


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

    @property
    def _jlistener(self) -> Any:
        """The JVM side of this listener (pyspark's own, bridged by ``_JsonProgressListener``)."""
        if not hasattr(self, "_jlistenerobj"):
            jvm: Any = SparkContext._jvm
            self._jlistenerobj = jvm.PythonStreamingQueryListenerWrapper(
                _JsonProgressListener(self)
            )
        return self._jlistenerobj

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

    def __init__(self, runner: ProgressOwner) -> None:
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
        rows_by_entity = {name: {**counts} for name, counts in stats.by_entity.items()} or {
            entity: {"input_rows": input_rows, **stats.counts}
        }
        for name, counts in rows_by_entity.items():
            INPUT_ROWS.labels(self.runner.service, name).inc(counts.pop("input_rows", 0))
            for outcome, count in counts.items():
                ROWS.labels(self.runner.service, name, outcome).inc(count)
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
                # Spark's own phases of the batch (latestOffset, getBatch, queryPlanning,
                # addBatch: the foreachBatch, walCommit, commitOffsets): what the batch
                # cost outside the service's own code.
                "spark_ms": dict(progress.durationMs or {}),
                "input_rows_per_s": round(input_rows / max(duration_ms, 1) * 1000, 1),
                "lag": lag,
            },
        )
