"""Benchmark: how long each service takes to start with many tables, by start parallelism.

N copies of the example's tables (``bench_many_tables.many_tables_config``) on empty
topics. Per variant, on a storage root of its own, each service runs ``--once`` as its own
process, in pipeline order (the ingestor makes bronze, the merger silver, ...): with no
data a ``--once`` run is its start (session, leases, every table's stream opened and
started) and one empty trigger per table, so its wall time is the start's cost. Variants
differ in ``spark.cdc.streams.startParallelism`` (how many streams a service opens side
by side); they run one after the other after a warm-up run, never together.

    .venv/bin/python tests/bench/bench_service_start.py [--tables 24] [--parallelism 1,4]
        [--workdir /tmp/bench-service-start]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cdc_devkit.workload import ensure_topics
from cdc_shared.config import load_config
from cdc_shared.layout import SERVICES, command_name
from cdc_shared.spark import START_PARALLELISM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_many_tables import many_tables_config  # the same N tables

BIN = Path(sys.executable).parent


def run_services(config: Path, logs: Path) -> dict[str, float]:
    """Each service ``--once`` in pipeline order; its wall time in seconds."""
    logs.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for service in SERVICES:
        command = command_name(service)
        started = time.monotonic()
        with (logs / f"{command}.log").open("wb") as log:
            done = subprocess.run(
                [str(BIN / command), "--config", str(config), "--once"],
                stdout=subprocess.DEVNULL,
                stderr=log,
                check=False,
            )
        if done.returncode != 0:
            raise SystemExit(f"{command} exited {done.returncode}; see {logs / command}.log")
        seconds[service] = time.monotonic() - started
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--tables", type=int, default=24)
    parser.add_argument("--parallelism", default="1,4", help="values of startParallelism")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-service-start"))
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    variants = [int(v) for v in args.parallelism.split(",")]
    results: dict[int, list[dict[str, float]]] = {v: [] for v in variants}
    plan = [("warm-up", variants[-1])] + [
        (f"round {r + 1}", v) for r in range(args.rounds) for v in variants
    ]
    for number, (label, parallelism) in enumerate(plan):
        folder = args.workdir / f"run-{number}"
        folder.mkdir(parents=True)
        config = many_tables_config(folder, args.tables, {START_PARALLELISM: str(parallelism)})
        pipeline = load_config(config)
        ensure_topics(pipeline.kafka, [e.source_topic for e in pipeline.entities])
        seconds = run_services(config, folder / "logs")
        print(
            f"{label:>8}  parallelism {parallelism}: "
            + "  ".join(f"{s} {t:5.1f} s" for s, t in seconds.items()),
            flush=True,
        )
        if label != "warm-up":
            results[parallelism].append(seconds)
    print(f"\n{args.tables} tables, each service --once with no data (median of {args.rounds}):")
    print(f"{'service':<16}" + "".join(f"{'parallel ' + str(v):>14}" for v in variants))
    for service in [*SERVICES, "total"]:
        row = [
            statistics.median(
                sum(r.values()) if service == "total" else r[service] for r in results[v]
            )
            for v in variants
        ]
        print(f"{service:<16}" + "".join(f"{value:>12.1f} s" for value in row))


if __name__ == "__main__":
    main()
