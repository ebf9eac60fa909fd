"""The services as local processes: start, watch, stop.

Either four processes, one per service, or one (``application``: ``cdc run``, every
service in one Spark application). Each runs in its own process group with its JSON log
in a file. The supervisor
reads the per-batch log lines as they come (for progress lines and the report) and
samples the resident memory of each process group (the Python driver and its JVM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from enum import StrEnum
from http.client import HTTPException
from pathlib import Path
from typing import Any

from cdc_shared.contracts import layout

#: The services' process names, in pipeline order (``publisher-kafka``).
SERVICES: tuple[str, ...] = tuple(layout.display_name(s) for s in layout.SERVICES)
APPLICATION = "application"  # the four services in one process (``cdc run``)


class RunMode(StrEnum):
    """How a local run deploys the services."""

    APPLICATION = "application"  # one process: ``cdc run``, one Spark application
    SERVICES = "services"  # four processes, one per service, as deployed apart


_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcessSample:
    """One process as /proc shows it at one instant."""

    pid: int
    parent: int
    group: int
    virtual_pages: int
    resident_bytes: int
    cpu_ticks: int  # user + system, with reaped children
    executable: str = ""  # the program it runs ("" when /proc does not say)


def process_snapshot() -> dict[int, ProcessSample]:
    """Every process now, by pid (processes that end while we look are left out)."""
    snapshot: dict[int, ProcessSample] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            statm = (entry / "statm").read_text().split()
            snapshot[int(entry.name)] = ProcessSample(
                pid=int(entry.name),
                parent=int(stat[1]),
                group=int(stat[2]),
                virtual_pages=int(statm[0]),
                resident_bytes=int(statm[1]) * _PAGE,
                cpu_ticks=sum(int(v) for v in stat[11:15]),
                executable=_executable(entry),
            )
        except (OSError, IndexError, ValueError):
            continue
    return snapshot


def _executable(entry: Path) -> str:
    """The program a process runs, "" when /proc does not say (another user's, or gone)."""
    try:
        return os.readlink(entry / "exe")
    except OSError:
        return ""


def owns_its_memory(sample: ProcessSample, snapshot: dict[int, ProcessSample]) -> bool:
    """False for a child that still shares its parent's address space.

    The JVM starts commands (Hadoop's ``chmod``, ``df``) with ``posix_spawn``, whose
    child runs in the parent's memory until it execs: for that instant /proc shows it
    with the whole JVM's size and RSS. Summing it would count the JVM twice. (A child
    just forked, e.g. a PySpark worker, also matches until it maps memory of its own:
    its pages are then still the parent's.) The two are read at different instants, and
    a JVM maps memory all the time, so sizes within 2% count as the same address space.
    A child running another program than its parent has exec'd, so it owns its memory
    whatever its size: a Python driver's JVM can come within 2% of the driver's size (a
    driver with a hundred Kafka clients maps gigabytes of thread stacks).
    """
    parent = snapshot.get(sample.parent)
    if parent is None:
        return True
    if sample.executable and parent.executable and sample.executable != parent.executable:
        return True
    return abs(parent.virtual_pages - sample.virtual_pages) > parent.virtual_pages // 50


def group_rss_bytes(group: int, snapshot: dict[int, ProcessSample] | None = None) -> int:
    """Resident memory of process group ``group``: each address space counted once."""
    snapshot = process_snapshot() if snapshot is None else snapshot
    return sum(
        s.resident_bytes
        for s in snapshot.values()
        if s.group == group and owns_its_memory(s, snapshot)
    )


@dataclass
class ServiceProcess:
    """One running service: its process, its log, what it has reported so far."""

    name: str
    config: Path
    log_path: Path
    only: tuple[str, ...] = ()  # the application: the services it runs (empty: all four)
    process: subprocess.Popen[bytes] | None = None
    batches: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    peak_rss: int = 0
    _read_upto: int = 0
    _signalled: subprocess.Popen[bytes] | None = None  # the process SIGTERM went to

    @property
    def command(self) -> list[str]:
        """``cdc-<name> --config <config>``, or ``cdc run --config <config>`` for the app."""
        if self.name == APPLICATION:
            chosen = [arg for service in self.only for arg in ("--service", service)]
            cdc = str(Path(sys.executable).with_name("cdc"))
            return [cdc, "run", "--config", str(self.config), *chosen]
        return [
            str(Path(sys.executable).with_name(f"cdc-{self.name}")),
            "--config",
            str(self.config),
        ]

    def start(self) -> None:
        """Launch the service (``command``) in its own process group."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )

    def poll(self) -> None:
        """Read new log lines and sample memory."""
        if self.process is not None and self.process.poll() is None:
            self.peak_rss = max(self.peak_rss, group_rss_bytes(self.process.pid))
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._read_upto)
                chunk = log.read()
        except OSError:
            return
        complete = chunk.rfind(b"\n") + 1
        self._read_upto += complete
        for line in chunk[:complete].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # Spark's own console lines
            if entry.get("msg") == "batch":
                self.batches.append(entry)
            elif entry.get("level") == "error":
                self.errors.append(str(entry.get("msg")))

    def healthy(self, port: int) -> bool:
        """Whether ``/health`` on ``port`` answers 200 (every stream started and running)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:  # refused, 503, timeout
            return False
        except HTTPException:  # something else than a service answers on the port
            return False

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process is not None and self.process.poll() is None

    def summary_line(self) -> str:
        """``name: N batches, R rows, lag L`` for the live progress display."""
        if not self.batches:
            state = "starting" if self.alive else "stopped"
            return f"{self.name:<16} {state}"
        rows = sum(int(b.get("input_rows") or 0) for b in self.batches)
        last = self.batches[-1]
        lag = last.get("lag")
        lag_text = "?" if lag is None else f"{lag:,.0f}"
        return f"{self.name:<16} {len(self.batches):>4} batches {rows:>9,} rows  lag {lag_text}"

    def request_stop(self) -> None:
        """SIGTERM, once, to the service's own process if it runs; returns at once.

        SIGTERM goes to the service's own process, as a container runtime sends it: the
        JVM it drives must stay up while the batch in flight finishes.
        """
        if self.process is None or self.process.poll() is not None:
            return
        if self._signalled is not self.process:
            self.process.send_signal(signal.SIGTERM)
            self._signalled = self.process

    def stop(self, grace_s: float = 120.0) -> int | None:
        """SIGTERM (the service finishes its batch), SIGKILL after ``grace_s``; exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.request_stop()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.poll()
        return self.process.returncode


def stop_all(processes: list[ServiceProcess], grace_s: float = 120.0) -> dict[str, int | None]:
    """SIGTERM every process at once, then wait for each; exit codes by process name.

    So a container runtime stops a deployment; the stops then take as long as the
    slowest one, not as long as all of them together (SIGKILL after ``grace_s``).
    """
    for process in processes:
        process.request_stop()
    return {process.name: process.stop(grace_s) for process in processes}


def batches_by_service(processes: list[ServiceProcess]) -> dict[str, list[dict[str, Any]]]:
    """The batch log lines of every service, by service (an application logs several)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for process in processes:
        for batch in process.batches:
            name = layout.display_name(str(batch.get("service") or process.name))
            grouped.setdefault(name, []).append(batch)
    return grouped


def launch(
    mode: RunMode, config: Path, logs: Path, only: tuple[str, ...] = ()
) -> list[ServiceProcess]:
    """The processes of a run, not started: four services, or one application.

    ``only``: the services to run (``SERVICES`` names; empty: all four).
    """
    if mode is RunMode.APPLICATION:
        return [ServiceProcess(APPLICATION, config, logs / f"{APPLICATION}.log", only)]
    names = [name for name in SERVICES if not only or name in only]
    return [ServiceProcess(name, config, logs / f"{name}.log") for name in names]


def wait_a_little(processes: list[ServiceProcess], seconds: float) -> None:
    """Sleep while sampling the processes often enough to catch memory peaks."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for service in processes:
            service.poll()
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
