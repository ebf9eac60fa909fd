"""CPU seconds of a local Spark driver's JVM, by kind of thread (Linux ``/proc``).

For benchmarks: how much of a batch's CPU is the work itself (tasks, and the driver's
planning and commits) and how much the JVM's own upkeep (JIT compilers, garbage
collector). Read from the JVM's threads in ``/proc/<pid>/task``; threads that ended
between two readings are not counted.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

_TICK = os.sysconf("SC_CLK_TCK")

#: Thread name prefixes (as Linux keeps them: the first 15 characters) and their kind.
KINDS: tuple[tuple[str, str], ...] = (
    ("Executor task", "tasks"),
    # The driver's own work: calls from Python (Py4J's threads) and streaming queries.
    ("Thread-", "driver"),
    ("stream executio", "driver"),
    ("C1 CompilerThre", "JIT compiler"),
    ("C2 CompilerThre", "JIT compiler"),
    ("Sweeper thread", "JIT compiler"),
    ("GC Thread", "garbage collector"),
    ("G1 ", "garbage collector"),
    ("VM Thread", "garbage collector"),  # Serial collections and safepoints run here
    ("dag-scheduler", "scheduler"),
    ("broadcast-exch", "scheduler"),
    ("spark-listener", "scheduler"),
    ("task-result-get", "scheduler"),
    ("dispatcher-", "scheduler"),
)


def jvm_pid(spark: SparkSession) -> int:
    """The process id of the session's (local) JVM."""
    jvm = spark.sparkContext._jvm  # no public handle on the JVM
    assert jvm is not None
    return int(jvm.java.lang.ProcessHandle.current().pid())


def kind_of(thread: str) -> str:
    """The kind of a JVM thread, from its name."""
    return next((kind for prefix, kind in KINDS if thread.startswith(prefix)), "other")


def cpu_by_kind(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the JVM's live threads have used, summed per kind."""
    used: defaultdict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        used[kind_of(name)] += (int(fields[11]) + int(fields[12])) / _TICK
    return dict(used)


def since(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds per kind used between two readings of :func:`cpu_by_kind`."""
    return {kind: cpu - before.get(kind, 0.0) for kind, cpu in now.items()}


def shares(used: Mapping[str, float]) -> str:
    """``used`` as percentages, largest first: ``tasks 30%, JIT compiler 25%, ...``."""
    total = sum(used.values()) or 1.0
    ordered = sorted(used.items(), key=lambda item: -item[1])
    return ", ".join(f"{kind} {100 * cpu / total:.0f}%" for kind, cpu in ordered)
