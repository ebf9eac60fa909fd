"""Benchmark: how long ``cdc status`` takes, reading state through Spark or without a JVM.

Makes a pipeline shaped like the example one (deploy/local/pipeline.yaml: customers and
orders) on the test servers (``cdc infra``'s Kafka and Elasticsearch, ports
``CDC_INFRA_*``), with fresh topics under a temporary folder: ``cdc generate`` writes
``--events`` changes, then ``cdc run --once`` carries them through the four services, so
every table, checkpoint and quarantine table exists. ``--tables N`` makes N copies of
the example's tables instead (``bench_many_tables.many_tables_config``), ``--events``
changes produced to each, then each service ``--once`` as its own process in pipeline
order (one application with many tables needs more heap than the example's).
``--with-services`` starts the four services on the pipeline first (as processes, with
nothing new to read) and measures once each runs its queries (one per table group), as
an operator would run the command during an incident. Then it runs ``cdc status --config
<pipeline> --json`` ``--runs`` times per engine, each in a new process as an operator
would: ``--engine spark`` (the Spark session reading Delta logs and checkpoints through
Hadoop: the code before issue #39) and ``--engine delta-rs`` (the default: delta-rs and
plain file reads). Cold is the first run, warm the median of the others, CPU the median
CPU time; both engines must print the same report (exit 1 otherwise).

    .venv/bin/python tests/bench/bench_cli_status.py [--events 3000] [--runs 5]
        [--folder DIR] [--engines spark,delta-rs] [--tables N] [--with-services]

``--folder`` reuses the pipeline a previous run left there (``pipeline.yaml``), or makes
it there and keeps it; without it a temporary folder is used and removed. The topics
and indexes it makes are left on the test servers (they are small and uniquely named).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from cdc_devkit import infra  # noqa: E402
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig  # noqa: E402
from support.pipelines import write_pipeline  # noqa: E402
from support.servers import TEST_INFRA  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_many_tables import many_tables_config  # noqa: E402  the same N tables

CDC = str(Path(sys.executable).with_name("cdc"))
PIPELINE = "pipeline.yaml"


def make_pipeline(folder: Path, events: int) -> Path:
    """A two-entity pipeline in ``folder`` whose tables and checkpoints all exist."""
    endpoints = infra.up(TEST_INFRA)
    ports_off = {"metrics_port": 0}
    pipeline = write_pipeline(
        folder,
        KafkaConfig(bootstrap_servers=endpoints.kafka_bootstrap_servers),
        ElasticsearchConfig(hosts=[endpoints.elasticsearch_url]),
        ingestor=ports_off,
        merger=ports_off,
        publisher_kafka=ports_off,
        publisher_es=ports_off,
        application=ports_off,
    )
    config = ("--config", str(pipeline.path))
    keys = str(max(1, events // 3))
    started = time.monotonic()
    for command in (
        ("generate", *config, "--events", str(events), "--keys", keys, "--poison-share", "0.01"),
        ("run", *config, "--once"),
    ):
        subprocess.run([CDC, *command], check=True, stdout=subprocess.DEVNULL)
    print(f"pipeline made in {time.monotonic() - started:.0f} s: {pipeline.path}")
    target = folder / PIPELINE
    shutil.copy(pipeline.path, target)
    return target


def make_many_tables(folder: Path, tables: int, events: int) -> Path:
    """A pipeline of ``tables`` copies of the example's tables, ``events`` changes each."""
    from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, ensure_topics, produce
    from cdc_shared.clients.schemas import make_registry
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.contracts.layout import SERVICES, command_name

    infra.up(TEST_INFRA)
    started = time.monotonic()
    path = many_tables_config(folder, tables, {"spark.ui.enabled": "false"})
    config = load_config(path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])
    registry = make_registry(config)
    spec = WorkloadSpec(events=events, keys=max(1, events // 3), snapshot_rows=0, seed=3)
    for entity in config.entities:
        produce(config.kafka, WorkloadGenerator([entity], registry, spec).messages())
    for service in SERVICES:
        command = str(Path(sys.executable).with_name(command_name(service)))
        with (folder / f"{command_name(service)}.log").open("wb") as log:
            subprocess.run(
                [command, "--config", str(path), "--once"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        print(f"{service} done after {time.monotonic() - started:.0f} s", flush=True)
    target = folder / PIPELINE
    if path != target:  # the next run finds it there
        shutil.copy(path, target)
    return target


def start_services(pipeline: Path, timeout_s: float = 1800.0) -> list[Any]:
    """The four services running on ``pipeline``, once each started every group's query."""
    from cdc_devkit.processes import RunMode, launch, wait_a_little
    from cdc_shared.config.pipeline import load_config
    from cdc_shared.streaming.groups import table_groups

    config = load_config(pipeline)
    queries = len(table_groups(config, config.ingestor))  # every service runs the same groups
    processes = launch(RunMode.SERVICES, pipeline, pipeline.parent / "services")
    started = time.monotonic()
    for process in processes:
        process.start()
    while True:
        if dead := [p.name for p in processes if not p.alive]:
            raise SystemExit(f"{', '.join(dead)} stopped during start-up; see its log")
        counts = [
            p.log_path.read_text(errors="replace").count('"stream started"') for p in processes
        ]
        if all(count >= queries for count in counts):
            break
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"streams started after {timeout_s:.0f} s: {counts} of {queries}")
        wait_a_little(processes, 5.0)
    print(f"services running every query after {time.monotonic() - started:.0f} s", flush=True)
    return processes


def run_status(pipeline: Path, engine: str) -> tuple[float, float, dict[str, Any]]:
    """One ``cdc status --json`` in a new process: wall time, CPU time and its report.

    CPU time is the process's and its waited-for children's (user + system): on a busy
    machine it tells what the command costs when the wall time mostly waits for a core.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(
        [CDC, "status", "--config", str(pipeline), "--json", "--engine", engine],
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--engines", default="spark,delta-rs")
    parser.add_argument("--tables", type=int, default=2, help="2: the example pipeline")
    parser.add_argument("--with-services", action="store_true", help="measure beside them")
    args = parser.parse_args()

    temporary = args.folder is None
    services: list[Any] = []
    folder = Path(tempfile.mkdtemp(prefix="bench-status-")) if temporary else args.folder
    folder.mkdir(parents=True, exist_ok=True)
    try:
        pipeline = folder / PIPELINE
        if not pipeline.exists():
            if args.tables == 2:
                pipeline = make_pipeline(folder, args.events)
            else:
                pipeline = make_many_tables(folder, args.tables, args.events)
        if args.with_services:
            services = start_services(pipeline)
        figures: dict[str, tuple[float, float, float]] = {}
        reports: dict[str, dict[str, Any]] = {}
        for engine in args.engines.split(","):
            times, cpus = [], []
            for _ in range(args.runs):
                wall, cpu, reports[engine] = run_status(pipeline, engine)
                times.append(wall)
                cpus.append(cpu)
            warm = statistics.median(times[1:]) if len(times) > 1 else times[0]
            figures[engine] = (times[0], warm, statistics.median(cpus))
            runs = ", ".join(f"{t:.2f}" for t in times)
            print(f"{engine:<9} runs (s): {runs}")
        print(f"\n{'engine':<9} {'cold (s)':>9} {'warm (s)':>9} {'CPU (s)':>8}")
        for engine, (cold, warm, cpu) in figures.items():
            print(f"{engine:<9} {cold:>9.2f} {warm:>9.2f} {cpu:>8.2f}")
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
        first, *others = reports.values()
        same = all(report == first for report in others)
        print(f"\nsame report from every engine: {same}")
        if not same:
            for engine, report in reports.items():
                print(f"--- {engine}\n{json.dumps(report, indent=2)}")
            raise SystemExit(1)
    finally:
        if services:
            from cdc_devkit.processes import stop_all

            print(f"services stopped: {stop_all(services)}")
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
