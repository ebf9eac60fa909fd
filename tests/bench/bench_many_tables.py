"""Benchmark: the driver's memory with many tables in one application (``cdc run``).

N copies of the example's tables (each on topics, a silver table and an index of its own;
bronze is one table for all) run as one Spark application with the shipped defaults (the
driver's heap among them: nothing in ``spark.conf``, the Spark UI on). A steady load
spread over every table is produced once all streams are healthy. The driver JVM is
sampled every ``--sample-every`` seconds: ``jcmd GC.class_histogram`` (which collects
the whole heap first), then ``jcmd GC.heap_info``, so the heap figure is the heap in use
after a full collection.

Printed per variant: time to healthy, peak heap used after a full collection, peak RSS
of the application's processes, whether it survived the load (still running, then a
clean exit on SIGTERM), merger batches that wrote rows, and the classes whose instances
grew most between the first and the last sample. ``--variant NAME:key=value,key=value``
adds a run with those ``spark.conf`` entries (e.g. the old defaults, to compare in the
same invocation); the variants run one after the other, never together.

``--restart PIPELINE`` runs every variant on the tables, checkpoints and topics that
pipeline file names instead (made before, e.g. by ``bench_cli_status.py --tables N
--folder DIR``): a restart of a running deployment rather than its first start.
``--hot N`` puts the whole load on the first N tables (the rest idle).

    .venv/bin/python tests/bench/bench_many_tables.py [--tables 24] [--seconds 300]
        [--rate 200] [--workdir /tmp/bench-many-tables] [--restart PIPELINE] [--hot N]
        [--with-old] [--variant NAME:key=value,...]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cdc_devkit import infra
from cdc_devkit.local_run import health_port, wait_until_healthy, write_pipeline_config
from cdc_devkit.processes import (
    RunMode,
    group_rss_bytes,
    launch,
    process_snapshot,
    stop_all,
    wait_a_little,
)
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, ensure_topics, produce
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, however this is run
from support.servers import TEST_INFRA  # the test session's servers

GIB = 2**30
#: The values spark_conf shipped before its bounds on the driver's memory, as ``spark.conf``
#: entries: ``--with-old`` runs them beside the defaults.
OLD_DEFAULTS = {
    "spark.cdc.python.gcIntervalSeconds": "0",
    "spark.sql.streaming.numRecentProgressUpdates": "100",
    "spark.sql.streaming.ui.retainedProgressUpdates": "100",
}
_USED = re.compile(r"total (\d+)K, used (\d+)K")
_HISTOGRAM_ROW = re.compile(r"^\s*\d+:\s+(\d+)\s+(\d+)\s+(\S+)")


@dataclass
class Sample:
    """One look at the driver JVM."""

    at_s: float
    heap_used: int  # bytes in use after a full collection
    rss: int
    classes: dict[str, tuple[int, int]]  # class -> (instances, bytes)


@dataclass
class Outcome:
    """What one variant's run showed."""

    name: str
    healthy_after_s: float | None = None
    survived: bool = False
    exit_code: int | None = None
    merged_batches: int = 0
    samples: list[Sample] = field(default_factory=list)
    peak_rss: int = 0
    failure: str = ""


def many_tables_config(workdir: Path, tables: int, conf: dict[str, str]) -> Path:
    """The example pipeline with ``tables`` tables: copies of its entities, shipped defaults.

    The copies as ``write_pipeline_config`` makes them; ``spark.conf`` holds ``conf`` only.
    """
    served = infra.endpoints(TEST_INFRA)
    path = write_pipeline_config(workdir, served, prefix="many", tables=tables)
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    document["spark"]["conf"] = dict(conf)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def restarted_config(pipeline: Path, workdir: Path, conf: dict[str, str]) -> Path:
    """A copy of ``pipeline`` in ``workdir`` with ``conf`` added to its ``spark.conf``."""
    document: dict[str, Any] = yaml.safe_load(pipeline.read_text())
    document.setdefault("spark", {}).setdefault("conf", {}).update(conf)
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def driver_pid(group: int) -> int | None:
    """The JVM of the application whose process group is ``group``."""
    for sample in process_snapshot().values():
        if sample.group != group:
            continue
        try:
            if Path(f"/proc/{sample.pid}/comm").read_text().strip() == "java":
                return sample.pid
        except OSError:
            continue
    return None


def jcmd(pid: int, command: str) -> str:
    """``jcmd <pid> <command>``'s output ("" when the JVM is gone or does not answer)."""
    try:
        done = subprocess.run(
            ["jcmd", str(pid), command], check=False, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout if done.returncode == 0 else ""


def sample_driver(pid: int, group: int, at_s: float) -> Sample | None:
    """The class histogram (after a full collection) and the heap then in use."""
    histogram = jcmd(pid, "GC.class_histogram")
    info = jcmd(pid, "GC.heap_info")
    if not histogram or not info:
        return None
    classes = {}
    for line in histogram.splitlines():
        row = _HISTOGRAM_ROW.match(line)
        if row:
            classes[row.group(3)] = (int(row.group(1)), int(row.group(2)))
    used = sum(int(m.group(2)) * 1024 for m in _USED.finditer(info))
    return Sample(at_s, used, group_rss_bytes(group), classes)


def run_variant(
    name: str, conf: dict[str, str], args: argparse.Namespace, workdir: Path
) -> Outcome:
    """One application with ``conf``: start, load for ``args.seconds``, sample, stop."""
    outcome = Outcome(name)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    if args.restart:
        config_path = restarted_config(args.restart, workdir, conf)
    else:
        config_path = many_tables_config(workdir, args.tables, conf)
    config = load_config(config_path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])
    loaded = config.entities[: args.hot] if args.hot else config.entities
    events = int(args.rate * args.seconds)
    spec = WorkloadSpec(events=events, keys=args.keys, snapshot_rows=100, seed=7, poison_share=0.0)
    messages = list(WorkloadGenerator(loaded, make_registry(config), spec).messages())
    processes = launch(RunMode.APPLICATION, config_path, workdir / "logs")
    application = processes[0]
    started = time.monotonic()
    application.start()
    try:
        try:
            wait_until_healthy(processes, config, args.start_timeout)
        except RuntimeError as error:
            outcome.failure = str(error)
            return outcome
        outcome.healthy_after_s = time.monotonic() - started
        print(f"[{name}] healthy after {outcome.healthy_after_s:.0f} s", flush=True)
        assert application.process is not None
        group = application.process.pid
        load = threading.Thread(
            target=produce, args=(config.kafka, iter(messages)), kwargs={"rate": args.rate}
        )
        load.start()
        end = time.monotonic() + args.seconds + args.settle
        while time.monotonic() < end and application.alive:
            pid = driver_pid(group)
            if pid is not None:
                sample = sample_driver(pid, group, time.monotonic() - started)
                if sample is not None:
                    outcome.samples.append(sample)
                    print(
                        f"[{name}] t={sample.at_s:.0f}s heap after GC "
                        f"{sample.heap_used / GIB:.2f} GiB, RSS {sample.rss / GIB:.2f} GiB",
                        flush=True,
                    )
            wait_a_little(processes, args.sample_every)
        load.join()
        outcome.survived = application.alive and application.healthy(
            health_port(config, application.name)
        )
        if not application.alive:
            outcome.failure = "the application stopped during the load; see its log"
    finally:
        codes = stop_all(processes)
        outcome.exit_code = codes[application.name]
        outcome.peak_rss = application.peak_rss
        outcome.merged_batches = sum(
            1
            for b in application.batches
            if b.get("service") == "merger" and int(b.get("input_rows") or 0) > 0
        )
    if outcome.exit_code != 0:
        outcome.survived = False
    return outcome


def growth(outcome: Outcome, top: int) -> list[tuple[str, int, int]]:
    """The classes whose bytes grew most from the first to the last sample."""
    if len(outcome.samples) < 2:
        return []
    first, last = outcome.samples[0].classes, outcome.samples[-1].classes
    grown = [
        (cls, count - first.get(cls, (0, 0))[0], size - first.get(cls, (0, 0))[1])
        for cls, (count, size) in last.items()
    ]
    return sorted(grown, key=lambda g: -g[2])[:top]


def report(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    """The figures side by side, then each variant's growing classes."""
    tables = f"restart on {args.restart}" if args.restart else f"{args.tables} tables"
    spread = f" on {args.hot} of them" if args.hot else ""
    print(
        f"\n{tables}, {args.rate:.0f} events/s{spread} for {args.seconds:.0f} s "
        f"(+{args.settle:.0f} s), one application\n"
    )
    print("| variant | healthy after | peak heap after GC | peak RSS | survived | exit |")
    print("|---|---|---|---|---|---|")
    for o in outcomes:
        healthy = "never" if o.healthy_after_s is None else f"{o.healthy_after_s:.0f} s"
        heap = max((s.heap_used for s in o.samples), default=0) / GIB
        print(
            f"| {o.name} | {healthy} | {heap:.2f} GiB | {o.peak_rss / GIB:.2f} GiB "
            f"| {'yes' if o.survived else 'no'} ({o.merged_batches} merger batches with rows) "
            f"| {o.exit_code} |"
        )
    for o in outcomes:
        if o.failure:
            print(f"\n{o.name}: {o.failure}")
        grown = growth(o, args.top)
        if grown:
            span = o.samples[-1].at_s - o.samples[0].at_s
            print(f"\n{o.name}: classes grown most over {span:.0f} s (instances, MiB)")
            for cls, count, size in grown:
                print(f"  {size / 2**20:8.1f} MiB {count:>10,}  {cls}")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name:key=value,key=value`` -> (name, conf)."""
    name, _, entries = text.partition(":")
    conf = dict(e.split("=", 1) for e in entries.split(",") if e)
    return name, conf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=300.0, help="load duration")
    parser.add_argument("--settle", type=float, default=30.0, help="sampling after the load")
    parser.add_argument("--rate", type=float, default=200.0, help="events/s over all tables")
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-many-tables"))
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:key=value,... a run with these spark.conf entries (repeatable)",
    )
    parser.add_argument("--restart", type=Path, help="a pipeline file whose tables exist")
    parser.add_argument("--hot", type=int, default=0, help="tables with load (0: all)")
    parser.add_argument("--with-old", action="store_true", help="also a run with OLD_DEFAULTS")
    parser.add_argument("--no-defaults", action="store_true", help="only the --variant runs")
    args = parser.parse_args()
    variants: list[tuple[str, dict[str, str]]] = [] if args.no_defaults else [("defaults", {})]
    variants += [("old defaults", OLD_DEFAULTS)] if args.with_old else []
    variants += [parse_variant(v) for v in args.variant]
    outcomes = [run_variant(n, c, args, args.workdir / n.replace(" ", "-")) for n, c in variants]
    report(outcomes, args)
    sys.exit(0 if all(o.survived for o in outcomes) else 1)


if __name__ == "__main__":
    main()
