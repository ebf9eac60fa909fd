"""The work queue a micro-batch writes its tables through.

A service's query reads every table of its group at once; its micro-batch says which
tables changed and up to where (a source position per table: a bronze version, a silver
version). Each table keeps its own progress in its target (``docs/design.md``, "The
runtime"), so a table need not be written in the batch that brought its change: it stays
*pending* until a batch writes it, from its own progress up to the newest position
offered.

A batch writes the pending tables that are due, ``tables_at_once`` side by side, each
worker taking the next table as it frees up (no fixed groups waiting for their slowest).
The order alternates between two lines, so that neither starves the other:

- the *hot* line: every due table, the most rows first;
- the *overdue* line: the tables whose oldest unwritten change has waited its
  *deadline* (its ``freshness``, else the service's ``max_table_delay``, less the time
  its writes take), the earliest deadline first.

A backlog of overdue tables (a first start of many tables, each with its snapshot)
takes every other write, not all of them: the hot tables go on being written in
between. A table with a ``freshness`` whose deadline is still ahead is not due
(*deferred*): a cold table written less often leaves the cores to the hot ones, and
each of its writes takes more rows at once.

No table's write starts once the batch has run ``batch_budget``: the rest wait for the
next batch, where the oldest come first. A query run to the end of what is there
(``--once``) *drains*: every pending table is due, and no budget applies.

A table whose write fails for a reason of its own is *held*: stopped alone (``/health``,
the exit code), its progress where its last write left it, while the others go on; the
next start of the service takes it up from there. A table's own is any failure but those
the service reads as its whole's (a full disk, a refused transactional id:
``Failure.entity_only`` false) and those of a service that is stopping (its jobs
cancelled).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pyspark import InheritableThread
from pyspark.sql import SparkSession

from cdc_shared.config.services import StreamingServiceConfig
from cdc_shared.config.values import interval_seconds
from cdc_shared.streaming.failures import Failure
from cdc_shared.streaming.progress import BatchStats

log = logging.getLogger("cdc_shared.streaming")

#: Writes one table up to a position of its source, in the given session (one per worker:
#: a session's settings, e.g. Delta's idempotent-write ones, are its worker's alone).
WriteTable = Callable[[SparkSession, str, int], BatchStats]
#: Reads a table's failed write: a Failure saying how (None: a failure the service does
#: not know, held as the table's own).
OnTableFailure = Callable[[str, BaseException], Failure | None]
#: Holds a table (table, why): False when it cannot (the service is stopping).
HoldTable = Callable[[str, str], bool]
#: How much of a table's past write times its estimate keeps (an exponential average).
_WRITE_TIME_WEIGHT = 0.7


@dataclass
class Pending:
    """A table's unwritten changes: up to where, since when, how many rows."""

    until: int
    since: float  # time.monotonic() of the oldest unwritten change
    rows: int = 0


@dataclass
class BatchWrites:
    """What one batch's writes did: each table's stats, and the tables left waiting."""

    written: dict[str, BatchStats] = field(default_factory=dict)
    waiting: int = 0
    held: list[str] = field(default_factory=list)

    def stats(self) -> BatchStats:
        """The batch's counts summed over its tables, and each table's (``tables``)."""
        counts: dict[str, int] = {}
        errors: dict[str, int] = {}
        for stats in self.written.values():
            for name, value in stats.counts.items():
                counts[name] = counts.get(name, 0) + value
            for kind, value in stats.extra.get("errors", {}).items():
                errors[kind] = errors.get(kind, 0) + value
        tables = {name: {**s.counts, **s.extra} for name, s in self.written.items()}
        extra: dict[str, object] = {"tables": tables, "tables_waiting": self.waiting}
        if errors:
            extra["errors"] = errors
        return BatchStats(
            counts=counts,
            extra=extra,
            by_entity={name: dict(s.counts) for name, s in self.written.items()},
        )


class TableQueue:
    """The pending tables of one query, and the workers that write them per batch."""

    def __init__(
        self,
        spark: SparkSession,
        settings: StreamingServiceConfig,
        write: WriteTable,
        on_failure: OnTableFailure,
        hold: HoldTable,
        freshness: Mapping[str, float] | None = None,
        drain: bool = False,
    ) -> None:
        self._write = write
        self.drain = drain
        self._on_failure = on_failure
        self._hold = hold
        self.freshness = dict(freshness or {})
        self.budget_s = interval_seconds(settings.batch_budget) or 0.0
        self.max_delay_s = interval_seconds(settings.max_table_delay) or 0.0
        # One session per worker, made once: each write sets its own session's settings.
        self._sessions = [spark.newSession() for _ in range(settings.tables_at_once)]
        self.pending: dict[str, Pending] = {}
        self.held: dict[str, str] = {}
        self._write_s: dict[str, float] = {}
        self._lock = threading.Lock()
        self._running = threading.Lock()  # one run at a time

    def offer(self, table: str, until: int, rows: int = 0) -> None:
        """Note that ``table`` has changes up to ``until`` (``rows`` of them) to write."""
        with self._lock:
            if table in self.held:
                return
            pending = self.pending.get(table)
            if pending is None:
                self.pending[table] = Pending(until, time.monotonic(), rows)
            else:
                pending.until = max(pending.until, until)
                pending.rows += rows

    def deadline(self, table: str, pending: Pending) -> float:
        """When ``table``'s oldest unwritten change is due to be written (monotonic time)."""
        allowed = self.freshness.get(table, self.max_delay_s)
        return pending.since + allowed - self._write_s.get(table, 0.0)

    def order(
        self, now: float, skip: set[str] | frozenset[str] = frozenset(), overdue_first: bool = False
    ) -> list[str]:
        """The tables due now, in the order the workers take them (see the module).

        The lines alternate from the hot one, or from the overdue one if ``overdue_first``
        (a run's every other take).
        """
        overdue: list[tuple[float, str]] = []
        hot: list[tuple[int, str]] = []
        for table, pending in self.pending.items():
            if table in skip:
                continue
            deadline = self.deadline(table, pending)
            if not self.drain and now >= deadline:  # draining: everything is due, none late
                overdue.append((deadline, table))
            if self.drain or now >= deadline or table not in self.freshness:
                hot.append((-pending.rows, table))
        lines = [[t for _, t in sorted(hot)], [t for _, t in sorted(overdue)]]
        if overdue_first:
            lines.reverse()
        order: dict[str, None] = {}  # taken in turn from each line, each table once
        for position in range(max(map(len, lines))):
            order.update(dict.fromkeys(line[position] for line in lines if position < len(line)))
        return list(order)

    def run(self) -> BatchWrites:
        """Write the due tables (see the module); raise what a write raised for the batch.

        One run at a time: a batch's run waits for a run between batches to end.
        """
        with self._running:
            return self._run()

    def write_between_batches(
        self,
        written: Callable[[BatchWrites], None],
        failed: Callable[[BaseException], None],
        interval_s: float = 1.0,
    ) -> Callable[[], None] | None:
        """Write the tables that fall due while no batch comes; a thread's stop, or None.

        A table offered at start (behind its source), or deferred by its freshness,
        must not wait for the group's next change. Every ``interval_s`` a thread runs
        the queue when a table is due and no batch's run is under way; ``written`` gets
        each run's outcome, ``failed`` what a run raised (the thread then stops). A queue
        that drains (``--once``) writes what is pending now instead, and starts none.
        """
        if self.drain:
            while self.pending and (outcome := self.run()).written:
                written(outcome)
            return None
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                with self._lock:
                    due = bool(self.order(time.monotonic()))
                if not due or not self._running.acquire(blocking=False):
                    continue
                try:
                    outcome = self._run()
                except Exception as error:
                    failed(error)
                    return
                finally:
                    self._running.release()
                if outcome.written:
                    written(outcome)

        thread = InheritableThread(target=loop, name="tables-between-batches", daemon=True)
        thread.start()
        return stop.set

    def _run(self) -> BatchWrites:
        started = time.monotonic()
        outcome = BatchWrites()
        taken: set[str] = set()
        failed: list[BaseException] = []

        def take() -> tuple[str, int] | None:
            with self._lock:
                now = time.monotonic()
                if failed or (taken and not self.drain and now - started >= self.budget_s):
                    return None
                due = self.order(now, taken, overdue_first=len(taken) % 2 == 1)
                if not due:
                    return None
                taken.add(due[0])
                return due[0], self.pending[due[0]].until

        def work(session: SparkSession) -> None:
            while (next_table := take()) is not None:
                table, until = next_table
                began = time.monotonic()
                try:
                    stats = self._write(session, table, until)
                except Exception as error:
                    if not self._held_for(table, error):
                        with self._lock:
                            failed.append(error)
                        return
                    continue
                took = time.monotonic() - began
                with self._lock:
                    pending = self.pending.get(table)
                    if pending is not None and pending.until <= until:
                        del self.pending[table]
                    before = self._write_s.get(table, took)
                    weight = _WRITE_TIME_WEIGHT
                    self._write_s[table] = weight * before + (1 - weight) * took
                    outcome.written[table] = stats

        workers = [InheritableThread(target=work, args=(s,), daemon=True) for s in self._sessions]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        outcome.waiting = len(self.pending)
        outcome.held = [t for t in taken if t in self.held]
        if failed:
            raise failed[0]
        return outcome

    def _held_for(self, table: str, error: BaseException) -> bool:
        """Hold ``table`` when ``error`` is its own (True); False when it fails the batch."""
        failure = self._on_failure(table, error)
        if failure is not None and (not failure.entity_only or failure.transient):
            return False
        reason = failure.message if failure else f"stopped: {type(error).__name__}: {error}"
        if not self._hold(table, reason[:2000]):
            return False
        with self._lock:
            self.held[table] = reason
            self.pending.pop(table, None)
        log.error(
            "a table's write failed for a reason of its own: held at its last write, "
            "the others go on",
            extra={"entity": table, "reason": reason[:2000]},
        )
        return True

    def holds_all(self, tables: Iterable[str]) -> bool:
        """Whether every one of ``tables`` is held: the query has nothing left to write."""
        return set(tables) <= self.held.keys()
