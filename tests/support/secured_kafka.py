"""The test session's secured broker: ``cdc_devkit.secured_kafka`` on free ports.

The broker's code (certificates by ``trustme``, SCRAM users at format time, ACLs through
``StandardAuthorizer``, the ACL table) lives in the dev kit, which ``cdc infra up
--secure`` runs too; here only the session fixture that starts one beside the plain
broker, from a folder of the session's own, and stops it at the session's end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cdc_devkit import secured_kafka
from cdc_devkit.certificates import pkcs8
from cdc_devkit.secured_kafka import (
    ADMIN,
    APPLICATION,
    INGESTOR,
    OPERATOR,
    PUBLISHER,
    SecuredBroker,
    acl_table,
)

from support.servers import TEST_INFRA
from support.waiting import free_ports

#: The environment variable a pipeline file names for its Kafka password.
PASSWORD_ENV = "CDC_TEST_KAFKA_PASSWORD"

__all__ = [
    "ADMIN",
    "APPLICATION",
    "INGESTOR",
    "OPERATOR",
    "PASSWORD_ENV",
    "PUBLISHER",
    "SecuredBroker",
    "acl_table",
    "pkcs8",
    "secured_broker",
]


@pytest.fixture(scope="session")
def secured_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredBroker]:
    """The secured broker, started for this session and stopped at its end.

    Beside its listener, one presenting a certificate that expired yesterday
    (``expired_bootstrap_servers``).
    """
    folder = tmp_path_factory.mktemp("secured-kafka")
    port, controller_port, expired_port = free_ports(3)
    settings = TEST_INFRA.model_copy(update={"state_dir": folder / "state", "kafka_heap": "384m"})
    broker = secured_kafka.start(settings, folder, port, controller_port, expired_port=expired_port)
    try:
        yield broker
    finally:
        secured_kafka.stop(settings, broker)
