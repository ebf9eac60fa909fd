"""A secured Elasticsearch for the tests, as production clusters are secured.

HTTPS with a certificate made at start (:mod:`cdc_devkit.certificates`), basic auth
against the file realm, and a least-privilege role per service (:func:`roles`): the
publisher writes and manages only its own indexes, the CLI reads them.
:class:`cdc_devkit.infra.SecuredElasticsearch` runs it; the test session starts one on
free ports (``tests/support/secured_elasticsearch.py``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from cdc_shared.config.connections import ElasticsearchConfig
from pydantic import SecretStr

from cdc_devkit import infra
from cdc_devkit.certificates import make_certificates

ADMIN = "admin"
PUBLISHER = "cdc-publisher-es"
#: The CLI's user (``cdc status``, ``cdc verify``): reads the indexes, writes nothing.
OPERATOR = "cdc-operator"
#: The roles of :func:`roles`, by user.
USER_ROLES = {PUBLISHER: "cdc_publisher_es", OPERATOR: "cdc_operator"}


def roles(index_patterns: list[str]) -> str:
    """The ``roles.yml`` of the least-privilege roles over the pipeline's indexes.

    ``cdc_publisher_es``: creates, maps, aliases and writes its indexes (``manage``
    covers index creation, mappings, settings and aliases; ``write`` the bulk requests;
    ``read`` the rebuild's checks). ``cdc_operator``: reads them and their metadata, and
    refreshes them (``maintenance``: ``cdc verify`` refreshes before it reads, so that
    it sees every acknowledged write). Neither has a cluster privilege. The rows of
    docs/configuration.md's role table.
    """
    names = ", ".join(f'"{pattern}"' for pattern in index_patterns)
    return (
        "cdc_publisher_es:\n"
        "  indices:\n"
        f"    - names: [{names}]\n"
        '      privileges: ["manage", "write", "read"]\n'
        "cdc_operator:\n"
        "  indices:\n"
        f"    - names: [{names}]\n"
        '      privileges: ["read", "view_index_metadata", "maintenance"]\n'
    )


@dataclass(frozen=True)
class SecuredCluster:
    """A running secured Elasticsearch: how to connect, and as whom."""

    server: infra.SecuredElasticsearch

    @property
    def url(self) -> str:
        """Where clients connect (HTTPS)."""
        return self.server.url

    @property
    def ca_file(self) -> Path:
        """The PEM CA that clients trust."""
        return self.server.ca_file

    def password(self, user: str) -> str:
        """``user``'s password."""
        return self.server.users[user]

    def config(self, user: str, password: str | None = None) -> ElasticsearchConfig:
        """The typed pipeline settings to connect as ``user`` (its password unless given)."""
        return ElasticsearchConfig(
            hosts=[self.url],
            username=user,
            password=SecretStr(password or self.password(user)),
            ca_certs=self.ca_file,
        )


def start(
    settings: infra.InfraSettings,
    folder: Path,
    port: int,
    transport_port: int,
    index_patterns: list[str],
) -> SecuredCluster:
    """Start a secured Elasticsearch with new certificates in ``folder``.

    Its users are :data:`ADMIN` (superuser), :data:`PUBLISHER` and :data:`OPERATOR`, each
    with a new random password and the role of :func:`roles` over ``index_patterns``.
    """
    ca_file, certificate_file, key_file = make_certificates(folder, "node")
    server = infra.SecuredElasticsearch(
        port=port,
        transport_port=transport_port,
        ca_file=ca_file,
        certificate_file=certificate_file,
        key_file=key_file,
        users={user: secrets.token_urlsafe(18) for user in (ADMIN, PUBLISHER, OPERATOR)},
        user_roles=USER_ROLES,
        roles=roles(index_patterns),
        admin=ADMIN,
    )
    infra.start_secured_elasticsearch(settings, server)
    return SecuredCluster(server)


def stop(settings: infra.InfraSettings, cluster: SecuredCluster) -> bool:
    """Stop the cluster; True if it ran."""
    return infra.stop_secured_elasticsearch(settings, cluster.server)
