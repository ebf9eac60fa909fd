"""Polling helpers shared by the tests that watch a running service."""

from __future__ import annotations

import time
from collections.abc import Callable

from cdc_devkit.local_run import free_ports


def wait_for(condition: Callable[[], bool], timeout_s: float = 180.0) -> None:
    """Poll ``condition`` every second until it holds; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError("condition not met in time")


def free_port() -> int:
    """A loopback port free right now (for a service's metrics/health server)."""
    return free_ports(1)[0]
