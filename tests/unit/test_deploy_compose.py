"""The container images and docker-compose.yml agree with the code (static: no Docker engine).

What a running stack would find out late is checked here: every service script has an
image and a compose service, each runs its script with the mounted pipeline file, its
healthcheck probes the port its configuration serves /health on (and the healthcheck
command really tells a healthy service from a failing one), the JVM jars land where
cdc_shared.jvm.artifacts looks, the mounted pipeline file loads and has the example entities,
volumes and dependencies are declared, and Kafka is configured for single-node
transactions.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import pytest
import yaml
from cdc_shared.avro.registry import ConfluentSchemaRegistry, subject_name
from cdc_shared.clients.schemas import entity_schemas
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.jvm import artifacts as jvm
from cdc_shared.streaming.observability import HealthServer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_PIPELINE = DOCKER / "pipeline.compose.yaml"
LOCAL_PIPELINE = ROOT / "deploy" / "local" / "pipeline.yaml"
CONFIG_PATH = "/etc/cdc/pipeline.yaml"  # where images and compose put the pipeline file
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SCRIPTS = sorted(name for name in PYPROJECT["project"]["scripts"] if name != "cdc")
# What an image runs: each service's script, and `cdc run` (all four in one application).
APPLICATION = "cdc run"
DEPLOYABLES = [*SCRIPTS, APPLICATION]
INFRA = {"kafka", "schema-registry", "elasticsearch", "init"}
# What each service reads or writes besides Delta, so compose must start it first.
NEEDS = {
    "cdc-ingestor": {"kafka", "schema-registry", "init"},
    "cdc-merger": {"init"},
    "cdc-publisher-kafka": {"kafka", "schema-registry", "init"},
    "cdc-publisher-es": {"elasticsearch", "init"},
    APPLICATION: {"kafka", "schema-registry", "elasticsearch", "init"},
}
JVM_CACHE_IN_IMAGE = "/opt/cdc/jvm"


def service_of(script: str) -> str:
    """``cdc-publisher-kafka`` -> ``publisher-kafka`` (compose service, Dockerfile name)."""
    return "application" if script == APPLICATION else script.removeprefix("cdc-")


def metrics_port(config: PipelineConfig, script: str) -> int:
    """The service's ``<attribute>.metrics_port`` (ingestor, merger, publisher_kafka, ...)."""
    return int(getattr(config, service_of(script).replace("-", "_")).metrics_port)


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return instructions


def only(instructions: list[tuple[str, str]], keyword: str) -> str:
    values = [rest for kw, rest in instructions if kw == keyword]
    assert len(values) == 1, f"expected one {keyword}, found {values}"
    return values[0]


def env_of(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """Every ``ENV`` of a Dockerfile (KEY=VALUE form)."""
    found: dict[str, str] = {}
    for keyword, rest in instructions:
        if keyword == "ENV":
            for name, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', rest):
                found[name] = value.strip('"')
    return found


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), f"not in exec (JSON) form: {value}"
    return [str(v) for v in parsed]


def python_code(command: list[str]) -> str:
    """The ``python -c CODE`` of a healthcheck command (CMD or compose test list)."""
    if command[0] == "CMD":
        command = command[1:]
    assert command[:2] == ["python", "-c"], f"healthcheck must run python -c: {command}"
    return command[2]


def duration_s(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(number) * units[unit]
    assert total > 0, f"cannot read duration {value!r}"
    return total


def size_bytes(value: str | int) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)i?b?", str(value).lower())
    assert match, f"cannot read size {value!r}"
    return float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


@pytest.fixture(autouse=True)
def _no_cdc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configuration under test is the files', not this shell's CDC_* overrides."""
    for name in [n for n in os.environ if n.startswith("CDC_")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture
def compose_config() -> PipelineConfig:
    return load_config(COMPOSE_PIPELINE)


def volumes_of(service: dict[str, Any]) -> list[dict[str, Any]]:
    """A service's volumes in long form (short ``source:target[:ro]`` strings converted)."""
    result = []
    for item in service.get("volumes", []):
        if isinstance(item, str):
            source, target, *mode = item.split(":")
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            result.append(
                {"type": kind, "source": source, "target": target, "read_only": mode == ["ro"]}
            )
        else:
            result.append(item)
    return result


def env_dict(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


# ---- images ---------------------------------------------------------------------------


def test_there_are_services_to_check() -> None:
    assert {"cdc-ingestor", "cdc-merger"} <= set(SCRIPTS)
    assert "cdc" in PYPROJECT["project"]["scripts"]


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_every_service_script_has_an_image_and_a_compose_service(
    script: str, compose: dict[str, Any]
) -> None:
    dockerfile = DOCKER / f"{service_of(script)}.Dockerfile"
    assert dockerfile.is_file(), f"{script} has no image: {dockerfile}"
    service = compose["services"].get(service_of(script))
    assert service is not None, f"{script} has no compose service {service_of(script)!r}"
    assert service["build"]["context"] == "."
    assert (ROOT / service["build"]["dockerfile"]).resolve() == dockerfile.resolve()


def test_no_image_or_compose_service_without_a_script(compose: dict[str, Any]) -> None:
    images = {p.name.removesuffix(".Dockerfile") for p in DOCKER.glob("*.Dockerfile")}
    assert images == {"base"} | {service_of(s) for s in DEPLOYABLES}
    assert set(compose["services"]) == INFRA | {service_of(s) for s in DEPLOYABLES}


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_service_dockerfile_runs_the_script_with_the_pipeline_file(script: str) -> None:
    instructions = parse_dockerfile(DOCKER / f"{service_of(script)}.Dockerfile")
    port = metrics_port(PipelineConfig(), script)

    assert only(instructions, "FROM") == "${BASE_IMAGE}"
    assert only(instructions, "ARG") == "BASE_IMAGE=cdc-base"
    assert only(instructions, "STOPSIGNAL") == "SIGTERM"
    assert only(instructions, "EXPOSE") == str(port)
    entrypoint = exec_form(only(instructions, "ENTRYPOINT"))
    assert entrypoint == ["tini", "--", *script.split()]  # tini forwards SIGTERM, reaps the JVM
    assert exec_form(only(instructions, "CMD")) == ["--config", CONFIG_PATH]
    healthcheck = only(instructions, "HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert f"http://127.0.0.1:{port}/health" in command
    start_period = re.search(r"--start-period=(\S+)", options)
    assert start_period and duration_s(start_period.group(1)) >= 60


def test_base_dockerfile_builds_what_the_services_expect() -> None:
    instructions = parse_dockerfile(DOCKER / "base.Dockerfile")
    text = (DOCKER / "base.Dockerfile").read_text(encoding="utf-8")
    env = env_of(instructions)
    froms = [rest for kw, rest in instructions if kw == "FROM"]
    args = dict(rest.split("=", 1) for kw, rest in instructions if kw == "ARG" and "=" in rest)

    # Python of the project (requires-python), a headless JRE 17, a JVM build stage.
    python_minor = re.search(r">=(\d+\.\d+)", PYPROJECT["project"]["requires-python"])
    assert python_minor and args["PYTHON_IMAGE"].startswith(f"python:{python_minor.group(1)}-")
    assert "-slim" in args["PYTHON_IMAGE"]
    assert "openjdk-17-jre-headless" in text
    assert froms[-1] == "${PYTHON_IMAGE}"  # the runtime stage: no Maven, no compilers
    assert "${MAVEN_IMAGE} AS jvm" in froms

    # Jars: Maven builds only the spark module into the cache the services read.
    assert env[jvm.JVM_CACHE_ENV_VAR] == JVM_CACHE_IN_IMAGE
    mvn = next(rest for kw, rest in instructions if kw == "RUN" and " mvn " in f" {rest}")
    assert "-f deploy/jvm/pom.xml" in mvn
    assert "-pl spark" in mvn
    assert f"-Djvm.cache={JVM_CACHE_IN_IMAGE}" in mvn
    spark_dir = f"{JVM_CACHE_IN_IMAGE}/spark"
    assert ("COPY", f"--from=jvm {spark_dir} {spark_dir}") in instructions

    # Pinned Python dependencies, then the project (not editable), then a pip check.
    assert any(
        "pip install --requirement deploy/docker/constraints.txt" in r for _, r in instructions
    )
    assert any(re.search(r"pip install --no-deps .* \.( |$)", r) for _, r in instructions)

    # What the compose/k8s pipeline files and the init service point into the image.
    assert ("COPY", "schemas/ /app/schemas/") in instructions
    assert ("COPY", "deploy/docker/init_pipeline.py /opt/cdc/init_pipeline.py") in instructions
    assert env["CDC_CONFIG"] == CONFIG_PATH
    spark_conf = env["SPARK_CONF_DIR"]
    copied = f"deploy/docker/spark-defaults.conf {spark_conf}/spark-defaults.conf"
    assert ("COPY", copied) in instructions

    # Non-root: the last USER is the uid created for the service user.
    user = [rest for kw, rest in instructions if kw == "USER"][-1]
    uid = user.split(":")[0]
    assert uid not in {"0", "root"}
    assert f"--uid {uid}" in text
    assert "chown -R cdc:cdc /data" in text

    # No secret baked in.
    for keyword, rest in instructions:
        if keyword in {"ENV", "ARG"}:
            assert not re.search(r"(?i)(password|secret|api_key|token)", rest), rest


def test_jvm_module_the_image_builds_fills_the_folder_the_services_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    parent = ET.parse(ROOT / "deploy" / "jvm" / "pom.xml").getroot()
    assert "spark" in [m.text for m in parent.findall("m:modules/m:module", ns)]
    spark_pom = ET.parse(ROOT / "deploy" / "jvm" / "spark" / "pom.xml").getroot()
    outputs = [e.text for e in spark_pom.iter(f"{{{ns['m']}}}outputDirectory")]
    assert outputs and set(outputs) == {"${jvm.cache}/spark"}  # Delta etc., hadoop-aws
    # ... which is where cdc_shared.jvm.artifacts looks under $CDC_JVM_CACHE.
    (tmp_path / "spark").mkdir()
    (tmp_path / "spark" / "delta-spark_2.13-x.jar").touch()
    monkeypatch.setenv(jvm.JVM_CACHE_ENV_VAR, str(tmp_path))
    assert jvm.spark_jars() == [tmp_path / "spark" / "delta-spark_2.13-x.jar"]


def test_spark_defaults_of_the_image_write_only_under_tmp() -> None:
    settings = dict(
        line.split(None, 1)
        for line in (DOCKER / "spark-defaults.conf").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert settings, "spark-defaults.conf sets nothing"
    for name, value in settings.items():
        assert value.strip().startswith("/tmp"), f"{name} writes outside /tmp: {value}"


def test_constraints_pin_every_runtime_dependency_within_its_range() -> None:
    pins: dict[str, str] = {}
    for line in (DOCKER / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version.strip()
    for text in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside {requirement.specifier}"
        )
    dev = {
        canonicalize_name(Requirement(t).name)
        for t in PYPROJECT["project"]["optional-dependencies"]["dev"]
    }
    runtime = {canonicalize_name(Requirement(t).name) for t in PYPROJECT["project"]["dependencies"]}
    assert not (dev - runtime) & set(pins), "dev-only packages would be installed in images"


def test_dockerignore_keeps_local_state_out_but_not_what_the_images_copy() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for required in (".venv", ".cache", ".state", "data", ".git"):
        assert required in patterns, f".dockerignore does not exclude {required}"
    copied: set[str] = set()
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        for keyword, rest in parse_dockerfile(dockerfile):
            if keyword == "COPY" and not rest.startswith("--from"):
                copied.update(rest.split()[:-1])
    assert copied, "no COPY found"
    for source in copied:
        path = PurePosixPath(source.rstrip("/"))
        assert (ROOT / path).exists(), f"COPY {source}: not in the repository"
        # Excluded if the path or a folder above it matches a pattern.
        for prefix in [path, *path.parents][:-1]:
            for pattern in patterns:
                excluded = fnmatch.fnmatchcase(str(prefix), pattern)
                assert not excluded, f"COPY {source} is excluded by .dockerignore {pattern!r}"


def test_images_do_not_contain_the_development_kit() -> None:
    # The kit (devkit/, cdc_devkit: demo, chaos, local servers) is a second distribution,
    # installed only by `make venv`: no image copies it, the build context leaves it out,
    # and the product's distribution (what the images install) does not package it.
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        for keyword, rest in parse_dockerfile(dockerfile):
            if keyword == "COPY" and not rest.startswith("--from"):
                sources = [PurePosixPath(s.rstrip("/")) for s in rest.split()[:-1]]
                assert not any(s.parts[:1] == ("devkit",) for s in sources), (
                    f"{dockerfile.name}: COPY {rest} copies the development kit"
                )
            if keyword == "RUN":
                assert "devkit" not in rest, f"{dockerfile.name}: RUN {rest}"
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert "devkit" in ignored, ".dockerignore does not exclude devkit"
    packaged = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
    assert not [w for w in packaged if PurePosixPath(w).parts[:1] == ("devkit",)], packaged
    kit = tomllib.loads((ROOT / "devkit" / "pyproject.toml").read_text(encoding="utf-8"))
    assert "cdc.commands" in kit["project"]["entry-points"]  # how `cdc` finds its commands


# ---- healthcheck command against the real health server ------------------------------


@pytest.fixture
def health_server() -> Iterator[tuple[HealthServer, dict[str, str]]]:
    state = {"status": "ok"}
    server = HealthServer("127.0.0.1", 0, lambda: dict(state)).start()
    yield server, state
    server.stop()


def healthcheck_commands(compose: dict[str, Any], script: str) -> dict[str, list[str]]:
    instructions = parse_dockerfile(DOCKER / f"{service_of(script)}.Dockerfile")
    _, _, image_command = only(instructions, "HEALTHCHECK").partition(" CMD ")
    return {
        "image": exec_form(image_command.strip()),
        "compose": list(compose["services"][service_of(script)]["healthcheck"]["test"]),
    }


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_healthcheck_passes_when_healthy_and_fails_otherwise(
    script: str, compose: dict[str, Any], health_server: tuple[HealthServer, dict[str, str]]
) -> None:
    server, state = health_server
    port = metrics_port(PipelineConfig(), script)
    for origin, command in healthcheck_commands(compose, script).items():
        code = python_code(command)
        assert f"127.0.0.1:{port}/" in code, f"{origin} healthcheck of {script} not on {port}"
        code = code.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{server.port}/")

        def run(snippet: str) -> int:
            done = subprocess.run(
                [sys.executable, "-c", snippet], check=False, capture_output=True, timeout=30
            )
            return done.returncode

        state["status"] = "ok"
        assert run(code) == 0, f"{origin} healthcheck of {script} fails a healthy service"
        state["status"] = "failing"
        assert run(code) != 0, f"{origin} healthcheck of {script} passes a 503"
        unused = code.replace(f"127.0.0.1:{server.port}/", "127.0.0.1:9/")
        assert run(unused) != 0, f"{origin} healthcheck of {script} passes without a server"


# ---- docker-compose.yml ---------------------------------------------------------------


def test_compose_pipeline_file_has_the_example_entities(compose_config: PipelineConfig) -> None:
    local = load_config(LOCAL_PIPELINE)
    assert [e.model_dump() for e in compose_config.entities] == [
        e.model_dump() for e in local.entities
    ]
    assert [e.name for e in compose_config.entities] == ["customers", "orders"]
    assert compose_config.storage_root == "/data"
    assert compose_config.schema_registry.dirs == [Path("/app/schemas")]
    assert compose_config.schema_registry.url
    assert compose_config.elasticsearch.api_key is None


def test_compose_pipeline_addresses_are_compose_services(
    compose: dict[str, Any], compose_config: PipelineConfig
) -> None:
    services = compose["services"]
    # Kafka: the bootstrap address is what the broker advertises on the compose network.
    kafka_env = env_dict(services["kafka"])
    bootstrap = compose_config.kafka.bootstrap_servers
    host = bootstrap.split(":")[0]
    assert host in services
    advertised = [a.split("://", 1)[1] for a in kafka_env["KAFKA_ADVERTISED_LISTENERS"].split(",")]
    assert bootstrap in advertised
    # Schema registry: a service listening on the URL's port.
    url = compose_config.schema_registry.url
    assert url is not None
    match = re.fullmatch(r"http://([\w-]+):(\d+)/?", url)
    assert match, f"registry URL {url}"
    registry = services[match.group(1)]
    assert registry["image"].startswith("confluentinc/cp-schema-registry:")
    listeners = env_dict(registry)["SCHEMA_REGISTRY_LISTENERS"]
    assert listeners.endswith(f":{match.group(2)}")
    assert env_dict(registry)["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"].endswith(bootstrap)
    # Elasticsearch: the image's default HTTP port.
    for es_host in compose_config.elasticsearch.hosts:
        match = re.fullmatch(r"http://([\w-]+):9200/?", es_host)
        assert match and match.group(1) in services, es_host


def test_kafka_is_a_single_kraft_node_with_transactions(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    env = env_dict(kafka)
    assert kafka["image"] == f"apache/kafka:{jvm.KAFKA_VERSION}"
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert not any("ZOOKEEPER" in name for name in env)
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    # Every single-node setting of the loopback broker the tests use is here too.
    template = (ROOT / "deploy" / "local" / "kafka" / "server.properties.template").read_text()
    for line in template.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.partition("=")
        if "replication.factor" in name or "min.isr" in name or "insync" in name:
            variable = "KAFKA_" + name.strip().upper().replace(".", "_")
            assert env.get(variable) == value.strip(), f"{variable} should be {value.strip()}"
    assert "/var/lib/kafka/data" in [v["target"] for v in volumes_of(kafka)]
    assert env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"


def test_elasticsearch_is_a_single_node_of_the_tested_version(compose: dict[str, Any]) -> None:
    es = compose["services"]["elasticsearch"]
    env = env_dict(es)
    image, _, tag = es["image"].rpartition(":")
    assert image.endswith("/elasticsearch") and tag == jvm.ELASTICSEARCH_VERSION
    client = next(
        Requirement(t)
        for t in PYPROJECT["project"]["dependencies"]
        if t.startswith("elasticsearch")
    )
    client_major = str(client.specifier).lstrip("=<>~!").split(".")[0]
    assert client_major == tag.split(".")[0]
    assert env["discovery.type"] == "single-node"
    assert env["xpack.security.enabled"] == "false"


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_compose_service_runs_the_script_with_the_mounted_pipeline(
    script: str, compose: dict[str, Any], compose_config: PipelineConfig
) -> None:
    service = compose["services"][service_of(script)]
    assert "entrypoint" not in service  # the image's: tini -- <script>
    assert service["command"] == ["--config", CONFIG_PATH]
    assert service.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert 60 <= duration_s(service["stop_grace_period"]) <= 300

    mounts = {v["target"]: v for v in volumes_of(service)}
    pipeline = mounts[CONFIG_PATH]
    assert pipeline["type"] == "bind"
    assert pipeline["read_only"] is True
    assert (ROOT / pipeline["source"]).resolve() == COMPOSE_PIPELINE.resolve()
    storage = mounts[compose_config.storage_root]
    assert storage["type"] == "volume"
    checkpoint = compose_config.layout.checkpoint("svc", "default")  # <root>/_streams/svc/default
    checkpoints = str(PurePosixPath(checkpoint).parent.parent)
    assert mounts[checkpoints]["type"] == "volume"
    assert mounts[checkpoints]["source"] != storage["source"]

    # Health: the port the mounted configuration serves /health on, and the default.
    port = metrics_port(compose_config, script)
    assert port == metrics_port(PipelineConfig(), script)
    test = service["healthcheck"]["test"]
    assert f"http://127.0.0.1:{port}/health" in python_code(test)
    assert duration_s(service["healthcheck"]["start_period"]) >= 60
    assert any(str(p).endswith(f":{port}") for p in service.get("ports", []))

    # Memory: the limit leaves room above the driver heap (ingestor: 2.4 GiB RSS at 2g).
    heap = size_bytes(env_dict(service)["SPARK_DRIVER_MEMORY"])
    assert size_bytes(service["mem_limit"]) >= 1.25 * heap


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_a_service_with_a_published_metrics_port_binds_it_on_every_interface(
    script: str, compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A published port arrives at the container's IP, which the loopback default misses."""
    service = compose["services"][service_of(script)]
    for name, value in env_dict(service).items():
        monkeypatch.setenv(name, value)
    config = load_config(COMPOSE_PIPELINE)  # as the container loads it: file, then its env
    port = metrics_port(config, script)
    published = [p for p in service.get("ports", []) if str(p).endswith(f":{port}")]
    assert published, f"{script}: compose publishes no port {port}"
    section = getattr(config, service_of(script).replace("-", "_"))
    assert section.metrics_host == "0.0.0.0", (
        f"{script} binds /health and /metrics to {section.metrics_host}: the published port "
        f"{published[0]} would not reach it; set CDC_{section_env(script)}__METRICS_HOST"
    )


def section_env(script: str) -> str:
    """``cdc-publisher-kafka`` -> ``PUBLISHER_KAFKA``: its section in CDC_* variables."""
    return service_of(script).replace("-", "_").upper()


def test_one_application_is_an_alternative_to_the_four_services(compose: dict[str, Any]) -> None:
    # Both at once would give each table two writers: the application is opt-in only.
    services = compose["services"]
    assert services[service_of(APPLICATION)].get("profiles") == ["one-app"]
    assert all("profiles" not in services[service_of(s)] for s in SCRIPTS)


def test_every_named_volume_is_declared_and_used(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used = {
        v["source"]
        for service in compose["services"].values()
        for v in volumes_of(service)
        if v["type"] == "volume"
    }
    assert used - declared == set(), f"undeclared volumes: {used - declared}"
    assert declared - used == set(), f"unused volumes: {declared - used}"
    for service in compose["services"].values():
        for v in volumes_of(service):
            if v["type"] == "bind":
                assert (ROOT / v["source"]).exists(), f"bind source {v['source']} missing"


def test_dependencies_exist_and_start_in_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    graph: dict[str, set[str]] = {}
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        graph[name] = set(depends)
        for target, spec in depends.items():
            assert target in services, f"{name} depends on unknown {target}"
            condition = spec["condition"]
            if condition == "service_healthy":
                has_check = "healthcheck" in services[target]
                assert has_check, f"{name} waits for {target} to be healthy: no healthcheck"
            else:
                assert condition == "service_completed_successfully", condition
                assert services[target].get("restart") == "no", f"{target} is not one-shot"
    # No cycle, and everything a service needs starts before it (transitively).
    order: list[str] = []
    while len(order) < len(graph):
        ready = [n for n in graph if n not in order and graph[n] <= set(order)]
        assert ready, f"depends_on cycle among {set(graph) - set(order)}"
        order.extend(sorted(ready))

    def before(name: str) -> set[str]:
        direct = graph[name]
        return direct.union(*(before(d) for d in direct)) if direct else set()

    for script in DEPLOYABLES:
        missing = NEEDS.get(script, {"init"}) - before(service_of(script))
        assert not missing, f"{service_of(script)} starts without {missing}"


def test_init_uses_the_base_image_and_its_script(compose: dict[str, Any]) -> None:
    init = compose["services"]["init"]
    assert init["build"]["dockerfile"] == "deploy/docker/base.Dockerfile"
    assert init["command"][:2] == ["python", "/opt/cdc/init_pipeline.py"]
    assert init["command"][2:] == ["--config", CONFIG_PATH]
    assert CONFIG_PATH in [v["target"] for v in volumes_of(init)]
    base = init["image"].split(":")[0]
    for script in DEPLOYABLES:
        build = compose["services"][service_of(script)]["build"]
        assert build["additional_contexts"] == {base: "service:init"}


def load_init_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("init_pipeline", DOCKER / "init_pipeline.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_init_registers_every_schema_the_services_look_up(compose_config: PipelineConfig) -> None:
    # The image's /app/schemas is the repository's schemas/ (base.Dockerfile copies it).
    config = compose_config.model_copy(
        update={
            "schema_registry": compose_config.schema_registry.model_copy(
                update={"dirs": [ROOT / "schemas"]}
            )
        }
    )
    init = load_init_module()
    registry = ConfluentSchemaRegistry("mock://compose-init")
    first = init.register_source_schemas(config, registry)
    again = init.register_source_schemas(config, registry)  # idempotent
    assert first == again
    for entity in config.entities:
        schemas = entity_schemas(entity, registry)
        assert schemas.key is not None
        subject = subject_name(entity.source_topic, False)
        files = sorted((ROOT / "schemas").glob(f"{subject}*.avsc"))
        assert len(registry.versions(subject)) == len(files) >= 1


def test_docker_compose_config_accepts_the_file() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client on this machine: `docker compose config` not run")
    probe = subprocess.run(
        [docker, "compose", "version"], check=False, capture_output=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(
            "the docker compose plugin is not installed here (`docker compose version` "
            "fails): `docker compose config` not run; the other tests check the file"
        )
    done = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_FILE), "config", "-q"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
