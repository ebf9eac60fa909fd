"""A secured Kafka broker for the tests and the demo, as production brokers are secured.

One SASL_SSL listener (SCRAM-SHA-512) with certificates made when it first starts
(:mod:`cdc_devkit.certificates`: a PEM CA and a server certificate for 127.0.0.1, never
checked in), SCRAM users created when its storage is formatted, and ACLs enforced by the
broker's ``StandardAuthorizer`` (:class:`cdc_devkit.infra.SecuredKafka` runs it). The test session
starts one on free ports in a folder of its own (``tests/support/secured_kafka.py``);
``cdc infra up --secure`` starts one on fixed ports for the example pipeline
``deploy/local/pipeline-secured.yaml``, with its topics and the ACL table of
``deploy/kafka-acls/README.md`` granted (:func:`start_local`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdc_shared.config.connections import KafkaConfig, KafkaSaslConfig, KafkaTlsConfig
from cdc_shared.config.services import PublisherKafkaConfig
from cdc_shared.contracts.layout import publisher_progress_group
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)
from pydantic import SecretStr

from cdc_devkit import infra
from cdc_devkit.certificates import EXPIRED_CERTIFICATE, make_certificates

ADMIN = "admin"
INGESTOR = "cdc-ingestor"
PUBLISHER = "cdc-publisher-kafka"
#: The ``cdc`` CLI's principal (status, verify): describes and reads, writes nothing.
OPERATOR = "cdc-operator"
#: ``cdc run``'s principal: the four services in one application hold the ingestor's and
#: publisher-kafka's rows of the ACL table.
APPLICATION = "cdc-application"
USERS = (ADMIN, INGESTOR, PUBLISHER, OPERATOR, APPLICATION)
MECHANISM = infra.SECURED_KAFKA_MECHANISM

#: The example pipeline of ``cdc infra up --secure`` (deploy/local/pipeline-secured.yaml):
#: its topic prefixes, its entities' topics and its environment variable for the password.
LOCAL_SOURCE_PREFIX = "dbserver1.inventory."
LOCAL_CHANGE_PREFIX = "cdc.inventory."
LOCAL_TABLES = ("customers", "orders")
LOCAL_PASSWORD_ENV = "CDC_KAFKA_PASSWORD"

_READ_WRITE = (AclOperation.WRITE, AclOperation.DESCRIBE, AclOperation.READ)
_DESCRIBE_READ = (AclOperation.DESCRIBE, AclOperation.READ)
_PREFIXED = ResourcePatternType.PREFIXED
_LITERAL = ResourcePatternType.LITERAL


@dataclass(frozen=True)
class Grant:
    """One row of the ACL table: a principal's operations on a resource pattern."""

    user: str
    resource: ResourceType
    name: str
    operations: tuple[AclOperation, ...]
    pattern: ResourcePatternType = _LITERAL


def acl_table(
    *,
    source_prefix: str,
    change_prefix: str,
    progress_topic: str,
    ingestor: str = INGESTOR,
    publisher: str = PUBLISHER,
    operator: str | None = OPERATOR,
) -> list[Grant]:
    """The least-privilege grants of deploy/kafka-acls for a pipeline's prefixes.

    The rows of its README's table (its script's commands); one principal may hold
    several roles, and ``operator=None`` leaves the CLI's rows out.
    """
    ids = publisher_progress_group(change_prefix)
    services = [
        Grant(ingestor, ResourceType.TOPIC, source_prefix, _DESCRIBE_READ, _PREFIXED),
        Grant(
            publisher,
            ResourceType.TOPIC,
            change_prefix,
            (*_READ_WRITE, AclOperation.DESCRIBE_CONFIGS),
            _PREFIXED,
        ),
        Grant(publisher, ResourceType.TOPIC, progress_topic, _READ_WRITE),
        Grant(
            publisher,
            ResourceType.TRANSACTIONAL_ID,
            ids,
            (AclOperation.WRITE, AclOperation.DESCRIBE),
            _PREFIXED,
        ),
        Grant(publisher, ResourceType.GROUP, ids, _DESCRIBE_READ, _PREFIXED),
    ]
    if operator is None:
        return services
    return [
        *services,
        # `cdc status` reads the source topics' watermarks, never their records.
        Grant(operator, ResourceType.TOPIC, source_prefix, (AclOperation.DESCRIBE,), _PREFIXED),
        # `cdc verify` reads the change topics: what downstream teams read anyway.
        Grant(operator, ResourceType.TOPIC, change_prefix, _DESCRIBE_READ, _PREFIXED),
        # `cdc status` reads publisher-kafka's progress: its group's offset on this topic.
        Grant(operator, ResourceType.TOPIC, progress_topic, (AclOperation.DESCRIBE,)),
        Grant(operator, ResourceType.GROUP, ids, (AclOperation.DESCRIBE,), _PREFIXED),
        *[
            Grant(operator, ResourceType.GROUP, group, _DESCRIBE_READ, _PREFIXED)
            for group in ("cdc-cli-", "cdc-verify-")
        ],
    ]


@dataclass(frozen=True)
class SecuredBroker:
    """A running secured broker: how to connect, as whom, and the admin's tools."""

    server: infra.SecuredKafka

    @property
    def bootstrap_servers(self) -> str:
        """Where clients connect (the SASL_SSL listener)."""
        return self.server.bootstrap_servers

    @property
    def expired_bootstrap_servers(self) -> str:
        """The listener presenting an expired certificate (``start(expired_port=...)``)."""
        other = self.server.other_listener
        if other is None:
            raise ValueError("this broker was started without an expired listener")
        return f"127.0.0.1:{other.port}"

    @property
    def ca_file(self) -> Path:
        """The PEM CA that clients trust."""
        return self.server.ca_file

    def password(self, user: str) -> str:
        """``user``'s SCRAM password."""
        return self.server.users[user]

    def kafka_config(self, user: str, password: str | None = None) -> KafkaConfig:
        """The typed pipeline settings to connect as ``user``."""
        return KafkaConfig(
            bootstrap_servers=self.bootstrap_servers,
            security_protocol="SASL_SSL",
            sasl=KafkaSaslConfig(
                mechanism="SCRAM-SHA-512",  # MECHANISM
                username=user,
                password=SecretStr(password or self.password(user)),
            ),
            tls=KafkaTlsConfig(ca_file=self.server.ca_file),
        )

    def kafka_section(self, user: str, password_env: str) -> dict[str, object]:
        """The ``kafka:`` block of a pipeline file for ``user``.

        The password is read from the environment variable ``password_env``, as a
        deployment would.
        """
        return {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": "SASL_SSL",
            "sasl": {
                "mechanism": MECHANISM,
                "username": user,
                "password": f"${{env:{password_env}}}",
            },
            "tls": {"ca_file": str(self.server.ca_file)},
        }

    def admin(self) -> AdminClient:
        """An admin client as the super user, for topics and ACLs."""
        return AdminClient({**self.server.client_settings(self.server.admin), "log_level": 0})

    def allow(
        self,
        user: str,
        resource: ResourceType,
        name: str,
        operations: tuple[AclOperation, ...],
        pattern: ResourcePatternType = _LITERAL,
    ) -> None:
        """Grant ``user`` the ``operations`` on a resource (ACLs, as the admin)."""
        self.grant([Grant(user, resource, name, operations, pattern)])

    def grant(self, grants: list[Grant]) -> None:
        """Add the ``grants`` (idempotent: an ACL that exists is left as it is)."""
        bindings = [binding for g in grants for binding in _allowing(AclBinding, g)]
        admin = self.admin()  # held until the futures are done: its end cancels them
        for future in admin.create_acls(bindings).values():
            future.result(30)

    def revoke(
        self,
        user: str,
        resource: ResourceType,
        name: str,
        operations: tuple[AclOperation, ...],
        pattern: ResourcePatternType = _LITERAL,
    ) -> None:
        """Take back the ``operations`` on a resource that :meth:`allow` granted ``user``."""
        filters = _allowing(AclBindingFilter, Grant(user, resource, name, operations, pattern))
        admin = self.admin()
        for future in admin.delete_acls(filters).values():
            assert future.result(30), f"no such ACL of User:{user} on {name}"

    def create_topics(self, topics: list[NewTopic]) -> None:
        """Create the ``topics`` that do not exist yet, as the admin (auto-create is off)."""
        admin = self.admin()
        existing = set(admin.list_topics(timeout=30).topics)
        missing = [t for t in topics if t.topic not in existing]
        if missing:
            for future in admin.create_topics(missing, operation_timeout=30).values():
                future.result(60)


def start(
    settings: infra.InfraSettings,
    folder: Path,
    port: int,
    controller_port: int,
    users: dict[str, str] | None = None,
    name: str = "kafka-secured",
    expired_port: int | None = None,
) -> SecuredBroker:
    """Start a secured broker with new certificates in ``folder`` and the ``users``.

    By default the users are :data:`USERS`, each with a new random password.
    ``expired_port``: also a SASL_SSL listener there presenting a certificate of the
    same CA that expired yesterday (for tests of what clients say about it).
    """
    expired_too = expired_port is not None
    ca_file, certificate_file, key_file = make_certificates(
        folder, "broker", expired_too=expired_too
    )
    other = None
    if expired_port is not None:
        other = infra.TlsListener(
            expired_port,
            folder / f"{EXPIRED_CERTIFICATE}.pem",
            folder / f"{EXPIRED_CERTIFICATE}-key.pem",
        )
    server = infra.SecuredKafka(
        port=port,
        controller_port=controller_port,
        ca_file=ca_file,
        certificate_file=certificate_file,
        key_file=key_file,
        users=users or {user: secrets.token_urlsafe(18) for user in USERS},
        admin=ADMIN,
        name=name,
        other_listener=other,
    )
    infra.start_secured_kafka(settings, server)
    return SecuredBroker(server)


def stop(settings: infra.InfraSettings, broker: SecuredBroker) -> bool:
    """Stop the broker; True if it ran."""
    return infra.stop_secured_kafka(settings, broker.server)


# --- `cdc infra up --secure` ----------------------------------------------------------

#: Its name among ``infra.SERVERS``: ``cdc infra down`` stops it with the others.
LOCAL_NAME = infra.SECURED_KAFKA


def local_folder(settings: infra.InfraSettings) -> Path:
    """Where the local secured broker keeps its data, certificates and passwords."""
    return settings.state_dir / LOCAL_NAME


def password_file(settings: infra.InfraSettings, user: str) -> Path:
    """The file holding ``user``'s password on the local secured broker (mode 0600)."""
    return local_folder(settings) / "passwords" / user


def _local_server(settings: infra.InfraSettings) -> infra.SecuredKafka | None:
    """The local broker as made before (certificates and passwords kept), if it was."""
    folder = local_folder(settings)
    files = [folder / f for f in ("ca.pem", "broker.pem", "broker-key.pem")]
    if not all(f.exists() for f in files) or not password_file(settings, ADMIN).exists():
        return None
    return infra.SecuredKafka(
        port=settings.kafka_secured_port,
        controller_port=settings.kafka_secured_controller_port,
        ca_file=files[0],
        certificate_file=files[1],
        key_file=files[2],
        users={u: password_file(settings, u).read_text() for u in USERS},
        admin=ADMIN,
        name=LOCAL_NAME,
    )


def start_local(settings: infra.InfraSettings) -> SecuredBroker:
    """``cdc infra up --secure``: the secured broker for deploy/local/pipeline-secured.yaml.

    The first start makes the certificates and one random password per user of
    :data:`USERS` (files of mode 0600 under ``<state_dir>/kafka-secured``); later starts
    reuse them, since the SCRAM users live in the broker's formatted storage. As the
    admin it then creates the example's topics (no principal of the pipeline may create
    topics) and grants the ACL table: the services' rows to their principals and to
    ``cdc-application`` (``cdc run``), the operator's rows to ``cdc-operator``.
    """
    folder = local_folder(settings)
    server = _local_server(settings)
    if server is None:
        if (folder / "data" / "meta.properties").exists():
            raise infra.InfraError(
                f"the secured Kafka's storage in {folder} has lost its passwords or "
                "certificates; remove that folder and run `cdc infra up --secure` again"
            )
        ca_file, certificate_file, key_file = make_certificates(folder, "broker")
        users = {user: secrets.token_urlsafe(18) for user in USERS}
        (folder / "passwords").mkdir(mode=0o700, exist_ok=True)
        for user, password in users.items():
            path = password_file(settings, user)
            path.touch(mode=0o600)
            path.write_text(password)
        server = infra.SecuredKafka(
            port=settings.kafka_secured_port,
            controller_port=settings.kafka_secured_controller_port,
            ca_file=ca_file,
            certificate_file=certificate_file,
            key_file=key_file,
            users=users,
            admin=ADMIN,
            name=LOCAL_NAME,
        )
    infra.start_secured_kafka(settings, server)
    broker = SecuredBroker(server)
    publisher = PublisherKafkaConfig()
    broker.create_topics(
        [
            *[NewTopic(f"{LOCAL_SOURCE_PREFIX}{t}", 3, 1) for t in LOCAL_TABLES],
            *[
                NewTopic(f"{LOCAL_CHANGE_PREFIX}{t}", publisher.topic_partitions, 1)
                for t in LOCAL_TABLES
            ],
            NewTopic(publisher.progress_topic, 1, 1, config={"cleanup.policy": "compact"}),
        ]
    )
    prefixes = {
        "source_prefix": LOCAL_SOURCE_PREFIX,
        "change_prefix": LOCAL_CHANGE_PREFIX,
        "progress_topic": publisher.progress_topic,
    }
    broker.grant(
        [
            *acl_table(**prefixes),
            *acl_table(**prefixes, ingestor=APPLICATION, publisher=APPLICATION, operator=None),
        ]
    )
    return broker


def _allowing(kind: type[Any], grant: Grant) -> list[Any]:
    """One ALLOW binding (or filter: ``kind``) per operation of a grant."""
    return [
        kind(
            grant.resource,
            grant.name,
            grant.pattern,
            f"User:{grant.user}",
            "*",
            operation,
            AclPermissionType.ALLOW,
        )
        for operation in grant.operations
    ]
