"""Kafka and Elasticsearch clients built from the pipeline configuration.

The Kafka security of the configuration (``kafka.security_protocol``, ``kafka.sasl``,
``kafka.tls``) is rendered here for both kinds of client, whose settings differ:
librdkafka (confluent-kafka) takes ``sasl.username``/``sasl.password`` and PEM file
locations; the Java client (Spark's Kafka source and sink) takes a JAAS line and PEM
trust and key stores. Both renderings hold secrets: never log them (use
:func:`cdc_shared.config.values.redact` for anything printed).
"""

from __future__ import annotations

import re
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from elasticsearch import Elasticsearch

from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.values import ConfigError

if TYPE_CHECKING:  # the client costs a third of a second to import: only when used
    from elasticsearch import Elasticsearch

#: The Java client's login module per SASL mechanism (for ``sasl.jaas.config``).
JAAS_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def librdkafka_security(config: KafkaConfig) -> dict[str, str]:
    """The typed security as librdkafka settings (holds the password); none for PLAINTEXT."""
    if config.security_protocol == "PLAINTEXT":
        return {}
    settings: dict[str, str] = {"security.protocol": config.security_protocol}
    if config.sasl is not None:
        settings["sasl.mechanisms"] = config.sasl.mechanism
        settings["sasl.username"] = config.sasl.username
        settings["sasl.password"] = config.sasl.password.get_secret_value()
    tls = config.tls
    if tls is not None:
        settings["ssl.endpoint.identification.algorithm"] = (
            "https" if tls.verify_hostname else "none"
        )
        if tls.ca_file is not None:
            settings["ssl.ca.location"] = str(tls.ca_file)
        if tls.certificate_file is not None and tls.key_file is not None:
            settings["ssl.certificate.location"] = str(tls.certificate_file)
            settings["ssl.key.location"] = str(tls.key_file)
        if tls.key_password is not None:
            settings["ssl.key.password"] = tls.key_password.get_secret_value()
    return settings


def _jaas_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def java_security(config: KafkaConfig) -> dict[str, str]:
    """The typed security as Java client settings, without Spark's ``kafka.`` prefix.

    The PEM files are read here, on the driver, and passed by content
    (``ssl.truststore.certificates``, ``ssl.keystore.certificate.chain``/``.key``): Spark
    ships source options to its executors, so workers need no copy of the files. (A
    PEM key store by location would also need an encrypted key: the client refuses a
    PEM ``ssl.keystore.location`` without ``ssl.key.password``.) Holds the password and
    the private key: Spark redacts both in plans and its UI (:mod:`cdc_shared.jvm.spark`).
    None for PLAINTEXT.
    """
    if config.security_protocol == "PLAINTEXT":
        return {}
    settings: dict[str, str] = {"security.protocol": config.security_protocol}
    if config.sasl is not None:
        module = JAAS_LOGIN_MODULES[config.sasl.mechanism]
        username = _jaas_quoted(config.sasl.username)
        password = _jaas_quoted(config.sasl.password.get_secret_value())
        settings["sasl.mechanism"] = config.sasl.mechanism
        settings["sasl.jaas.config"] = f"{module} required username={username} password={password};"
    tls = config.tls
    if tls is not None:
        settings["ssl.endpoint.identification.algorithm"] = "https" if tls.verify_hostname else ""
        if tls.ca_file is not None:
            settings["ssl.truststore.type"] = "PEM"
            settings["ssl.truststore.certificates"] = tls.ca_file.read_text(encoding="ascii")
        if tls.certificate_file is not None and tls.key_file is not None:
            settings["ssl.keystore.type"] = "PEM"
            settings["ssl.keystore.certificate.chain"] = tls.certificate_file.read_text(
                encoding="ascii"
            )
            settings["ssl.keystore.key"] = tls.key_file.read_text(encoding="ascii")
        if tls.key_password is not None:
            settings["ssl.key.password"] = tls.key_password.get_secret_value()
    return settings


#: How the broker refused a client, as the Java client and librdkafka say it: the SASL
#: credentials, or the TLS handshake (a CA that does not sign the broker's certificate, an
#: expired or unknown client one).
KAFKA_AUTHENTICATION_FAILED = re.compile(
    r"org\.apache\.kafka\.common\.errors\.(?P<java>Sasl|Ssl)AuthenticationException"
    r"|(?P<sasl>SASL authentication error)|(?P<ssl>SSL handshake failed)"
)

#: What to do about refused credentials (the same credentials fail again).
FIX_CREDENTIALS = "fix kafka.sasl / kafka.tls (or the secret they name) and restart"


def kafka_refusal(config: KafkaConfig, error: str) -> str | None:
    """What the broker refused, if ``error`` shows it refused the credentials; else None.

    "Kafka at <brokers> (<mechanism> as <user>) refused <what>": the brokers and the
    mechanism (:meth:`KafkaConfig.describe`), never a secret.
    """
    found = KAFKA_AUTHENTICATION_FAILED.search(error)
    if found is None:
        return None
    if found.group("java") == "Sasl" or found.group("sasl"):
        what = "the SASL credentials (username or password)"
    elif (problem := broker_certificate_problem(config)) is not None:
        what = f"the TLS handshake: the broker's certificate fails verification ({problem})"
    else:
        what = "the TLS handshake (CA bundle, or an expired or untrusted certificate)"
    return f"Kafka at {config.describe()} refused {what}"


#: How long :func:`broker_certificate_problem` waits for one broker.
CERTIFICATE_PROBE_TIMEOUT_S = 5.0


def broker_certificate_problem(config: KafkaConfig) -> str | None:
    """Why a bootstrap broker's certificate fails verification, in OpenSSL's words.

    For example "certificate has expired" or "unable to get local issuer certificate"
    (a CA bundle that did not sign it). librdkafka reports only that verification failed,
    so after a refused handshake one TLS handshake of our own, with the same CA bundle
    and hostname rule, names the reason for the operator. None when the protocol has no
    TLS, the certificate verifies, or no broker answers.
    """
    if config.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    tls = config.tls
    context = ssl.create_default_context(
        cafile=str(tls.ca_file) if tls is not None and tls.ca_file is not None else None
    )
    context.check_hostname = tls is None or tls.verify_hostname
    for server in config.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        host = host.strip("[]")
        try:
            with (
                socket.create_connection((host, int(port)), CERTIFICATE_PROBE_TIMEOUT_S) as raw,
                context.wrap_socket(raw, server_hostname=host),
            ):
                return None
        except ssl.SSLCertVerificationError as error:
            return str(error.verify_message)
        except (OSError, ValueError):  # unreachable, or not a host:port: the next one
            continue
    return None


def kafka_authentication_failure(config: KafkaConfig, error: str) -> str | None:
    """One line for a Kafka authentication failure found in ``error``; None if there is none.

    Not a fault to wait out: the same credentials fail again, so the service stops.
    """
    refused = kafka_refusal(config, error)
    if refused is None:
        return None
    return f"stopped: {refused}; nothing was read. {FIX_CREDENTIALS.capitalize()}"


#: How the Java client says the broker's ACLs refused it access to a topic.
KAFKA_TOPIC_AUTHORIZATION_FAILED = re.compile(
    r"org\.apache\.kafka\.common\.errors\.TopicAuthorizationException"
)


def kafka_principal(config: KafkaConfig) -> str:
    """The principal the broker's ACLs see for these settings, as ``kafka-acls`` names it."""
    if config.sasl is not None:
        return f"User:{config.sasl.username}"
    return "the client's principal (its TLS certificate's subject, or User:ANONYMOUS)"


def kafka_missing_permission(
    config: KafkaConfig, operation: str, resource_type: str, resource_name: str
) -> str:
    """One line for an operation the broker's ACLs refused: what, for whom, how to grant it.

    No secret. ``operation`` and ``resource_type`` as ``kafka-acls`` names them (Read,
    Write, Describe; topic, group, transactional-id). Not a fault to wait out: the ACLs stay
    as they are until an administrator changes them, so the stream stops; its checkpoint
    keeps its place, and a restart once the ACL is back resumes there, losing nothing.
    """
    principal = kafka_principal(config)
    return (
        f"stopped: Kafka at {config.bootstrap_servers} refused {operation} on {resource_type} "
        f"{resource_name!r} to {principal}: no ACL allows it (missing or revoked). Grant it "
        f"(kafka-acls --bootstrap-server <brokers> --add --allow-principal {principal} "
        f"--operation {operation} --{resource_type} {resource_name}) and restart: the stream "
        "resumes from its checkpoint and loses nothing"
    )


def kafka_client_config(config: KafkaConfig, **overrides: Any) -> dict[str, Any]:
    """librdkafka settings: bootstrap servers, security, the pass-through maps, overrides.

    ``options`` then ``librdkafka_options``, so the client-specific map wins.
    """
    return {
        "bootstrap.servers": config.bootstrap_servers,
        **librdkafka_security(config),
        **config.options,
        **config.librdkafka_options,
        **overrides,
    }


def spark_kafka_options(config: KafkaConfig) -> dict[str, str]:
    """Options for Spark's Kafka source and sink (``kafka.``-prefixed client settings).

    Security, then ``options``, then ``java_options`` (the client-specific map wins).
    """
    settings = {
        "bootstrap.servers": config.bootstrap_servers,
        **java_security(config),
        **config.options,
        **config.java_options,
    }
    return {f"kafka.{k}": v for k, v in settings.items()}


def make_producer(config: KafkaConfig, **overrides: Any) -> Producer:
    """A confluent-kafka producer with the pipeline's connection and security settings."""
    return Producer(kafka_client_config(config, **overrides))


def make_consumer(config: KafkaConfig, group_id: str, **overrides: Any) -> Consumer:
    """A confluent-kafka consumer in ``group_id`` (auto commit off unless overridden)."""
    settings = {"group.id": group_id, "enable.auto.commit": False, **overrides}
    return Consumer(kafka_client_config(config, **settings))


def make_admin(config: KafkaConfig, **overrides: Any) -> AdminClient:
    """A confluent-kafka admin client."""
    return AdminClient(kafka_client_config(config, **overrides))


def make_elasticsearch(config: ElasticsearchConfig) -> Elasticsearch:
    """An Elasticsearch client; API key or basic auth when configured."""
    kwargs: dict[str, Any] = {
        "hosts": list(config.hosts),
        "request_timeout": config.request_timeout_s,
        "verify_certs": config.verify_certs,
    }
    if config.ca_certs is not None:
        kwargs["ca_certs"] = str(config.ca_certs)
    if config.api_key is not None:
        kwargs["api_key"] = config.api_key.get_secret_value()
    elif config.username is not None and config.password is not None:
        kwargs["basic_auth"] = (config.username, config.password.get_secret_value())
    return Elasticsearch(**kwargs)


def check_tls_files(config: KafkaConfig) -> None:
    """ConfigError naming each TLS file that cannot be read or is not PEM the clients read.

    Run at start (``cdc_shared.config.entity_sets.load_pipeline``), not at load: loading reads
    only the configuration. Keys must be PKCS#8 (``PRIVATE KEY``, or ``ENCRYPTED PRIVATE
    KEY`` with ``key_password``): the one PEM key form both librdkafka and the Java client
    read.
    """
    tls = config.tls
    if tls is None:
        return
    files = {
        "ca_file": (tls.ca_file, "CERTIFICATE"),
        "certificate_file": (tls.certificate_file, "CERTIFICATE"),
        "key_file": (tls.key_file, "PRIVATE KEY"),
    }
    problems = [
        f"  kafka.tls.{field}: {problem}"
        for field, (path, kind) in files.items()
        if path is not None and (problem := _pem_problem(path, kind)) is not None
    ]
    if problems:
        raise ConfigError("\n".join(["invalid pipeline configuration:", *problems]))


def _pem_problem(path: Path, kind: str) -> str | None:
    """What is wrong with ``path`` as a PEM file holding a ``kind`` block; None if nothing."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror}"
    if kind == "PRIVATE KEY" and re.search(r"-----BEGIN (RSA|EC|DSA) PRIVATE KEY-----", text):
        return (
            f"{path} holds a key in its algorithm's own PEM form, which the Java client "
            "refuses: convert it to PKCS#8 (openssl pkcs8 -topk8 -nocrypt -in KEY -out NEW)"
        )
    if f"-----BEGIN {kind}-----" not in text and f"-----BEGIN ENCRYPTED {kind}-----" not in text:
        return f"{path} is not a PEM file with a {kind.lower()} block"
    return None
