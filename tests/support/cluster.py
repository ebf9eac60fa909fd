"""The services as applications of the local Spark standalone cluster, tables on S3.

Pipelines whose ``spark.master`` is the test cluster and whose ``storage_root`` is a fresh
prefix of the local S3 server's bucket; the service commands run as subprocesses (each its
own driver, so its own application); what the master, the worker and the bucket show of
them; and the change-topic check that counts duplicates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import yaml
from cdc_devkit import infra
from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
from cdc_shared.avro import FileSchemaRegistry, subject_name
from cdc_shared.clients.schemas import change_event_schemas, entity_schemas
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from pyspark.sql import SparkSession

from support.change_topics import read_change_topic
from support.pipelines import Pipeline, write_pipeline
from support.publishing import OPS, _row
from support.servers import TEST_INFRA

T = TypeVar("T")

SERVICES = ("cdc-ingestor", "cdc-merger", "cdc-publisher-kafka", "cdc-publisher-es")

#: ``PYSPARK_PYTHON`` of the services under test: no such interpreter. A driver sends its
#: own ``PYSPARK_PYTHON`` with every Python function it ships, and an executor starts that
#: program for a Python UDF (or ``mapInPandas``, ``rdd.map``, ...): any of them would fail
#: with "Cannot run program". The drivers themselves are the venv's interpreter (the
#: console scripts are run directly), so the services run only if executors run no Python.
NO_PYTHON = "/nonexistent/cdc-tests/python3"


def service_env(python: str = NO_PYTHON) -> dict[str, str]:
    """The environment of a service under test: ``python`` for executors (none by default)."""
    return {**os.environ, "PYSPARK_PYTHON": python}


def cluster_s3_pipeline(
    folder: Path,
    kafka: KafkaConfig,
    es: ElasticsearchConfig,
    s3_endpoint: str,
    master: str,
    cores_max: int,
    entities: tuple[str, ...] = ("customers", "orders"),
    **services: Mapping[str, object],
) -> Pipeline:
    """The usual test pipeline (of ``entities``) with every service an application
    of the cluster at ``master`` (``cores_max`` cores each, 1 GiB executors and drivers)
    and every table and checkpoint under a fresh prefix of the S3 bucket.

    ``services`` are the service sections (``ingestor={...}``); each gets ``metrics_port:
    0`` unless it says otherwise.
    """
    sections = {
        name: {"metrics_port": 0, **services.get(name, {})}
        for name in ("ingestor", "merger", "publisher_kafka", "publisher_es")
    }
    pipeline = write_pipeline(folder, kafka, es, entities, **sections)
    document = yaml.safe_load(pipeline.path.read_text())
    document["storage_root"] = f"s3a://{infra.S3_BUCKET}/pytest-{uuid.uuid4().hex[:8]}"
    document["object_storage"] = {
        "endpoint": s3_endpoint,
        "path_style_access": True,
        "region": infra.S3_REGION,
        "access_key": infra.S3_ACCESS_KEY,
        "secret_key": infra.S3_SECRET_KEY,
    }
    document["spark"] = {
        "master": master,
        "conf": {
            "spark.ui.enabled": "false",
            # The driver stays on loopback, like the cluster.
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.memory": "1g",
            "spark.executor.memory": "1g",
            "spark.cores.max": str(cores_max),
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.databricks.delta.snapshotPartitions": "2",
        },
    }
    pipeline.path.write_text(yaml.safe_dump(document))
    return pipeline


def write_change_schemas(pipeline: Pipeline) -> None:
    """Put the change topics' schemas among the pipeline's schema files.

    On object storage publisher-kafka does not write its derived schemas under
    ``<root>/_schemas`` (that folder is local-only): a consumer without a registry finds
    them in ``schema_registry.dirs`` instead.
    """
    registry = FileSchemaRegistry([pipeline.schema_dir])
    for entity in pipeline.config.entities:
        key, value = change_event_schemas(entity, entity_schemas(entity, registry))
        for is_key, definition in ((True, key), (False, value)):
            name = f"{subject_name(entity.change_topic_name, is_key)}.avsc"
            (pipeline.schema_dir / name).write_text(json.dumps(definition, indent=2))


# --- the services as processes -------------------------------------------------------


def command_path(command: str) -> str:
    """The console script ``command`` of this virtual environment."""
    return str(Path(sys.executable).with_name(command))


def launch_service(
    command: str, pipeline: Pipeline, log: Path, *extra: str, python: str = NO_PYTHON
) -> subprocess.Popen[bytes]:
    """``command --config ...`` in its own process group (a kill takes its JVM with it),
    its executors' Python ``python``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [command_path(command), "--config", str(pipeline.path), *extra],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=service_env(python),
            start_new_session=True,
        )


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_ok(command: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Wait for ``process`` to exit 0; fails with the tail of its log otherwise."""
    try:
        code = process.wait(timeout_s)
    except subprocess.TimeoutExpired as late:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        message = f"{command} still ran after {timeout_s:.0f} s:\n{log_tail(log)}"
        raise AssertionError(message) from late
    assert code == 0, f"{command} exited {code}:\n{log_tail(log)}"


def run_once(
    pipeline: Pipeline,
    folder: Path,
    *commands: str,
    python: str = NO_PYTHON,
    timeout_s: float = 600,
) -> None:
    """``command --once`` for each command, all at once; each must exit 0."""
    running = [
        (
            command,
            launch_service(command, pipeline, folder / f"{command}.log", "--once", python=python),
        )
        for command in commands
    ]
    for command, process in running:
        wait_ok(command, process, folder / f"{command}.log", timeout_s)


def sigkill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a service's process group: the Python driver and its JVM at once."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def batch_logs(log: Path, entity: str | None = None) -> list[dict[str, Any]]:
    """The ``batch`` lines a service logged (of ``entity``, if given)."""
    batches = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"msg": "batch"' in line:
            record = json.loads(line)
            if entity is None or record.get("entity") == entity:
                batches.append(record)
    return batches


# --- the cluster ---------------------------------------------------------------------


def master_state() -> dict[str, Any]:
    state = infra.spark_master_state(TEST_INFRA)
    assert state is not None, "the Spark master does not answer"
    return state


def completed_apps() -> dict[str, str]:
    """Application id to name, of the applications the master lists as completed."""
    return {app["id"]: app["name"] for app in master_state().get("completedapps", [])}


def active_apps() -> dict[str, dict[str, Any]]:
    """Application name to the master's record of it (``cores`` granted, ``state``)."""
    return {app["name"]: app for app in master_state().get("activeapps", [])}


def alive_workers() -> set[str]:
    """The ids of the workers the master lists as ALIVE."""
    return {w["id"] for w in master_state().get("workers", []) if w.get("state") == "ALIVE"}


def executor_logs(app_id: str) -> str:
    """Every executor's stderr of ``app_id`` on this cluster's workers."""
    logs = (TEST_INFRA.state_dir / "spark").glob(f"worker-*/{app_id}/*/stderr")
    return "".join(p.read_text(errors="replace") for p in logs)


def worker_pid(number: int = 0) -> int:
    """The process id of the test cluster's worker ``number`` (its JVM)."""
    pid_file = TEST_INFRA.state_dir / f"{infra.SPARK_WORKERS}-{number}.pid"
    return int(pid_file.read_text().strip())


def _stat(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def executor_backends() -> dict[int, str]:
    """The executor JVMs (``CoarseGrainedExecutorBackend``) the test cluster's workers
    started, running or orphaned: pid -> application id (by their working folder, which
    is ``<worker work dir>/<app id>/<executor id>``)."""
    work = TEST_INFRA.state_dir.resolve() / "spark"
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(int(entry.name)):
            continue
        try:
            words = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            cwd = (entry / "cwd").resolve()
        except OSError:
            continue
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in words and (
            cwd.is_relative_to(work)
        ):
            found[int(entry.name)] = cwd.parent.name
    return found


# --- the bucket ------------------------------------------------------------------------


class Bucket:
    """Reads a pipeline's objects in the local S3 server directly (not through Spark)."""

    def __init__(self) -> None:
        self.client = infra.s3_client(TEST_INFRA)

    def names(self, folder: str) -> list[str]:
        """The names of the objects directly under ``folder`` (an ``s3a://`` path)."""
        url = urlparse(folder)
        prefix = url.path.lstrip("/").rstrip("/") + "/"
        names: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=url.netloc, Prefix=prefix
        ):
            names.extend(o["Key"][len(prefix) :] for o in page.get("Contents", []))
        return [n for n in names if n and "/" not in n]

    def batch_ids(self, folder: str) -> set[int]:
        """The micro-batch ids logged in a checkpoint's ``offsets`` or ``commits``."""
        return {int(n) for n in self.names(folder) if n.isdigit()}

    def in_flight(self, checkpoint: str) -> int | None:
        """The micro-batch begun (offsets logged) and not committed yet, if any."""
        started = self.batch_ids(f"{checkpoint}/offsets")
        committed = self.batch_ids(f"{checkpoint}/commits")
        pending = started - committed
        return max(pending) if pending else None

    def committed(self, checkpoint: str) -> int:
        """The last committed micro-batch id (-1: none)."""
        return max(self.batch_ids(f"{checkpoint}/commits"), default=-1)

    def delta_version(self, table: str) -> int:
        """The newest version in a Delta table's log (-1: no table yet)."""
        names = self.names(f"{table}/_delta_log")
        versions = (n.removesuffix(".json") for n in names if n.endswith(".json"))
        return max((int(v) for v in versions if v.isdigit()), default=-1)


def wait_until(
    condition: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.1
) -> T:
    """Poll ``condition`` until it returns neither None nor False; that value.

    AssertionError ``what`` after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value is not None and value is not False:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


# --- the change topics -------------------------------------------------------------------


def assert_change_topics_exactly_once(
    spark: SparkSession, pipeline: Pipeline, kafka: KafkaConfig
) -> dict[str, int]:
    """Each change topic holds silver's change feed exactly once (no duplicate, no gap),
    in order per key, and its last event per key is the oracle's final state.

    support.publishing's check, for a root whose change schemas are in the pipeline's
    schema folder (see :func:`write_change_schemas`). Returns events per entity.
    """
    config = pipeline.config
    fingerprints = load_fingerprints([pipeline.schema_dir])
    counts = {}
    for entity in config.entities:
        feed = (
            spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load(config.layout.silver(entity.name))
            .where("_change_type != 'update_preimage'")
        )
        columns = [c for c in feed.columns if not c.startswith("_")]
        expected = sorted(
            (
                tuple(r[k] for k in entity.key),
                r["_commit_version"],
                OPS[r["_change_type"]],
                None if r["_change_type"] == "delete" else _row(r.asDict(), columns),
            )
            for r in feed.collect()
        )
        records = read_change_topic(
            kafka.bootstrap_servers, entity.change_topic_name, pipeline.schema_dir
        )
        got = [
            (
                tuple(r.key[k] for k in entity.key),
                r.event["commit_version"],
                r.event["op"],
                _row(r.event["after"], columns),
            )
            for r in records
            if r.event is not None
        ]
        assert got, f"the change topic of {entity.name} is empty: the test proves nothing"
        assert len(got) == len(set(got)), f"duplicate change events in {entity.name}"
        assert sorted(got) == expected, f"change topic of {entity.name} != silver's feed"

        per_key: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        last: dict[tuple[Any, ...], tuple[str, Any]] = {}
        for key, version, op, after in got:  # partition order: one key, one partition
            per_key[key].append(version)
            last[key] = (op, after)
        assert all(v == sorted(set(v)) for v in per_key.values()), "out-of-order versions"

        oracle = read_topic(kafka, EntityOracle(entity, list(entity.key), fingerprints))
        final = {k: after for k, (op, after) in last.items() if op != "d"}
        assert final == {k: _row(row, columns) for k, row in oracle.rows.items()}, (
            f"change topic of {entity.name}: last events differ from the oracle"
        )
        counts[entity.name] = len(got)
    return counts
