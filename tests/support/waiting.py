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


def eventually(check: Callable[[], object], timeout_s: float = 240.0) -> None:
    """Run ``check`` (which asserts) every two seconds until it passes; its last
    AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(2)


def free_port() -> int:
    """A loopback port free right now (for a service's metrics/health server)."""
    return free_ports(1)[0]
