"""Resources: CPU seconds and peak RSS of the processes taking part."""

from __future__ import annotations

import os
import threading

from cdc_devkit.processes import owns_its_memory, process_snapshot

_TICK = os.sysconf("SC_CLK_TCK")


class Meter(threading.Thread):
    """CPU seconds and peak RSS per process group (or single process), sampled every second.

    CPU per process is the largest total seen (user + system, with reaped children), so
    a process that ends keeps its share. ``together`` names a set of those names whose
    RSS is also summed at each sample: its peak is the most they held at one time (the
    sum of their own peaks may add peaks of different moments).
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.groups: dict[int, str] = {}  # process group id -> name
        self.single: dict[int, str] = {}  # process id -> name (its children not included)
        self.cpu_ticks: dict[str, dict[int, int]] = {}
        self.peak_rss: dict[str, int] = {}
        self.sums: dict[str, tuple[str, ...]] = {}  # name of a sum -> the names summed
        self.peak_sum_rss: dict[str, int] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def watch(self, name: str, pid: int, *, group: bool = True) -> None:
        """Meter process group ``pid`` (or only process ``pid``) as ``name``."""
        with self.lock:
            (self.groups if group else self.single)[pid] = name
            self.cpu_ticks.setdefault(name, {})
            self.peak_rss.setdefault(name, 0)

    def together(self, name: str, members: list[str]) -> None:
        """Also keep the peak of the RSS ``members`` (watched names) hold at one time."""
        with self.lock:
            self.sums[name] = tuple(members)
            self.peak_sum_rss.setdefault(name, 0)

    def run(self) -> None:
        """Sample until ``done``."""
        while not self.done.wait(1.0):
            self.sample()

    def sample(self) -> None:
        """One pass over /proc."""
        snapshot = process_snapshot()
        with self.lock:
            rss = dict.fromkeys(self.peak_rss, 0)
            for process in snapshot.values():
                name = self.single.get(process.pid) or self.groups.get(process.group)
                if name is None:
                    continue
                seen = self.cpu_ticks[name]
                seen[process.pid] = max(seen.get(process.pid, 0), process.cpu_ticks)
                if owns_its_memory(process, snapshot):
                    rss[name] += process.resident_bytes
            for name, value in rss.items():
                self.peak_rss[name] = max(self.peak_rss[name], value)
            for name, members in self.sums.items():
                total = sum(rss.get(member, 0) for member in members)
                self.peak_sum_rss[name] = max(self.peak_sum_rss[name], total)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far per name."""
        self.sample()
        with self.lock:
            return {n: sum(t.values()) / _TICK for n, t in self.cpu_ticks.items()}
