"""Benchmark: the whole pipeline at steady offered loads, beside the seed-style baseline.

The command line, and the whole run: every pipeline at every rate, then the figures.
What the bench measures and how: the package docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from cdc_devkit import infra

from .baseline import run_baseline
from .probes import ROOT
from .report import markdown, svg
from .run import PIPELINES, run_pipeline


def _switch(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    """``--NAME``, on unless ``--no-NAME`` is given."""
    parser.add_argument(
        f"--{name}", action=argparse.BooleanOptionalAction, default=True, help=help_text
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=[1000.0, 5000.0, 20000.0],
        help="offered loads in events/s, comma-separated (default 1000,5000,20000)",
    )
    parser.add_argument("--seconds-per-rate", type=float, default=180.0)
    parser.add_argument("--keys", type=int, default=100_000, help="key space per entity")
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench-e2e")
    parser.add_argument(
        "--pipelines",
        type=lambda text: [p for p in text.split(",") if p],
        default=list(PIPELINES),
        help="which to run, one after another (default cdc,cdc-app,baseline); KIND@N runs "
        "KIND on N tables instead of --tables (e.g. cdc-app@2,cdc-app@100)",
    )
    _switch(parser, "baseline", "--no-baseline leaves the baseline out of --pipelines")
    parser.add_argument(
        "--producers",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 4),
        help="producer processes (one reaches about 5,000 events/s per core)",
    )
    parser.add_argument("--probe-share", type=float, default=0.02)
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--port-base", type=int, default=49101, help="metrics ports from here")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--entities",
        type=lambda text: [e for e in text.split(",") if e],
        default=None,
        help="entities of the example pipeline to run, comma-separated (default all); the "
        "load is the same, spread over fewer streams",
    )
    parser.add_argument(
        "--tables",
        type=int,
        default=None,
        help="that many tables, copies of the example's entities in turn (a whole "
        "database); default: the example's own",
    )
    parser.add_argument(
        "--hot",
        "--hot-tables",
        dest="hot",
        type=int,
        default=0,
        help="the first K tables take --hot-share of the changes, the others the rest "
        "(every table changes); delays are then also given for the hot and the cold "
        "tables apart (default 0: the changes spread evenly)",
    )
    parser.add_argument(
        "--hot-share",
        "--hot-tables-share",
        dest="hot_share",
        type=float,
        default=0.7,
        help="the share of the changes the --hot tables take (default 0.7)",
    )
    parser.add_argument(
        "--cold-trigger",
        default=None,
        help="ours only, with --hot: the hot tables in a group of their own (the services' "
        "trigger), the others in a group triggered this often (e.g. '60 seconds')",
    )
    parser.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        type=_setting,
        metavar="KEY=VALUE",
        help="ours only: a Spark setting over the pipeline file's (e.g. "
        "spark.driver.memory=3g); repeatable",
    )
    parser.add_argument(
        "--snapshot-rows",
        type=int,
        default=None,
        help="rows of each table's snapshot (the warm-up); default half the key space",
    )
    _switch(
        parser,
        "history",
        "--no-history drops the example's SCD type 2 history (the baseline keeps none)",
    )
    _switch(
        parser, "index", "--no-index runs ours without publisher-es (the baseline feeds no index)"
    )
    parser.add_argument("--down", action="store_true", help="stop the servers at the end")
    parser.add_argument("--run-baseline", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _setting(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def pipeline_run(text: str, tables: int | None) -> tuple[str, int | None]:
    """``KIND`` or ``KIND@N`` of ``--pipelines`` -> (kind, tables); ``tables`` by default."""
    kind, _, count = text.partition("@")
    if kind not in PIPELINES:
        raise SystemExit(f"unknown pipeline {kind!r}; known: {', '.join(PIPELINES)}")
    if count and not count.isdigit():
        raise SystemExit(f"{text!r}: the number of tables after @ must be a whole number")
    return kind, int(count) if count else tables


def main(argv: list[str] | None = None) -> None:
    """Run both pipelines at every rate; write and print the figures."""
    args = parse_args(argv)
    if args.run_baseline:
        run_baseline(args.run_baseline)
        return
    runs = [pipeline_run(text, args.tables) for text in args.pipelines]
    if any(tables is not None for _, tables in runs) and args.entities:
        raise SystemExit("--tables copies every entity of the example: no --entities with it")
    if not args.baseline:
        runs = [(kind, tables) for kind, tables in runs if kind != "baseline"]
    if args.hot < 0 or not 0.0 <= args.hot_share <= 1.0:
        raise SystemExit("--hot is a number of tables (0 or more), --hot-share a share (0 to 1)")
    if args.cold_trigger and not args.hot:
        raise SystemExit("--cold-trigger needs --hot: which tables are the hot group's")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    args.workdir.mkdir(parents=True)
    served = infra.up()
    print(f"kafka {served.kafka_bootstrap_servers} · es {served.elasticsearch_url}", flush=True)
    started = time.time()
    results = [run_pipeline(kind, tables, args, served, started) for kind, tables in runs]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    document = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bench_cpu_s": usage.ru_utime + usage.ru_stime,
        "pipelines": [
            {
                **asdict(r),
                "highest_sustainable": r.highest_sustainable,
                "steps": [
                    {**asdict(s), "achieved": s.achieved, "worst_tables": s.worst_tables()}
                    for s in r.steps
                ],
            }
            for r in results
        ],
    }
    (args.workdir / "results.json").write_text(json.dumps(document, indent=1, default=str))
    table = markdown(results, args)
    (args.workdir / "results.md").write_text(table)
    (args.workdir / "plot.svg").write_text(svg(results))
    print("\n" + table)
    print(f"written: {args.workdir}/results.json, results.md, plot.svg", flush=True)
    if args.down:
        infra.down()
