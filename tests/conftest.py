"""Session-wide fixtures: real local servers, started once, and one SparkSession."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from cdc_devkit import infra
from cdc_devkit.postgres import Database, local_server
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm.spark import build_spark_session
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import settings
from pyspark.sql import SparkSession
from support.servers import TEST_INFRA


@pytest.fixture(scope="session")
def local_servers() -> Iterator[infra.Endpoints]:
    """Kafka and Elasticsearch on loopback; stopped at the end if this session started them."""
    already = infra.running(TEST_INFRA)
    served = infra.up(TEST_INFRA)
    yield served
    if not any(already.values()) and not os.environ.get("CDC_TEST_KEEP_INFRA"):
        infra.down(TEST_INFRA)


@pytest.fixture(scope="session")
def registry_url(local_servers: infra.Endpoints) -> Iterator[str]:
    """A Confluent-compatible schema registry (Apicurio, in memory), started on first use."""
    already = infra.running(TEST_INFRA)["registry"]
    url = infra.start_registry(TEST_INFRA)
    yield url
    if not already and not os.environ.get("CDC_TEST_KEEP_INFRA"):
        infra.stop(TEST_INFRA, "registry")


def _keep_infra() -> bool:
    return bool(os.environ.get("CDC_TEST_KEEP_INFRA"))


@pytest.fixture(scope="session")
def s3_endpoint(local_servers: infra.Endpoints) -> Iterator[str]:
    """An S3-compatible server (S3Proxy, in memory) with the bucket ``infra.S3_BUCKET``,
    started on first use; its endpoint (path-style, fixed local credentials)."""
    already = infra.running(TEST_INFRA)["s3"]
    url = infra.start_s3(TEST_INFRA)
    yield url
    if not already and not _keep_infra():
        infra.stop(TEST_INFRA, "s3")


@pytest.fixture(scope="session")
def spark_master(local_servers: infra.Endpoints) -> Iterator[str]:
    """A Spark standalone cluster (a master, ``TEST_INFRA.spark_workers`` workers) on
    loopback, started on first use; the master's ``spark://`` URL."""
    already = infra.running(TEST_INFRA)["spark-master"]
    url = infra.start_spark_cluster(TEST_INFRA)
    yield url
    if not already and not _keep_infra():
        infra.stop(TEST_INFRA, infra.SPARK_WORKERS)
        infra.stop(TEST_INFRA, "spark-master")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Database]:
    """PostgreSQL (``wal_level=logical``, loopback), started on first use; its superuser."""
    already = infra.running(TEST_INFRA)["postgres"]
    infra.start_postgres(TEST_INFRA)
    yield local_server(TEST_INFRA)
    if not already and not _keep_infra():
        infra.stop(TEST_INFRA, "postgres")


@pytest.fixture(scope="session")
def connect_url(local_servers: infra.Endpoints) -> Iterator[str]:
    """Kafka Connect (standalone, Debezium and Apicurio's converter) on the test Kafka,
    started on first use; the URL of its REST API."""
    already = infra.running(TEST_INFRA)["connect"]
    url = infra.start_connect(TEST_INFRA)
    yield url
    if not already and not _keep_infra():
        infra.stop(TEST_INFRA, "connect")


@pytest.fixture(scope="session")
def kafka_config(local_servers: infra.Endpoints) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=local_servers.kafka_bootstrap_servers)


@pytest.fixture(scope="session")
def es_config(local_servers: infra.Endpoints) -> ElasticsearchConfig:
    return ElasticsearchConfig(hosts=[local_servers.elasticsearch_url])


@pytest.fixture
def topic(kafka_config: KafkaConfig, request: pytest.FixtureRequest) -> Iterator[str]:
    """A throwaway topic (3 partitions) named after the test, deleted afterwards."""
    name = f"pytest_{request.node.name[:40]}_{uuid.uuid4().hex[:8]}".replace("[", "_")
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    admin = AdminClient({"bootstrap.servers": kafka_config.bootstrap_servers})
    for future in admin.create_topics([NewTopic(name, 3, 1)]).values():
        future.result(30)
    yield name
    for future in admin.delete_topics([name]).values():
        future.result(30)


@pytest.fixture(scope="session")
def spark() -> SparkSession:
    """One small local SparkSession for the whole test process."""
    return build_spark_session(
        SparkConfig(
            master="local[2]",
            conf={
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "2",
                "spark.default.parallelism": "2",
                "spark.databricks.delta.snapshotPartitions": "2",
                "spark.databricks.delta.delta.log.cacheSize": "3",
                "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2",
                "spark.driver.memory": "2g",
            },
        ),
        app_name="cdc-tests",
    )


# Property tests: reproducible in CI, and bounded when a failure shrinks.
settings.register_profile("default", deadline=None, database=None, max_examples=100)
settings.load_profile("default")
