"""How many of a service's micro-batches run at once: its tables' batches take turns.

Each table is a streaming query with a thread of its own, so a service with many tables
that all have data (its first start, a restart after downtime) runs every table's batch
at once: on a small machine each then takes as long as all of them, and the driver's heap
holds every batch's plans and MERGE sources together, which with 100 tables exhausted a
heap sized per table (docs/benchmarks.md). A gate lets ``slots`` batches run and queues
the others in arrival order, so the first tables finish early, memory is bounded by the
slots instead of the tables, and a table that triggers often cannot keep a rarely
changing one waiting for ever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pyspark.sql import DataFrame

ProcessBatch = Callable[[DataFrame, int], None]


class BatchGate:
    """At most ``slots`` batches inside at once, let in first come, first served.

    ``slots`` of 0 or less: no limit (every batch goes in at once, as without a gate).
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._changed = threading.Condition()
        self._queue: deque[object] = deque()
        self._inside = 0

    @property
    def inside(self) -> int:
        """Batches running now."""
        return self._inside

    @property
    def waiting(self) -> int:
        """Batches queued for a slot now."""
        return len(self._queue)

    @contextmanager
    def slot(self) -> Iterator[float]:
        """Hold a slot for the block; yields the seconds waited for it."""
        if self.slots <= 0:
            yield 0.0
            return
        ticket = object()
        started = time.monotonic()
        with self._changed:
            self._queue.append(ticket)
            while self._queue[0] is not ticket or self._inside >= self.slots:
                self._changed.wait()
            self._queue.popleft()
            self._inside += 1
            self._changed.notify_all()  # the next in line may take a slot still free
        try:
            yield time.monotonic() - started
        finally:
            with self._changed:
                self._inside -= 1
                self._changed.notify_all()

    def around(self, process: ProcessBatch) -> ProcessBatch:
        """``process`` run inside a slot (a foreachBatch function)."""
        if self.slots <= 0:
            return process

        def gated(batch: DataFrame, batch_id: int) -> None:
            with self.slot():
                process(batch, batch_id)

        return gated
