"""Local infrastructure without Docker: a real Kafka broker and Elasticsearch on loopback.

Both run from the JVM cache that deploy/jvm/pom.xml fills (``make jvm``); so do the
optional schema registry, Kafka Connect and S3 server (S3Proxy). The optional PostgreSQL
(a Debezium source) runs from Debian's ``postgresql-15`` package. The optional Spark
standalone cluster (a master and its workers) runs from the installed pyspark's
``spark-class``. Each server's configuration, data, log and PID live in one state folder,
so ``up`` is idempotent (a server already answering is left alone) and ``down`` stops
exactly what ``up`` started, with its whole process group.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from base64 import urlsafe_b64encode
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import boto3
import httpx
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from cdc_shared.jvm import artifacts as jvm
from confluent_kafka.admin import AdminClient
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ES_USER = "cdc-es"  # Elasticsearch refuses to run as root
POSTGRES_USER = "cdc-pg"  # initdb and postgres refuse to run as root
MIN_ES_JAVA = 21
MIN_REGISTRY_JAVA = 21  # Apicurio Registry 3 (Quarkus)
MIN_CONNECT_JAVA = 17
REGISTRY_CONFLUENT_API = "/apis/ccompat/v7"
#: Apicurio's own API of the 2.x line: what its Kafka Connect converter speaks.
REGISTRY_CORE_API = "/apis/registry/v2"
POSTGRES_MAJOR = 15  # Debian's postgresql-15
#: The database superuser ``up`` creates (its password: ``postgres_password``).
POSTGRES_SUPERUSER = "cdc"
#: The local S3 server's fixed credentials and bucket: loopback only, for tests and demos.
S3_ACCESS_KEY = "cdc-local"
S3_SECRET_KEY = "cdc-local-secret"  # public: a local-only server
S3_BUCKET = "cdc"
S3_REGION = "us-east-1"
#: Every server ``up`` can start, in start order (``down`` stops them in reverse).
#: ``spark-worker`` stands for all of the cluster's workers (``spark-worker-<n>.pid``).
SERVERS = (
    "kafka",
    "kafka-secured",  # `cdc infra up --secure` (cdc_devkit.secured_kafka.start_local)
    "elasticsearch",
    "registry",
    "s3",
    "postgres",
    "connect",
    "spark-master",
    "spark-worker",
)
SPARK_WORKERS = "spark-worker"
SECURED_KAFKA = "kafka-secured"
#: The signal that asks a server to stop, when it is not SIGTERM. PostgreSQL's SIGTERM
#: is a "smart" shutdown that waits for every client (Debezium's replication connection
#: among them); SIGINT is its "fast" shutdown.
_STOP_SIGNALS = {"postgres": signal.SIGINT}


class InfraError(RuntimeError):
    """A local server could not be started or stopped; the message says what to do."""


def _default_state_dir() -> Path:
    root = jvm.project_root()
    return (root if root is not None else Path.cwd()) / ".state" / "infra"


class InfraSettings(BaseSettings):
    """Ports, heap sizes and the state folder (env ``CDC_INFRA_*``)."""

    model_config = SettingsConfigDict(env_prefix="CDC_INFRA_", frozen=True)

    state_dir: Path = Field(default_factory=_default_state_dir)
    kafka_port: int = Field(default=9092, gt=0, lt=65536)
    kafka_controller_port: int = Field(default=9093, gt=0, lt=65536)
    kafka_heap: str = "512m"
    #: The SASL_SSL listener of `cdc infra up --secure`'s broker, and its controller.
    kafka_secured_port: int = Field(default=9094, gt=0, lt=65536)
    kafka_secured_controller_port: int = Field(default=9095, gt=0, lt=65536)
    es_port: int = Field(default=9200, gt=0, lt=65536)
    es_transport_port: int = Field(default=9300, gt=0, lt=65536)
    es_heap: str = "512m"
    registry_port: int = Field(default=8081, gt=0, lt=65536)
    registry_management_port: int = Field(default=8082, gt=0, lt=65536)  # Quarkus' health
    registry_heap: str = "256m"
    postgres_port: int = Field(default=5432, gt=0, lt=65536)
    postgres_bin: Path = Path(f"/usr/lib/postgresql/{POSTGRES_MAJOR}/bin")
    connect_port: int = Field(default=8083, gt=0, lt=65536)
    connect_heap: str = "512m"
    s3_port: int = Field(default=9000, gt=0, lt=65536)
    s3_heap: str = "512m"  # S3Proxy keeps the objects in memory: the heap bounds them
    spark_master_port: int = Field(default=7077, gt=0, lt=65536)
    spark_master_webui_port: int = Field(default=8080, gt=0, lt=65536)
    #: Worker ``n`` (from 0) serves its web UI on this port + n.
    spark_worker_webui_port: int = Field(default=8091, gt=0, lt=65536)
    spark_workers: int = Field(default=1, gt=0, le=16)
    spark_worker_cores: int = Field(default=2, gt=0)
    spark_worker_memory: str = "2g"  # what executors of all applications may take, per worker
    spark_daemon_heap: str = "512m"  # the master's and each worker's own JVM
    start_timeout_s: float = 120.0


@dataclass(frozen=True)
class Endpoints:
    """What the local infrastructure serves."""

    kafka_bootstrap_servers: str
    elasticsearch_url: str
    registry_url: str | None = None  # the Confluent-compatible API, when it was started
    postgres: str | None = None  # host:port of PostgreSQL, when it was started
    connect_url: str | None = None  # Kafka Connect's REST API, when it was started
    s3_endpoint: str | None = None  # the S3-compatible server, when it was started
    spark_master: str | None = None  # spark://host:port of the standalone cluster, if started


def endpoints(
    settings: InfraSettings,
    with_registry: bool = False,
    with_postgres: bool = False,
    with_s3: bool = False,
    with_spark_cluster: bool = False,
) -> Endpoints:
    """The addresses ``up`` serves with these settings."""
    return Endpoints(
        kafka_bootstrap_servers=f"127.0.0.1:{settings.kafka_port}",
        elasticsearch_url=f"http://127.0.0.1:{settings.es_port}",
        registry_url=registry_url(settings) if with_registry else None,
        postgres=f"127.0.0.1:{settings.postgres_port}" if with_postgres else None,
        connect_url=connect_url(settings) if with_postgres else None,
        s3_endpoint=s3_endpoint(settings) if with_s3 else None,
        spark_master=spark_master_url(settings) if with_spark_cluster else None,
    )


def s3_endpoint(settings: InfraSettings) -> str:
    """The local S3 server's endpoint (``object_storage.endpoint``, path-style access)."""
    return f"http://127.0.0.1:{settings.s3_port}"


def spark_master_url(settings: InfraSettings) -> str:
    """The standalone Spark master (``spark.master`` of a pipeline run on the cluster)."""
    return f"spark://127.0.0.1:{settings.spark_master_port}"


def spark_master_json_url(settings: InfraSettings) -> str:
    """The master web UI's JSON summary: workers, active and completed applications."""
    return f"http://127.0.0.1:{settings.spark_master_webui_port}/json/"


def registry_url(settings: InfraSettings) -> str:
    """Apicurio Registry's Confluent-compatible API (``schema_registry.url``)."""
    return f"http://127.0.0.1:{settings.registry_port}{REGISTRY_CONFLUENT_API}"


def registry_core_url(settings: InfraSettings) -> str:
    """Apicurio Registry's own v2 API: where Apicurio's Kafka Connect converter registers."""
    return f"http://127.0.0.1:{settings.registry_port}{REGISTRY_CORE_API}"


def connect_url(settings: InfraSettings) -> str:
    """Kafka Connect's REST API (connectors are added with PUT /connectors/NAME/config)."""
    return f"http://127.0.0.1:{settings.connect_port}"


# --- processes --------------------------------------------------------------------


def _pid_file(settings: InfraSettings, name: str) -> Path:
    return settings.state_dir / f"{name}.pid"


def _read_pid(settings: InfraSettings, name: str) -> int | None:
    try:
        pid = int(_pid_file(settings, name).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited child not yet reaped) is not alive for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _check_ports_free(name: str, ports: dict[str, int]) -> None:
    for setting, port in ports.items():
        if _port_taken(port):
            raise InfraError(
                f"cannot start {name}: port {port} on 127.0.0.1 is taken by another process; "
                f"stop it or choose another port (env CDC_INFRA_{setting.upper()})"
            )


def _start(
    settings: InfraSettings, name: str, command: list[str], env: dict[str, str] | None = None
) -> int:
    log = (settings.state_dir / f"{name}.log").open("ab")
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # its own process group: `down` stops all of it
    )
    _pid_file(settings, name).write_text(str(process.pid))
    return process.pid


def _wait_ready(settings: InfraSettings, name: str, pid: int, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + settings.start_timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            tail = _log_tail(settings, name)
            raise InfraError(f"{name} exited during start; last lines of its log:\n{tail}")
        if ready():
            return
        time.sleep(0.5)
    raise InfraError(
        f"{name} did not become ready within {settings.start_timeout_s:.0f} s; "
        f"see {settings.state_dir / (name + '.log')}"
    )


def _log_tail(settings: InfraSettings, name: str, lines: int = 25) -> str:
    try:
        text = (settings.state_dir / f"{name}.log").read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _stop(settings: InfraSettings, name: str, grace_s: float = 30.0) -> bool:
    pid = _read_pid(settings, name)
    _pid_file(settings, name).unlink(missing_ok=True)
    if pid is None:
        return False
    first = _STOP_SIGNALS.get(name, signal.SIGTERM)
    for sig, wait in ((first, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid) and not _group_alive(pid):
                return True
            time.sleep(0.2)
    raise InfraError(f"{name} (process group {pid}) did not stop after SIGKILL")


def _group_alive(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


# --- Java ---------------------------------------------------------------------------


def _java_major(home: Path) -> int | None:
    try:
        release = (home / "release").read_text()
    except OSError:
        return None
    for line in release.splitlines():
        if line.startswith("JAVA_VERSION="):
            version = line.split("=", 1)[1].strip('"')
            return int(version.split(".")[0])
    return None


def _find_java_home(minimum: int, env_var: str) -> Path:
    candidates: list[Path] = []
    if os.environ.get(env_var):
        candidates.append(Path(os.environ[env_var]))
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]))
    java = shutil.which("java")
    if java:
        candidates.append(Path(java).resolve().parents[1])
    jvm_root = Path("/usr/lib/jvm")
    if jvm_root.is_dir():
        candidates.extend(sorted(jvm_root.iterdir(), reverse=True))
    for home in candidates:
        major = _java_major(home)
        if major is not None and major >= minimum and (home / "bin" / "java").exists():
            return home
    raise InfraError(
        f"no Java {minimum} or newer found (looked at ${env_var}, $JAVA_HOME, the java on "
        f"PATH and /usr/lib/jvm); install one or point {env_var} at it"
    )


# --- Kafka --------------------------------------------------------------------------


def _kafka_ready(bootstrap: str) -> bool:
    _, port = bootstrap.rsplit(":", 1)
    if not _port_taken(int(port)):
        return False
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        metadata = admin.list_topics(timeout=2)
    except Exception:  # not answering yet
        return False
    return bool(metadata.brokers)


def _kafka_cluster_id() -> str:
    return urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _format_kafka_storage(
    java: list[str], properties: Path, what: str, extra: list[str] | None = None
) -> None:
    """Format a KRaft broker's storage (``kafka-storage format``) before its first start."""
    formatted = subprocess.run(
        [
            *java,
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={_kafka_cluster_id()}",
            "-c",
            str(properties),
            *(extra or []),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if formatted.returncode != 0:
        raise InfraError(
            f"formatting {what}'s storage failed:\n{formatted.stdout}{formatted.stderr}"
        )


def start_kafka(settings: InfraSettings) -> None:
    """Start the single-node KRaft broker unless it already runs; wait until it answers."""
    bootstrap = endpoints(settings).kafka_bootstrap_servers
    if (pid := _read_pid(settings, "kafka")) is not None:
        _wait_ready(settings, "kafka", pid, lambda: _kafka_ready(bootstrap))
        return
    classpath = jvm.kafka_classpath()
    if not classpath:
        raise InfraError("the Kafka broker is not in the JVM cache; run `make jvm` first")
    _check_ports_free(
        "Kafka",
        {
            "kafka_port": settings.kafka_port,
            "kafka_controller_port": settings.kafka_controller_port,
        },
    )
    java = _find_java_home(17, "CDC_KAFKA_JAVA_HOME") / "bin" / "java"
    folder = settings.state_dir / "kafka"
    data_dir = folder / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    templates = _deploy_local()
    properties = folder / "server.properties"
    properties.write_text(
        Template((templates / "kafka" / "server.properties.template").read_text()).substitute(
            port=settings.kafka_port,
            controller_port=settings.kafka_controller_port,
            data_dir=data_dir,
        )
    )
    base = [
        str(java),
        f"-Dlog4j2.configurationFile={templates / 'kafka' / 'log4j2.yaml'}",
        "-cp",
        ":".join(str(p) for p in classpath),
    ]
    if not (data_dir / "meta.properties").exists():
        _format_kafka_storage(base, properties, "Kafka")
    heap = settings.kafka_heap
    pid = _start(
        settings,
        "kafka",
        [
            *base[:1],
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            *base[1:],
            "kafka.Kafka",
            str(properties),
        ],
    )
    _wait_ready(settings, "kafka", pid, lambda: _kafka_ready(bootstrap))


#: The one SASL mechanism of the secured broker (SCRAM users are made at format time).
SECURED_KAFKA_MECHANISM = "SCRAM-SHA-512"
#: Kafka's authorizer for KRaft clusters: ACLs live in the metadata log.
KAFKA_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(frozen=True)
class TlsListener:
    """A listener's port and its own certificate chain and PKCS#8 key (PEM files)."""

    port: int
    certificate_file: Path
    key_file: Path


@dataclass(frozen=True)
class SecuredKafka:
    """A second, secured broker: one SASL_SSL listener, SCRAM users, ACLs enforced.

    TLS material is PEM: ``ca_file`` (what clients trust), the broker's certificate
    chain and its PKCS#8 key, whose names must match ``127.0.0.1``. ``users`` maps
    each SCRAM-SHA-512 username to its password (written into the metadata log when
    the storage is formatted); ``admin`` among them is the super user, and the broker
    talks to itself as ``admin``. Nothing else is allowed without an ACL. The
    controller listener is plaintext on loopback; its principal (``ANONYMOUS``) is a
    super user too, since the broker reaches its own controller through it: fine for
    tests and demos, not for production.
    """

    port: int
    controller_port: int
    ca_file: Path
    certificate_file: Path
    key_file: Path
    users: dict[str, str]
    admin: str = "admin"
    name: str = "kafka-secured"  # its state folder, PID file and log in the state dir
    #: A second SASL_SSL listener presenting another certificate (e.g. one past its
    #: dates, for the tests of what clients say about it); not advertised, clients
    #: reach it only by bootstrapping to its port.
    other_listener: TlsListener | None = None

    @property
    def bootstrap_servers(self) -> str:
        """Where clients connect (the SASL_SSL listener)."""
        return f"127.0.0.1:{self.port}"

    def client_settings(self, user: str, password: str | None = None) -> dict[str, str]:
        """librdkafka settings to connect as ``user`` (its own password unless given)."""
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": SECURED_KAFKA_MECHANISM,
            "sasl.username": user,
            "sasl.password": self.users[user] if password is None else password,
            "ssl.ca.location": str(self.ca_file),
        }


def _property_value(text: str) -> str:
    """``text`` escaped for a Java properties file (PEM blocks span lines)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _secured_kafka_properties(secured: SecuredKafka, data_dir: Path) -> str:
    admin_jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{secured.admin}" password="{secured.users[secured.admin]}";'
    )
    mechanism = SECURED_KAFKA_MECHANISM.lower()
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{secured.controller_port}",
        "listeners": (
            f"SASL_SSL://127.0.0.1:{secured.port},CONTROLLER://127.0.0.1:{secured.controller_port}"
        ),
        "advertised.listeners": f"SASL_SSL://127.0.0.1:{secured.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "SASL_SSL",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
        "sasl.enabled.mechanisms": SECURED_KAFKA_MECHANISM,
        "sasl.mechanism.inter.broker.protocol": SECURED_KAFKA_MECHANISM,
        f"listener.name.sasl_ssl.{mechanism}.sasl.jaas.config": admin_jaas,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.certificate.chain": secured.certificate_file.read_text(),
        "ssl.keystore.key": secured.key_file.read_text(),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(secured.ca_file),
        "authorizer.class.name": KAFKA_AUTHORIZER,
        "super.users": f"User:{secured.admin};User:ANONYMOUS",
        "allow.everyone.if.no.acl.found": "false",
        "log.dirs": str(data_dir),
        # One node: every internal topic has one replica (as the plain broker's template).
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "min.insync.replicas": "1",
        "default.replication.factor": "1",
        "num.partitions": "1",
        # Topics are made by whoever owns them (an admin), never by a reader's request.
        "auto.create.topics.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
    }
    if (other := secured.other_listener) is not None:
        settings["listeners"] += f",OTHER://127.0.0.1:{other.port}"
        settings["listener.security.protocol.map"] += ",OTHER:SASL_SSL"
        settings[f"listener.name.other.{mechanism}.sasl.jaas.config"] = admin_jaas
        settings["listener.name.other.ssl.keystore.type"] = "PEM"
        settings["listener.name.other.ssl.keystore.certificate.chain"] = (
            other.certificate_file.read_text()
        )
        settings["listener.name.other.ssl.keystore.key"] = other.key_file.read_text()
    return "".join(f"{key}={_property_value(value)}\n" for key, value in settings.items())


def _secured_kafka_ready(secured: SecuredKafka) -> bool:
    if not _port_taken(secured.port):
        return False
    admin = AdminClient({**secured.client_settings(secured.admin), "log_level": 0})
    try:
        metadata = admin.list_topics(timeout=3)
    except Exception:  # not answering yet
        return False
    return bool(metadata.brokers)


def start_secured_kafka(settings: InfraSettings, secured: SecuredKafka) -> str:
    """Start the secured broker (see :class:`SecuredKafka`) unless it runs; its bootstrap.

    Its data, configuration (holding the admin's password and the broker's key) and log
    live in ``<state_dir>/<name>``; stop it with :func:`stop_secured_kafka`.
    """
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    if (pid := _read_pid(settings, secured.name)) is not None:
        _wait_ready(settings, secured.name, pid, lambda: _secured_kafka_ready(secured))
        return secured.bootstrap_servers
    classpath = jvm.kafka_classpath()
    if not classpath:
        raise InfraError("the Kafka broker is not in the JVM cache; run `make jvm` first")
    if secured.admin not in secured.users:
        raise InfraError(f"the admin {secured.admin!r} needs a password in users")
    _check_ports_free(
        "the secured Kafka",
        {
            "secured_port": secured.port,
            "secured_controller_port": secured.controller_port,
            **({"other_port": secured.other_listener.port} if secured.other_listener else {}),
        },
    )
    java = _find_java_home(17, "CDC_KAFKA_JAVA_HOME") / "bin" / "java"
    folder = settings.state_dir / secured.name
    data_dir = folder / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    properties = folder / "server.properties"
    properties.touch(mode=0o600)
    properties.write_text(_secured_kafka_properties(secured, data_dir))
    base = [
        str(java),
        f"-Dlog4j2.configurationFile={_deploy_local() / 'kafka' / 'log4j2.yaml'}",
        "-cp",
        ":".join(str(p) for p in classpath),
    ]
    if not (data_dir / "meta.properties").exists():
        scram = [
            f"--add-scram={SECURED_KAFKA_MECHANISM}=[name={user},password={password}]"
            for user, password in secured.users.items()
        ]
        _format_kafka_storage(base, properties, "the secured Kafka", scram)
    heap = settings.kafka_heap
    pid = _start(
        settings,
        secured.name,
        [*base[:1], f"-Xms{heap}", f"-Xmx{heap}", *base[1:], "kafka.Kafka", str(properties)],
    )
    _wait_ready(settings, secured.name, pid, lambda: _secured_kafka_ready(secured))
    return secured.bootstrap_servers


def stop_secured_kafka(settings: InfraSettings, secured: SecuredKafka) -> bool:
    """Stop the secured broker; True if it ran. Its data stay (start resumes)."""
    return _stop(settings, secured.name)


# --- Elasticsearch ------------------------------------------------------------------


def _es_ready(
    url: str, auth: tuple[str, str] | None = None, verify: ssl.SSLContext | bool = True
) -> bool:
    try:
        response = httpx.get(f"{url}/_cluster/health", timeout=2.0, auth=auth, verify=verify)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and response.json().get("status") in ("yellow", "green")


def _ensure_system_user(name: str) -> tuple[int, int]:
    """Uid and gid of the system user ``name``, created (no home, no shell) if missing."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def _as_user(uid: int, gid: int) -> list[str]:
    """The prefix that runs a command as ``uid``/``gid`` (servers that refuse root)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


def _chown_tree(folder: Path, uid: int, gid: int) -> None:
    for path in (folder, *folder.rglob("*")):
        os.chown(path, uid, gid)


def start_elasticsearch(settings: InfraSettings) -> None:
    """Start single-node Elasticsearch unless it already runs; wait for yellow or green."""
    url = endpoints(settings).elasticsearch_url
    _start_elasticsearch_node(
        settings,
        "elasticsearch",
        settings.es_port,
        settings.es_transport_port,
        lambda: _es_ready(url),
    )


@dataclass(frozen=True)
class SecuredElasticsearch:
    """A second Elasticsearch with security on, as production clusters run it.

    HTTPS from a PEM certificate chain and key (names must match ``127.0.0.1``) signed by
    ``ca_file``; users of the file realm (``users``: name -> password, made with
    ``elasticsearch-users`` before the first start), each given the role ``user_roles``
    names, roles defined by ``roles`` (the text of a ``roles.yml``). ``admin`` (among the
    users) is a superuser. The transport layer stays plaintext on loopback (single node).
    """

    port: int
    transport_port: int
    ca_file: Path
    certificate_file: Path
    key_file: Path
    users: dict[str, str]
    user_roles: dict[str, str]
    roles: str
    admin: str = "admin"
    name: str = "elasticsearch-secured"  # its state folder, PID file and log

    @property
    def url(self) -> str:
        """Where clients connect (HTTPS)."""
        return f"https://127.0.0.1:{self.port}"


def start_secured_elasticsearch(settings: InfraSettings, secured: SecuredElasticsearch) -> str:
    """Start the secured Elasticsearch (see :class:`SecuredElasticsearch`); its URL.

    Its data, configuration and log live in ``<state_dir>/<name>``; stop it with
    :func:`stop_secured_elasticsearch`.
    """
    auth = (secured.admin, secured.users[secured.admin])
    trusting = ssl.create_default_context(cafile=str(secured.ca_file))
    _start_elasticsearch_node(
        settings,
        secured.name,
        secured.port,
        secured.transport_port,
        lambda: _es_ready(secured.url, auth, trusting),
        secured,
    )
    return secured.url


def stop_secured_elasticsearch(settings: InfraSettings, secured: SecuredElasticsearch) -> bool:
    """Stop the secured Elasticsearch; True if it ran."""
    return _stop(settings, secured.name)


def _secure_elasticsearch_config(
    secured: SecuredElasticsearch, config_dir: Path, env: dict[str, str]
) -> str:
    """Put the TLS files, roles and users into ``config_dir``; the settings that use them."""
    certs = config_dir / "certs"
    certs.mkdir(exist_ok=True)
    for source, target in (
        (secured.ca_file, "ca.pem"),
        (secured.certificate_file, "node.pem"),
        (secured.key_file, "node-key.pem"),
    ):
        shutil.copy(source, certs / target)
    (config_dir / "roles.yml").write_text(secured.roles)
    users_tool = jvm.elasticsearch_home() / "bin" / "elasticsearch-users"
    for user, password in secured.users.items():
        role = "superuser" if user == secured.admin else secured.user_roles[user]
        subprocess.run(
            [str(users_tool), "useradd", user, "-p", password, "-r", role],
            env={**os.environ, **env},
            check=True,
            capture_output=True,
        )
    return (
        "xpack.security.enabled: true\n"
        "xpack.security.http.ssl.enabled: true\n"
        "xpack.security.http.ssl.certificate: certs/node.pem\n"
        "xpack.security.http.ssl.key: certs/node-key.pem\n"
        "xpack.security.http.ssl.certificate_authorities: [certs/ca.pem]\n"
        "xpack.security.transport.ssl.enabled: false\n"
        "xpack.security.authc.realms.file.file1.order: 0\n"
    )


def _start_elasticsearch_node(
    settings: InfraSettings,
    name: str,
    port: int,
    transport_port: int,
    ready: Callable[[], bool],
    secured: SecuredElasticsearch | None = None,
) -> None:
    """Start a single-node Elasticsearch called ``name`` unless it runs; wait until ``ready``."""
    if (pid := _read_pid(settings, name)) is not None:
        _wait_ready(settings, name, pid, ready)
        return
    home = jvm.elasticsearch_home()
    if not (home / "bin" / "elasticsearch").exists():
        raise InfraError("Elasticsearch is not in the JVM cache; run `make jvm` first")
    if secured is None:
        ports = {"es_port": port, "es_transport_port": transport_port}
        _check_ports_free("Elasticsearch", ports)
    else:  # free ports chosen by the caller: no setting to name
        _check_ports_free(name, {"port": port, "transport_port": transport_port})
    java_home = _find_java_home(MIN_ES_JAVA, "CDC_ES_JAVA_HOME")
    folder = settings.state_dir / name
    config_dir, data_dir, logs_dir, tmp_dir = (
        folder / "config",
        folder / "data",
        folder / "logs",
        folder / "tmp",
    )
    env = {
        "ES_JAVA_HOME": str(java_home),
        "ES_PATH_CONF": str(config_dir),
        "ES_TMPDIR": str(tmp_dir),
    }
    first_start = not config_dir.exists()
    if first_start:
        shutil.copytree(home / "config", config_dir)
    for path in (data_dir, logs_dir, tmp_dir):
        path.mkdir(parents=True, exist_ok=True)
    config = Template(
        (_deploy_local() / "elasticsearch" / "elasticsearch.yml.template").read_text()
    ).substitute(port=port, transport_port=transport_port, data_dir=data_dir, logs_dir=logs_dir)
    if secured is not None:
        config = config.replace("xpack.security.enabled: false\n", "")
        if first_start:
            security = _secure_elasticsearch_config(secured, config_dir, env)
            (config_dir / "security.yml.part").write_text(security)
        config += (config_dir / "security.yml.part").read_text()
    (config_dir / "elasticsearch.yml").write_text(config)
    command = [str(home / "bin" / "elasticsearch")]
    if os.geteuid() == 0:
        uid, gid = _ensure_system_user(ES_USER)
        _chown_tree(folder, uid, gid)
        command = [*_as_user(uid, gid), *command]
    heap = settings.es_heap
    pid = _start(settings, name, command, env={**env, "ES_JAVA_OPTS": f"-Xms{heap} -Xmx{heap}"})
    _wait_ready(settings, name, pid, ready)


# --- schema registry ----------------------------------------------------------------


def _answers(url: str) -> bool:
    """Whether an HTTP API answers ``GET url`` with 200 (a readiness probe)."""
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def start_registry(settings: InfraSettings) -> str:
    """Start Apicurio Registry (in-memory) unless it runs; wait until its API answers.

    Returns the URL of its Confluent-compatible API. Its schemas live as long as the
    process: a restart forgets them, as a test or demo registry may.
    """
    url = registry_url(settings)
    if (pid := _read_pid(settings, "registry")) is not None:
        _wait_ready(settings, "registry", pid, lambda: _answers(f"{url}/subjects"))
        return url
    home = jvm.registry_home()
    if not (home / "quarkus-run.jar").exists():
        raise InfraError("Apicurio Registry is not in the JVM cache; run `make jvm` first")
    _check_ports_free(
        "the schema registry",
        {
            "registry_port": settings.registry_port,
            "registry_management_port": settings.registry_management_port,
        },
    )
    java = _find_java_home(MIN_REGISTRY_JAVA, "CDC_REGISTRY_JAVA_HOME") / "bin" / "java"
    heap = settings.registry_heap
    pid = _start(
        settings,
        "registry",
        [
            str(java),
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseSerialGC",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={settings.registry_port}",
            "-Dquarkus.log.level=WARN",
            "-Dquarkus.http.access-log.enabled=false",
            # Quarkus' management interface (health, metrics) listens on every address
            # at port 9000 unless told otherwise: the S3 server's default port.
            "-Dquarkus.management.host=127.0.0.1",
            f"-Dquarkus.management.port={settings.registry_management_port}",
            "-jar",
            str(home / "quarkus-run.jar"),
        ],
    )
    _wait_ready(settings, "registry", pid, lambda: _answers(f"{url}/subjects"))
    return url


# --- S3 (S3Proxy) -------------------------------------------------------------------


def s3_client(settings: InfraSettings) -> Any:
    """A boto3 S3 client for the local server, with its fixed credentials (path-style)."""
    return boto3.client(
        "s3",
        endpoint_url=s3_endpoint(settings),
        aws_access_key_id=S3_ACCESS_KEY,
        aws_secret_access_key=S3_SECRET_KEY,
        region_name=S3_REGION,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=5,
            read_timeout=5,
            retries={"max_attempts": 1},
        ),
    )


def _s3_ready(settings: InfraSettings) -> bool:
    """Whether the server answers a signed ListBuckets (so the credentials work too)."""
    try:
        s3_client(settings).list_buckets()
    except (BotoCoreError, ClientError):
        return False
    return True


def start_s3(settings: InfraSettings) -> str:
    """Start S3Proxy unless it runs; wait for it and make the bucket ``S3_BUCKET``.

    Storage is S3Proxy's in-memory backend (``transient``): its file-system backends
    mishandle the empty directory markers Hadoop's S3A writes (Spark's checkpoint
    folders then vanish or turn into files). Objects live as long as the process, like
    the registry's schemas. Credentials are the fixed ``S3_ACCESS_KEY`` /
    ``S3_SECRET_KEY``, on loopback only. Returns the endpoint.
    """
    url = s3_endpoint(settings)
    if (pid := _read_pid(settings, "s3")) is None:
        jar = jvm.s3proxy_jar()
        if not jar.is_file():
            raise InfraError("S3Proxy is not in the JVM cache; run `make jvm` first")
        _check_ports_free("the S3 server", {"s3_port": settings.s3_port})
        java = _find_java_home(17, "CDC_S3_JAVA_HOME") / "bin" / "java"
        folder = settings.state_dir / "s3"
        folder.mkdir(parents=True, exist_ok=True)
        properties = folder / "s3proxy.conf"
        properties.write_text(
            "\n".join(
                [
                    "# Written by `cdc infra up --with-s3`: loopback, fixed local credentials.",
                    f"s3proxy.endpoint={url}",
                    "s3proxy.authorization=aws-v2-or-v4",
                    f"s3proxy.identity={S3_ACCESS_KEY}",
                    f"s3proxy.credential={S3_SECRET_KEY}",
                    "jclouds.provider=transient",
                    "",
                ]
            )
        )
        properties.chmod(0o600)
        heap = settings.s3_heap
        pid = _start(
            settings,
            "s3",
            [
                str(java),
                f"-Xms{heap}",
                f"-Xmx{heap}",
                "-XX:+UseSerialGC",
                "-jar",
                str(jar),
                "--properties",
                str(properties),
            ],
        )
    _wait_ready(settings, "s3", pid, lambda: _s3_ready(settings))
    client = s3_client(settings)
    if S3_BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=S3_BUCKET)
    return url


# --- PostgreSQL ---------------------------------------------------------------------


def postgres_password(settings: InfraSettings) -> str:
    """The superuser's password, made with the data folder (a file readable by this user).

    Never printed: commands get it through ``PGPASSWORD``, connectors through their
    configuration (Connect hides password fields in its logs).
    """
    try:
        return (settings.state_dir / "postgres.password").read_text().strip()
    except OSError:
        raise InfraError(
            "PostgreSQL has not been set up here; run `cdc infra up --with-postgres`"
        ) from None


def _postgres_ready(settings: InfraSettings) -> bool:
    if not _port_taken(settings.postgres_port):
        return False
    answered = subprocess.run(
        [
            str(settings.postgres_bin / "pg_isready"),
            "--quiet",
            "--host=127.0.0.1",
            f"--port={settings.postgres_port}",
            f"--username={POSTGRES_SUPERUSER}",
            "--dbname=postgres",
        ],
        capture_output=True,
        check=False,
    )
    return answered.returncode == 0


def _init_postgres(settings: InfraSettings, data_dir: Path, owner: tuple[int, int] | None) -> None:
    """``initdb`` a fresh data folder (as ``owner`` when given).

    UTF-8, superuser ``cdc`` with a new random password, password (SCRAM) authentication
    over TCP on loopback only, replication connections allowed.
    """
    password_file = settings.state_dir / "postgres.password"
    password = secrets.token_urlsafe(18)
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    # initdb reads the password from a file its own user can read; gone right after.
    handoff = data_dir.parent / "initdb.pw"
    handoff.write_text(password + "\n")
    if owner is not None:
        os.chown(handoff, *owner)
    handoff.chmod(0o600)
    try:
        made = subprocess.run(
            [
                *(_as_user(*owner) if owner else []),
                str(settings.postgres_bin / "initdb"),
                f"--pgdata={data_dir}",
                f"--username={POSTGRES_SUPERUSER}",
                f"--pwfile={handoff}",
                "--auth=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        handoff.unlink(missing_ok=True)
    if made.returncode != 0:
        raise InfraError(f"initdb failed:\n{made.stdout}{made.stderr}")
    (data_dir / "pg_hba.conf").write_text(
        "# Written by `cdc infra up`: TCP on loopback only, passwords (SCRAM).\n"
        "host all all 127.0.0.1/32 scram-sha-256\n"
        "host replication all 127.0.0.1/32 scram-sha-256\n"
    )


def start_postgres(settings: InfraSettings) -> str:
    """Start PostgreSQL (``wal_level=logical``, loopback only) unless it runs; wait for it.

    The data folder is made on first start (``initdb``) and kept: a restart resumes.
    Under root it runs as the system user ``cdc-pg``. Returns ``host:port``.
    """
    address = f"127.0.0.1:{settings.postgres_port}"
    if (pid := _read_pid(settings, "postgres")) is not None:
        _wait_ready(settings, "postgres", pid, lambda: _postgres_ready(settings))
        return address
    if not (settings.postgres_bin / "postgres").exists():
        raise InfraError(
            f"PostgreSQL {POSTGRES_MAJOR} is not installed ({settings.postgres_bin} has no "
            f"postgres); install the Debian package postgresql-{POSTGRES_MAJOR} "
            "(deploy/local/ensure-tools.sh does) or set CDC_INFRA_POSTGRES_BIN"
        )
    _check_ports_free("PostgreSQL", {"postgres_port": settings.postgres_port})
    folder = settings.state_dir / "postgres"
    data_dir = folder / "data"
    folder.mkdir(parents=True, exist_ok=True)
    owner = _ensure_system_user(POSTGRES_USER) if os.geteuid() == 0 else None
    if not (data_dir / "PG_VERSION").exists():
        if data_dir.exists():
            shutil.rmtree(data_dir)  # a failed initdb's leftovers
        data_dir.mkdir(mode=0o700)
        if owner is not None:
            _chown_tree(folder, *owner)
        _init_postgres(settings, data_dir, owner)
    if owner is not None:
        _chown_tree(folder, *owner)
    pid = _start(
        settings,
        "postgres",
        [
            *(_as_user(*owner) if owner else []),
            str(settings.postgres_bin / "postgres"),
            "-D",
            str(data_dir),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"port={settings.postgres_port}",
            "-c",
            "unix_socket_directories=",  # TCP on loopback only
            "-c",
            "wal_level=logical",  # what Debezium's logical decoding (pgoutput) needs
            "-c",
            "max_replication_slots=20",
            "-c",
            "max_wal_senders=20",
            "-c",
            "shared_buffers=64MB",
            "-c",
            "fsync=off",  # a test and demo server: speed over crash safety
            "-c",
            "full_page_writes=off",
            "-c",
            "logging_collector=off",
        ],
    )
    _wait_ready(settings, "postgres", pid, lambda: _postgres_ready(settings))
    return address


# --- Kafka Connect ------------------------------------------------------------------


def connect_home() -> Path:
    """The Kafka Connect worker and its plugins in the JVM cache (may not exist yet)."""
    return jvm.jvm_cache_dir() / "connect"


def start_connect(settings: InfraSettings) -> str:
    """Start a standalone Kafka Connect worker on the local Kafka unless it runs.

    Waits for its REST API and returns its URL. Plugins (Debezium's PostgreSQL connector,
    Apicurio's converter) are found in the cache's plugin folders
    (``plugin.discovery=hybrid_warn``). Source offsets go to a file in the state folder;
    connectors added over the REST API live as long as the process.
    """
    url = connect_url(settings)
    if (pid := _read_pid(settings, "connect")) is not None:
        _wait_ready(settings, "connect", pid, lambda: _answers(f"{url}/connectors"))
        return url
    home = connect_home()
    classpath = sorted((home / "libs").glob("*.jar")) if (home / "libs").is_dir() else []
    if not classpath or not (home / "plugins").is_dir():
        raise InfraError("Kafka Connect is not in the JVM cache; run `make jvm` first")
    _check_ports_free("Kafka Connect", {"connect_port": settings.connect_port})
    java = _find_java_home(MIN_CONNECT_JAVA, "CDC_CONNECT_JAVA_HOME") / "bin" / "java"
    folder = settings.state_dir / "connect"
    folder.mkdir(parents=True, exist_ok=True)
    worker = folder / "worker.properties"
    worker.write_text(
        "\n".join(
            [
                "# Written by `cdc infra up --with-postgres`: a standalone worker on loopback.",
                f"bootstrap.servers={endpoints(settings).kafka_bootstrap_servers}",
                f"listeners=http://127.0.0.1:{settings.connect_port}",
                "rest.advertised.host.name=127.0.0.1",
                f"rest.advertised.port={settings.connect_port}",
                # Each connector names its own converters; these are the fallback.
                "key.converter=org.apache.kafka.connect.json.JsonConverter",
                "value.converter=org.apache.kafka.connect.json.JsonConverter",
                f"offset.storage.file.filename={folder / 'offsets.dat'}",
                "offset.flush.interval.ms=1000",
                f"plugin.path={home / 'plugins'}",
                "plugin.discovery=hybrid_warn",
                # Connectors may create their topics (topic.creation.default.*).
                "topic.creation.enable=true",
                "",
            ]
        )
    )
    # Properties, not YAML: the worker's classpath has no YAML parser for log4j2.
    logging = folder / "log4j2.properties"
    logging.write_text(
        "\n".join(
            [
                "appender.out.type=Console",
                "appender.out.name=STDOUT",
                "appender.out.layout.type=PatternLayout",
                "appender.out.layout.pattern=[%d] %p %m (%c)%n",
                "rootLogger.level=INFO",
                "rootLogger.appenderRef.out.ref=STDOUT",
                # Every config dump at start: long, and not what a reader of the log wants.
                "logger.config.name=org.apache.kafka.common.config.AbstractConfig",
                "logger.config.level=WARN",
                "",
            ]
        )
    )
    heap = settings.connect_heap
    pid = _start(
        settings,
        "connect",
        [
            str(java),
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseSerialGC",
            f"-Dlog4j2.configurationFile={logging}",
            "-cp",
            ":".join(str(p) for p in classpath),
            "org.apache.kafka.connect.cli.ConnectStandalone",
            str(worker),
        ],
    )
    _wait_ready(settings, "connect", pid, lambda: _answers(f"{url}/connectors"))
    return url


# --- Spark standalone cluster ------------------------------------------------------


def _spark_class() -> Path:
    """The installed pyspark's ``bin/spark-class`` (its wheel carries no ``sbin`` scripts).

    Found without importing PySpark: ``cdc`` loads this module for every command.
    """
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise RuntimeError("pyspark is not installed: pip install the project first")
    return Path(spec.origin).resolve().parent / "bin" / "spark-class"


def spark_master_state(settings: InfraSettings) -> dict[str, Any] | None:
    """The master's JSON summary (status, workers, applications); None if it does not answer."""
    try:
        response = httpx.get(spark_master_json_url(settings), timeout=2.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    state: dict[str, Any] = response.json()
    return state


def _alive_workers(settings: InfraSettings) -> int:
    state = spark_master_state(settings)
    if state is None or state.get("status") != "ALIVE":
        return -1
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


def _spark_env(settings: InfraSettings, folder: Path) -> dict[str, str]:
    """The environment of the master and workers: loopback, their own conf and log folders.

    Workers pass it on to their executors, so ``PYSPARK_PYTHON`` (this interpreter) and
    ``PYTHONPATH`` reach the Python workers that executors start.
    """
    java_home = _find_java_home(17, "CDC_SPARK_JAVA_HOME")
    conf_dir = folder / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    return {
        "JAVA_HOME": str(java_home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_CONF_DIR": str(conf_dir),  # empty: no spark-defaults.conf is picked up
        "SPARK_LOG_DIR": str(folder / "logs"),
        "SPARK_DAEMON_MEMORY": settings.spark_daemon_heap,
        "PYSPARK_PYTHON": sys.executable,
    }


def _worker_pid_names(settings: InfraSettings) -> list[str]:
    """The PID-file names of the workers started here (``spark-worker-<n>``)."""
    return sorted(p.stem for p in settings.state_dir.glob(f"{SPARK_WORKERS}-*.pid"))


def start_spark_cluster(settings: InfraSettings) -> str:
    """Start a standalone Spark master and ``spark_workers`` workers unless they run.

    All on loopback; each worker offers ``spark_worker_cores`` cores and
    ``spark_worker_memory`` to executors, with its work folder (executor logs, fetched
    jars) under the state folder, and runs executors' Python with this interpreter.
    Waits until the master lists that many ALIVE workers; returns the master's URL.
    """
    url = spark_master_url(settings)
    spark_class = _spark_class()
    if not spark_class.is_file():
        raise InfraError(f"pyspark's spark-class is missing ({spark_class}); reinstall pyspark")
    folder = settings.state_dir / "spark"
    env = _spark_env(settings, folder)
    if (pid := _read_pid(settings, "spark-master")) is None:
        _check_ports_free(
            "the Spark master",
            {
                "spark_master_port": settings.spark_master_port,
                "spark_master_webui_port": settings.spark_master_webui_port,
            },
        )
        pid = _start(
            settings,
            "spark-master",
            [
                str(spark_class),
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(settings.spark_master_port),
                "--webui-port",
                str(settings.spark_master_webui_port),
            ],
            env,
        )
    _wait_ready(settings, "spark-master", pid, lambda: _alive_workers(settings) >= 0)
    for n in range(settings.spark_workers):
        name = f"{SPARK_WORKERS}-{n}"
        if _read_pid(settings, name) is not None:
            continue
        webui_port = settings.spark_worker_webui_port + n
        _check_ports_free("a Spark worker", {"spark_worker_webui_port": webui_port})
        work_dir = folder / f"worker-{n}"
        work_dir.mkdir(parents=True, exist_ok=True)
        worker_env = {
            **env,
            # Executors' scratch space (shuffle, spills) under the state folder too.
            "SPARK_LOCAL_DIRS": str(work_dir / "local"),
            # Finished applications' folders (fetched jars, executor logs) go after a day.
            "SPARK_WORKER_OPTS": "-Dspark.worker.cleanup.enabled=true "
            "-Dspark.worker.cleanup.appDataTtl=86400",
        }
        _start(
            settings,
            name,
            [
                str(spark_class),
                "org.apache.spark.deploy.worker.Worker",
                url,
                "--host",
                "127.0.0.1",
                "--cores",
                str(settings.spark_worker_cores),
                "--memory",
                settings.spark_worker_memory,
                "--webui-port",
                str(webui_port),
                "--work-dir",
                str(work_dir),
            ],
            worker_env,
        )
    # The master must list every worker as ALIVE; a worker that dies meanwhile fails it.
    _wait_ready(
        settings,
        "spark-master",
        pid,
        lambda: _workers_ready(settings),
    )
    return url


def _workers_ready(settings: InfraSettings) -> bool:
    for name in _worker_pid_names(settings):
        if _read_pid(settings, name) is None:
            raise InfraError(
                f"{name} exited during start; last lines of its log:\n{_log_tail(settings, name)}"
            )
    return _alive_workers(settings) >= settings.spark_workers


def _stop_server(settings: InfraSettings, name: str) -> bool:
    """Stop one entry of ``SERVERS``; ``spark-worker`` stops every worker."""
    if name == SPARK_WORKERS:
        return any([_stop(settings, w) for w in _worker_pid_names(settings)])
    return _stop(settings, name)


def _server_running(settings: InfraSettings, name: str) -> bool:
    if name == SPARK_WORKERS:
        return any(_read_pid(settings, w) is not None for w in _worker_pid_names(settings))
    return _read_pid(settings, name) is not None


# --- the whole ----------------------------------------------------------------------


def _deploy_local() -> Path:
    root = jvm.project_root()
    if root is None:
        raise InfraError("`cdc infra` runs from a source checkout (it needs deploy/local)")
    return root / "deploy" / "local"


def up(
    settings: InfraSettings | None = None,
    with_registry: bool = False,
    with_postgres: bool = False,
    with_s3: bool = False,
    with_spark_cluster: bool = False,
) -> Endpoints:
    """Start Kafka and Elasticsearch; the registry, S3, PostgreSQL, Connect, Spark if asked.

    The Spark standalone cluster is a master and its workers. Idempotent. Servers
    started before are reported whether asked for or not.
    """
    settings = settings or InfraSettings()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    start_kafka(settings)
    start_elasticsearch(settings)
    if with_registry:
        start_registry(settings)
    if with_s3:
        start_s3(settings)
    if with_postgres:
        start_postgres(settings)
        start_connect(settings)
    if with_spark_cluster:
        start_spark_cluster(settings)
    now = running(settings)
    served = endpoints(
        settings,
        with_registry or now["registry"],
        with_postgres or (now["postgres"] and now["connect"]),
        with_s3 or now["s3"],
        with_spark_cluster or (now["spark-master"] and now[SPARK_WORKERS]),
    )
    (settings.state_dir / "endpoints.json").write_text(json.dumps(served.__dict__, indent=2))
    return served


def down(settings: InfraSettings | None = None) -> list[str]:
    """Stop what ``up`` started; returns the names of the servers that were running."""
    settings = settings or InfraSettings()
    return [name for name in reversed(SERVERS) if _stop_server(settings, name)]


def running(settings: InfraSettings | None = None) -> dict[str, bool]:
    """Which local servers are running (by their PID files)."""
    settings = settings or InfraSettings()
    return {name: _server_running(settings, name) for name in SERVERS}


def stop(settings: InfraSettings, name: str) -> bool:
    """Stop one server (one of ``SERVERS``); True if it ran.

    Kafka's, Elasticsearch's and PostgreSQL's data stay: starting them again (``up``)
    resumes where they stopped. Used by the fault injection of the chaos run and the restart tests.
    """
    if name not in SERVERS:
        raise InfraError(f"unknown server {name!r}: one of {', '.join(SERVERS)}")
    return _stop_server(settings, name)


def pause(settings: InfraSettings, name: str) -> bool:
    """Freeze a running server (SIGSTOP to its process group); True if it was running.

    A frozen server accepts connections but answers nothing: how an overloaded or
    garbage-collecting server looks to its clients. The chaos run slows Elasticsearch
    down with short freezes.
    """
    return _signal_group(settings, name, signal.SIGSTOP)


def resume(settings: InfraSettings, name: str) -> bool:
    """Let a server frozen by :func:`pause` run again."""
    return _signal_group(settings, name, signal.SIGCONT)


def _signal_group(settings: InfraSettings, name: str, sig: signal.Signals) -> bool:
    pid = _read_pid(settings, name)
    if pid is None:
        return False
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True
