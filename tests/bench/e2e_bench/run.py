"""One pipeline from start to stop: configuration, processes, watchers, load, rate steps."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml
from cdc_devkit import infra
from cdc_devkit.local_run import Progress, wait_until_healthy, write_pipeline_config
from cdc_devkit.processes import SERVICES, RunMode, ServiceProcess, launch, wait_a_little
from cdc_devkit.workload import WorkloadSpec, ensure_topics
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.contracts import layout

from .baseline import BaselineProcess
from .load import Load
from .measure import PipelineResult, StepResult, measure_delays
from .meter import Meter
from .probes import Key, Mark, Seq, probe_keys, probe_numbers
from .watch import IndexWatcher, TopicWatcher, pending

STAGES = ("silver", "topic", "index")
#: The pipelines the bench can run: ours as four processes, ours as one application.
CDC_MODES = {"cdc": RunMode.SERVICES, "cdc-app": RunMode.APPLICATION}
PIPELINES = ("cdc", "cdc-app", "baseline")
#: Our services without publisher-es (``--no-index``), like the baseline's queries.
UNINDEXED = tuple(s for s in SERVICES if s != layout.display_name(layout.PUBLISHER_ES))
#: The meter's name for the pipeline's own processes together (their RSS at one time).
PIPELINE_RSS = "pipeline (together)"


def _wait_for_group_coordinator(config: PipelineConfig, timeout_s: float = 120.0) -> None:
    """Wait until the broker answers offset requests (a fresh broker first says NOT_COORDINATOR).

    publisher-kafka reads its progress with such a request at start-up and exits on that
    error, so on a just-started broker the bench waits for the coordinator first.
    """
    from confluent_kafka import KafkaException, TopicPartition

    consumer = make_consumer(config.kafka, f"bench-e2e-{uuid.uuid4().hex[:8]}")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                consumer.committed([TopicPartition(config.entities[0].source_topic, 0)], 10)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
    finally:
        consumer.close()


def _configure(
    workdir: Path,
    served: infra.Endpoints,
    prefix: str,
    port_base: int,
    entities: list[str] | None = None,
    tables: int | None = None,
    history: bool = True,
    hot_group: tuple[int, str] | None = None,
    spark_conf: dict[str, str] | None = None,
) -> Path:
    """The example pipeline file, metrics ports from ``port_base``, only ``entities``.

    ``tables`` as ``write_pipeline_config`` takes it; ``history`` False: no entity keeps
    SCD type 2 history; ``hot_group`` (K, interval): the first K tables in a group
    ``hot``, the others in a group ``cold`` triggered every interval; ``spark_conf``:
    Spark settings over the file's (``spark.conf``).
    """
    path = write_pipeline_config(workdir, served, prefix=prefix, tables=tables)
    document = yaml.safe_load(path.read_text())
    if entities:
        document["entities"] = [e for e in document["entities"] if e["name"] in entities]
        missing = set(entities) - {e["name"] for e in document["entities"]}
        if missing:
            raise SystemExit(f"--entities: no such entity in the example pipeline: {missing}")
    if not history:
        for entity in document["entities"]:
            entity.pop("history", None)
    document["spark"].setdefault("conf", {}).update(spark_conf or {})
    if hot_group:
        hot, interval = hot_group
        document["groups"] = [
            {"name": "hot", "tables": [e["name"] for e in document["entities"][:hot]]},
            {"name": "cold", "tables": ["*"], "trigger_interval": interval},
        ]
    for offset, section in enumerate((*layout.SERVICES, "application")):
        document[section]["metrics_port"] = port_base + offset
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


class PipelineRun:
    """One pipeline (``cdc`` or ``baseline``) from start to stop, one rate step at a time."""

    def __init__(
        self,
        kind: str,
        tables: int | None,
        args: argparse.Namespace,
        served: infra.Endpoints,
        started: float,
    ) -> None:
        self.args, self.started = args, started
        self.is_cdc = kind in CDC_MODES
        # Named with its tables when the run's pipelines differ in them (``KIND@N``).
        self.kind = kind if tables == args.tables else f"{kind}@{tables or 'example'}"
        self.workdir = args.workdir / self.kind
        self.workdir.mkdir(parents=True)
        prefix = {"cdc": "e2e", "cdc-app": "app"}.get(kind, "base")
        self.config_path = _configure(
            self.workdir,
            served,
            prefix,
            args.port_base,
            args.entities,
            tables,
            args.history,
            (args.hot, args.cold_trigger) if self.is_cdc and args.cold_trigger else None,
            dict(args.spark_conf) if self.is_cdc else None,
        )
        self.config = load_config(self.config_path)
        indexed = self.is_cdc and args.index
        self.result = PipelineResult(self.kind, list(STAGES) if indexed else ["silver", "topic"])
        numbers = probe_numbers(
            args.keys, args.probe_share, WorkloadSpec().hot_keys, args.producers
        )
        self.probes = probe_keys(self.config, numbers)
        logs = self.workdir / "logs"
        self.services: list[ServiceProcess] = (
            launch(CDC_MODES[kind], self.config_path, logs, () if indexed else UNINDEXED)
            if self.is_cdc
            else [BaselineProcess("baseline", self.config_path, logs / "baseline.log")]
        )
        self.result.processes = [s.name for s in self.services]
        self.meter = Meter()
        self.progress = Progress(
            self.services, lambda line: print(f"  {self.kind}: {line}", flush=True)
        )
        self.topic = TopicWatcher(self.config, self.probes, headers=not self.is_cdc)
        self.index = IndexWatcher(self.config, self.probes) if indexed else None
        self.load: Load | None = None
        self.launched_at = 0.0  # wall clock, as the watchers note times
        self.expected: dict[tuple[str, Key], tuple[Seq, str]] = {}
        self.produced_at: dict[Mark, tuple[float, int]] = {}  # first time, step (-1: warm-up)

    def start(self) -> None:
        """Topics, producers, the snapshot, watchers, then the processes; returns when all
        are ready.

        Every table holds its snapshot in its source topic before the pipeline is launched
        (produced unthrottled, the warm-up's load), so the launch is a first start on
        tables that each hold a snapshot: ``warm_up`` times it. The change topics are made
        beforehand, as publisher-kafka makes them, so the topic watcher reads each from
        its first event.
        """
        topics = [e.source_topic for e in self.config.entities]
        ensure_topics(self.config.kafka, topics)
        changes = [e.change_topic_name for e in self.config.entities]
        ensure_topics(self.config.kafka, changes, self.config.publisher_kafka.topic_partitions)
        _wait_for_group_coordinator(self.config)
        self.meter.watch("bench (this process)", os.getpid(), group=False)
        for name in ("kafka", "elasticsearch"):
            pid_file = infra.InfraSettings().state_dir / f"{name}.pid"
            if pid_file.exists():
                self.meter.watch(name, int(pid_file.read_text().strip()))
        self.load = Load(self.config_path, self.args, self.probes)
        for shard, pid in self.load.pids().items():
            self.meter.watch(shard, pid, group=False)
        print(f"{self.kind}: the snapshot to every table's topic, unthrottled", flush=True)
        produced, took, marks = self.load.run(None, None)
        self._note(marks, -1)
        print(f"{self.kind}: {produced:,} snapshot messages in {took:.0f} s", flush=True)
        self.topic.start()
        if not self.topic.assigned.wait(120):
            raise RuntimeError("the topic watcher got no partitions of the change topics")
        if self.index is not None:
            self.index.start()
        print(f"{self.kind}: starting; logs in {self.workdir / 'logs'}", flush=True)
        self.launched_at = time.time()
        launched = time.monotonic()
        for service in self.services:
            service.start()
            assert service.process is not None
            self.meter.watch(service.name, service.process.pid)
        self.meter.together(PIPELINE_RSS, [s.name for s in self.services])
        self.meter.start()
        self.progress.start()
        if isinstance(self.services[0], BaselineProcess):
            baseline = self.services[0]
            deadline = time.monotonic() + self.args.start_timeout
            while not baseline.ready():
                if not baseline.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"the baseline did not start; see {baseline.log_path}")
                wait_a_little(self.services, 2)
        else:
            wait_until_healthy(self.services, self.config, self.args.start_timeout)
        self.result.start_s = time.monotonic() - launched
        print(f"{self.kind}: ready after {self.result.start_s:.1f} s", flush=True)

    def _note(self, marks: list[tuple[str, Key, Seq, str, float]], step: int) -> None:
        for entity, key, seq, op, at in marks:
            if (entity, key) not in self.expected or self.expected[(entity, key)][0] < seq:
                self.expected[(entity, key)] = (seq, op)
            if op != "d":
                self.produced_at.setdefault((entity, key, seq), (at, step))

    def _wait(self, done: Callable[[], bool], timeout: float) -> tuple[bool, float]:
        """Wait until ``done()`` while every service runs; (done, seconds)."""
        begun = time.monotonic()
        while time.monotonic() - begun < timeout:
            if not all(s.alive for s in self.services):
                raise RuntimeError("a service stopped; see its log")
            if done():
                return True, time.monotonic() - begun
            wait_a_little(self.services, 1)
        return False, time.monotonic() - begun

    def _drain(self, timeout: float) -> tuple[bool, float]:
        """Wait until every probe key's last change is in every output; (done, seconds)."""
        return self._wait(
            lambda: not pending(self.config, self.expected, self.topic, self.index), timeout
        )

    def warm_up(self) -> None:
        """Until the snapshot is everywhere (not measured as delays): the first start.

        ``first_start_s``: from the launch until every table's first change event was
        readable; ``snapshot_s``: until every table's whole snapshot was in its change
        topic (and the probes' last changes in every output).
        """
        assert self.load is not None
        rows, counts = self.load.snapshot_rows, self.topic.events_by_entity
        entities = [e.name for e in self.config.entities]
        timeout = self.args.drain_timeout * 2
        # The probes alone do not tell: a small snapshot holds no probe key of most
        # tables. Each snapshot row is one event on its table's change topic.
        drained, took = self._wait(
            lambda: (
                not pending(self.config, self.expected, self.topic, self.index)
                and all(counts[name] >= rows for name in entities)
            ),
            timeout,
        )
        firsts = [self.topic.first_at[name] for name in entities if name in self.topic.first_at]
        if rows and len(firsts) == len(entities):
            self.result.first_start_s = max(firsts) - self.launched_at
        elif rows:
            self.result.notes.append(
                f"first start: {len(entities) - len(firsts)} of {len(entities)} tables had "
                "no change event by the end of the warm-up"
            )
        else:
            self.result.notes.append("first start: no snapshot (--snapshot-rows 0), not timed")
        if drained:
            self.result.snapshot_s = time.time() - self.launched_at
        first = self.result.first_start_s
        print(
            f"{self.kind}: every table's first change event after "
            f"{'-' if first is None else f'{first:.1f} s'}; snapshot everywhere: "
            f"drained={drained} in {took:.0f} s",
            flush=True,
        )

    def step(self, number: int, rate: float) -> StepResult:
        """Offer ``rate`` for the step's length, then wait for the pipeline to drain."""
        assert self.load is not None
        step = StepResult(rate, self.args.seconds_per_rate)
        cpu_before = self.meter.cpu_seconds()
        begun = time.time()
        print(f"{self.kind}: {rate:,.0f} events/s for {step.seconds:.0f} s", flush=True)
        step.produced, step.produce_seconds, marks = self.load.run(int(rate * step.seconds), rate)
        ended = time.time()
        self._note(marks, number)
        step.drained, step.drain_seconds = self._drain(self.args.drain_timeout)
        cpu_after = self.meter.cpu_seconds()
        step.cpu_s = {n: cpu_after[n] - cpu_before.get(n, 0.0) for n in cpu_after}
        self.result.steps.append(step)
        self.result.step_bounds.append((begun - self.started, ended - self.started))
        print(
            f"{self.kind}: {rate:,.0f}/s offered, {step.achieved:,.0f}/s produced; "
            f"drained={step.drained} after {step.drain_seconds:.0f} s",
            flush=True,
        )
        return step

    def stop(self) -> None:
        """Stop watchers, producers and processes (SIGTERM: the batch in flight finishes)."""
        self.topic.done.set()
        if self.index is not None:
            self.index.done.set()
        if self.load is not None:
            self.load.stop()
        self.progress.done.set()
        for service in self.services:
            code = service.stop()
            if code not in (0, None):
                self.result.notes.append(f"{service.name} exited {code}")
        self.meter.done.set()
        if self.index is not None:  # a node holds 1,000 shards: 100-table runs fill it
            with make_elasticsearch(self.config.elasticsearch) as es:
                indexes = [f"{e.es_index_name}-*" for e in self.config.entities]
                es.indices.delete(index=",".join(indexes), ignore_unavailable=True)

    def measure(self) -> PipelineResult:
        """Lag series from the logs, peak RSS, and the delays (``measure_delays``)."""
        for service in self.services:
            service.poll()
            for batch in service.batches:
                if batch.get("lag") is None:
                    continue
                at = dt.datetime.fromisoformat(str(batch["ts"]).replace("Z", "+00:00"))
                name = f"{batch.get('service') or service.name}/{batch.get('entity')}"
                self.result.lags.setdefault(name, []).append(
                    (at.timestamp() - self.started, float(batch["lag"]))
                )
        self.result.peak_rss_mib = {n: v / 2**20 for n, v in self.meter.peak_rss.items()}
        self.result.peak_pipeline_rss_mib = self.meter.peak_sum_rss.get(PIPELINE_RSS, 0) / 2**20
        spec = WorkloadSpec(hot_tables=self.args.hot)  # the producers' split
        hot = {e.name for e in spec.hot_of(self.config.entities)}
        measure_delays(
            self.config,
            self.result,
            self.produced_at,
            self.topic,
            self.index,
            self.started,
            hot,
            baseline=not self.is_cdc,
        )
        return self.result


def run_pipeline(
    kind: str,
    tables: int | None,
    args: argparse.Namespace,
    served: infra.Endpoints,
    started: float,
) -> PipelineResult:
    """Start ``kind`` (cdc or baseline) on ``tables``, offer every rate, stop, measure."""
    run = PipelineRun(kind, tables, args, served, started)
    try:
        run.start()
        run.warm_up()
        for number, rate in enumerate(args.rates):
            if not run.step(number, rate).drained:
                run.result.notes.append(
                    f"{rate:,.0f}/s did not drain in {args.drain_timeout:.0f} s: "
                    "higher rates not run"
                )
                break
    finally:
        run.stop()
    return run.measure()
