"""Where the test session's own servers run (Kafka, Elasticsearch, and on demand the
registry, the S3 server, PostgreSQL, Kafka Connect and a Spark standalone cluster)."""

from __future__ import annotations

import os
from pathlib import Path

from cdc_devkit import infra

ROOT = Path(__file__).resolve().parents[2]

# Test servers get their own ports and state folder, so a demo left running on the
# default ports is neither used nor disturbed.
TEST_INFRA = infra.InfraSettings(
    state_dir=Path(os.environ.get("CDC_TEST_INFRA_STATE", ROOT / ".state" / "test-infra")),
    kafka_port=int(os.environ.get("CDC_TEST_KAFKA_PORT", "29092")),
    kafka_controller_port=int(os.environ.get("CDC_TEST_KAFKA_CONTROLLER_PORT", "29093")),
    es_port=int(os.environ.get("CDC_TEST_ES_PORT", "29200")),
    es_transport_port=int(os.environ.get("CDC_TEST_ES_TRANSPORT_PORT", "29300")),
    registry_port=int(os.environ.get("CDC_TEST_REGISTRY_PORT", "28081")),
    registry_management_port=int(os.environ.get("CDC_TEST_REGISTRY_MANAGEMENT_PORT", "28082")),
    postgres_port=int(os.environ.get("CDC_TEST_POSTGRES_PORT", "25432")),
    connect_port=int(os.environ.get("CDC_TEST_CONNECT_PORT", "28083")),
    s3_port=int(os.environ.get("CDC_TEST_S3_PORT", "29000")),
    spark_master_port=int(os.environ.get("CDC_TEST_SPARK_MASTER_PORT", "27077")),
    spark_master_webui_port=int(os.environ.get("CDC_TEST_SPARK_MASTER_WEBUI_PORT", "28180")),
    spark_worker_webui_port=int(os.environ.get("CDC_TEST_SPARK_WORKER_WEBUI_PORT", "28191")),
)


def infra_env() -> dict[str, str]:
    """The environment for a ``cdc`` command that brings up servers with ``cdc infra up``
    (demo, chaos): pointed at the test session's own servers."""
    return {
        **os.environ,
        "CDC_INFRA_STATE_DIR": str(TEST_INFRA.state_dir),
        "CDC_INFRA_KAFKA_PORT": str(TEST_INFRA.kafka_port),
        "CDC_INFRA_KAFKA_CONTROLLER_PORT": str(TEST_INFRA.kafka_controller_port),
        "CDC_INFRA_ES_PORT": str(TEST_INFRA.es_port),
        "CDC_INFRA_ES_TRANSPORT_PORT": str(TEST_INFRA.es_transport_port),
        "CDC_INFRA_REGISTRY_PORT": str(TEST_INFRA.registry_port),
        "CDC_INFRA_REGISTRY_MANAGEMENT_PORT": str(TEST_INFRA.registry_management_port),
        "CDC_INFRA_POSTGRES_PORT": str(TEST_INFRA.postgres_port),
        "CDC_INFRA_CONNECT_PORT": str(TEST_INFRA.connect_port),
        "CDC_INFRA_S3_PORT": str(TEST_INFRA.s3_port),
        "CDC_INFRA_SPARK_MASTER_PORT": str(TEST_INFRA.spark_master_port),
        "CDC_INFRA_SPARK_MASTER_WEBUI_PORT": str(TEST_INFRA.spark_master_webui_port),
        "CDC_INFRA_SPARK_WORKER_WEBUI_PORT": str(TEST_INFRA.spark_worker_webui_port),
    }
