"""The Kubernetes manifests in deploy/k8s are valid and agree with the code (offline).

Two shapes share deploy/k8s/common (namespace, pipeline file, credentials, volume):
deploy/k8s adds one Deployment per service, deploy/k8s/all-in-one one for all four. Each
manifest is listed by exactly one kustomization, and kustomize renders the files as they
are (when kubectl is installed, checked by rendering). Every manifest is checked against
the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), then
against the project: one single-replica Deployment per service script (or one for all
four) that runs the image's entrypoint with the mounted pipeline file, probes /health on
the port its configuration serves, gets the Secret keys its pipeline file references, has
resources above its JVM heap, binds its metrics port on the pod's IP, and runs as the
image's user. The example NetworkPolicy (in no kustomization) isolates every service pod of
the three shapes but for its metrics port and the Spark driver ports, and lets the pods
reach what their pipeline file names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.config.values import ConfigError

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
LOCAL_PIPELINE = ROOT / "deploy" / "local" / "pipeline.yaml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SCRIPTS = sorted(name for name in PYPROJECT["project"]["scripts"] if name != "cdc")
# What a Deployment runs: each service's script, or `cdc run` (deploy/k8s/all-in-one).
APPLICATION = "cdc run"
DEPLOYABLES = [*SCRIPTS, APPLICATION]
COMMON = K8S / "common"
ALL_IN_ONE = K8S / "all-in-one"
SPARK_ON_K8S = K8S / "spark-on-k8s"
# An example for every shape, in no kustomization: `kubectl apply -f` once edited.
NETWORK_POLICY = K8S / "network-policy.yaml"
# The oldest Kubernetes the manifests are meant for (1.30, or the oldest schema this
# kubernetes-validate still ships), and the newest it knows.
_KNOWN = sorted(
    set(kubernetes_validate.utils.all_versions()), key=lambda v: tuple(map(int, v.split(".")))
)
KUBERNETES_VERSIONS = sorted(
    {next(v for v in _KNOWN if tuple(map(int, v.split("."))) >= (1, 30)), _KNOWN[-1]}
)
# Benchmark: the ingestor peaked at 2.4 GiB RSS with a 2g driver heap.
INGESTOR_PEAK_RSS = 2.4 * 2**30
PLACEHOLDER = "CHANGE-ME"


def service_of(script: str) -> str:
    return "application" if script == APPLICATION else script.removeprefix("cdc-")


def deployment_name(script: str) -> str:
    return f"cdc-{service_of(script)}"


def metrics_port(config: PipelineConfig, script: str) -> int:
    return int(getattr(config, service_of(script).replace("-", "_")).metrics_port)


def read_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


# Folder -> its kustomization, for every kustomization under deploy/k8s.
KUSTOMIZATIONS: dict[Path, dict[str, Any]] = {
    path.parent: yaml.safe_load(path.read_text(encoding="utf-8"))
    for path in sorted(K8S.rglob("kustomization.yaml"))
}


def listed_files(folder: Path) -> list[Path]:
    """The manifest files a kustomization lists, directly or through the folders it lists."""
    files = []
    for resource in KUSTOMIZATIONS[folder]["resources"]:
        path = (folder / resource).resolve()
        files += listed_files(path) if path.is_dir() else [path]
    return files


def listed_docs(folder: Path) -> list[dict[str, Any]]:
    return [doc for path in listed_files(folder) for doc in read_docs(path)]


def by_kind_and_name(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


KUSTOMIZATION = KUSTOMIZATIONS[K8S]
NAMESPACE = KUSTOMIZATION["namespace"]
ALL_IN_ONE_KUSTOMIZATION = KUSTOMIZATIONS[ALL_IN_ONE]
DOCS = listed_docs(K8S)  # common's and the four Deployments
COMMON_DOCS = listed_docs(COMMON)
APPLICATION_DOCS = read_docs(ALL_IN_ONE / "application.yaml")


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def deployment(script: str) -> dict[str, Any]:
    deployments = {d["metadata"]["name"]: d for d in APPLICATION_DOCS} | of_kind("Deployment")
    name = deployment_name(script)
    assert name in deployments, f"no Deployment {name}; have {sorted(deployments)}"
    return deployments[name]


def container(script: str) -> dict[str, Any]:
    containers = deployment(script)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pod: the service"
    return dict(containers[0])


def dockerfile_instruction(script: str, keyword: str, name: str | None = None) -> str:
    """The last ``keyword`` line of an image's Dockerfile (continuations joined)."""
    name = name or f"{service_of(script)}.Dockerfile"
    text = (DOCKER / name).read_text(encoding="utf-8").replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(f"{keyword} ")]
    assert lines, f"{name} has no {keyword}"
    return lines[-1].removeprefix(f"{keyword} ").strip()


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (``3Gi``, ``500m``, ``2``) as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|m)?", str(value))
    assert match, f"cannot read quantity {value!r}"
    number, unit = float(match.group(1)), match.group(2)
    if unit == "m":
        return number / 1000
    return number * units.get(unit or "", 1)


def java_size(value: str) -> float:
    match = re.fullmatch(r"(\d+)([kmgt]?)", value.lower())
    assert match, f"cannot read JVM size {value!r}"
    return (
        int(match.group(1))
        * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[match.group(2)]
    )


def configmap_pipeline() -> tuple[str, str, str]:
    """(ConfigMap name, key, text) of the pipeline file."""
    entries = [
        (name, key, text)
        for name, cm in of_kind("ConfigMap").items()
        for key, text in cm.get("data", {}).items()
        if key.endswith((".yaml", ".yml"))
    ]
    assert len(entries) == 1, f"expected one pipeline file in the ConfigMaps: {entries}"
    return entries[0]


def secret_keys() -> dict[str, dict[str, str]]:
    return {
        name: {**s.get("stringData", {}), **s.get("data", {})}
        for name, s in of_kind("Secret").items()
    }


@pytest.fixture
def k8s_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineConfig:
    """The ConfigMap's pipeline, loaded as a pod would (the Secret's keys in the env)."""
    for name in [n for n in os.environ if n.startswith("CDC_")]:
        monkeypatch.delenv(name)
    for values in secret_keys().values():
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    _, key, text = configmap_pipeline()
    path = tmp_path / key
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def test_every_manifest_is_listed_by_exactly_one_kustomization() -> None:
    listed = [
        (folder / resource).resolve()
        for folder, kustomization in KUSTOMIZATIONS.items()
        for resource in kustomization["resources"]
    ]
    folders = [path for path in listed if path.is_dir()]
    assert set(folders) <= set(KUSTOMIZATIONS), "a listed folder without a kustomization"
    files = sorted(path.relative_to(K8S).as_posix() for path in listed if not path.is_dir())
    manifests = sorted(
        path.relative_to(K8S).as_posix()
        for path in K8S.rglob("*.yaml")
        if path.name != "kustomization.yaml" and path != NETWORK_POLICY
    )
    assert files == manifests, "each manifest once: unlisted files are never applied"
    # The example NetworkPolicy is applied on its own, after its placeholders are edited.
    assert NETWORK_POLICY.resolve() not in listed


@pytest.mark.parametrize("folder", [K8S, COMMON, ALL_IN_ONE], ids=["k8s", "common", "all-in-one"])
def test_kustomization_applies_its_files_as_they_are_in_one_namespace(folder: Path) -> None:
    """No patches or generators: what the tests read is what is applied (but the images)."""
    kustomization = KUSTOMIZATIONS[folder]
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["apiVersion"].startswith("kustomize.config.k8s.io/")
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "resources", "images"}
    assert kustomization["namespace"] == NAMESPACE
    docs = listed_docs(folder)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == [NAMESPACE]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["kind"]


def test_both_shapes_take_namespace_pipeline_credentials_and_volume_from_common() -> None:
    kinds = sorted(d["kind"] for d in COMMON_DOCS)
    assert kinds == ["ConfigMap", "Namespace", "PersistentVolumeClaim", "Secret"]
    deployments = [f"{service_of(script)}.yaml" for script in SCRIPTS]
    assert sorted(KUSTOMIZATION["resources"]) == sorted(["common", *deployments])
    assert sorted(ALL_IN_ONE_KUSTOMIZATION["resources"]) == ["../common", "application.yaml"]


def test_kustomization_images_name_every_service_at_the_project_version() -> None:
    images = {i["name"]: i for i in KUSTOMIZATION["images"]}
    for script in SCRIPTS:
        name, _, tag = container(script)["image"].rpartition(":")
        assert name == script
        assert tag == PYPROJECT["project"]["version"]
        assert images[name]["newTag"] == PYPROJECT["project"]["version"]


def test_all_in_one_is_the_same_pipeline_with_one_deployment_instead_of_four() -> None:
    overlay = ALL_IN_ONE_KUSTOMIZATION
    docs = listed_docs(ALL_IN_ONE)
    deployments = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    assert deployments == [deployment_name(APPLICATION)], "each table must keep one writer"
    shared = by_kind_and_name([d for d in docs if d["kind"] != "Deployment"])
    assert shared == by_kind_and_name([d for d in DOCS if d["kind"] != "Deployment"])
    images = {i["name"]: i for i in overlay["images"]}
    name, _, tag = container(APPLICATION)["image"].rpartition(":")
    assert name == deployment_name(APPLICATION)
    assert tag == images[name]["newTag"] == PYPROJECT["project"]["version"]


@cache
def kustomize(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize folder`` renders."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, check=False
    )
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize(
    "folder", [K8S, ALL_IN_ONE, SPARK_ON_K8S], ids=["k8s", "all-in-one", "spark-on-k8s"]
)
def test_kustomize_renders_the_listed_files_with_their_images(folder: Path) -> None:
    docs = kustomize(folder)
    names = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert names == sorted((d["kind"], d["metadata"]["name"]) for d in listed_docs(folder))
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in KUSTOMIZATIONS[folder]["images"]}
    for doc in docs:
        if doc["kind"] == "Deployment":
            (main,) = doc["spec"]["template"]["spec"]["containers"]
            assert main["image"] == images[doc["metadata"]["name"]]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_four_deployments_or_one_beside_the_same_common_objects() -> None:
    four, one = kustomize(K8S), kustomize(ALL_IN_ONE)
    assert sorted(d["metadata"]["name"] for d in four if d["kind"] == "Deployment") == SCRIPTS
    deployments = [d["metadata"]["name"] for d in one if d["kind"] == "Deployment"]
    assert deployments == [deployment_name(APPLICATION)], "each table must keep one writer"
    shared = by_kind_and_name([d for d in one if d["kind"] != "Deployment"])
    assert shared == by_kind_and_name([d for d in four if d["kind"] != "Deployment"])
    kinds = sorted(d["kind"] for d in shared)
    assert kinds == ["ConfigMap", "Namespace", "PersistentVolumeClaim", "Secret"]


ALL_DOCS = DOCS + APPLICATION_DOCS


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "doc", ALL_DOCS, ids=[f"{d['kind']}-{d['metadata']['name']}" for d in ALL_DOCS]
)
def test_manifest_is_valid_kubernetes(doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']} (k8s {version}): {exc.message}")


def test_one_deployment_per_service_script_and_nothing_else() -> None:
    assert sorted(of_kind("Deployment")) == SCRIPTS
    kinds = {d["kind"] for d in DOCS}
    assert kinds == {
        "Namespace",
        "ConfigMap",
        "Secret",
        "PersistentVolumeClaim",
        "Deployment",
    }


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_single_writer_deployment(script: str) -> None:
    spec = deployment(script)["spec"]
    assert spec["replicas"] == 1, "each table has one writer"
    assert spec["strategy"] == {"type": "Recreate"}, "old and new pod must not overlap"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 60 <= grace <= 300, "room for a micro-batch (~15 s under load) to finish"


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_container_runs_the_image_entrypoint_with_the_mounted_pipeline(script: str) -> None:
    main = container(script)
    entrypoint = json.loads(dockerfile_instruction(script, "ENTRYPOINT"))
    cmd = json.loads(dockerfile_instruction(script, "CMD"))
    assert main["command"] == entrypoint
    assert " ".join(main["command"][2:]) == script
    assert main["args"] == cmd
    config_path = main["args"][main["args"].index("--config") + 1]
    env = {e["name"]: e.get("value") for e in main.get("env", [])}
    assert env.get("CDC_CONFIG", config_path) == config_path

    # The ConfigMap key is mounted at exactly the path the command reads.
    cm_name, key, _ = configmap_pipeline()
    volumes = {v["name"]: v for v in deployment(script)["spec"]["template"]["spec"]["volumes"]}
    mounted = []
    for mount in main["volumeMounts"]:
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            continue
        assert source["name"] == cm_name
        assert mount.get("readOnly") is True
        for item in source.get("items", [{"key": key, "path": key}]):
            assert item["key"] in of_kind("ConfigMap")[cm_name]["data"]
            mounted.append(str(PurePosixPath(mount["mountPath"]) / item["path"]))
    assert config_path in mounted


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_probes_ask_health_on_the_configured_port(script: str, k8s_config: PipelineConfig) -> None:
    main = container(script)
    port = metrics_port(k8s_config, script)
    assert port == metrics_port(PipelineConfig(), script)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert port in ports.values()
    assert dockerfile_instruction(script, "EXPOSE") == str(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http = main[probe]["httpGet"]
        assert http["path"] == "/health", probe
        assert ports.get(http["port"], http["port"]) == port, probe
    annotations = deployment(script)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    # Liveness gives a slow micro-batch and a restart of Spark more than a minute.
    live = main["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_metrics_endpoint_binds_every_interface_of_the_pod(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's probes and Prometheus reach the pod's IP; the default binds loopback."""
    for name in [n for n in os.environ if n.startswith("CDC_")]:
        monkeypatch.delenv(name)
    for values in secret_keys().values():
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    for entry in container(script).get("env", []):
        if "value" in entry:
            monkeypatch.setenv(entry["name"], entry["value"])
    _, key, text = configmap_pipeline()
    path = tmp_path / key
    path.write_text(text, encoding="utf-8")
    section = getattr(load_config(path), service_of(script).replace("-", "_"))
    assert section.metrics_host == "0.0.0.0", (
        f"{deployment_name(script)} serves /health on {section.metrics_host}: its probes "
        f"fail; set CDC_{service_of(script).replace('-', '_').upper()}__METRICS_HOST"
    )


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_resources_leave_room_above_the_driver_heap(script: str) -> None:
    main = container(script)
    resources = main["resources"]
    for kind in ("cpu", "memory"):
        request = quantity(resources["requests"][kind])
        limit = quantity(resources["limits"][kind])
        assert 0 < request <= limit, kind
    env = {e["name"]: e.get("value") for e in main["env"]}
    heap = java_size(env["SPARK_DRIVER_MEMORY"])
    memory = quantity(resources["limits"]["memory"])
    assert memory >= 1.25 * heap, "the JVM needs off-heap room (2.4 GiB RSS at a 2g heap)"
    assert quantity(resources["requests"]["memory"]) == memory, "no overcommit for a JVM"
    if script == "cdc-ingestor":
        assert memory >= INGESTOR_PEAK_RSS * 1.1


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_runs_as_the_image_user_without_privileges(script: str) -> None:
    pod = deployment(script)["spec"]["template"]["spec"]
    main = container(script)
    uid = dockerfile_instruction(script, "USER", "base.Dockerfile").split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    security = main["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    if security.get("readOnlyRootFilesystem"):
        # Then everything Spark writes outside the tables must be on a volume.
        writable = {m["mountPath"] for m in main["volumeMounts"] if not m.get("readOnly", False)}
        defaults = (DOCKER / "spark-defaults.conf").read_text(encoding="utf-8")
        for line in defaults.splitlines():
            if line.strip() and not line.startswith("#"):
                path = PurePosixPath(line.split()[1])
                assert any(path.is_relative_to(w) for w in writable), f"{path} not writable"


@pytest.mark.parametrize("script", DEPLOYABLES)
def test_storage_root_is_the_shared_claim(script: str, k8s_config: PipelineConfig) -> None:
    pod = deployment(script)["spec"]["template"]["spec"]
    claims = of_kind("PersistentVolumeClaim")
    by_volume = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    mounts = {m["mountPath"]: m["name"] for m in container(script)["volumeMounts"]}
    volume = mounts[k8s_config.storage_root]  # tables and checkpoints (_streams) under it
    claim = claims[by_volume[volume]]
    assert "ReadWriteMany" in claim["spec"]["accessModes"], "four pods share it"


def test_configmap_pipeline_has_the_example_entities(k8s_config: PipelineConfig) -> None:
    local = load_config(LOCAL_PIPELINE)
    assert [e.model_dump() for e in k8s_config.entities] == [e.model_dump() for e in local.entities]
    assert k8s_config.schema_registry.dirs == [Path("/app/schemas")]
    assert k8s_config.elasticsearch.api_key is not None


def test_every_secret_reference_reaches_every_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, key, text = configmap_pipeline()
    active = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    references = set(re.findall(r"\$\{env:([^}]+)\}", active))
    assert references, "the pipeline file should take its credentials from the Secret"
    secrets = secret_keys()
    for script in DEPLOYABLES:
        main = container(script)
        provided = {e["name"] for e in main.get("env", [])}
        for source in main.get("envFrom", []):
            provided |= set(secrets[source["secretRef"]["name"]])
        missing = references - provided
        assert not missing, f"{script} cannot resolve ${{env:...}} for {missing}"
    # The references are live: without the Secret the configuration does not load.
    for name in references:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / key
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="is not set"):
        load_config(path)


def test_secret_values_are_marked_placeholders() -> None:
    secrets = secret_keys()
    assert secrets
    for name, values in secrets.items():
        assert values, f"Secret {name} is empty"
        for key, value in values.items():
            assert PLACEHOLDER in value, f"{name}.{key} does not look like a placeholder"


# ---- the example NetworkPolicy ---------------------------------------------------------

POLICIES = read_docs(NETWORK_POLICY)
SPARK_DOCS = [
    doc
    for path in sorted(SPARK_ON_K8S.glob("*.yaml"))
    if path.name != "kustomization.yaml"
    for doc in read_docs(path)
]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions) picks labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, values = expression["key"], expression.get("values", [])
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }
        if not held[expression["operator"]]:
            return False
    return True


def service_pods() -> dict[str, dict[str, Any]]:
    """Every service pod template of the three shapes: "<shape>/<Deployment>" -> template."""
    shapes = {"k8s": DOCS, "all-in-one": APPLICATION_DOCS, "spark-on-k8s": SPARK_DOCS}
    return {
        f"{shape}/{d['metadata']['name']}": d["spec"]["template"]
        for shape, docs in shapes.items()
        for d in docs
        if d["kind"] == "Deployment"
    }


def executor_labels() -> dict[str, str]:
    (held,) = [d for d in SPARK_DOCS if "executor-pod.yaml" in d.get("data", {})]
    labels: dict[str, str] = yaml.safe_load(held["data"]["executor-pod.yaml"])["metadata"]["labels"]
    return labels


def rules(labels: dict[str, str], direction: str) -> list[dict[str, Any]]:
    """The ingress or egress rules of every policy that selects a pod with these labels."""
    key = {"Ingress": "ingress", "Egress": "egress"}[direction]
    found = []
    for policy in POLICIES:
        spec = policy["spec"]
        if direction in spec["policyTypes"] and selects(spec["podSelector"], labels):
            found += spec.get(key, [])
    return found


def peers(rule: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    peers_: list[dict[str, Any]] = rule[{"Ingress": "from", "Egress": "to"}[direction]]
    return peers_


def numbers(rule: dict[str, Any], ports: dict[str, int]) -> set[tuple[int, str]]:
    """(port, protocol) a rule opens, named ports resolved against ``ports``."""
    opened = set()
    for entry in rule["ports"]:
        port = entry["port"]
        if isinstance(port, str):
            if port not in ports:
                continue  # a name this pod has no port of: opens nothing on it
            port = ports[port]
        opened.add((int(port), entry.get("protocol", "TCP")))
    return opened


def test_network_policy_is_an_example_for_the_cdc_namespace() -> None:
    assert POLICIES, "deploy/k8s/network-policy.yaml holds no policy"
    for policy in POLICIES:
        assert policy["kind"] == "NetworkPolicy"
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["metadata"]["namespace"] == NAMESPACE
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(policy, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"NetworkPolicy {policy['metadata']['name']} ({version}): {exc}")
    # What the cluster decides (another namespace, a range) is a marked placeholder.
    for line in NETWORK_POLICY.read_text(encoding="utf-8").splitlines():
        decided = "cidr:" in line or "kubernetes.io/metadata.name:" in line
        if decided and "kube-system" not in line:
            assert "REPLACE" in line, f"not marked as a placeholder: {line.strip()}"


@pytest.mark.parametrize("pod", sorted(service_pods()))
def test_network_policy_opens_a_service_pod_to_monitoring_on_its_metrics_port_only(
    pod: str,
) -> None:
    template = service_pods()[pod]
    labels = template["metadata"]["labels"]
    (main,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    metrics = int(template["metadata"]["annotations"]["prometheus.io/port"])
    assert ports["metrics"] == metrics
    ingress = rules(labels, "Ingress")
    assert ingress, f"no NetworkPolicy isolates {pod}"
    opened: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for rule in ingress:
        assert rule.get("ports"), "an ingress rule without ports opens every port, the UI too"
        for port in numbers(rule, ports):
            opened.setdefault(port, []).extend(peers(rule, "Ingress"))
    driver_ports = {ports[n] for n in ("spark-driver", "spark-blockmgr") if n in ports}
    assert {p for p, _ in opened} == {metrics, *driver_ports}, "4040 and the rest stay closed"
    # The metrics port: from the monitoring namespace's scraper, not from every pod there.
    (scraper,) = opened[(metrics, "TCP")]
    assert scraper["namespaceSelector"]["matchLabels"]
    assert scraper["podSelector"]["matchLabels"]
    # A driver's ports: from executor pods of this namespace only.
    for port in driver_ports:
        for peer in opened[(port, "TCP")]:
            assert set(peer) == {"podSelector"}, "same namespace"
            assert selects(peer["podSelector"], executor_labels())
            for other in service_pods().values():
                assert not selects(peer["podSelector"], other["metadata"]["labels"])


def pipeline_ports(text: str) -> set[int]:
    """The ports of the Kafka brokers, the registry and Elasticsearch a pipeline file names."""
    pipeline = yaml.safe_load(text)
    addresses = [
        *str(pipeline["kafka"]["bootstrap_servers"]).split(","),
        str(pipeline["schema_registry"]["url"]),
        *pipeline["elasticsearch"]["hosts"],
    ]
    return {int(address.rstrip("/").rsplit(":", 1)[1]) for address in addresses}


@pytest.mark.parametrize("pod", sorted(service_pods()))
def test_network_policy_lets_a_service_pod_reach_what_its_pipeline_names(pod: str) -> None:
    template = service_pods()[pod]
    egress = rules(template["metadata"]["labels"], "Egress")
    assert egress, f"no egress policy for {pod}"
    opened: set[tuple[int, str]] = set()
    for rule in egress:
        assert peers(rule, "Egress"), "an egress rule without 'to' reaches everything"
        opened |= numbers(rule, {}) if rule.get("ports") else set()
    assert {(53, "UDP"), (53, "TCP")} <= opened, "DNS"
    spark = pod.startswith("spark-on-k8s/")
    pipelines = [
        d for d in (SPARK_DOCS if spark else DOCS) if d["metadata"]["name"] == "cdc-pipeline"
    ]
    (text,) = [d["data"]["pipeline.yaml"] for d in pipelines]
    for port in pipeline_ports(text):
        assert (port, "TCP") in opened, f"{pod} cannot reach port {port} of its pipeline file"
    if spark:
        master = yaml.safe_load(text)["spark"]["master"]
        assert (int(master.rsplit(":", 1)[1]), "TCP") in opened, "the API server"
        assert (443, "TCP") in opened, "the object store"
        to_executors = [
            rule
            for rule in egress
            if any(selects(p.get("podSelector", {}), executor_labels()) for p in rule["to"])
        ]
        assert to_executors, "the driver fetches from its executors' block managers"


def test_network_policy_lets_executors_and_their_driver_reach_each_other() -> None:
    labels = executor_labels()
    ingress, egress = rules(labels, "Ingress"), rules(labels, "Egress")
    assert ingress, "executor pods are isolated too"
    drivers = {k: v for k, v in service_pods().items() if k.startswith("spark-on-k8s/")}
    for name, template in drivers.items():
        (main,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        driver = template["metadata"]["labels"]
        assert any(selects(p["podSelector"], driver) for r in ingress for p in r["from"]), (
            f"{name} cannot reach its executors"
        )
        reach = set()
        for rule in egress:
            if any(selects(p.get("podSelector", {}), driver) for p in rule["to"]):
                reach |= numbers(rule, ports)
        wanted = {(ports["spark-driver"], "TCP"), (ports["spark-blockmgr"], "TCP")}
        assert wanted <= reach, f"executors cannot reach {name}'s driver ports"
    opened = {p for r in egress if r.get("ports") for p in numbers(r, {})}
    assert {(53, "UDP"), (53, "TCP"), (443, "TCP")} <= opened, "DNS and the object store"
