"""The table queue: which tables a batch writes, in what order, and what a failure holds."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from cdc_shared.config.services import StreamingServiceConfig
from cdc_shared.streaming.failures import Failure
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.queue import TableQueue


class _Sessions:
    """Stands in for a SparkSession: the queue only asks it for sessions of its own."""

    def newSession(self) -> object:
        return object()


def _queue(
    write: Any,
    on_failure: Any = lambda _table, _error: None,
    held: list[tuple[str, str]] | None = None,
    stopping: bool = False,
    **settings: Any,
) -> TableQueue:
    def hold(table: str, reason: str) -> bool:
        if stopping:
            return False
        (held if held is not None else []).append((table, reason))
        return True

    config = StreamingServiceConfig(**{"tables_at_once": 1, **settings})
    return TableQueue(_Sessions(), config, write, on_failure, hold)  # type: ignore[arg-type]


def test_the_most_rows_and_the_longest_waiting_alternate_and_fresh_ones_wait() -> None:
    written: list[tuple[str, int]] = []

    def write(_spark: object, table: str, until: int) -> BatchStats:
        written.append((table, until))
        return BatchStats(counts={"rows": 1})

    queue = _queue(write, max_table_delay="60 seconds")
    queue.freshness["cold"] = 3600.0
    queue.offer("old", 7, rows=1)
    queue.pending["old"].since -= 120  # waited past max_table_delay
    queue.offer("warm", 5, rows=10)
    queue.offer("hot", 5, rows=500)
    queue.offer("hot", 9, rows=20)  # a later batch: up to its end, rows added up
    queue.offer("cold", 5, rows=1000)  # its freshness is ahead: deferred
    outcome = queue.run()
    assert written == [("hot", 9), ("old", 7), ("warm", 5)]  # hot, overdue, hot, ...
    assert set(outcome.written) == {"old", "hot", "warm"}
    assert list(queue.pending) == ["cold"] and outcome.waiting == 1

    queue.pending["cold"].since -= 3600  # its freshness reached: written
    queue.run()
    assert written[-1] == ("cold", 5) and not queue.pending


def test_no_write_starts_past_the_budget_and_a_backlog_does_not_starve_the_hot() -> None:
    written: list[str] = []

    def write(_spark: object, table: str, _until: int) -> BatchStats:
        written.append(table)
        time.sleep(0.3)
        return BatchStats()

    queue = _queue(write, batch_budget="0.5 seconds")
    for number in range(6):
        queue.offer(f"t{number}", 1, rows=100 - number)
    queue.run()
    assert written == ["t0", "t1"]  # the second began before the budget ran out
    assert sorted(queue.pending) == ["t2", "t3", "t4", "t5"]
    for pending in queue.pending.values():
        pending.since -= 3600  # waited long: overdue
    queue.offer("new", 1, rows=10_000)
    queue.run()
    assert written[2:4] == ["new", "t2"]  # the hottest, then the longest waiting


def test_tables_are_written_side_by_side_each_worker_taking_the_next() -> None:
    together = threading.Barrier(3, timeout=10)  # passes only if three writes run at once

    def write(_spark: object, _table: str, _until: int) -> BatchStats:
        together.wait()
        return BatchStats()

    queue = _queue(write, tables_at_once=3)
    for table in ("a", "b", "c"):
        queue.offer(table, 1, rows=1)
    assert set(queue.run().written) == {"a", "b", "c"}


def test_a_table_failing_alone_is_held_and_the_others_are_written() -> None:
    held: list[tuple[str, str]] = []

    def write(_spark: object, table: str, _until: int) -> BatchStats:
        if table == "bad":
            raise RuntimeError("its silver refuses the write")
        return BatchStats()

    queue = _queue(write, held=held)
    for table in ("bad", "good"):
        queue.offer(table, 3, rows=1)
    outcome = queue.run()
    assert list(outcome.written) == ["good"]
    assert held == [("bad", "stopped: RuntimeError: its silver refuses the write")]
    assert "bad" in queue.held and not queue.pending
    queue.offer("bad", 4, rows=1)  # held: offers are ignored until the next start
    assert "bad" not in queue.pending
    assert queue.holds_all(["bad"]) and not queue.holds_all(["bad", "good"])


def test_a_failure_of_the_whole_service_fails_the_batch() -> None:
    def write(_spark: object, _table: str, _until: int) -> BatchStats:
        raise OSError("No space left on device")

    def whole(_table: str, error: BaseException) -> Failure:
        return Failure(f"stopped: {error}")  # not entity_only: the service's

    queue = _queue(write, on_failure=whole)
    queue.offer("a", 1)
    with pytest.raises(OSError, match="No space"):
        queue.run()
    assert not queue.held and "a" in queue.pending


def test_a_write_failing_while_the_service_stops_is_not_held() -> None:
    def write(_spark: object, _table: str, _until: int) -> BatchStats:
        raise RuntimeError("job cancelled because SparkContext was shut down")

    queue = _queue(write, stopping=True)
    queue.offer("a", 1)
    with pytest.raises(RuntimeError, match="cancelled"):
        queue.run()
    assert not queue.held
