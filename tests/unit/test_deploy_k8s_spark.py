"""deploy/k8s/spark-on-k8s, the Spark-on-Kubernetes variant, checked offline.

Each service's pod stays the Spark driver (client mode) and its executors are pods Spark
creates through the Kubernetes API. Checked here without a cluster: every manifest (and
the executor pod template) against the Kubernetes schemas (kubernetes-validate, strict);
the pipeline file as each driver loads it (its Secret, its own ``CDC_SPARK__CONF``) and the
Spark configuration the service builds from it; that ``spark.driver.host`` names a
headless Service exposing the driver's fixed ports; the RBAC against what Spark's
Kubernetes backend calls; Pod Security "restricted" for drivers and executors (the
template, and the template plus what Spark adds to it); one writer per table; the executor
launcher against Spark's own executor backend (a real JVM when one is installed); and that
the services' code asks executors for no Python (their image needs Spark's jars only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cdc_shared.config.connections import s3a_bucket
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.jvm.spark import spark_conf

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s"
VARIANT = BASE / "spark-on-k8s"
DOCKER = ROOT / "deploy" / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
VERSION = PYPROJECT["project"]["version"]
SCRIPTS = sorted(name for name in PYPROJECT["project"]["scripts"] if name != "cdc")
_KNOWN = sorted(
    set(kubernetes_validate.utils.all_versions()), key=lambda v: tuple(map(int, v.split(".")))
)
KUBERNETES_VERSIONS = sorted(
    {next(v for v in _KNOWN if tuple(map(int, v.split("."))) >= (1, 30)), _KNOWN[-1]}
)
PLACEHOLDER = "CHANGE-ME"
EXECUTOR_MAIN = "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend"


def read_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


KUSTOMIZATION = yaml.safe_load((VARIANT / "kustomization.yaml").read_text(encoding="utf-8"))
BASE_KUSTOMIZATION = yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
FILES = {name: read_docs(VARIANT / name) for name in KUSTOMIZATION["resources"]}
DOCS = [doc for docs in FILES.values() for doc in docs]
# deploy/k8s's manifests: its four Deployments and what it takes from deploy/k8s/common.
BASE_DOCS = [
    doc
    for path in [*sorted(BASE.glob("*.yaml")), *sorted((BASE / "common").glob("*.yaml"))]
    if path.name != "kustomization.yaml"
    for doc in read_docs(path)
]
NAMESPACE = KUSTOMIZATION["namespace"]


def of_kind(kind: str, docs: list[dict[str, Any]] = DOCS) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(script: str, docs: list[dict[str, Any]] = DOCS) -> dict[str, Any]:
    spec: dict[str, Any] = of_kind("Deployment", docs)[script]["spec"]
    return dict(spec["template"]["spec"])


def container(script: str, docs: list[dict[str, Any]] = DOCS) -> dict[str, Any]:
    containers = pod_spec(script, docs)["containers"]
    assert len(containers) == 1, "one container per pod: the service (the driver)"
    return dict(containers[0])


def pipeline_text() -> str:
    return str(of_kind("ConfigMap")["cdc-pipeline"]["data"]["pipeline.yaml"])


def executor_configmap() -> dict[str, Any]:
    held = [cm for cm in of_kind("ConfigMap").values() if "executor-pod.yaml" in cm["data"]]
    assert len(held) == 1, "one ConfigMap holds the executor pod template"
    return held[0]


def executor_template() -> dict[str, Any]:
    template: dict[str, Any] = yaml.safe_load(executor_configmap()["data"]["executor-pod.yaml"])
    return template


def launcher_text() -> str:
    return str(executor_configmap()["data"]["executor.sh"])


def secret_values() -> dict[str, str]:
    secret = of_kind("Secret")["cdc-credentials"]
    return {**secret.get("stringData", {}), **secret.get("data", {})}


def fake_pod_name(script: str) -> str:
    return f"{script}-7c9d8f6b5-x2x7q"


def container_env(script: str) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: envFrom, then env in order,
    ``$(NAME)`` expanded from what is defined before, the pod name from the downward API."""
    env = dict(secret_values())
    for entry in container(script).get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                entry["value"],
            )
        else:
            field = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "metadata.name", f"unexpected downward API field {field}"
            env[entry["name"]] = fake_pod_name(script)
    return env


def driver_config(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[PipelineConfig, dict[str, str]]:
    """The pipeline as ``script``'s driver loads it, and the Spark configuration it builds."""
    for name in [n for n in os.environ if n.startswith("CDC_")]:
        monkeypatch.delenv(name)
    for name, value in container_env(script).items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "pipeline.yaml"
    path.write_text(pipeline_text(), encoding="utf-8")
    config = load_config(path)
    return config, spark_conf(config.spark, script)  # the app is named after the script


# --- the manifests ---------------------------------------------------------------------


def test_kustomization_applies_every_manifest_in_one_namespace() -> None:
    assert KUSTOMIZATION["kind"] == "Kustomization"
    files = sorted(p.name for p in VARIANT.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(KUSTOMIZATION["resources"]) == files, "self-contained: no '..' base"
    assert BASE_KUSTOMIZATION["namespace"] == NAMESPACE
    for doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
    assert KUSTOMIZATION["images"] == BASE_KUSTOMIZATION["images"]
    for script in SCRIPTS:
        assert container(script)["image"] == f"{script}:{VERSION}"


def test_namespace_and_secret_are_the_base_ones_plus_the_object_storage_keys() -> None:
    assert of_kind("Namespace") == of_kind("Namespace", BASE_DOCS)
    labels = of_kind("Namespace")[NAMESPACE]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    base = of_kind("Secret", BASE_DOCS)["cdc-credentials"]["stringData"]
    assert base.items() <= secret_values().items()
    for key, value in secret_values().items():
        assert PLACEHOLDER in value, f"{key} does not look like a placeholder"


VALIDATED = [*DOCS, {**executor_template(), "metadata": {"name": "executor-pod-template"}}]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "doc", VALIDATED, ids=[f"{d['kind']}-{d['metadata']['name']}" for d in VALIDATED]
)
def test_manifest_is_valid_kubernetes(doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']} (k8s {version}): {exc.message}")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_variant() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(VARIANT)], capture_output=True, text=True, check=False
    )
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    names = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert names == sorted((d["kind"], d["metadata"]["name"]) for d in DOCS)
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in KUSTOMIZATION["images"]}
    for script in SCRIPTS:
        assert container(script, docs)["image"] == images[script]


def test_no_claim_no_tables_on_a_volume() -> None:
    assert not of_kind("PersistentVolumeClaim"), "executors on other nodes cannot share it"
    for script in SCRIPTS:
        for volume in pod_spec(script)["volumes"]:
            assert "persistentVolumeClaim" not in volume, script
    for volume in executor_template()["spec"]["volumes"]:
        assert "persistentVolumeClaim" not in volume


# --- the pipeline each driver loads -------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_pipeline_loads_with_a_k8s_master_and_an_object_storage_root(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, conf = driver_config(script, tmp_path, monkeypatch)
    master = config.spark.master
    assert re.fullmatch(r"k8s://https://[a-z0-9.-]+:\d+", master), "Spark wants the port"
    assert conf["spark.master"] == master
    bucket = s3a_bucket(config.storage_root)
    assert bucket is not None, f"storage_root {config.storage_root} is not s3a://"
    # The keys come from the Secret and become the bucket's Hadoop settings, which the
    # driver's SparkConf carries to the executors.
    prefix = f"spark.hadoop.fs.s3a.bucket.{bucket}"
    assert conf[f"{prefix}.access.key"] == secret_values()["CDC_S3_ACCESS_KEY"]
    assert conf[f"{prefix}.secret.key"] == secret_values()["CDC_S3_SECRET_KEY"]
    assert config.schema_registry.url, "an object-storage root needs the registry"
    # The Deployment's CDC_SPARK__CONF is merged into the file's spark.conf, not instead.
    assert conf["spark.kubernetes.namespace"] == NAMESPACE
    assert conf["spark.kubernetes.driver.pod.name"] == fake_pod_name(script)
    assert conf["spark.driver.host"].startswith(f"{script}-driver.")
    assert conf["spark.kubernetes.executor.deleteOnTermination"] == "true"
    for key in ("spark.executor.instances", "spark.executor.cores"):
        assert int(conf[key]) >= 1
    assert re.fullmatch(r"\d+[gm]", conf["spark.executor.memory"])
    base = yaml.safe_load(of_kind("ConfigMap", BASE_DOCS)["cdc-pipeline"]["data"]["pipeline.yaml"])
    assert [e.model_dump() for e in config.entities] == [
        e.model_dump() for e in PipelineConfig(entities=base["entities"]).entities
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_driver_serves_health_on_every_interface(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet's probes and Prometheus reach the pod's IP; the default binds loopback."""
    config, _ = driver_config(script, tmp_path, monkeypatch)
    section = getattr(config, script.removeprefix("cdc-").replace("-", "_"))
    assert section.metrics_host == "0.0.0.0", f"{script}'s probes would find nothing"


@pytest.mark.parametrize("script", SCRIPTS)
def test_pod_name_is_defined_before_the_conf_that_expands_it(script: str) -> None:
    defined: set[str] = set()
    for entry in container(script)["env"]:
        for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
            assert name in defined, f"$({name}) in {entry['name']} is not defined before it"
        defined.add(entry["name"])
    json.loads(container_env(script)["CDC_SPARK__CONF"])


def test_executor_image_is_cdc_base_at_the_project_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, conf = driver_config(SCRIPTS[0], tmp_path, monkeypatch)
    name, _, tag = conf["spark.kubernetes.container.image"].rpartition(":")
    assert name.rpartition("/")[2] == "cdc-base"
    assert tag == VERSION
    # What the template's command and the launcher need from that image.
    base = (DOCKER / "base.Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"apt-get install [^\n]*\btini\b", base)
    assert "JAVA_HOME=/opt/java" in base
    assert "PATH=/opt/venv/bin:$PATH" in base, "python3 is the venv's, with pyspark"
    user = re.findall(r"^USER (\d+):(\d+)$", base, re.MULTILINE)[-1]
    security = executor_template()["spec"]["securityContext"]
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == user


# --- drivers, their Services and their account ----------------------------------------


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("script", SCRIPTS)
def test_driver_host_is_a_headless_service_exposing_the_driver_ports(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, conf = driver_config(script, tmp_path, monkeypatch)
    name, namespace, *suffix = conf["spark.driver.host"].split(".")
    assert namespace == NAMESPACE
    assert suffix in (["svc"], ["svc", "cluster", "local"])
    services = of_kind("Service")
    assert name in services, f"spark.driver.host names no Service: {name}"
    spec = services[name]["spec"]
    assert spec["clusterIP"] == "None", "headless: the name resolves to the driver pod"
    assert spec["publishNotReadyAddresses"] is True, "the pod is Ready only after executors"
    wanted = {int(conf["spark.driver.port"]), int(conf["spark.driver.blockManager.port"])}
    assert {p["port"] for p in spec["ports"]} == wanted
    assert conf["spark.driver.bindAddress"] == "0.0.0.0"
    # Each port reaches the driver container's port of the same number.
    ports = {p["name"]: p["containerPort"] for p in container(script)["ports"]}
    for port in spec["ports"]:
        target = port.get("targetPort", port["port"])
        assert ports.get(target, target) == port["port"]
    # The selector picks this driver's pod, and no other pod: not another driver, not an
    # executor (whose labels come from the template plus Spark's spark-* ones).
    for other in SCRIPTS:
        labels = of_kind("Deployment")[other]["spec"]["template"]["metadata"]["labels"]
        assert matches(spec["selector"], labels) == (other == script)
    assert not matches(spec["selector"], executor_template()["metadata"]["labels"])


def test_role_grants_what_sparks_kubernetes_backend_calls() -> None:
    # Client mode, from Spark's k8s backend (ExecutorPodsAllocator, the watch and polling
    # snapshot sources, KubernetesClusterSchedulerBackend.start/stop): executor pods
    # created, watched, listed, deleted one by one and by label (fabric8 sends a
    # deletecollection); the driver pod read; the executors' ConfigMap created and deleted
    # by label; services and PVCs of the application deleted by label on stop.
    need = {"create", "get", "list", "watch", "delete", "deletecollection"}
    required = {
        "pods": need,
        "configmaps": need,
        "services": need,
        "persistentvolumeclaims": need,
    }
    (role,) = of_kind("Role").values()
    granted: dict[str, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""], "core resources only"
        assert "*" not in rule["resources"] and "*" not in rule["verbs"]
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
    assert granted == required, "exactly what Spark needs: no secrets, no patch"


def test_drivers_run_as_the_bound_account_named_in_spark_conf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, conf = driver_config(SCRIPTS[0], tmp_path, monkeypatch)
    accounts = of_kind("ServiceAccount")
    driver_account = conf["spark.kubernetes.authenticate.driver.serviceAccountName"]
    executor_account = conf["spark.kubernetes.authenticate.executor.serviceAccountName"]
    assert {driver_account, executor_account} <= set(accounts)
    (role,) = of_kind("Role").values()
    bindings = list(of_kind("RoleBinding").values())
    bound = {
        s["name"]
        for b in bindings
        for s in b["subjects"]
        if s["kind"] == "ServiceAccount" and s.get("namespace", NAMESPACE) == NAMESPACE
    }
    assert [b["roleRef"] for b in bindings] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    ]
    assert bound == {driver_account}, "the executors' account has no rights"
    for script in SCRIPTS:
        spec = pod_spec(script)
        assert spec["serviceAccountName"] == driver_account
        assert spec["automountServiceAccountToken"] is True, "the driver needs its token"
    template = executor_template()["spec"]
    assert template["serviceAccountName"] == executor_account
    assert template["automountServiceAccountToken"] is False
    assert accounts[executor_account]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_writer_per_table(script: str) -> None:
    assert sorted(of_kind("Deployment")) == SCRIPTS
    spec = of_kind("Deployment")[script]["spec"]
    assert spec["replicas"] == 1, "one driver: each table has one writer"
    assert spec["strategy"] == {"type": "Recreate"}, "old and new driver must not overlap"
    assert not [d for d in DOCS if d["kind"] in ("StatefulSet", "DaemonSet", "Job")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_drivers_are_the_base_deployments_but_for_spark(script: str) -> None:
    """What the variant changes in a service's pod, and nothing else."""
    base, variant = container(script, BASE_DOCS), container(script)
    for key in ("image", "command", "args", "readinessProbe", "livenessProbe", "envFrom"):
        assert variant[key] == base[key], key
    assert variant["securityContext"] == base["securityContext"]
    assert variant["resources"] == base["resources"]
    base_env = {e["name"]: e.get("value") for e in base["env"]}
    variant_env = {e["name"]: e.get("value") for e in variant["env"]}
    assert base_env.items() <= variant_env.items()
    assert set(variant_env) - set(base_env) == {"POD_NAME", "CDC_SPARK__CONF"}
    assert variant["startupProbe"]["failureThreshold"] >= base["startupProbe"]["failureThreshold"]
    base_ports = {p["name"]: p for p in base["ports"]}
    assert base_ports.items() <= {p["name"]: p for p in variant["ports"]}.items()
    base_pod, variant_pod = pod_spec(script, BASE_DOCS), pod_spec(script)
    grace = "terminationGracePeriodSeconds"
    assert variant_pod[grace] == base_pod[grace]
    # The same user and seccomp; no fsGroupChangePolicy: there is no volume to chown.
    base_security = dict(base_pod["securityContext"])
    del base_security["fsGroupChangePolicy"]
    assert variant_pod["securityContext"] == base_security
    annotations = of_kind("Deployment")[script]["spec"]["template"]["metadata"]["annotations"]
    base_deployment = of_kind("Deployment", BASE_DOCS)[script]
    assert annotations == base_deployment["spec"]["template"]["metadata"]["annotations"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_driver_mounts_the_template_spark_reads(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, conf = driver_config(script, tmp_path, monkeypatch)
    configmap = executor_configmap()["metadata"]["name"]
    volumes = {v["name"]: v for v in pod_spec(script)["volumes"]}
    mounted = []
    for mount in container(script)["volumeMounts"]:
        source = volumes[mount["name"]].get("configMap")
        if source and source["name"] == configmap:
            assert mount["readOnly"] is True
            mounted += [str(PurePosixPath(mount["mountPath"]) / i["path"]) for i in source["items"]]
    assert conf["spark.kubernetes.executor.podTemplateFile"] in mounted
    # Not nested in another configMap mount (the kubelet cannot make a mount point there).
    paths = [PurePosixPath(m["mountPath"]) for m in container(script)["volumeMounts"]]
    for path in paths:
        assert not any(path != other and path.is_relative_to(other) for other in paths)


# --- Pod Security "restricted" -----------------------------------------------------------

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod spec breaks Pod Security Standards "restricted" (latest)."""
    problems = []
    pod = spec.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            problems.append(host)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {kinds}")
    for key in ("sysctls", "seLinuxOptions", "appArmorProfile"):
        if key in pod:
            problems.append(f"pod {key}")
    if pod.get("runAsUser") == 0:
        problems.append("pod runs as root")
    containers = [
        *spec.get("initContainers", []),
        *spec["containers"],
        *spec.get("ephemeralContainers", []),
    ]
    for c in containers:
        problems += _container_violations(c, pod)
    return problems


def _container_violations(c: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    """What in one container (with its pod's ``securityContext``) breaks "restricted"."""
    problems = []
    security = c.get("securityContext", {})
    name = c.get("name")
    if security.get("privileged"):
        problems.append(f"{name}: privileged")
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{name}: allowPrivilegeEscalation must be false")
    capabilities = security.get("capabilities", {})
    if "ALL" not in capabilities.get("drop", []):
        problems.append(f"{name}: capabilities must drop ALL")
    if not set(capabilities.get("add", [])) <= {"NET_BIND_SERVICE"}:
        problems.append(f"{name}: adds capabilities")
    non_root = security.get("runAsNonRoot", pod.get("runAsNonRoot"))
    if non_root is not True:
        problems.append(f"{name}: runAsNonRoot must be true")
    if security.get("runAsUser", pod.get("runAsUser")) == 0:
        problems.append(f"{name}: runs as root")
    seccomp = security.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        problems.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
    if security.get("procMount", "Default") != "Default":
        problems.append(f"{name}: procMount")
    for key in ("seLinuxOptions", "appArmorProfile"):
        if key in security:
            problems.append(f"{name}: {key}")
    for port in c.get("ports", []):
        if port.get("hostPort"):
            problems.append(f"{name}: hostPort")
    return problems


def as_spark_creates_it(template: dict[str, Any], conf: dict[str, str]) -> dict[str, Any]:
    """The template plus what Spark's BasicExecutorFeatureStep adds (an emulation, from
    Spark's source: image, args, SPARK_* env, block manager port, resources, the conf
    ConfigMap at /opt/spark/conf, hostname, restart policy, owner reference)."""
    pod = json.loads(json.dumps(template))
    main = next(
        c
        for c in pod["spec"]["containers"]
        if c["name"] == conf["spark.kubernetes.executor.podTemplateContainerName"]
    )
    main["image"] = conf["spark.kubernetes.container.image"]
    main["args"] = ["executor"]
    main["env"] = [
        {"name": "SPARK_USER", "value": "cdc"},
        {"name": "SPARK_DRIVER_URL", "value": "spark://CoarseGrainedScheduler@driver:7078"},
        {"name": "SPARK_EXECUTOR_CORES", "value": conf["spark.executor.cores"]},
        {"name": "SPARK_EXECUTOR_MEMORY", "value": "2048m"},
        {"name": "SPARK_APPLICATION_ID", "value": "spark-0123456789abcdef"},
        {"name": "SPARK_CONF_DIR", "value": "/opt/spark/conf"},
        {"name": "SPARK_EXECUTOR_ID", "value": "1"},
        {"name": "SPARK_RESOURCE_PROFILE_ID", "value": "0"},
        {"name": "SPARK_JAVA_OPT_0", "value": "-Dspark.driver.port=7078"},
        {"name": "SPARK_LOCAL_DIRS", "value": "/tmp"},
        {
            "name": "SPARK_EXECUTOR_POD_IP",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}},
        },
        {
            "name": "SPARK_EXECUTOR_POD_NAME",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
        },
    ]
    main["ports"] = [{"name": "blockmanager", "containerPort": 7079}]
    main["resources"] = {
        "requests": {"cpu": conf["spark.executor.cores"], "memory": "2432Mi"},
        "limits": {"memory": "2432Mi"},
    }
    main["volumeMounts"].append({"name": "spark-conf-volume-exec", "mountPath": "/opt/spark/conf"})
    pod["spec"]["volumes"].append(
        {"name": "spark-conf-volume-exec", "configMap": {"name": "spark-exec-0123-conf-map"}}
    )
    pod["spec"]["hostname"] = "cdc-ingestor-0123456789abcdef-exec-1"
    pod["spec"]["restartPolicy"] = "Never"
    pod["metadata"] = {
        **pod["metadata"],
        "name": "cdc-ingestor-0123456789abcdef-exec-1",
        "namespace": conf["spark.kubernetes.namespace"],
        "labels": {**pod["metadata"]["labels"], "spark-role": "executor", "spark-exec-id": "1"},
        "ownerReferences": [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": conf["spark.kubernetes.driver.pod.name"],
                "uid": "00000000-0000-0000-0000-000000000000",
                "controller": True,
            }
        ],
    }
    return dict(pod)


def test_executor_pods_meet_restricted_pod_security(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = executor_template()
    assert restricted_violations(template["spec"]) == []
    _, conf = driver_config(SCRIPTS[0], tmp_path, monkeypatch)
    created = as_spark_creates_it(template, conf)
    assert restricted_violations(created["spec"]) == []
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(created, version, strict=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_driver_pods_meet_restricted_pod_security(script: str) -> None:
    assert restricted_violations(pod_spec(script)) == []


def test_restricted_check_catches_what_it_should() -> None:
    spec = executor_template()["spec"]
    loose = json.loads(json.dumps(spec))
    loose["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    loose["securityContext"] = {"runAsUser": 0}
    loose["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    problems = restricted_violations(loose)
    for fragment in ("allowPrivilegeEscalation", "drop ALL", "adds", "runAsNonRoot", "root"):
        assert any(fragment in p for p in problems), fragment
    assert any("hostPath" in p for p in problems)


def test_executor_template_gives_spark_what_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, conf = driver_config(SCRIPTS[0], tmp_path, monkeypatch)
    spec = executor_template()["spec"]
    (main,) = spec["containers"]
    assert main["name"] == conf["spark.kubernetes.executor.podTemplateContainerName"]
    assert "image" not in main and "resources" not in main and "args" not in main, (
        "Spark sets these"
    )
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    # Spark's scratch space: a template volume named spark-local-dir-* is used as is, at
    # the path of spark.local.dir (a volume of that name elsewhere fails the pod build).
    local = [m for m in main["volumeMounts"] if m["name"].startswith("spark-local-dir-")]
    assert [m["mountPath"] for m in local] == conf["spark.local.dir"].split(",")
    for mount in local:
        assert "emptyDir" in volumes[mount["name"]]
    # The working directory, where the executor fetches the driver's jars, is writable.
    assert "emptyDir" in volumes[mounts[main["workingDir"]]["name"]]
    assert not mounts[main["workingDir"]].get("readOnly", False)
    # The command runs the launcher from this very ConfigMap.
    assert main["command"][:2] == ["tini", "--"]
    script = PurePosixPath(main["command"][-1])
    launcher = volumes[mounts[str(script.parent)]["name"]]["configMap"]
    assert launcher["name"] == executor_configmap()["metadata"]["name"]
    assert [i["key"] for i in launcher["items"] if i["path"] == script.name] == ["executor.sh"]


# --- the executor launcher ----------------------------------------------------------------

SPARK_EXECUTOR_ENV = {
    "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@cdc-ingestor-driver.cdc.svc:7078",
    "SPARK_EXECUTOR_ID": "3",
    "SPARK_EXECUTOR_CORES": "1",
    "SPARK_EXECUTOR_MEMORY": "2048m",
    "SPARK_APPLICATION_ID": "spark-0123456789abcdef",
    "SPARK_RESOURCE_PROFILE_ID": "0",
    "SPARK_EXECUTOR_POD_IP": "10.1.2.3",
    "SPARK_EXECUTOR_POD_NAME": "cdc-ingestor-0123456789abcdef-exec-3",
    "SPARK_CONF_DIR": "/opt/spark/conf",
}


def run_launcher(
    tmp_path: Path, env: dict[str, str], *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "executor.sh"
    script.write_text(launcher_text(), encoding="utf-8")
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    return subprocess.run(
        ["bash", str(script), *args],
        cwd=workdir,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fake_java(tmp_path: Path) -> tuple[Path, Path]:
    """A JAVA_HOME whose java writes its arguments, one per line, to a file."""
    home, record = tmp_path / "java", tmp_path / "argv"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n', encoding="utf-8")
    java.chmod(0o755)
    return home, record


def test_launcher_runs_the_executor_backend_as_sparks_entrypoint_does(tmp_path: Path) -> None:
    java_home, record = fake_java(tmp_path)
    spark_home = tmp_path / "pyspark"
    (spark_home / "jars").mkdir(parents=True)
    opts = {f"SPARK_JAVA_OPT_{i}": f"-Dopt.{i}=v{i}" for i in range(12)}
    opts["SPARK_JAVA_OPT_5"] = "-Dspark.with.space=a b"
    env = {
        **SPARK_EXECUTOR_ENV,
        **opts,
        "JAVA_HOME": str(java_home),
        "SPARK_HOME": str(spark_home),
        "SPARK_CLASSPATH": "/extra/*",
    }
    done = run_launcher(tmp_path, env, "executor")
    assert done.returncode == 0, done.stderr
    argv = record.read_text(encoding="utf-8").splitlines()
    options = [opts[f"SPARK_JAVA_OPT_{i}"] for i in range(12)]  # in numeric order
    classpath = f"/opt/spark/conf:/extra/*:{spark_home}/jars/*:{tmp_path / 'work'}"
    assert argv == [
        *options,
        "-Xms2048m",
        "-Xmx2048m",
        "-cp",
        classpath,
        EXECUTOR_MAIN,
        "--driver-url",
        SPARK_EXECUTOR_ENV["SPARK_DRIVER_URL"],
        "--executor-id",
        "3",
        "--cores",
        "1",
        "--app-id",
        "spark-0123456789abcdef",
        "--hostname",
        "10.1.2.3",
        "--resourceProfileId",
        "0",
        "--podName",
        "cdc-ingestor-0123456789abcdef-exec-3",
    ]


def test_launcher_refuses_anything_but_an_executor(tmp_path: Path) -> None:
    java_home, record = fake_java(tmp_path)
    done = run_launcher(tmp_path, {**SPARK_EXECUTOR_ENV, "JAVA_HOME": str(java_home)}, "driver")
    assert done.returncode == 64
    assert "expected the argument 'executor'" in done.stderr
    assert not record.exists()


def _java_home() -> Path | None:
    java = shutil.which("java")
    return Path(os.path.realpath(java)).parents[1] if java else None


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.skipif(_java_home() is None, reason="no java on PATH")
def test_launcher_starts_sparks_executor_backend_with_pysparks_jars(tmp_path: Path) -> None:
    """The real thing, but for the driver: the executor backend of this pyspark parses the
    arguments and tries the driver (nothing listens there), so class, classpath and
    arguments are right. SPARK_HOME is found as in the image: pyspark of python3 on PATH."""
    port = _closed_port()
    java_home = _java_home()
    assert java_home is not None
    env = {
        **SPARK_EXECUTOR_ENV,
        "SPARK_DRIVER_URL": f"spark://CoarseGrainedScheduler@127.0.0.1:{port}",
        "SPARK_EXECUTOR_POD_IP": "127.0.0.1",
        "SPARK_EXECUTOR_MEMORY": "256m",
        "SPARK_CONF_DIR": str(tmp_path / "conf"),
        "SPARK_JAVA_OPT_0": "-XX:+IgnoreUnrecognizedVMOptions",
        "SPARK_JAVA_OPT_1": "-Dspark.driver.port=7078",
        "JAVA_HOME": str(java_home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = run_launcher(tmp_path, env, "executor", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Unrecognized options" not in output
    assert "ClassNotFoundException" not in output and "Could not find" not in output
    assert f"Failed to connect to /127.0.0.1:{port}" in output, output[-3000:]


# --- what runs Python on executors ---------------------------------------------------------

# PySpark APIs whose Python runs in a Python worker on the executors.
PYTHON_ON_EXECUTORS = re.compile(
    r"\b(udf|pandas_udf|udtf|mapInPandas|mapInArrow|applyInPandas|applyInArrow|"
    r"applyInPandasWithState|transformWithStateInPandas|foreachPartition|mapPartitions|"
    r"parallelize)\b|\.rdd\b|\.foreach\("
)
#: The one module that makes DataFrames of the driver's rows: from Arrow, which the JVM
#: decodes (``createDataFrame`` of Python rows has pyspark's worker decode them on executors).
DRIVER_FRAMES = ROOT / "shared" / "cdc_shared" / "jvm" / "driver_frames.py"


def test_executors_run_no_python() -> None:
    """The services' transformations are DataFrame and SQL; their Python callbacks
    (foreachBatch bodies, Kafka and Elasticsearch clients) run on the driver; DataFrames
    of the driver's rows come from ``cdc_shared.jvm.driver_frames`` only. So no PySpark API
    starts a Python worker on an executor (the cluster test runs the services with none)."""
    found = []
    for path in sorted([*ROOT.glob("services/*/cdc_*/**/*.py"), *ROOT.glob("shared/**/*.py")]):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            rows_frame = "createDataFrame(" in code and path != DRIVER_FRAMES
            if PYTHON_ON_EXECUTORS.search(code) or rows_frame:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "Python on executors (use cdc_shared.jvm.driver_frames for driver rows)"
