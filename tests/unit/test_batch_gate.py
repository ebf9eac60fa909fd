"""The batch gate: at most N of a service's batches at once, let in in arrival order."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest
from cdc_shared.streaming.gate import BatchGate


def _wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_no_more_batches_than_slots_run_and_the_queue_goes_in_arrival_order() -> None:
    gate = BatchGate(2)
    release = threading.Event()
    entered: list[int] = []
    most_inside = 0
    lock = threading.Lock()

    def batch(_frame: Any, batch_id: int) -> None:
        nonlocal most_inside
        with lock:
            entered.append(batch_id)
            most_inside = max(most_inside, gate.inside)
        release.wait()

    gated = gate.around(batch)
    threads = []
    for batch_id in range(6):
        thread = threading.Thread(target=gated, args=(cast(Any, None), batch_id))
        thread.start()
        threads.append(thread)
        # each queued before the next arrives, so arrival order is known
        _wait_for(lambda n=batch_id: gate.inside + gate.waiting == n + 1)
    assert sorted(entered) == [0, 1] and gate.waiting == 4
    release.set()
    for thread in threads:
        thread.join(5)
    assert entered[2:] == [2, 3, 4, 5]
    assert most_inside == 2 and gate.inside == 0 and gate.waiting == 0


def test_a_failing_batch_gives_its_slot_back() -> None:
    gate = BatchGate(1)

    def failing(_frame: Any, _batch_id: int) -> None:
        raise RuntimeError("boom")

    gated = gate.around(failing)
    for _ in range(2):  # a slot kept by the first failure would block the second for ever
        with pytest.raises(RuntimeError, match="boom"):
            gated(cast(Any, None), 0)
    assert gate.inside == 0


def test_no_slots_means_no_gate() -> None:
    def process(_frame: Any, _batch_id: int) -> None:
        pass

    assert BatchGate(0).around(process) is process
    with BatchGate(0).slot() as waited:
        assert waited == 0.0
