"""``cdc chaos``: the whole pipeline under faults, then every output checked.

Like ``cdc demo``, the four services run as separate processes on a generated load
(duplicates, out-of-order re-deliveries, deletes, re-inserts, a schema change, poison
records). Meanwhile a fault injector works through a seeded, shuffled plan: it SIGKILLs a
service and restarts it (half the kills aimed at a dangerous window: right after a Delta
commit, before the checkpoint; right after a Kafka transaction commit; while a bulk
request is being applied), restarts the Kafka broker, stops Elasticsearch for a while,
and slows it down (the server frozen in bursts). Asked for registry outages, the pipeline
reads its schemas from the real registry through a loopback proxy, which answers HTTP 503
for a while as a service restarts into it (a running service has its schemas cached, a
starting one must ask). Given several modes, the run switches deployment at equal
shares of the kills (services, application, services: after a third and two thirds):
it SIGKILLs every process of one mode at once and goes on in the next on the same
storage root. When load and faults are over
and the pipeline caught up, it checks bronze + quarantine against the source topics' offsets,
silver / change topics / indexes against the oracle, the change topics for duplicates,
the quarantine for each poison record (and nothing else: a valid record quarantined,
e.g. as unknown_schema for a registry that could not answer, is a divergence), and every
log for the planted secrets.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from cdc_cli.verify import silver_hashes
from cdc_shared.avro import ConfluentSchemaRegistry, subject_name
from cdc_shared.clients.connect import make_consumer, make_elasticsearch
from cdc_shared.clients.schemas import entity_schemas, make_registry
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import publisher_progress_group
from cdc_shared.jvm.spark import build_spark_session
from cdc_shared.streaming.tables import has_commits
from confluent_kafka import KafkaException, TopicPartition
from pyspark.sql import SparkSession

from cdc_devkit import infra
from cdc_devkit.checks import (
    Difference,
    PoisonCheck,
    SourceCoverage,
    change_topic_state,
    quarantined_poison,
    source_coverage,
)
from cdc_devkit.local_run import (
    ROOT,
    Echo,
    Progress,
    check_outputs,
    health_port,
    oracle_rows,
    unwind_on_sigterm,
    wait_until_healthy,
    write_pipeline_config,
)
from cdc_devkit.oracle import EntityOracle, Key, load_fingerprints, read_topic
from cdc_devkit.processes import (
    APPLICATION,
    SERVICES,
    RunMode,
    ServiceProcess,
    launch,
    stop_all,
    wait_a_little,
)
from cdc_devkit.registry_proxy import RegistryProxy, registry_proxy
from cdc_devkit.workload import (
    GeneratedMessage,
    ProduceReport,
    WorkloadGenerator,
    WorkloadSpec,
    ensure_topics,
    produce,
)

Fault = Literal["kill", "broker restart", "es outage", "es slowdown", "registry outage"]

#: The window each service's aimed kills wait for.
WINDOWS = {
    "ingestor": "after a bronze commit",
    "merger": "after a silver commit",
    "publisher-kafka": "after a Kafka transaction commit",
    "publisher-es": "while documents are being indexed",
}
#: The services that ask the registry as they start (their entities' schemas; the Kafka
#: publisher registers its change schemas too): a registry outage restarts one of them.
#: The merger reads bronze's columns, not Avro.
REGISTRY_READERS = ("ingestor", "publisher-kafka", "publisher-es")


@dataclass(frozen=True)
class ChaosOptions:
    """How much load, how many faults of each kind, and how far apart."""

    events: int = 200_000
    rate: float = 500.0  # messages per second offered to Kafka
    keys: int = 5_000
    seed: int = 42
    kills: int = 50
    broker_restarts: int = 3
    es_outages: int = 3
    es_slowdowns: int = 3
    # Above 0, the pipeline reads its schemas from the real registry, through a proxy.
    registry_outages: int = 0
    pause_s: float = 10.0  # mean pause between two faults
    outage_s: float = 20.0  # how long Elasticsearch (or the registry) stays down or slowed
    window_timeout_s: float = 60.0  # an aimed kill fires anyway after this long
    workdir: Path = Path("data/chaos")
    catch_up_timeout_s: float = 1800.0
    # The deployments in turn (application: a kill takes every service down); the run
    # switches from one to the next at equal shares of the kills (``switch_points``).
    modes: tuple[RunMode, ...] = (RunMode.SERVICES,)
    # None: the example's tables; else that many copies of them (a whole database).
    tables: int | None = None


@dataclass
class FaultRecord:
    """What the injector did."""

    kills: Counter[str] = field(default_factory=Counter)  # "<service> <how>" -> count
    switches: list[str] = field(default_factory=list)  # "<mode> -> <mode>", as done
    broker_restarts: int = 0
    es_outages: int = 0
    es_slowdowns: int = 0
    registry_outages: int = 0
    registry_refused: int = 0  # requests answered 503 during the outages
    problems: list[str] = field(default_factory=list)  # faults that could not be injected

    def kills_of(self, service: str) -> int:
        """All kills of one service, aimed or not."""
        return sum(n for what, n in self.kills.items() if what.startswith(f"{service} "))

    @property
    def killed(self) -> list[str]:
        """The processes killed at least once, in the order of ``processes.SERVICES``."""
        names = [*SERVICES, APPLICATION]
        return [name for name in names if self.kills_of(name)]


@dataclass
class ChaosResult:
    """What the run saw; ``divergences`` must be 0."""

    produced: ProduceReport = field(default_factory=ProduceReport)
    faults: FaultRecord = field(default_factory=FaultRecord)
    outputs: list[Difference] = field(default_factory=list)
    coverage: list[SourceCoverage] = field(default_factory=list)
    poison: PoisonCheck | None = None
    topic_duplicates: dict[str, int] = field(default_factory=dict)
    leaked_secrets: list[str] = field(default_factory=list)  # log files with a secret
    silver_hash: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def divergences(self) -> int:
        """Every key, offset, record or log line that is not as it must be."""
        outputs = sum(len(d.missing) + len(d.extra) + len(d.different) for d in self.outputs)
        coverage = sum(len(c.missing) + len(c.duplicated) + len(c.unknown) for c in self.coverage)
        poison = 0
        if self.poison is not None:
            p = self.poison
            poison = len(p.missing) + len(p.wrong_kind) + len(p.duplicated) + len(p.unexpected)
        duplicates = sum(self.topic_duplicates.values())
        return outputs + coverage + poison + duplicates + len(self.leaked_secrets)

    @property
    def passed(self) -> bool:
        """Nothing diverged, everything was checked, and every service stopped cleanly."""
        return (
            self.divergences == 0
            and bool(self.outputs)
            and self.poison is not None
            and all(code == 0 for code in self.exit_codes.values())
        )


def plan_faults(options: ChaosOptions, rng: random.Random) -> list[Fault]:
    """The faults in a seeded random order."""
    counts: dict[Fault, int] = {
        "kill": options.kills,
        "broker restart": options.broker_restarts,
        "es outage": options.es_outages,
        "es slowdown": options.es_slowdowns,
        "registry outage": options.registry_outages,
    }
    plan = [fault for fault, n in counts.items() for _ in range(n)]
    rng.shuffle(plan)
    return plan


def switch_points(plan: list[Fault], modes: int) -> list[int]:
    """Where the run changes deployment: before these plan positions (1-based).

    Each mode gets an equal share of the kills (the first ones the remainder), so every
    deployment is killed, whatever the shuffle did with the other faults.
    """
    kill_positions = [number for number, fault in enumerate(plan, 1) if fault == "kill"]
    points, share = [], len(kill_positions) / modes
    for mode in range(1, modes):
        index = math.ceil(share * mode)
        points.append(kill_positions[index] if index < len(kill_positions) else len(plan) + 1)
    return points


class WindowWatch:
    """Waits for the moment a service enters its dangerous window."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config

    def wait(self, service: str, entity_name: str, timeout_s: float) -> bool:
        """Block until ``service`` just committed (or is indexing) for the entity.

        The ingestor's window is a commit of the one bronze table (each of its batches
        commits every entity it read at once); the others' are the entity's own target.
        """
        entity = self.config.entity(entity_name)
        layout = self.config.layout
        if service in ("ingestor", "merger"):
            table = layout.bronze() if service == "ingestor" else layout.silver(entity.name)
            log = Path(table) / "_delta_log"
            return _changes(lambda: _latest_commit(log), timeout_s, every_s=0.005)
        if service == "publisher-kafka":
            return self._wait_for_transaction(entity.change_topic_name, timeout_s)
        return self._wait_for_indexing(entity.es_index_name, timeout_s)

    def _wait_for_transaction(self, topic: str, timeout_s: float) -> bool:
        progress = TopicPartition(self.config.publisher_kafka.progress_topic, 0)
        consumer = make_consumer(
            self.config.kafka,
            publisher_progress_group(topic),
            **{"isolation.level": "read_committed"},
        )

        def committed() -> int | None:
            try:
                return int(consumer.committed([progress], timeout=5)[0].offset)
            except KafkaException:
                return None

        try:
            return _changes(committed, timeout_s, every_s=0.005)
        finally:
            consumer.close()

    def _wait_for_indexing(self, alias: str, timeout_s: float) -> bool:
        client = make_elasticsearch(self.config.elasticsearch)

        def operations() -> int | None:
            try:
                stats = client.indices.stats(index=alias, metric="indexing")
                indexing = stats["_all"]["primaries"]["indexing"]
                return int(indexing["index_total"]) + int(indexing["delete_total"])
            except Exception:  # not created yet, or Elasticsearch away
                return None

        try:
            return _changes(operations, timeout_s, every_s=0.02)
        finally:
            client.close()


def _latest_commit(log: Path) -> int | None:
    try:
        versions = [int(p.name[:20]) for p in os.scandir(log) if p.name.endswith(".json")]
    except OSError:
        return None
    return max(versions, default=None)


def _changes(read: Callable[[], int | None], timeout_s: float, every_s: float) -> bool:
    """Whether ``read()`` moved on from its first known value within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    first = read()
    while time.monotonic() < deadline:
        time.sleep(every_s)
        now = read()
        if first is None:
            first = now
        elif now is not None and now != first:
            return True
    return False


#: How long a switch of deployment waits for the new processes to serve /health.
SWITCH_HEALTH_TIMEOUT_S = 300.0


class Deployment:
    """The processes the run has up now, in one mode; a switch replaces them all.

    ``processes`` is one list, changed in place, so whoever holds it (the progress
    display) follows a switch. Processes a switch killed stay in ``retired``, for
    their peak memory.
    """

    def __init__(self, mode: RunMode, config_path: Path, logs: Path) -> None:
        self.config_path, self.logs = config_path, logs
        self.mode = mode
        self.processes: list[ServiceProcess] = []
        self.retired: list[ServiceProcess] = []
        self._launch(mode)

    def _launch(self, mode: RunMode) -> None:
        self.mode = mode
        self.processes[:] = launch(mode, self.config_path, self.logs / str(mode))
        for service in self.processes:
            service.start()

    def process_of(self, service: str) -> ServiceProcess:
        """The process running ``service``: its own, or the application."""
        by_name = {p.name: p for p in self.processes}
        return by_name.get(service) or by_name[APPLICATION]

    def switch(self, mode: RunMode) -> None:
        """SIGKILL every process at once (a lost machine), then start ``mode``'s."""
        for service in self.processes:
            if service.process is not None and service.process.poll() is None:
                os.killpg(service.process.pid, signal.SIGKILL)
        for service in self.processes:
            if service.process is not None:
                service.process.wait(60)
            service.poll()
        self.retired.extend(self.processes)
        self._launch(mode)

    def peak_rss(self) -> dict[str, int]:
        """Each process name's highest resident memory, over every mode it ran in."""
        peaks: dict[str, int] = {}
        for service in [*self.retired, *self.processes]:
            peaks[service.name] = max(peaks.get(service.name, 0), service.peak_rss)
        return peaks


class FaultInjector(threading.Thread):
    """Works through the fault plan while the load runs; see the module docstring."""

    def __init__(
        self,
        plan: list[Fault],
        deployment: Deployment,
        config: PipelineConfig,
        options: ChaosOptions,
        echo: Echo,
        registry: RegistryProxy | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.plan, self.deployment, self.config = plan, deployment, config
        self.registry = registry  # the proxy the pipeline reaches the registry through
        self.options, self.echo = options, echo
        self.switches = dict(
            zip(switch_points(plan, len(options.modes)), options.modes[1:], strict=True)
        )
        self.rng = random.Random(options.seed + 1)
        self.settings = infra.InfraSettings()
        self.windows = WindowWatch(config)
        self.record = FaultRecord()
        self.stopping = threading.Event()
        self.done = 0  # faults injected (or given up on) so far
        self.current = 0  # the fault being injected
        self.armed = 0  # the last fault armed: waiting for its moment, or under way

    def run(self) -> None:
        """Inject every planned fault, with random pauses between them."""
        for number, fault in enumerate(self.plan, 1):
            pause = self.rng.uniform(0.5, 1.5) * self.options.pause_s
            if self.stopping.wait(pause):
                return
            if number in self.switches:
                self._switch_or_record(self.switches.pop(number))
            self.echo(f"fault {number}/{len(self.plan)}: {fault}")
            self.current = number
            if fault != "kill":  # a kill is armed once its service is up again
                self.armed = number
            try:
                self._inject(fault)
            except Exception as exc:
                self.record.problems.append(f"{fault}: {type(exc).__name__}: {exc}")
                self.echo(f"fault {number} could not be injected: {exc}")
            self.done = number
        for mode in self.switches.values():  # a plan with too few kills to reach them
            self._switch_or_record(mode)

    def _switch_or_record(self, mode: RunMode) -> None:
        """:meth:`_switch`; one that fails is a problem of the run, not the injector's end."""
        try:
            self._switch(mode)
        except Exception as exc:
            self.record.problems.append(f"switch to {mode}: {type(exc).__name__}: {exc}")
            self.echo(f"the switch to {mode} failed: {exc}")

    def _switch(self, mode: RunMode) -> None:
        """SIGKILL every process of the deployment at once; go on as ``mode``."""
        before = self.deployment.mode
        self.echo(f"switching from {before} to {mode}: every process killed at once")
        self.deployment.switch(mode)
        self.record.switches.append(f"{before} -> {mode}")
        for service in self.deployment.processes:  # the next fault needs them up
            port = health_port(self.config, service.name)
            deadline = time.monotonic() + SWITCH_HEALTH_TIMEOUT_S
            while not service.healthy(port) and time.monotonic() < deadline:
                time.sleep(1.0)

    def _inject(self, fault: Fault) -> None:
        if fault == "kill":
            self._kill(self.rng.choice(SERVICES))
        elif fault == "broker restart":
            infra.stop(self.settings, "kafka")
            time.sleep(self.rng.uniform(2.0, 8.0))
            infra.start_kafka(self.settings)
            self.record.broker_restarts += 1
        elif fault == "es outage":
            infra.stop(self.settings, "elasticsearch")
            time.sleep(self.options.outage_s)
            infra.start_elasticsearch(self.settings)
            self.record.es_outages += 1
        elif fault == "es slowdown":
            self._slow_down_elasticsearch(self.options.outage_s)
            self.record.es_slowdowns += 1
        else:
            self._registry_outage(self.rng.choice(REGISTRY_READERS))

    def _wait_until_up(self, service: ServiceProcess) -> None:
        """Give a (re)starting service up to the window timeout to serve /health."""
        deadline = time.monotonic() + self.options.window_timeout_s
        port = health_port(self.config, service.name)
        while not service.healthy(port) and time.monotonic() < deadline:
            time.sleep(1.0)

    def _kill(self, name: str) -> None:
        """SIGKILL the process running service ``name`` (the application, if it is one)."""
        service = self.deployment.process_of(name)
        aimed = self.rng.random() < 0.5
        how = "at random"
        # A kill during a JVM start proves little: let the service come up first.
        self._wait_until_up(service)
        self.armed = self.current  # its load slice comes now
        if aimed:
            entity = self.rng.choice(self.config.entities).name
            reached = self.windows.wait(name, entity, self.options.window_timeout_s)
            how = WINDOWS[name] if reached else "at random (window not reached)"
        else:
            time.sleep(self.rng.uniform(0.0, 3.0))
        self._sigkill(service)
        self.record.kills[f"{service.name} {how}"] += 1
        if not self.stopping.is_set():  # the run ends: its supervisor stops the services
            service.start()

    @staticmethod
    def _sigkill(service: ServiceProcess) -> None:
        process = service.process
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(60)
        service.poll()

    def _registry_outage(self, name: str) -> None:
        """The registry answers HTTP 503 while the process running ``name`` restarts.

        A running service has the schemas it uses cached, so an outage alone may go
        unnoticed; a starting service must ask the registry for its entities' schemas
        (and publisher-kafka registers its change schemas). So the process is SIGKILLed
        and started again as the outage begins, and the outage lasts until the registry
        has refused a request, then ``outage_s`` more: the restarted service retries
        through it (``cdc_shared.clients.retry``), and no valid record may be quarantined for
        it. An outage no request met is reported as a fault not injected.
        """
        proxy = self.registry
        if proxy is None:
            raise RuntimeError(
                "a registry outage needs the pipeline on the registry proxy; run_chaos "
                "starts one when ChaosOptions.registry_outages is above 0"
            )
        service = self.deployment.process_of(name)
        self._wait_until_up(service)
        refused_before = proxy.requests["503"]
        proxy.fail("503")
        try:
            self._sigkill(service)
            if self.stopping.is_set():
                return  # the run ends: its supervisor stops the services
            service.start()
            self.echo(f"registry answers 503; {service.name} restarted into the outage")
            deadline = time.monotonic() + SWITCH_HEALTH_TIMEOUT_S
            while proxy.requests["503"] == refused_before and time.monotonic() < deadline:
                time.sleep(0.2)
            if proxy.requests["503"] == refused_before:
                raise RuntimeError(
                    f"no request reached the registry within {SWITCH_HEALTH_TIMEOUT_S:g} s "
                    f"of restarting {service.name}: the outage was not met"
                )
            time.sleep(self.options.outage_s)
        finally:
            proxy.fail("forward")
            self.record.registry_refused += proxy.requests["503"] - refused_before
        self.record.registry_outages += 1

    def _slow_down_elasticsearch(self, seconds: float) -> None:
        """Freeze Elasticsearch for 1-3 s at a time, running 0.5 s between freezes."""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                infra.pause(self.settings, "elasticsearch")
                time.sleep(self.rng.uniform(1.0, 3.0))
                infra.resume(self.settings, "elasticsearch")
                time.sleep(0.5)
        finally:
            infra.resume(self.settings, "elasticsearch")


def produce_alongside(
    config: PipelineConfig,
    messages: list[GeneratedMessage],
    rate: float,
    injector: FaultInjector,
) -> ProduceReport:
    """Produce the load in equal slices, one per fault, each while its fault is under way.

    Produced at once, the load would be in long before a long fault plan is through, and
    most faults would hit an idle pipeline. A slice starts when its fault is armed: a
    kill once its service is up again and it waits for its moment (a window needs work
    in flight to come), any other fault as it begins. The slices keep the generator's
    order, so the same seed still makes the same records.
    """
    whole = ProduceReport()
    slices = max(1, len(injector.plan))
    size = math.ceil(len(messages) / slices)
    for number in range(1, slices + 1):
        while injector.armed < number and injector.done < number and injector.is_alive():
            time.sleep(0.2)
        chunk = messages[(number - 1) * size : number * size]
        whole.add(produce(config.kafka, iter(chunk), rate=rate))
        while injector.done < number and injector.is_alive():
            time.sleep(0.5)
    return whole


def _secret(rng: random.Random, kind: str) -> str:
    return f"planted-{kind}-{rng.getrandbits(64):016x}"


def _logs_with(secrets: list[str], folders: list[Path]) -> list[str]:
    """Log files (and other text the run wrote) that contain a planted secret."""
    pattern = re.compile("|".join(re.escape(s) for s in secrets).encode())
    found = []
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() and path.name != "pipeline.yaml":
                try:
                    if pattern.search(path.read_bytes()):
                        found.append(str(path))
                except OSError:
                    continue
    return found


def silver_fingerprint(spark: SparkSession, config: PipelineConfig) -> str:
    """One SHA-256 over every entity's silver content: same seed, same fingerprint."""
    digest = hashlib.sha256()
    for entity in config.entities:
        path = config.layout.silver(entity.name)
        if not has_commits(spark, path):
            continue
        _, hashes = silver_hashes(spark, path, entity)
        for key in sorted(hashes, key=lambda k: json.dumps(k, default=str)):
            digest.update(f"{entity.name}|{json.dumps(key, default=str)}|{hashes[key]}\n".encode())
    return digest.hexdigest()


def run_chaos(options: ChaosOptions, echo: Echo) -> ChaosResult:
    """Run load and faults, wait for the catch-up, check everything; see the module docstring."""
    started = time.monotonic()
    unwind_on_sigterm()
    rng = random.Random(options.seed)
    secrets = [_secret(rng, "sasl-password"), _secret(rng, "es-api-key")]
    with ExitStack() as resources:  # the registry proxy, serving until the services stop
        config_path, registry, schema_ids = _prepare(options, secrets, echo, resources)
        result = _under_faults(options, rng, config_path, registry, schema_ids, echo)
    result.leaked_secrets = _logs_with(secrets, [options.workdir])
    result.seconds = time.monotonic() - started
    return result


def _under_faults(
    options: ChaosOptions,
    rng: random.Random,
    config_path: Path,
    registry: RegistryProxy | None,
    schema_ids: dict[int, bytes],
    echo: Echo,
) -> ChaosResult:
    """The services up, the load produced under the faults, the catch-up, the checks."""
    config = load_pipeline(config_path)
    deployment = Deployment(options.modes[0], config_path, options.workdir / "logs")
    processes = deployment.processes  # one list: a switch changes it in place
    result = ChaosResult()
    progress = Progress(processes, echo)
    progress.start()
    plan = plan_faults(options, rng)
    injector = FaultInjector(plan, deployment, config, options, echo, registry)
    spark: SparkSession | None = None
    try:
        wait_until_healthy(processes, config, options.catch_up_timeout_s)
        generator = WorkloadGenerator(
            config.entities,
            make_registry(config),
            WorkloadSpec(
                events=options.events, keys=options.keys, seed=options.seed, poison_share=0.002
            ),
        )
        echo(
            f"producing {options.events:,} change events at {options.rate:,.0f} msgs/s under "
            f"{len(injector.plan)} faults"
        )
        injector.start()
        # Listed first (the generator keeps every message for re-deliveries anyway), so
        # the slices can be equal: re-deliveries and tombstones come on top of --events.
        messages = list(generator.messages())
        result.produced = produce_alongside(config, messages, options.rate, injector)
        echo(f"produced {result.produced.produced:,} messages")
        injector.join()
        result.faults = injector.record
        echo("faults over; waiting for the pipeline to catch up")
        _restart_stopped(processes, echo)
        expected = _oracle_rows(config, schema_ids)
        spark = build_spark_session(config.spark, "cdc-chaos-check")
        spark.sparkContext.setLogLevel("ERROR")
        deadline = time.monotonic() + options.catch_up_timeout_s
        while True:
            result.outputs = check_outputs(spark, config, expected)
            if all(d.agrees for d in result.outputs) or time.monotonic() > deadline:
                break
            _restart_stopped(processes, echo)
            wait_a_little(processes, 10)
        _check_the_rest(spark, config, result)
    finally:
        injector.stopping.set()
        if injector.is_alive():  # interrupted: let the fault in progress finish first
            injector.join(options.window_timeout_s + options.outage_s + 120)
        progress.done.set()
        result.exit_codes = stop_all(processes)
        result.peak_rss = deployment.peak_rss()
        if spark is not None:
            spark.stop()
    return result


def _prepare(
    options: ChaosOptions, secrets: list[str], echo: Echo, resources: ExitStack
) -> tuple[Path, RegistryProxy | None, dict[int, bytes]]:
    """Servers up, a fresh workdir, the pipeline file (secrets planted), source topics.

    With registry outages asked for, the registry too, and the proxy in front of it
    (entered in ``resources``) that the pipeline file points at; then also the ids the
    registry gave the run's source schemas, with each one's fingerprint.
    """
    on_registry = options.registry_outages > 0
    served = infra.up(with_registry=on_registry)
    echo(f"kafka {served.kafka_bootstrap_servers} · elasticsearch {served.elasticsearch_url}")
    if options.workdir.exists():
        shutil.rmtree(options.workdir)
    options.workdir.mkdir(parents=True)
    config_path = write_pipeline_config(
        options.workdir,
        served,
        prefix="chaos",
        kafka_options={"sasl.password": secrets[0]},
        es_api_key=secrets[1],
        tables=options.tables,
    )
    proxy, schema_ids = None, {}
    if on_registry:
        if served.registry_url is None:  # `infra.up(with_registry=True)` serves one
            raise infra.InfraError("`cdc infra up --with-registry` reported no registry URL")
        proxy = resources.enter_context(registry_proxy(served.registry_url))
        schema_ids = _use_registry(config_path, served.registry_url, proxy.url)
        echo(f"schema registry {served.registry_url}, reached through the proxy {proxy.url}")
    config = load_pipeline(config_path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])
    return config_path, proxy, schema_ids


def _use_registry(config_path: Path, upstream: str, url: str) -> dict[int, bytes]:
    """Point the pipeline file at the registry (as ``url``), the run's schemas registered.

    The file pipeline pins each entity's schema files. Here the run's subjects get the
    same schemas in the registry at ``upstream`` and the pins go: every service asks the
    registry for its entities' schemas as it starts, and the generator writes records
    framed with the registry's ids. The same load, read through the registry. Returns
    the ids registered, with each schema's fingerprint (for the oracle).
    """
    pinned = load_pipeline(config_path)
    files = make_registry(pinned)
    registry = ConfluentSchemaRegistry(upstream)
    registered = []
    for entity in pinned.entities:
        schemas = entity_schemas(entity, files)
        key_subject = subject_name(entity.source_topic, True)
        registered.append(registry.register(key_subject, schemas.key.definition))
        for version in schemas.values:
            value_subject = subject_name(entity.source_topic, False)
            registered.append(registry.register(value_subject, version.definition))
    document: dict[str, Any] = yaml.safe_load(config_path.read_text())
    document["schema_registry"]["url"] = url
    for entity_document in document["entities"]:
        entity_document.pop("key_schema", None)
        entity_document.pop("value_schema", None)
    config_path.write_text(yaml.safe_dump(document, sort_keys=False))
    return {k.schema_id: k.fingerprint for k in registered if k.schema_id is not None}


@dataclass
class _ReframingOracle(EntityOracle):
    """The oracle, fed records framed with registry ids as if framed with fingerprints.

    The oracle decodes single-object framing from its own schema files, sharing no code
    with the services. Records written through the registry start with a schema id
    instead: each id the run registered is replaced by its schema's fingerprint (the ids
    come from the run's own registrations, not from the services' registry client). An
    id the run did not register is left as it is: the oracle finds it undecodable, as
    the ingestor quarantines it.
    """

    schema_ids: dict[int, bytes] = field(default_factory=dict)

    def _reframed(self, data: bytes | None) -> bytes | None:
        if data is None or len(data) < 5 or data[0] != 0:
            return data
        fingerprint = self.schema_ids.get(int.from_bytes(data[1:5], "big"))
        return data if fingerprint is None else b"\xc3\x01" + fingerprint + data[5:]

    def feed(self, key: bytes | None, value: bytes | None, partition: int, offset: int) -> None:
        """Apply one Kafka record, its registry ids turned into fingerprints."""
        super().feed(self._reframed(key), self._reframed(value), partition, offset)


def _oracle_rows(
    config: PipelineConfig, schema_ids: dict[int, bytes]
) -> dict[str, dict[Key, dict[str, Any]]]:
    """Each entity's expected rows (``local_run.oracle_rows``), registry framing read too."""
    if not schema_ids:
        return oracle_rows(config)
    fingerprints = load_fingerprints([ROOT / "schemas"])
    registry = make_registry(config)
    expected = {}
    for entity in config.entities:
        oracle = _ReframingOracle.of(entity, registry, fingerprints)
        assert isinstance(oracle, _ReframingOracle)
        oracle.schema_ids = schema_ids
        expected[entity.name] = read_topic(config.kafka, oracle).rows
    return expected


def _check_the_rest(spark: SparkSession, config: PipelineConfig, result: ChaosResult) -> None:
    """Offsets, poison records, change-topic duplicates and the silver fingerprint."""
    result.coverage = [source_coverage(spark, config, e) for e in config.entities]
    result.poison = quarantined_poison(spark, config, result.produced.poison)
    result.topic_duplicates = {
        e.change_topic_name: len(change_topic_state(config, e).duplicates) for e in config.entities
    }
    result.silver_hash = silver_fingerprint(spark, config)


def _restart_stopped(processes: list[ServiceProcess], echo: Echo) -> None:
    """A service that stopped by itself is a finding: say so, and start it again."""
    for service in processes:
        if not service.alive:
            code = service.process.returncode if service.process is not None else None
            echo(f"{service.name} had stopped by itself (exit {code}); starting it again")
            service.start()


def summary_rows(result: ChaosResult) -> list[tuple[str, str]]:
    """The chaos table: volumes, faults, checks and the verdict, as (label, value) rows."""
    faults = result.faults
    rows = [
        ("events produced", f"{result.produced.produced:,}"),
        ("poison records injected", f"{len(result.produced.poison):,}"),
        *[(f"kills {name}", f"{faults.kills_of(name)}") for name in faults.killed],
        *[(f"  {how}", str(n)) for how, n in sorted(faults.kills.items())],
        *[("mode switch", switch) for switch in faults.switches],
        ("broker restarts", str(faults.broker_restarts)),
        ("Elasticsearch outages", str(faults.es_outages)),
        ("Elasticsearch slowdowns", str(faults.es_slowdowns)),
        ("registry outages", str(faults.registry_outages)),
        *(
            [("  requests answered 503", str(faults.registry_refused))]
            if faults.registry_outages
            else []
        ),
        *[("fault not injected", p) for p in faults.problems],
        *[("check", c.describe()) for c in result.coverage],
        *[("check", d.describe()) for d in result.outputs],
        *[
            ("check", f"{topic}: {n} duplicate (key, sequence, op)")
            for topic, n in result.topic_duplicates.items()
        ],
        ("check", result.poison.describe() if result.poison else "quarantine not checked"),
        (
            "check",
            f"planted secrets found in {result.leaked_secrets}"
            if result.leaked_secrets
            else "no planted secret in any log",
        ),
        ("silver fingerprint", result.silver_hash or "n/a"),
        *[(f"peak RSS {name}", f"{rss / 2**20:,.0f} MiB") for name, rss in result.peak_rss.items()],
        *[(f"exit code {name}", str(code)) for name, code in result.exit_codes.items()],
        ("wall time", str(dt.timedelta(seconds=round(result.seconds)))),
        ("divergences", str(result.divergences)),
        ("verdict", "PASSED" if result.passed else "FAILED"),
    ]
    return rows
