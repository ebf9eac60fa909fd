"""publisher-es and ``cdc verify`` against an Elasticsearch with security on.

The cluster (``cdc_devkit.secured_elasticsearch``) serves HTTPS from a CA made at test
time and takes basic auth from its file realm; each service has a least-privilege role
(docs/configuration.md): publisher-es may manage and write only the pipeline's indexes, the
CLI may only read them. The publisher's index must equal silver; a wrong password and a
missing CA bundle must stop it at start with one line and write nothing; no password shows
in any output.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Iterator

import pytest
import yaml
from cdc_devkit import secured_elasticsearch
from cdc_devkit.secured_elasticsearch import OPERATOR, PUBLISHER, SecuredCluster
from cdc_publisher_es.main import start as start_publisher
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.pipeline import load_config
from cdc_shared.config.services import PublisherEsConfig
from pyspark.sql import SparkSession
from support.es import assert_index_equals_silver, build_silver, index_documents
from support.ops import cdc
from support.pipelines import Pipeline, PipelineFactory
from support.servers import TEST_INFRA
from support.waiting import free_ports

pytestmark = pytest.mark.integration

#: The environment variable the pipeline file names for the Elasticsearch password.
PASSWORD_ENV = "CDC_TEST_ES_PASSWORD"


@pytest.fixture(scope="module")
def secured_cluster() -> Iterator[SecuredCluster]:
    """A secured Elasticsearch for this module, its roles over the tests' indexes."""
    # Beside the session's servers, not in pytest's temporary folder: Elasticsearch runs as
    # a user of its own (it refuses root), who cannot enter pytest's private folders.
    folder = TEST_INFRA.state_dir / f"secured-es-{uuid.uuid4().hex[:8]}"
    port, transport_port = free_ports(2)
    settings = TEST_INFRA.model_copy(update={"state_dir": folder / "state", "es_heap": "384m"})
    cluster = secured_elasticsearch.start(
        settings, folder, port, transport_port, ["pytest-*", PublisherEsConfig().progress_index]
    )
    try:
        yield cluster
    finally:
        secured_elasticsearch.stop(settings, cluster)
        shutil.rmtree(folder, ignore_errors=True)


def as_user(pipeline: Pipeline, cluster: SecuredCluster, user: str, **changes: object) -> None:
    """Point the pipeline file at the secured cluster as ``user`` (password from the env)."""
    document = yaml.safe_load(pipeline.path.read_text())
    document["elasticsearch"] = {
        "hosts": [cluster.url],
        "username": user,
        "password": f"${{env:{PASSWORD_ENV}}}",
        "ca_certs": str(cluster.ca_file),
        **changes,
    }
    pipeline.path.write_text(yaml.safe_dump(document))


def refused_start(pipeline: Pipeline, spark: SparkSession, caplog: pytest.LogCaptureFixture) -> str:
    """publisher-es once: it must stop at start (an exception, quickly); its one error line."""
    caplog.clear()
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        start_publisher(pipeline.config, once=True, spark=spark).run()
    assert time.monotonic() - started < 60
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return "\n".join([*errors, str(raised.value)])


def test_publisher_es_and_verify_with_basic_auth_over_tls(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    secured_cluster: SecuredCluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    pipeline = make_pipeline(
        entities=("customers",),
        ingestor={"metrics_port": 0},
        merger={"metrics_port": 0},
        publisher_es={"metrics_port": 0},
    )
    build_silver(pipeline, spark, kafka_config, events=400, keys=80)
    as_user(pipeline, secured_cluster, PUBLISHER)
    password = secured_cluster.password(PUBLISHER)

    # A wrong password: stopped at start, nothing written, the password never shown.
    monkeypatch.setenv(PASSWORD_ENV, "wrong-" + password)
    refused = refused_start(pipeline, spark, caplog)
    assert f"Elasticsearch at {secured_cluster.url} refused the credentials (HTTP 401)" in refused
    assert "wrong-" + password not in refused
    alias = pipeline.config.entity("customers").es_index_name
    admin = make_elasticsearch(secured_cluster.config(secured_elasticsearch.ADMIN))
    assert not admin.indices.exists_alias(name=alias)

    # No CA bundle: the cluster's certificate is not trusted (the system's store lacks it).
    monkeypatch.setenv(PASSWORD_ENV, password)
    as_user(pipeline, secured_cluster, PUBLISHER, ca_certs=None)
    refused = refused_start(pipeline, spark, caplog)
    reason = "its TLS certificate fails verification (unable to get local issuer certificate)"
    assert f"Elasticsearch at {secured_cluster.url}: {reason}" in refused, refused
    assert not admin.indices.exists_alias(name=alias)

    # The right credentials: the index equals silver, through the publisher's own role.
    as_user(pipeline, secured_cluster, PUBLISHER)
    start_publisher(pipeline.config, once=True, spark=spark).run()
    config = load_config(pipeline.path)
    assert_index_equals_silver(spark, config, "customers")

    # cdc verify as the operator, who may only read.
    as_user(pipeline, secured_cluster, OPERATOR)
    monkeypatch.setenv(PASSWORD_ENV, secured_cluster.password(OPERATOR))
    verified = cdc("verify", "--config", str(pipeline.path), "--target", "elasticsearch")
    assert verified.exit_code == 0, verified.output
    operator = make_elasticsearch(load_config(pipeline.path).elasticsearch)
    with pytest.raises(Exception, match=r"403|unauthorized"):
        operator.delete(index=alias, id=next(iter(index_documents(operator, alias))))

    logged = verified.output + caplog.text + "".join(capfd.readouterr())
    for user in (PUBLISHER, OPERATOR, secured_elasticsearch.ADMIN):
        assert secured_cluster.password(user) not in logged, user
