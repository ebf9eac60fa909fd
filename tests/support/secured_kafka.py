"""A second broker for the test session, secured as production brokers are.

One SASL_SSL listener (SCRAM-SHA-512), certificates made now by ``trustme`` (a PEM CA
and a server certificate for 127.0.0.1), SCRAM users created when its storage is
formatted, and ACLs enforced by the broker's ``StandardAuthorizer``. It runs beside the
plain broker, on free ports, from a folder of the session's own; the session stops it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import trustme
from cdc_devkit import infra
from cdc_shared.config import KafkaConfig
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from cryptography.hazmat.primitives import serialization

from support.servers import TEST_INFRA
from support.waiting import free_ports

ADMIN = "admin"
INGESTOR = "cdc-ingestor"
PUBLISHER = "cdc-publisher-kafka"
#: The environment variable a pipeline file names for its Kafka password.
PASSWORD_ENV = "CDC_TEST_KAFKA_PASSWORD"


@dataclass(frozen=True)
class SecuredBroker:
    """The running secured broker: how to connect, as whom, and the admin's tools."""

    server: infra.SecuredKafka

    @property
    def bootstrap_servers(self) -> str:
        return self.server.bootstrap_servers

    def password(self, user: str) -> str:
        return self.server.users[user]

    def kafka_config(self, user: str, password: str | None = None) -> KafkaConfig:
        """The typed pipeline settings to connect as ``user``."""
        return KafkaConfig(
            bootstrap_servers=self.bootstrap_servers,
            security_protocol="SASL_SSL",
            sasl={
                "mechanism": "SCRAM-SHA-512",
                "username": user,
                "password": password or self.password(user),
            },
            tls={"ca_file": self.server.ca_file},
        )

    def kafka_section(self, user: str) -> dict[str, object]:
        """The ``kafka:`` block of a pipeline file for ``user``; the password from the
        environment (``PASSWORD_ENV``), as a deployment would."""
        return {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": "SASL_SSL",
            "sasl": {
                "mechanism": "SCRAM-SHA-512",
                "username": user,
                "password": f"${{env:{PASSWORD_ENV}}}",
            },
            "tls": {"ca_file": str(self.server.ca_file)},
        }

    def admin(self) -> AdminClient:
        return AdminClient({**self.server.client_settings(ADMIN), "log_level": 0})

    def allow(
        self,
        user: str,
        resource: ResourceType,
        name: str,
        operations: tuple[AclOperation, ...],
        pattern: ResourcePatternType = ResourcePatternType.LITERAL,
    ) -> None:
        """Grant ``user`` the ``operations`` on a resource (ACLs, as the admin)."""
        bindings = _allowing(AclBinding, user, resource, name, operations, pattern)
        admin = self.admin()  # held until the futures are done: its end cancels them
        for future in admin.create_acls(bindings).values():
            future.result(30)

    def revoke(
        self,
        user: str,
        resource: ResourceType,
        name: str,
        operations: tuple[AclOperation, ...],
        pattern: ResourcePatternType = ResourcePatternType.LITERAL,
    ) -> None:
        """Take back the ``operations`` on a resource that :meth:`allow` granted ``user``."""
        filters = _allowing(AclBindingFilter, user, resource, name, operations, pattern)
        admin = self.admin()
        for future in admin.delete_acls(filters).values():
            assert future.result(30), f"no such ACL of User:{user} on {name}"


def pkcs8(key_pem: bytes) -> str:
    """``key_pem`` (trustme writes its algorithm's own PEM form) as unencrypted PKCS#8."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


@pytest.fixture(scope="session")
def secured_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredBroker]:
    """The secured broker, started for this session and stopped at its end."""
    folder = tmp_path_factory.mktemp("secured-kafka")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    certificate_file = folder / "broker.pem"
    certificate_file.write_text("".join(p.bytes().decode() for p in server_cert.cert_chain_pems))
    key_file = folder / "broker-key.pem"
    key_file.write_text(pkcs8(server_cert.private_key_pem.bytes()))
    port, controller_port = free_ports(2)
    server = infra.SecuredKafka(
        port=port,
        controller_port=controller_port,
        ca_file=ca_file,
        certificate_file=certificate_file,
        key_file=key_file,
        users={user: secrets.token_urlsafe(18) for user in (ADMIN, INGESTOR, PUBLISHER)},
        admin=ADMIN,
    )
    settings = TEST_INFRA.model_copy(update={"state_dir": folder / "state", "kafka_heap": "384m"})
    infra.start_secured_kafka(settings, server)
    try:
        yield SecuredBroker(server)
    finally:
        infra.stop_secured_kafka(settings, server)


def _allowing(
    kind: type[AclBinding],
    user: str,
    resource: ResourceType,
    name: str,
    operations: tuple[AclOperation, ...],
    pattern: ResourcePatternType,
) -> list[AclBinding]:
    """One ALLOW binding (or filter: ``kind``) per operation of ``user`` on a resource."""
    return [
        kind(resource, name, pattern, f"User:{user}", "*", operation, AclPermissionType.ALLOW)
        for operation in operations
    ]
