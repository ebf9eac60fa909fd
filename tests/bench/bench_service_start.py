"""Benchmark: how long each service takes to start with many tables.

N copies of the example's tables (``bench_many_tables.many_tables_config``) on topics of
their own, empty or with ``--events`` changes each. Per variant, on a storage root of its
own, each service runs ``--once`` as its own process, in pipeline order (the ingestor
makes bronze, the merger silver, ...). With no data a ``--once`` run is its start
(session, leases, every table's set-up, each table group's query started) and one empty
trigger per group, so its wall time is the start's cost; with data it is also every
table's first write (a first start, or a restart after downtime with something waiting
everywhere). Printed per service: wall time and peak RSS of its processes (Python and
JVM), the median of ``--rounds`` runs after a warm-up run.

``--setting NAME --values A,B`` runs a variant per value of one setting, one after the
other, never together: a ``spark.*`` name is a ``spark.conf`` entry, any other a setting
of every streaming service's section (e.g. ``tables_at_once``: how many tables a batch
writes side by side). Without it, one variant: the shipped defaults.

``--restart PIPELINE`` measures a restart instead: every run starts the services on the
tables, checkpoints and topics that pipeline file names (made before, e.g. by
``bench_cli_status.py --tables N --folder DIR``), with nothing new to read, so a run is
each service's start with every table group's stream resumed from its checkpoint.

    .venv/bin/python tests/bench/bench_service_start.py [--tables 24] [--events 0]
        [--setting tables_at_once --values 1,4] [--rounds 1]
        [--workdir /tmp/bench-service-start] [--restart PIPELINE]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from cdc_devkit.processes import group_rss_bytes
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, ensure_topics, produce
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.contracts.layout import SERVICES, command_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_many_tables import many_tables_config, restarted_config  # the same N tables

BIN = Path(sys.executable).parent
MIB = 2**20
DEFAULTS = "defaults"  # the one variant without --setting


def variant_config(folder: Path, args: argparse.Namespace, setting: str | None, value: str) -> Path:
    """The pipeline file of one variant: ``setting`` at ``value`` (none: shipped defaults)."""
    conf = {setting: value} if setting and setting.startswith("spark.") else {}
    if args.restart:
        path = restarted_config(args.restart, folder, conf)
    else:
        path = many_tables_config(folder, args.tables, conf)
    if setting and not setting.startswith("spark."):
        document: dict[str, Any] = yaml.safe_load(path.read_text())
        for service in SERVICES:
            document.setdefault(service, {})[setting] = yaml.safe_load(value)
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run_services(config: Path, logs: Path) -> dict[str, tuple[float, float]]:
    """Each service ``--once`` in pipeline order: its wall time (s) and peak RSS (MiB)."""
    logs.mkdir(parents=True, exist_ok=True)
    figures = {}
    for service in SERVICES:
        command = command_name(service)
        started = time.monotonic()
        peak = 0
        with (logs / f"{command}.log").open("wb") as log:
            process = subprocess.Popen(
                [str(BIN / command), "--config", str(config), "--once"],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # its own process group: the JVM is in it
            )
            while process.poll() is None:
                peak = max(peak, group_rss_bytes(process.pid))
                time.sleep(1.0)
        if process.returncode != 0:
            raise SystemExit(f"{command} exited {process.returncode}; see {logs / command}.log")
        figures[service] = (time.monotonic() - started, peak / MIB)
    return figures


def produce_changes(pipeline: PipelineConfig, events: int) -> None:
    """``events`` changes on every table's topic (keys reused, so updates and deletes too)."""
    registry = make_registry(pipeline)
    spec = WorkloadSpec(events=events, keys=max(1, events // 3), snapshot_rows=0, seed=3)
    for entity in pipeline.entities:
        produce(pipeline.kafka, WorkloadGenerator([entity], registry, spec).messages())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--tables", type=int, default=24)
    parser.add_argument(
        "--setting", help="a spark.conf entry (spark.*) or a setting of every service"
    )
    parser.add_argument("--values", default="", help="the setting's value in each variant")
    parser.add_argument("--events", type=int, default=0, help="changes per table before")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-service-start"))
    parser.add_argument("--restart", type=Path, help="a pipeline file whose tables exist")
    args = parser.parse_args()
    if bool(args.setting) != bool(args.values):
        parser.error("--setting and --values go together")
    shutil.rmtree(args.workdir, ignore_errors=True)
    variants = args.values.split(",") if args.setting else [DEFAULTS]
    results: dict[str, list[dict[str, tuple[float, float]]]] = {v: [] for v in variants}
    plan = [("warm-up", variants[-1])] + [
        (f"round {r + 1}", v) for r in range(args.rounds) for v in variants
    ]
    named = f"{args.setting} " if args.setting else ""
    for number, (label, value) in enumerate(plan):
        folder = args.workdir / f"run-{number}"
        folder.mkdir(parents=True)
        config = variant_config(folder, args, args.setting, value)
        if not args.restart:
            pipeline = load_config(config)
            ensure_topics(pipeline.kafka, [e.source_topic for e in pipeline.entities])
            if args.events:
                produce_changes(pipeline, args.events)
        figures = run_services(config, folder / "logs")
        print(
            f"{label:>8}  {named}{value}: "
            + "  ".join(f"{s} {t:5.1f} s {m:,.0f} MiB" for s, (t, m) in figures.items()),
            flush=True,
        )
        if label != "warm-up":
            results[value].append(figures)
    what = (
        f"restart on {args.restart}"
        if args.restart
        else f"{args.tables} tables, {args.events} changes each"
    )
    by = f" by {args.setting}" if args.setting else ""
    print(f"\n{what}, every service --once (median of {args.rounds}): wall time / peak RSS{by}")
    print(f"{'service':<16}" + "".join(f"{v:>20}" for v in variants))
    for service in [*SERVICES, "total"]:
        cells = []
        for v in variants:
            runs = results[v]
            if service == "total":
                wall = statistics.median(sum(t for t, _ in r.values()) for r in runs)
                cells.append(f"{wall:>10.1f} s{'':>8}")
                continue
            wall = statistics.median(r[service][0] for r in runs)
            rss = statistics.median(r[service][1] for r in runs)
            cells.append(f"{wall:>10.1f} s {rss:>5,.0f} MiB")
        print(f"{service:<16}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
