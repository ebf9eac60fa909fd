"""Benchmark: the ingestor with many tables and load on a few.

N copies of the example's ``customers`` entity (each on a topic of its own, the run's
topic plus ``_t<i>``), the ingestor alone: ``cdc-ingestor --config <file>`` in its own
process group, a 1 s trigger, its metrics port polled for ``/health``, on fresh topics
and a fresh storage root. Every table is one partition (``entity=<name>``) of the one
bronze table (``cdc_shared.contracts.bronze``), written by one query per table group (all of them
in the group ``default`` here).

Every topic gets ``--prime`` records before the launch (so every table gets data in its
first batch); start is the time from the launch to ``/health`` 200, to the first bronze
commit holding rows of every table, and to the batch log lines of every primed record
(those come after the batch's auto compaction). Once the first batches are done,
``--rate`` records/s spread over the ``--hot`` first tables only (the others stay
idle): ``--warmup`` seconds not measured, then ``--seconds`` measured. After the load
the bench waits until bronze holds every record produced to the hot topics
(``--drain-timeout``), then SIGTERMs the ingestor's own process and reports its exit
code.

Measured:

- ingest delay of each record whose Kafka timestamp (producer time, ``kafka_timestamp``
  in bronze) is in the measured window: that timestamp -> the bronze commit that added
  its file. A commit's time is its ``_delta_log/<version>.json`` file's modification
  time (what Delta's history reports for a table on local disk); files added with
  ``dataChange`` false (auto compaction) are skipped, their rows came earlier. A file's
  table is its add action's ``entity`` partition value. The rows' timestamps are read
  from the added Parquet files with pyarrow, not Spark. p50 / p99.
- CPU seconds of the ingestor's process group (Python driver, JVM and their children,
  from /proc) over the measured window, per 1,000 records measured; peak RSS of the
  group over the whole run (start included).
- streaming queries: the streams ``/health`` lists (sampled in the window): one per
  table group.
- bronze commits in the window (log files whose time falls in it), by operation, those
  that added rows of the hot tables, and the files added for idle tables in the window
  (their tables got no records: none expected).

``results.json`` under ``--workdir`` has every figure. Figures, not a test: run it alone
on the machine (docs/benchmarks.md). Needs the test servers (``support.servers``),
started here if they are not running, and left running.

    .venv/bin/python tests/bench/bench_ingestor_tables.py [--tables 24] [--hot 2]
        [--rate 200] [--seconds 120] [--warmup 60] [--workdir /tmp/bench-ingestor-tables]
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml
from cdc_devkit import infra
from cdc_devkit.local_run import copied_entities, write_pipeline_config
from cdc_devkit.processes import ServiceProcess, wait_a_little
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, ensure_topics, produce
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.contracts.bronze import ENTITY

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, however this is run
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench
from e2e_bench.meter import Meter  # CPU and peak RSS per process group, from /proc
from support.servers import TEST_INFRA  # the test session's servers

MIB = 2**20


@dataclass
class Ingestor(ServiceProcess):
    """``cdc-ingestor --config <file>`` in its own process group."""

    def start(self) -> None:
        """Launch it; stderr (its JSON log) to ``log_path``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )


@dataclass
class RunResult:
    """What the run showed (seconds unless named otherwise)."""

    tables: int
    hot: int
    healthy_after_s: float | None = None
    first_commit_every_table_s: float | None = None  # the last table's first data commit
    first_commit_median_s: float | None = None
    prime_done_s: float | None = None  # every primed record's batch logged (and compacted)
    produced_load: int = 0  # records produced to the hot topics (warm-up + window)
    produce_seconds: float = 0.0
    measured_records: int = 0  # bronze rows with a Kafka timestamp in the window
    missing_records: int = 0  # produced to hot topics, not in bronze after the drain
    drained_after_s: float | None = None  # after the load ended
    delay_p50_s: float | None = None
    delay_p99_s: float | None = None
    delay_max_s: float | None = None
    cpu_s_window: float = 0.0
    cpu_s_per_1k: float | None = None
    peak_rss_mib: float = 0.0
    streams: int | None = None  # streams /health lists
    stream_names: list[str] = field(default_factory=list)
    unhealthy_samples: int = 0  # /health not 200 while sampled in the window
    commits_window: int = 0  # bronze commits in the window
    commit_operations: dict[str, int] = field(default_factory=dict)  # e.g. WRITE: 3
    hot_commits_window: int = 0  # of those, commits adding rows of hot tables
    idle_files_window: int = 0  # files added for idle tables in the window (none expected)
    batch_lines_window: int = 0  # the ingestor's "batch" log lines in the window
    batch_ms_p50: float | None = None
    exit_code: int | None = None
    errors: list[str] = field(default_factory=list)
    failure: str = ""


# --- the pipeline -------------------------------------------------------------------------


def tables_config(workdir: Path, tables: int, driver_memory: str) -> Path:
    """The example pipeline with ``tables`` copies of ``customers``, each on its own topic."""
    path = write_pipeline_config(workdir, infra.endpoints(TEST_INFRA), prefix="ingt")
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    customers = next(e for e in document["entities"] if e["name"] == "customers")
    document["entities"] = copied_entities([customers], tables)
    document["spark"]["conf"]["spark.driver.memory"] = driver_memory
    document["ingestor"]["trigger_interval"] = "1 second"  # as written, said again
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def messages(
    config: PipelineConfig, entities: list[EntityConfig], spec: WorkloadSpec, count: int | None
) -> list[Any]:
    """The generated records of ``entities`` (the first ``count`` when given)."""
    stream = WorkloadGenerator(entities, make_registry(config), spec).messages()
    return list(stream if count is None else itertools.islice(stream, count))


# --- reading bronze's log -----------------------------------------------------------------


@dataclass
class Commit:
    """One commit of bronze."""

    version: int
    at: float  # its log file's modification time (wall clock)
    files: dict[str, list[str]]  # table -> data files added with dataChange true (paths)
    operation: str  # commitInfo's: WRITE, OPTIMIZE (auto compaction), CREATE TABLE...


def epoch_seconds(column: pa.ChunkedArray) -> list[float]:
    """A Parquet timestamp column (Spark writes UTC, without a zone) as epoch seconds."""
    unit = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}[column.type.unit]
    return [v / unit for v in pc.cast(column, pa.int64()).to_pylist() if v is not None]


class BronzeLog:
    """Bronze's commits on local disk, read incrementally; row counts per data file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.commits: dict[int, Commit] = {}
        self._rows: dict[str, int] = {}

    def refresh(self) -> None:
        """Read the commits not read yet."""
        folder = self.path / "_delta_log"
        if not folder.is_dir():
            return
        for entry in folder.glob("*.json"):
            if not entry.stem.isdigit() or int(entry.stem) in self.commits:
                continue
            try:
                at = entry.stat().st_mtime
                lines = entry.read_text().splitlines()
            except OSError:
                continue
            files: dict[str, list[str]] = {}
            operation = "?"
            for line in lines:
                action = json.loads(line)
                add = action.get("add")
                if add is not None and add.get("dataChange", True):
                    table = (add.get("partitionValues") or {}).get(ENTITY, "?")
                    files.setdefault(table, []).append(unquote(add["path"]))
                operation = action.get("commitInfo", {}).get("operation", operation)
            self.commits[int(entry.stem)] = Commit(int(entry.stem), at, files, operation)

    def rows_of(self, name: str) -> int:
        """Rows in data file ``name`` (its Parquet footer)."""
        if name not in self._rows:
            self._rows[name] = pq.ParquetFile(self.path / name).metadata.num_rows
        return self._rows[name]

    def rows(self, tables: set[str]) -> int:
        """Rows of ``tables`` added by every commit read so far."""
        return sum(
            self.rows_of(f)
            for c in self.commits.values()
            for table, files in c.files.items()
            if table in tables
            for f in files
        )

    def first_data_commits(self) -> dict[str, Commit]:
        """Each table's first commit that added rows of it."""
        firsts: dict[str, Commit] = {}
        for version in sorted(self.commits):
            commit = self.commits[version]
            for table, files in commit.files.items():
                if table not in firsts and any(self.rows_of(f) for f in files):
                    firsts[table] = commit
        return firsts

    def commits_between(self, start: float, end: float) -> list[Commit]:
        """Commits whose time is in [start, end)."""
        return [c for c in self.commits.values() if start <= c.at < end]

    def delays(self, tables: set[str], start: float, end: float) -> list[float]:
        """Commit time - Kafka timestamp of each row of ``tables`` whose Kafka timestamp is
        in [start, end)."""
        out = []
        for commit in self.commits.values():
            for table, files in commit.files.items():
                if table not in tables:
                    continue
                for name in files:
                    column = pq.read_table(self.path / name, columns=["kafka_timestamp"])[0]
                    out += [commit.at - at for at in epoch_seconds(column) if start <= at < end]
        return out


# --- the ingestor ---------------------------------------------------------------------------


def health(port: int) -> tuple[int, dict[str, Any]]:
    """``/health``'s status code and report (0 and {} when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return int(answer.status), json.loads(answer.read())
    except urllib.error.HTTPError as error:  # 503 has the report too
        try:
            return int(error.code), json.loads(error.read())
        except ValueError:
            return int(error.code), {}
    except (OSError, ValueError):
        return 0, {}


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def batch_lines_between(ingestor: ServiceProcess, start: float, end: float) -> list[dict[str, Any]]:
    """The ingestor's batch log lines logged in [start, end) (wall clock)."""
    chosen = []
    for line in ingestor.batches:
        try:
            at = dt.datetime.fromisoformat(str(line["ts"]))  # ...Z: UTC
        except (KeyError, ValueError):
            continue
        if start <= at.timestamp() < end:
            chosen.append(line)
    return chosen


class IngestorRun:
    """The run: fresh topics and storage, prime, start, load, measure, stop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.result = RunResult(args.tables, args.hot)
        folder = args.workdir / "run"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        config_path = tables_config(folder, args.tables, args.driver_memory)
        self.config = load_config(config_path)
        self.entities = list(self.config.entities)
        self.hot = self.entities[: args.hot]
        self.hot_names = {e.name for e in self.hot}
        self.bronze = BronzeLog(self.config.layout.bronze())
        self.port = self.config.ingestor.metrics_port
        self.ingestor = Ingestor("ingestor", config_path, folder / "logs" / "ingestor.log")
        self.meter = Meter()
        self.launched = self.window_start = self.window_end = 0.0

    def say(self, text: str) -> None:
        """A progress line."""
        print(f"[ingestor, {self.args.tables} tables] {text}", flush=True)

    def run(self) -> RunResult:
        """Every phase; a failure is noted in the result, the ingestor always stopped."""
        args, config = self.args, self.config
        ensure_topics(config.kafka, [e.source_topic for e in self.entities])
        spec = WorkloadSpec(
            events=0, keys=args.keys, snapshot_rows=args.prime, seed=3, poison_share=0
        )
        produce(config.kafka, iter(messages(config, self.entities, spec, None)))
        total = int(args.rate * (args.warmup + args.seconds))
        spec = WorkloadSpec(
            events=total,
            keys=args.keys,
            snapshot_rows=0,
            seed=7,
            poison_share=0,
            redelivery_share=0,
        )
        load = messages(config, self.hot, spec, total)
        self.launched = time.time()
        self.ingestor.start()
        assert self.ingestor.process is not None
        self.meter.watch("ingestor", self.ingestor.process.pid)
        self.meter.start()
        self.say(f"launched pid {self.ingestor.process.pid}, {args.tables} tables")
        try:
            self.result.failure = self.wait_for_start() or self.load(load) or self.drain()
        finally:
            self.result.exit_code = self.ingestor.stop(args.stop_grace)
            self.meter.done.set()
            self.meter.join()
            self.result.peak_rss_mib = self.meter.peak_rss.get("ingestor", 0) / MIB
            self.result.errors = self.ingestor.errors[:20]
        self.say(f"stopped, exit code {self.result.exit_code}")
        if self.window_end:
            self.figures()
        return self.result

    def wait_for_start(self) -> str:
        """Until /health is 200 and every table has a commit with rows ("" or the failure)."""
        result, entities = self.result, self.entities
        firsts: dict[str, float] = {}
        deadline = time.monotonic() + self.args.start_timeout
        while result.healthy_after_s is None or len(firsts) < len(entities):
            if not self.ingestor.alive:
                return "the ingestor stopped during its start; see its log"
            if time.monotonic() > deadline:
                return (
                    f"not started in {self.args.start_timeout:.0f} s: healthy "
                    f"{result.healthy_after_s is not None}, {len(firsts)} of "
                    f"{len(entities)} tables committed"
                )
            if result.healthy_after_s is None and health(self.port)[0] == 200:
                result.healthy_after_s = time.time() - self.launched
                self.say(f"healthy after {result.healthy_after_s:.1f} s")
            self.bronze.refresh()
            for name, commit in self.bronze.first_data_commits().items():
                firsts.setdefault(name, commit.at - self.launched)
            wait_a_little([self.ingestor], 0.5)
        result.first_commit_every_table_s = max(firsts.values())
        result.first_commit_median_s = statistics.median(firsts.values())
        self.say(f"every table's first commit after {result.first_commit_every_table_s:.1f} s")
        return self.wait_for_prime(deadline)

    def wait_for_prime(self, deadline: float) -> str:
        """Until the batches of every primed record are logged ("" or the failure).

        A batch's log line comes after its commits and the auto compaction that follows
        them: the load starts on a quiet ingestor, and that compaction stays out of the
        measured window.
        """
        primed = self.args.prime * len(self.entities)
        while sum(int(b.get("input_rows") or 0) for b in self.ingestor.batches) < primed:
            if not self.ingestor.alive:
                return "the ingestor stopped during its first batches; see its log"
            if time.monotonic() > deadline:
                return f"the first batches not logged in {self.args.start_timeout:.0f} s"
            wait_a_little([self.ingestor], 0.5)
        self.result.prime_done_s = time.time() - self.launched
        self.say(f"first batches done after {self.result.prime_done_s:.1f} s")
        return ""

    def load(self, load: list[Any]) -> str:
        """The load on the hot tables: warm-up, then the measured window ("" or the failure)."""
        args, result = self.args, self.result
        report: dict[str, Any] = {}

        def producing() -> None:
            report["started"] = time.time()
            report["done"] = produce(self.config.kafka, iter(load), rate=args.rate)

        producer = threading.Thread(target=producing, daemon=True)
        producer.start()
        while "started" not in report:
            time.sleep(0.05)
        self.window_start = report["started"] + args.warmup
        self.window_end = self.window_start + args.seconds
        self.say(f"load {args.rate:.0f}/s on {args.hot} tables")
        wait_a_little([self.ingestor], max(0.0, self.window_start - time.time()))
        cpu_start = self.meter.cpu_seconds()["ingestor"]
        while time.time() < self.window_end:
            if not self.ingestor.alive:
                return "the ingestor stopped during the load; see its log"
            status, answer = health(self.port)
            result.unhealthy_samples += int(status != 200)
            if result.streams is None and "streams" in answer:
                result.stream_names = sorted(answer["streams"])
                result.streams = len(result.stream_names)
            wait_a_little([self.ingestor], min(5.0, max(0.0, self.window_end - time.time())))
        result.cpu_s_window = self.meter.cpu_seconds()["ingestor"] - cpu_start
        producer.join()
        done = report.get("done")
        if done is None:
            return "the producer failed"
        result.produced_load, result.produce_seconds = done.produced, done.seconds
        self.say("measured window over; waiting for bronze to hold every record")
        return ""

    def drain(self) -> str:
        """Until bronze holds every record of the hot topics ("" or the failure)."""
        result = self.result
        expected = self.args.prime * len(self.hot) + result.produced_load
        load_end = time.time()
        deadline = time.monotonic() + self.args.drain_timeout
        held = 0
        while time.monotonic() < deadline and self.ingestor.alive:
            self.bronze.refresh()
            held = self.bronze.rows(self.hot_names)
            if held >= expected:
                result.drained_after_s = time.time() - load_end
                return ""
            wait_a_little([self.ingestor], 1.0)
        result.missing_records = max(0, expected - held)
        return f"{result.missing_records} records not in bronze after the drain"

    def figures(self) -> None:
        """Delays, commits and CPU per 1,000 events, from bronze's log and the batch log."""
        result, start, end = self.result, self.window_start, self.window_end
        self.bronze.refresh()
        commits = self.bronze.commits_between(start, end)
        result.commits_window = len(commits)
        for commit in commits:
            operations = result.commit_operations
            operations[commit.operation] = operations.get(commit.operation, 0) + 1
        result.hot_commits_window = sum(
            1 for c in commits if any(t in self.hot_names and f for t, f in c.files.items())
        )
        result.idle_files_window = sum(
            len(files) for c in commits for t, files in c.files.items() if t not in self.hot_names
        )
        delays = self.bronze.delays(self.hot_names, start, end)
        result.measured_records = len(delays)
        result.delay_p50_s = percentile(delays, 0.50)
        result.delay_p99_s = percentile(delays, 0.99)
        result.delay_max_s = max(delays, default=None)
        if result.measured_records:
            result.cpu_s_per_1k = result.cpu_s_window / (result.measured_records / 1000)
        lines = batch_lines_between(self.ingestor, start, end)
        result.batch_lines_window = len(lines)
        durations = [float(b["duration_ms"]) for b in lines if b.get("duration_ms") is not None]
        result.batch_ms_p50 = statistics.median(durations) if durations else None


# --- the report -----------------------------------------------------------------------------


ROWS: list[tuple[str, str, str]] = [  # label, RunResult field, format
    ("healthy after (s)", "healthy_after_s", "{:.1f}"),
    ("every table's 1st commit (s)", "first_commit_every_table_s", "{:.1f}"),
    ("median table's 1st commit (s)", "first_commit_median_s", "{:.1f}"),
    ("first batches done (s)", "prime_done_s", "{:.1f}"),
    ("ingest delay p50 (s)", "delay_p50_s", "{:.2f}"),
    ("ingest delay p99 (s)", "delay_p99_s", "{:.2f}"),
    ("CPU s / 1,000 events", "cpu_s_per_1k", "{:.2f}"),
    ("CPU s in window", "cpu_s_window", "{:.1f}"),
    ("peak RSS (MiB)", "peak_rss_mib", "{:,.0f}"),
    ("streaming queries", "streams", "{}"),
    ("bronze commits in window", "commits_window", "{}"),
    ("  adding rows of hot tables", "hot_commits_window", "{}"),
    ("files added for idle tables in window", "idle_files_window", "{}"),
    ("records measured", "measured_records", "{:,}"),
    ("records missing after drain", "missing_records", "{:,}"),
    ("batch log lines in window", "batch_lines_window", "{}"),
    ("batch duration p50 (ms)", "batch_ms_p50", "{:,.0f}"),
    ("/health not 200 in window", "unhealthy_samples", "{}"),
    ("exit code", "exit_code", "{}"),
]


def cell(value: Any, form: str) -> str:
    """A figure as the table shows it ("-" when missing)."""
    return "-" if value is None else form.format(value)


def print_table(result: RunResult, args: argparse.Namespace) -> None:
    """The figures, one per line."""
    print(
        f"\n{args.tables} tables, {args.hot} hot at {args.rate:.0f} events/s, "
        f"{args.warmup:.0f} s warm-up + {args.seconds:.0f} s measured, ingestor alone\n"
    )
    print("| | ingestor |")
    print("|---|---|")
    for label, name, form in ROWS:
        print(f"| {label} | {cell(getattr(result, name), form)} |")
    if result.failure:
        print(f"\nFAILED: {result.failure}")
    if result.errors:
        print(f"\nerror log lines: {result.errors[:5]}")
    more = " ..." if len(result.stream_names) > 6 else ""
    print(f"streams {result.stream_names[:6]}{more}")
    if result.commit_operations:
        print(f"bronze commits in the window by operation: {result.commit_operations}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--tables", type=int, default=24)
    parser.add_argument("--hot", type=int, default=2, help="the first N tables get the load")
    parser.add_argument("--rate", type=float, default=200.0, help="events/s over the hot tables")
    parser.add_argument("--seconds", type=float, default=120.0, help="measured load")
    parser.add_argument("--warmup", type=float, default=60.0, help="load before the window")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-ingestor-tables"))
    parser.add_argument("--prime", type=int, default=5, help="records per topic before start")
    parser.add_argument("--keys", type=int, default=2_000, help="key space per hot table")
    parser.add_argument("--driver-memory", default="1g")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--stop-grace", type=float, default=120.0)
    args = parser.parse_args()
    if not 0 < args.hot <= args.tables:
        parser.error("0 < --hot <= --tables")
    infra.up(TEST_INFRA)  # idempotent: the servers of a test session already running
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = IngestorRun(args).run()
    print_table(result, args)
    out = args.workdir / "results.json"
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out.write_text(json.dumps({"settings": settings, "result": asdict(result)}, indent=2))
    print(f"\nresults: {out}")
    sys.exit(0 if not result.failure and result.exit_code == 0 else 1)


if __name__ == "__main__":
    main()
