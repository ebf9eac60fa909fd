"""The whole pipeline on this machine, and what each of its outputs holds.

The four services run as processes on a generated load; the readers here compare
silver, the change topics and the indexes with the oracle. Used by ``cdc demo``,
``cdc chaos`` and the end-to-end benchmark.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import StreamingServiceConfig
from cdc_shared.contracts.layout import INGESTOR, SERVICES, section_name
from cdc_shared.streaming.tables import has_commits
from pyspark.sql import SparkSession

from cdc_devkit import infra
from cdc_devkit.checks import (
    Difference,
    Key,
    bronze_changes,
    change_topic_state,
    compare,
    index_rows,
    silver_rows,
)
from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_devkit.processes import ServiceProcess, wait_a_little

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = ROOT / "deploy" / "local" / "pipeline.yaml"
Echo = Callable[[str], None]


def write_pipeline_config(
    workdir: Path,
    served: infra.Endpoints,
    *,
    prefix: str = "demo",
    kafka_options: dict[str, str] | None = None,
    es_api_key: str | None = None,
    tables: int | None = None,
) -> Path:
    """The example pipeline on fresh topics, tables and indexes under ``workdir``.

    Topic and index names get ``prefix`` plus a random run id, so runs never share state.
    ``tables``: that many tables instead of the example's, copies of its entities taken
    in turn, each named ``<entity>_t<n>`` with a source topic, change topic and index of
    its own, and the driver heap the shipped default sizes for them (the example's is
    set to 1 GiB).
    """
    run = f"{prefix}{uuid.uuid4().hex[:6]}"
    document: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    document["storage_root"] = str(workdir / "store")
    document["kafka"]["bootstrap_servers"] = served.kafka_bootstrap_servers
    document["elasticsearch"]["hosts"] = [served.elasticsearch_url]
    document["schema_registry"]["dirs"] = [str(ROOT / "schemas")]
    document["spark"]["conf"] = {
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "1g",
    }
    for entity in document["entities"]:
        source = entity["source_topic"]
        # Pinned schemas: topics named per run still find their schemas.
        entity["key_schema"] = str(ROOT / "schemas" / f"{source}-key.avsc")
        entity["value_schema"] = str(ROOT / "schemas" / f"{source}-value.avsc")
        entity["source_topic"] = f"{run}.{source}"
        entity["change_topic"] = f"{run}.{entity['change_topic']}"
        entity["es_index"] = f"{run}-{entity['es_index']}"
    if tables is not None:
        document["entities"] = copied_entities(document["entities"], tables)
        del document["spark"]["conf"]["spark.driver.memory"]  # sized by the tables
    # Ports free now, not the example's: two runs (or a run and a test) can coexist.
    *ports, application_port = service_ports(len(SERVICES) + 1)
    for section, port in zip(SERVICES, ports, strict=True):
        document[section] = {"trigger_interval": "1 second", "metrics_port": port}
    document["application"] = {"metrics_port": application_port}
    document[INGESTOR]["max_offsets_per_trigger"] = 20_000
    if kafka_options:
        document["kafka"]["options"] = kafka_options
    if es_api_key:
        document["elasticsearch"]["api_key"] = es_api_key
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def copied_entities(originals: list[dict[str, Any]], tables: int) -> list[dict[str, Any]]:
    """``tables`` entities: ``originals`` copied in turn, each copy's names its own.

    A copy is named ``<name>_t<n>`` (n from 000), with ``.t<n>`` after its source and
    change topics and ``-t<n>`` after its index; everything else (key, schemas, history,
    column selection) is the original's.
    """
    copies = []
    for number in range(tables):
        entity = dict(originals[number % len(originals)])
        suffix = f"t{number:03d}"
        entity["name"] = f"{entity['name']}_{suffix}"
        entity["source_topic"] = f"{entity['source_topic']}.{suffix}"
        entity["change_topic"] = f"{entity['change_topic']}.{suffix}"
        entity["es_index"] = f"{entity['es_index']}-{suffix}"
        copies.append(entity)
    return copies


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, once, so the services get stopped, not orphaned.

    Later SIGTERMs (``timeout`` forwards its own, a supervisor repeats) are ignored: a
    second unwinding in the middle of the clean-up would leave the services running.
    """

    def unwind(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, unwind)


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nothing listens on right now.

    The probes stay bound until all are chosen: one at a time, the kernel may hand out a
    port just released twice (two services then fight over one metrics port).
    """
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


#: Where :func:`service_ports` picks: below the kernel's ephemeral range (Linux's default
#: 32768-60999) and clear of the ports the kit's servers take (``infra``'s defaults
#: 5432-9300, the tests' 25432-29300).
SERVICE_PORT_RANGE = range(10_000, 20_000)


def service_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports for the services' /health and /metrics, free now.

    Not from the kernel (:func:`free_ports`): its ports are the ephemeral range, which it
    hands to every process that binds port 0 (a JVM's Py4J gateway, a Spark driver's
    block manager) and to outgoing connections. A service's port is free each time the
    service is down (a restart, the chaos run's switch of deployment), and one taken
    meanwhile keeps the service from starting again. Ports outside that range are only
    ever bound on purpose, so a run keeps its ports; the pick is random within
    ``SERVICE_PORT_RANGE`` so that runs side by side do not meet.
    """
    candidates = random.sample(SERVICE_PORT_RANGE, len(SERVICE_PORT_RANGE))
    with contextlib.ExitStack() as stack:
        chosen: list[int] = []
        for port in candidates:
            probe = socket.socket()
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # taken
                probe.close()
                continue
            stack.enter_context(probe)  # bound until all are chosen, as in free_ports
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"fewer than {count} free ports in {SERVICE_PORT_RANGE}")


def machine_used_bytes() -> int:
    """Memory in use on the machine (total minus available), in bytes."""
    info = dict(
        (line.split(":")[0], int(line.split()[1]) * 1024)
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.split()[1:2] and line.split()[1].isdigit()
    )
    return info.get("MemTotal", 0) - info.get("MemAvailable", 0)


class Progress(threading.Thread):
    """Prints one line per service every few seconds, and samples the machine's memory."""

    def __init__(self, services: list[ServiceProcess], echo: Echo) -> None:
        super().__init__(daemon=True)
        self.services, self.echo = services, echo
        self.peak_machine_bytes = 0
        self.done = threading.Event()

    def run(self) -> None:
        """Report and sample until ``done`` is set."""
        started = time.monotonic()
        while not self.done.wait(5.0):
            for service in self.services:
                service.poll()
            self.peak_machine_bytes = max(self.peak_machine_bytes, machine_used_bytes())
            lines = " | ".join(s.summary_line() for s in self.services)
            self.echo(f"[{time.monotonic() - started:5.0f} s] {lines}")


def health_port(config: PipelineConfig, service: str) -> int:
    """The port a service (or the application) serves /health and /metrics on."""
    if service == "application":
        return config.application.metrics_port
    section: StreamingServiceConfig = getattr(config, section_name(service))
    return section.metrics_port


def wait_until_healthy(
    services: list[ServiceProcess], config: PipelineConfig, timeout_s: float
) -> None:
    """Wait until every service serves /health 200.

    The load starts after that, so the delays measure the pipeline, not four JVM starts.
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(services)
    while waiting:
        dead = [s.name for s in waiting if not s.alive]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} stopped during start-up; see its log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(s.name for s in waiting)} not healthy in time")
        waiting = [s for s in waiting if not s.healthy(health_port(config, s.name))]
        wait_a_little(services, 2)


def oracle_rows(config: PipelineConfig) -> dict[str, dict[Key, dict[str, Any]]]:
    """Each entity's expected final rows, replayed from its source topic."""
    fingerprints = load_fingerprints([ROOT / "schemas"])
    registry = make_registry(config)
    return {
        e.name: read_topic(config.kafka, EntityOracle.of(e, registry, fingerprints)).rows
        for e in config.entities
    }


def check_outputs(
    spark: SparkSession, config: PipelineConfig, expected: dict[str, dict[Key, dict[str, Any]]]
) -> list[Difference]:
    """Silver, the change topic and the index of every entity, each against ``expected``."""
    differences = []
    for entity in config.entities:
        want = expected[entity.name]
        differences.append(
            compare(f"silver/{entity.name}", want, silver_rows(spark, config, entity))
        )
        topic = change_topic_state(config, entity)
        differences.append(compare(f"topic {entity.change_topic_name}", want, topic.rows))
        differences.append(
            compare(f"index {entity.es_index_name}", want, index_rows(config, entity))
        )
    return differences


def produce_delays(spark: SparkSession, config: PipelineConfig) -> dict[str, list[float]]:
    """Produce -> silver commit, and produce -> change event published, per key's last change.

    The start is the source record's Kafka timestamp (producer time), found in bronze (the
    entity's rows of the one table) by key and sequence.
    """
    to_silver: list[float] = []
    to_topic: list[float] = []
    for entity in config.entities:
        bronze = bronze_changes(spark, config, entity)
        if bronze is None or not has_commits(spark, config.layout.silver(entity.name)):
            continue
        produced: dict[tuple[Key, tuple[int, ...]], float] = {}
        for r in bronze.select("key", "sequence", "kafka_timestamp").collect():
            mark = (tuple(r["key"][k] for k in entity.key), tuple(r["sequence"]))
            at = r["kafka_timestamp"].replace(tzinfo=dt.UTC).timestamp()
            produced[mark] = min(at, produced.get(mark, at))
        silver = spark.read.format("delta").load(config.layout.silver(entity.name))
        for r in silver.select(*entity.key, "_cdc_seq", "_cdc_commit_ts").collect():
            mark = (tuple(r[k] for k in entity.key), tuple(r["_cdc_seq"]))
            if mark in produced:
                committed = r["_cdc_commit_ts"].replace(tzinfo=dt.UTC).timestamp()
                to_silver.append((committed - produced[mark]) * 1000)
        for mark, published in change_topic_state(config, entity).publish_times.items():
            if mark in produced:
                to_topic.append((published - produced[mark]) * 1000)
    return {"silver commit": to_silver, "change topic": to_topic}
