"""``cdc status --watch``: the services' pace read from a real ``/metrics`` endpoint."""

from __future__ import annotations

import io
import re
import socket
from collections.abc import Iterator

import pytest
from cdc_cli.watch import CLEAR, NOT_REACHABLE, Pace, Totals, pace, refreshes, watch
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.observability import BATCH_SECONDS, BATCHES, INPUT_ROWS, HealthServer

SERVICE = "watch_test"  # a service label no other test's metrics use


@pytest.fixture
def endpoint() -> Iterator[int]:
    """The project's own /metrics and /health server, on a free loopback port."""
    server = HealthServer("127.0.0.1", 0, lambda: {"status": "ok"}).start()
    try:
        yield server.port
    finally:
        server.stop()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _config(merger_port: int, ingestor_port: int) -> PipelineConfig:
    local = {"metrics_host": "127.0.0.1"}
    return PipelineConfig(
        ingestor={**local, "metrics_port": ingestor_port},
        merger={**local, "metrics_port": merger_port},
        publisher_kafka={"metrics_port": 0},
        publisher_es={"metrics_port": 0},
        application={"metrics_port": 0},
    )


def _batches(count: int, rows: int, seconds: float) -> None:
    for _ in range(count):
        BATCHES.labels(SERVICE, "customers").inc()
        INPUT_ROWS.labels(SERVICE, "customers").inc(rows)
        BATCH_SECONDS.labels(SERVICE, "customers").observe(seconds)


def test_each_refresh_shows_the_pace_since_the_last(endpoint: int) -> None:
    _batches(1, 10, 1.0)  # before the first refresh: not counted in any pace
    screens = refreshes(_config(endpoint, _closed_port()), lambda: "REPORT", 0.5, count=2)
    first = next(screens)
    assert "REPORT" in first
    assert re.search(
        rf"watch-test\s+reachable, measuring\.\.\.\s+http://127\.0\.0\.1:{endpoint}", first
    )
    assert re.search(rf"ingestor\s+{NOT_REACHABLE}", first), first
    _batches(4, 250, 2.5)
    second = next(screens)
    line = next(line for line in second.splitlines() if "watch-test" in line)
    # 4 batches of 2.5 s and 250 rows each, between two scrapes about half a second apart
    assert "batch 2.5 s" in line, line
    figures = re.search(r"([\d.]+) batches/min\s+([\d,]+) rows/s", line)
    assert figures, line
    per_min, rows_per_s = float(figures[1]), float(figures[2].replace(",", ""))
    assert per_min > 4 * 60 / 2, line  # at most two seconds apart
    assert abs(rows_per_s - per_min / 60 * 250) <= 1, line  # one interval for both
    assert re.search(rf"ingestor\s+{NOT_REACHABLE}", second), second


def test_pace_survives_a_restart_of_the_service() -> None:
    before = Totals(at=10.0, batches=50, rows=5_000, batch_seconds=100.0)
    assert pace(before, Totals(20.0, 60, 6_000, 130.0)) == Pace(60.0, 100.0, 3.0)
    restarted = pace(before, Totals(20.0, 2, 40, 4.0))  # counters began again at zero
    assert (restarted.batches_per_min, restarted.rows_per_s) == (12.0, 4.0)
    assert restarted.mean_batch_s == 2.0
    assert pace(before, before).mean_batch_s is None  # no batch in between


def test_watch_draws_over_the_last_screen(endpoint: int) -> None:
    out = io.StringIO()
    watch(_config(endpoint, 0), lambda: "REPORT", 0.5, out=out, count=2)
    assert out.getvalue().count(CLEAR) == 2
    assert out.getvalue().count("REPORT") == 2
