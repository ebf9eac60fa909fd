"""side_by_side: calls overlap, all end before it returns, the first error is raised."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from cdc_shared.jvm.spark import side_by_side


def test_calls_overlap_and_all_end_before_it_returns() -> None:
    arrived = threading.Barrier(3, timeout=10)  # passes only if all three run at once
    ended: list[int] = []

    def call(n: int) -> None:
        arrived.wait()
        time.sleep(0.05 * n)
        ended.append(n)

    side_by_side([functools.partial(call, n) for n in range(3)])
    assert sorted(ended) == [0, 1, 2]


def test_the_first_error_is_raised_after_the_others_ended() -> None:
    ended: list[str] = []

    def slow() -> None:
        time.sleep(0.3)
        ended.append("slow")

    def failing() -> None:
        raise ValueError("no table")

    with pytest.raises(ValueError, match="no table"):
        side_by_side([slow, failing])
    assert ended == ["slow"]
