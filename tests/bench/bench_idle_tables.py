"""Benchmark: what an idle table costs each service, 2 tables configured vs N.

The four services run as four processes (``cdc-<service> --config <file>``, as deployed
apart), so the CPU of each is its own; one pipeline per table count, one after the
other, never together, each on fresh topics, tables and indexes. The tables are copies
of the example's entities (``bench_many_tables.many_tables_config``: shipped defaults,
every table in the group ``default``: one streaming query per service).

Per table count:

- **start**: every topic gets a few records (``--prime`` per table) before the launch,
  so every table has data in its first batch; start is the time from the launch to
  every table's records in its change topic and in its index (so every service has
  written every table).
- **idle**: after a quiet ``--settle`` (no batch with rows for that long), ``--idle``
  seconds with no load at all: CPU seconds of each service's process group, per minute.
  With N tables this is the cost of N idle tables; the difference to the 2-table run,
  divided by the extra tables, is the cost of one idle table.
- **load on two**: ``--rate`` events/s on the first two tables only (a copy of each
  example entity), the others idle, for ``--load`` seconds: CPU per service per 1,000
  events, and each service's batches with rows (count, duration p50) over the window.
- peak RSS of each service over the run; exit codes after SIGTERM.

Every CPU figure is given for the service's process group (Python driver and JVM) and,
on a line "(python)", for its Python driver alone.

The table printed puts the counts side by side; ``results.json`` under ``--workdir``
has every figure. Figures, not a test: run it alone on the machine (docs/benchmarks.md).
Needs the test servers (``support.servers``), started here if not running, left running.

    .venv/bin/python tests/bench/bench_idle_tables.py [--tables 2,24] [--idle 120]
        [--load 120] [--rate 200] [--workdir /tmp/bench-idle-tables]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cdc_devkit import infra
from cdc_devkit.local_run import wait_until_healthy
from cdc_devkit.processes import RunMode, ServiceProcess, launch, stop_all, wait_a_little
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, ensure_topics, produce
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import PipelineConfig, load_config
from confluent_kafka import TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, however this is run
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench
from bench_many_tables import many_tables_config
from e2e_bench.meter import Meter  # CPU and peak RSS per process group, from /proc
from support.servers import TEST_INFRA

MIB = 2**20
#: The services in pipeline order, as their logs name them.
SERVICES = ("ingestor", "merger", "publisher-kafka", "publisher-es")


@dataclass
class Run:
    """What one table count showed."""

    tables: int
    start_s: float | None = None
    idle_s: float = 0.0
    idle_cpu_s: dict[str, float] = field(default_factory=dict)
    load_events: int = 0
    load_cpu_s: dict[str, float] = field(default_factory=dict)
    load_batches: dict[str, int] = field(default_factory=dict)
    load_batch_p50_s: dict[str, float | None] = field(default_factory=dict)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    failure: str = ""


class FirstWrites:
    """Which tables' records are in their change topic and their index yet.

    The last two services' outputs: a table there has been written by every service.
    """

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.waiting = {e.name: e for e in config.entities}

    def done(self) -> bool:
        """Whether every table's records reached both (tables found are not looked at again)."""
        consumer = make_consumer(self.config.kafka, "bench-idle-tables")
        try:
            with make_elasticsearch(self.config.elasticsearch) as es:
                for name, entity in list(self.waiting.items()):
                    if _in_topic(consumer, entity.change_topic_name) and _in_index(
                        es, entity.es_index_name
                    ):
                        del self.waiting[name]
        finally:
            consumer.close()
        return not self.waiting


def _in_topic(consumer: Any, topic: str) -> bool:
    """Whether ``topic`` holds a record (its high watermarks)."""
    metadata = consumer.list_topics(topic, timeout=10).topics.get(topic)
    if metadata is None or metadata.error is not None:
        return False
    return any(
        consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] > 0
        for p in metadata.partitions
    )


def _in_index(es: Any, alias: str) -> bool:
    """Whether the index behind ``alias`` holds a document."""
    try:
        return int(es.count(index=alias)["count"]) > 0
    except Exception:  # not made yet
        return False


def batches_with_rows(
    processes: list[ServiceProcess], since: dict[str, int]
) -> dict[str, list[float]]:
    """Durations (s) of the batches with rows each service logged after its ``since``-th."""
    found: dict[str, list[float]] = {}
    for process in processes:
        process.poll()
        found[process.name] = [
            float(b["duration_ms"]) / 1000
            for b in process.batches[since[process.name] :]
            if int(b.get("input_rows") or 0) > 0
        ]
    return found


def rows_batches_count(processes: list[ServiceProcess]) -> int:
    """Batches with rows logged so far by all services."""
    for process in processes:
        process.poll()
    return sum(1 for p in processes for b in p.batches if int(b.get("input_rows") or 0) > 0)


def wait_quiet(processes: list[ServiceProcess], quiet_s: float, timeout_s: float) -> None:
    """Wait until no service logged a batch with rows for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    seen = rows_batches_count(processes)
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet_s:
        if time.monotonic() > deadline:
            raise RuntimeError(f"still busy after {timeout_s:.0f} s")
        wait_a_little(processes, 2.0)
        now = rows_batches_count(processes)
        if now != seen:
            seen, quiet_since = now, time.monotonic()


def prepare(tables: int, args: argparse.Namespace) -> tuple[Path, list[Any]]:
    """The pipeline file of ``tables`` tables, every topic primed; the load's records."""
    workdir = args.workdir / f"tables-{tables}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config_path = many_tables_config(workdir, tables, {})
    config = load_config(config_path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])
    registry = make_registry(config)
    for entity in config.entities:  # every table gets data in its first batch
        spec = WorkloadSpec(events=args.prime, keys=50, snapshot_rows=0, seed=3, poison_share=0.0)
        produce(config.kafka, WorkloadGenerator([entity], registry, spec).messages())
    hot = list(config.entities[:2])
    events = int(args.rate * args.load)
    spec = WorkloadSpec(events=events, keys=args.keys, snapshot_rows=0, seed=7, poison_share=0.0)
    return config_path, list(
        itertools.islice(WorkloadGenerator(hot, registry, spec).messages(), events)
    )


def start_metered(processes: list[ServiceProcess]) -> Meter:
    """Start the services, each metered whole and its Python driver alone."""
    meter = Meter()
    for process in processes:
        process.start()
        assert process.process is not None
        meter.watch(process.name, process.process.pid)
        # The Python driver alone (the JVM is its child): what py4j callbacks cost there.
        meter.watch(f"{process.name} (python)", process.process.pid, group=False)
    meter.start()
    return meter


def run_tables(tables: int, args: argparse.Namespace) -> Run:
    """One pipeline of ``tables`` tables: start, idle window, load on two, stop."""
    run = Run(tables)
    config_path, load_messages = prepare(tables, args)
    config = load_config(config_path)
    processes = launch(RunMode.SERVICES, config_path, config_path.parent / "logs")
    launched = time.monotonic()
    meter = start_metered(processes)
    try:
        wait_until_healthy(processes, config, args.start_timeout)
        first_writes = FirstWrites(config)
        while not first_writes.done():
            if time.monotonic() - launched > args.start_timeout:
                waiting = len(first_writes.waiting)
                raise RuntimeError(f"{waiting} tables not in their topic and index in time")
            if dead := [p.name for p in processes if not p.alive]:
                raise RuntimeError(f"{', '.join(dead)} stopped during start-up; see its log")
            wait_a_little(processes, 2.0)
        run.start_s = time.monotonic() - launched
        print(f"[{tables} tables] every table written after {run.start_s:.0f} s", flush=True)
        wait_quiet(processes, args.settle, args.start_timeout)

        before = meter.cpu_seconds()
        idle_started = time.monotonic()
        wait_a_little(processes, args.idle)
        run.idle_s = time.monotonic() - idle_started
        after = meter.cpu_seconds()
        run.idle_cpu_s = {s: after[s] - before[s] for s in after}
        print(f"[{tables} tables] idle CPU s: {run.idle_cpu_s}", flush=True)

        before = meter.cpu_seconds()
        for process in processes:
            process.poll()
        logged_before = {p.name: len(p.batches) for p in processes}
        load = threading.Thread(
            target=produce, args=(config.kafka, iter(load_messages)), kwargs={"rate": args.rate}
        )
        load.start()
        wait_a_little(processes, args.load)
        load.join()
        after = meter.cpu_seconds()
        run.load_events = len(load_messages)
        run.load_cpu_s = {s: after[s] - before[s] for s in after}
        for name, durations in batches_with_rows(processes, logged_before).items():
            run.load_batches[name] = len(durations)
            run.load_batch_p50_s[name] = statistics.median(durations) if durations else None
        print(f"[{tables} tables] load CPU s: {run.load_cpu_s}", flush=True)
    except RuntimeError as error:
        run.failure = str(error)
        print(f"[{tables} tables] {error}", flush=True)
    finally:
        run.exit_codes = stop_all(processes)
        meter.done.set()
        run.peak_rss_mib = {s: meter.peak_rss[s] / MIB for s in SERVICES}
    return run


def cell(value: float | None, form: str) -> str:
    """``value`` formatted, or "-" when it was not measured."""
    return "-" if value is None else form.format(value)


def print_table(runs: list[Run]) -> None:
    """Per service: idle CPU per minute, per idle table, load CPU per 1k, batches, RSS."""
    base = runs[0]
    print()
    print(
        "start (every table in its topic and index): "
        + ", ".join(f"{r.tables} tables {cell(r.start_s, '{:.0f} s')}" for r in runs)
    )
    header = ["service"]
    for r in runs:
        header += [
            f"idle CPU s/min @{r.tables}",
            f"load CPU s/1k @{r.tables}",
            f"batches p50 s @{r.tables}",
            f"peak RSS MiB @{r.tables}",
        ]
    header += [f"idle CPU ms/min per extra table @{r.tables}" for r in runs[1:]]
    print(" | ".join(header))
    for service in [name for s in SERVICES for name in (s, f"{s} (python)")]:
        row = [service]
        for r in runs:
            idle = r.idle_cpu_s.get(service)
            per_min = None if idle is None or not r.idle_s else idle / r.idle_s * 60
            load = r.load_cpu_s.get(service)
            per_1k = None if load is None or not r.load_events else load / r.load_events * 1000
            row += [
                cell(per_min, "{:.1f}"),
                cell(per_1k, "{:.2f}"),
                f"{r.load_batches.get(service, 0)} / "
                + cell(r.load_batch_p50_s.get(service), "{:.1f}"),
                cell(r.peak_rss_mib.get(service), "{:,.0f}"),
            ]
        for r in runs[1:]:
            extra = r.tables - base.tables
            if service in r.idle_cpu_s and service in base.idle_cpu_s and extra > 0:
                mine = r.idle_cpu_s[service] / r.idle_s * 60
                theirs = base.idle_cpu_s[service] / base.idle_s * 60
                row.append(f"{(mine - theirs) / extra * 1000:.0f}")
            else:
                row.append("-")
        print(" | ".join(row))
    for r in runs:
        if r.failure:
            print(f"{r.tables} tables: {r.failure}")
        print(f"{r.tables} tables: exit codes {r.exit_codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", default="2,24", help="table counts, the first the base")
    parser.add_argument("--prime", type=int, default=10, help="records per table before start")
    parser.add_argument("--settle", type=float, default=30.0, help="quiet before idle window")
    parser.add_argument("--idle", type=float, default=120.0, help="idle window (s)")
    parser.add_argument("--load", type=float, default=120.0, help="load window (s)")
    parser.add_argument("--rate", type=float, default=200.0, help="events/s on the two hot tables")
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--start-timeout", type=float, default=1200.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-idle-tables"))
    args = parser.parse_args()
    infra.up(TEST_INFRA)
    counts = [int(n) for n in args.tables.split(",")]
    runs = [run_tables(n, args) for n in counts]
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "results.json").write_text(
        json.dumps([asdict(r) for r in runs], indent=2, default=str)
    )
    print_table(runs)


if __name__ == "__main__":
    main()
