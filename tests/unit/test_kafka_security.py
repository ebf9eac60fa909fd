"""Typed Kafka security: checked at load and start, rendered for both kinds of client."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme
from cdc_shared.clients.connect import (
    kafka_authentication_failure,
    kafka_client_config,
    kafka_missing_permission,
    kafka_refusal,
    spark_kafka_options,
)
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.config.pipeline import load_config
from cdc_shared.config.values import ConfigError, redact
from support.secured_kafka import pkcs8

PASSWORD = "pl4nted-Secret"


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, Path]:
    """A CA bundle and a client certificate and key, as PEM files."""
    ca = trustme.CA()
    client = ca.issue_cert("cdc-ingestor")
    paths = {
        "ca": tmp_path / "ca.pem",
        "cert": tmp_path / "client.pem",
        "key": tmp_path / "key.pem",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    client.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    paths["key"].write_text(pkcs8(client.private_key_pem.bytes()))
    paths["traditional_key"] = tmp_path / "traditional.pem"
    client.private_key_pem.write_to_path(str(paths["traditional_key"]))
    return paths


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def secured(tmp_path: Path, pems: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> KafkaConfig:
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", PASSWORD)
    text = f"""
kafka:
  bootstrap_servers: "broker:9093"
  security_protocol: SASL_SSL
  sasl: {{mechanism: SCRAM-SHA-512, username: ingestor, password: "${{env:TEST_KAFKA_PASSWORD}}"}}
  tls: {{ca_file: {pems["ca"]}, certificate_file: {pems["cert"]}, key_file: {pems["key"]}}}
  options: {{client.id: both}}
  librdkafka_options: {{statistics.interval.ms: "0"}}
  java_options: {{max.poll.records: "100"}}
"""
    return load_config(write(tmp_path, text)).kafka


def test_rendered_for_librdkafka(
    tmp_path: Path, pems: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = kafka_client_config(secured(tmp_path, pems, monkeypatch), **{"group.id": "g"})
    assert settings == {
        "bootstrap.servers": "broker:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "ingestor",
        "sasl.password": PASSWORD,
        "ssl.endpoint.identification.algorithm": "https",
        "ssl.ca.location": str(pems["ca"]),
        "ssl.certificate.location": str(pems["cert"]),
        "ssl.key.location": str(pems["key"]),
        "client.id": "both",
        "statistics.interval.ms": "0",
        "group.id": "g",
    }


def test_rendered_for_the_java_client(
    tmp_path: Path, pems: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    options = spark_kafka_options(secured(tmp_path, pems, monkeypatch))
    assert options == {
        "kafka.bootstrap.servers": "broker:9093",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="ingestor" password="{PASSWORD}";'
        ),
        "kafka.ssl.endpoint.identification.algorithm": "https",
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.certificates": pems["ca"].read_text(),
        "kafka.ssl.keystore.type": "PEM",
        "kafka.ssl.keystore.certificate.chain": pems["cert"].read_text(),
        "kafka.ssl.keystore.key": pems["key"].read_text(),
        "kafka.client.id": "both",
        "kafka.max.poll.records": "100",
    }
    # Every rendered secret is one the log redaction masks.
    masked = redact(options)
    assert PASSWORD not in str(masked)
    assert "PRIVATE KEY" not in str(masked)


def test_plain_jaas_quotes_and_no_hostname_check() -> None:
    config = KafkaConfig(
        security_protocol="SASL_SSL",
        sasl={"mechanism": "PLAIN", "username": "a", "password": 'q"uo\\te'},
        tls={"verify_hostname": False},
    )
    java = spark_kafka_options(config)
    assert java["kafka.sasl.jaas.config"] == (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        'username="a" password="q\\"uo\\\\te";'
    )
    assert java["kafka.ssl.endpoint.identification.algorithm"] == ""
    assert "kafka.ssl.truststore.type" not in java  # no CA file: the JVM's trust store
    librdkafka = kafka_client_config(config)
    assert librdkafka["ssl.endpoint.identification.algorithm"] == "none"
    assert librdkafka["sasl.mechanisms"] == "PLAIN"


def test_plaintext_renders_what_it_did_before() -> None:
    config = KafkaConfig(bootstrap_servers="b:9092", options={"client.id": "x"})
    assert kafka_client_config(config) == {"bootstrap.servers": "b:9092", "client.id": "x"}
    assert spark_kafka_options(config) == {
        "kafka.bootstrap.servers": "b:9092",
        "kafka.client.id": "x",
    }


def test_secret_not_in_repr(
    tmp_path: Path, pems: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = secured(tmp_path, pems, monkeypatch)
    assert PASSWORD not in repr(config) + str(config) + str(config.model_dump())
    assert PASSWORD not in config.describe()
    assert config.describe() == "broker:9093 (SASL_SSL SCRAM-SHA-512 as 'ingestor')"


@pytest.mark.parametrize(
    ("error", "what"),
    [
        (
            "org.apache.kafka.common.errors.SaslAuthenticationException: Authentication failed",
            "the SASL credentials",
        ),
        (  # librdkafka's words (confluent-kafka's clients)
            "SASL authentication error: Authentication failed during authentication due to "
            "invalid credentials with SASL mechanism SCRAM-SHA-512",
            "the SASL credentials",
        ),
        ("org.apache.kafka.common.errors.SslAuthenticationException: x", "the TLS handshake"),
        ("SSL handshake failed: error:0A000086:SSL routines::certificate verify failed", "the TLS"),
    ],
)
def test_refused_credentials_read_from_both_clients(
    tmp_path: Path, pems: dict[str, Path], monkeypatch: pytest.MonkeyPatch, error: str, what: str
) -> None:
    config = secured(tmp_path, pems, monkeypatch)
    refused = kafka_refusal(config, "Job aborted ... " + error + "\n\tat ...")
    assert refused is not None
    assert refused.startswith(f"Kafka at {config.describe()} refused {what}")
    assert kafka_refusal(config, "org.apache.kafka.common.errors.TimeoutException") is None
    stop = kafka_authentication_failure(config, error)
    assert stop is not None and stop.startswith(f"stopped: {refused}; nothing was read.")


def test_missing_permission_names_it_and_how_to_grant_it(
    tmp_path: Path, pems: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = secured(tmp_path, pems, monkeypatch)
    line = kafka_missing_permission(config, "Read", "topic", "db.inventory.customers")
    assert line.startswith(
        "stopped: Kafka at broker:9093 refused Read on topic 'db.inventory.customers' to "
        "User:ingestor: no ACL allows it"
    )
    assert "--allow-principal User:ingestor --operation Read --topic db.inventory.customers" in line
    assert "\n" not in line and PASSWORD not in line
    mtls = KafkaConfig(bootstrap_servers="b:9093", security_protocol="SSL")
    assert "TLS certificate's subject" in kafka_missing_permission(mtls, "Write", "topic", "t")


@pytest.mark.parametrize(
    ("kafka", "field", "message"),
    [
        ("{security_protocol: SASL_SSL}", "kafka", "needs kafka.sasl"),
        (
            "{sasl: {username: u, password: p}}",
            "kafka",
            "kafka.sasl is set but security_protocol is PLAINTEXT",
        ),
        (
            "{security_protocol: SASL_PLAINTEXT, sasl: {username: u, password: p}, tls: {}}",
            "kafka",
            "kafka.tls is set but security_protocol is SASL_PLAINTEXT",
        ),
        ("{security_protocol: TLS}", "kafka.security_protocol", "'PLAINTEXT', 'SSL'"),
        (
            "{security_protocol: SASL_SSL, sasl: {mechanism: GSSAPI, username: u, password: p}}",
            "kafka.sasl.mechanism",
            "'SCRAM-SHA-256'",
        ),
        (
            "{security_protocol: SASL_SSL, sasl: {username: u, password: '${env:CDC_UNSET_PW}'}}",
            "kafka.sasl.password",
            "CDC_UNSET_PW",
        ),
        (
            "{security_protocol: SASL_SSL, sasl: {username: u}}",
            "kafka.sasl.password",
            "Field required",
        ),
        (
            "{security_protocol: SSL, tls: {ca_file: /nonexistent/ca.pem}}",
            "kafka.tls.ca_file",
            "cannot read /nonexistent/ca.pem",
        ),
        (
            "{security_protocol: SSL, tls: {certificate_file: %(cert)s}}",
            "kafka.tls",
            "set both certificate_file and key_file",
        ),
        (
            "{security_protocol: SSL, tls: {ca_file: %(key)s}}",
            "kafka.tls.ca_file",
            "not a PEM file with a certificate block",
        ),
        (
            "{security_protocol: SSL, tls: {certificate_file: %(cert)s, key_file: %(old)s}}",
            "kafka.tls.key_file",
            "convert it to PKCS#8",
        ),
        (
            "{security_protocol: SSL, java_options: {sasl.jaas.config: x}}",
            "kafka",
            "kafka.java_options sets sasl.jaas.config",
        ),
    ],
)
def test_bad_security_is_named(
    tmp_path: Path, pems: dict[str, Path], kafka: str, field: str, message: str
) -> None:
    text = "kafka: " + kafka % {
        "cert": pems["cert"],
        "key": pems["key"],
        "old": pems["traditional_key"],
    }
    with pytest.raises(ConfigError) as error:
        load_pipeline(write(tmp_path, text))
    assert f"  {field}: " in str(error.value)
    assert message in str(error.value)
    assert PASSWORD not in str(error.value)


def test_loading_reads_no_tls_file_and_the_start_reads_each(tmp_path: Path) -> None:
    """``load_config`` reads the file and the environment only; the TLS files it names are
    read, and refused with their field named, by the start (``load_pipeline``)."""
    missing = tmp_path / "gone" / "ca.pem"
    path = write(tmp_path, f"kafka: {{security_protocol: SSL, tls: {{ca_file: {missing}}}}}")
    config = load_config(path)
    assert config.kafka.tls is not None and config.kafka.tls.ca_file == missing
    with pytest.raises(ConfigError, match=r"  kafka\.tls\.ca_file: cannot read .*gone/ca\.pem"):
        load_pipeline(path)
