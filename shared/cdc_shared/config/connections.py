"""The servers the pipeline connects to: Kafka, the registry, Elasticsearch, object storage."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from cdc_shared.config.values import Resolved, Secret, Section, redact, resolve_reference

BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


#: The scheme of object-storage roots this configuration maps to Hadoop's S3A settings.
S3A_SCHEME = "s3a"


#: S3A's provider for a fixed access key and secret key (``fs.s3a.access.key`` / ``secret.key``).
S3A_STATIC_CREDENTIALS = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"


class ObjectStorageConfig(Section):
    """S3-compatible object storage for an ``s3a://bucket/prefix`` storage root.

    Mapped to Hadoop's S3A settings for the root's bucket only
    (``fs.s3a.bucket.<bucket>.*``, see :meth:`hadoop_options`), so other buckets keep
    their own. Without keys, S3A's default credential chain applies (environment,
    instance or pod role). The keys are secrets: ``${env:NAME}`` or ``${file:PATH}``,
    never printed.
    """

    endpoint: str | None = None  # e.g. https://minio.internal:9000; null: AWS S3
    region: str | None = None  # e.g. eu-west-1; most S3-compatible stores accept any
    path_style_access: bool = False  # bucket in the path, not the host name (MinIO, Ceph)
    access_key: Secret | None = None
    secret_key: Secret | None = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint_url(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not re.match(r"^https?://[^/\s]+/?$", endpoint):
            raise ValueError(f"must be http(s)://host[:port], got {endpoint!r}")
        return endpoint

    @model_validator(mode="after")
    def _both_keys(self) -> Self:
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("set both access_key and secret_key, or neither")
        return self

    def hadoop_options(self, bucket: str) -> dict[str, str]:
        """The Hadoop settings (without ``spark.hadoop.``) for ``bucket``; holds secrets."""
        options: dict[str, str] = {"path.style.access": str(self.path_style_access).lower()}
        if self.endpoint is not None:
            options["endpoint"] = self.endpoint.rstrip("/")
            options["connection.ssl.enabled"] = str(self.endpoint.startswith("https")).lower()
        if self.region is not None:
            options["endpoint.region"] = self.region
        if self.access_key is not None and self.secret_key is not None:
            options["aws.credentials.provider"] = S3A_STATIC_CREDENTIALS
            options["access.key"] = self.access_key.get_secret_value()
            options["secret.key"] = self.secret_key.get_secret_value()
        return {f"fs.s3a.bucket.{bucket}.{name}": value for name, value in options.items()}


def s3a_bucket(root: str) -> str | None:
    """The bucket of an ``s3a://bucket/...`` root; None for any other root."""
    scheme, _, rest = root.partition("://")
    if scheme.lower() != S3A_SCHEME:
        return None
    return rest.split("/", 1)[0]


#: Kafka's ``security.protocol`` values (the same names in librdkafka and the Java client).
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]


#: The SASL mechanisms both clients take with a username and password.
SaslMechanism = Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"]


#: Client settings the typed security renders; a pass-through map may not set them too.
KAFKA_SECURITY_KEYS = frozenset(
    {
        "security.protocol",
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.password",
        "sasl.jaas.config",
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.endpoint.identification.algorithm",
        "ssl.truststore.type",
        "ssl.truststore.location",
        "ssl.truststore.certificates",
        "ssl.keystore.type",
        "ssl.keystore.location",
        "ssl.keystore.certificate.chain",
        "ssl.keystore.key",
    }
)


class KafkaSaslConfig(Section):
    """SASL credentials: a mechanism, a username and a password (a secret)."""

    mechanism: SaslMechanism = "SCRAM-SHA-512"
    username: Annotated[Resolved, Field(min_length=1)]
    password: Secret

    @field_validator("password")
    @classmethod
    def _not_empty(cls, password: SecretStr) -> SecretStr:
        if not password.get_secret_value():
            raise ValueError("must not be empty")
        return password


class KafkaTlsConfig(Section):
    """TLS to the brokers: the CA bundle to trust and, for mutual TLS, a client cert + key.

    All files are PEM, the key PKCS#8 (checked at start, not at load:
    ``cdc_shared.clients.connect.check_tls_files``). Without ``ca_file`` the system's trust store
    applies (librdkafka) or the JVM's (the Java client). The key may be encrypted
    (``key_password``, a secret).
    """

    ca_file: Path | None = None
    certificate_file: Path | None = None
    key_file: Path | None = None
    key_password: Secret | None = None
    verify_hostname: bool = True

    @field_validator("ca_file", "certificate_file", "key_file")
    @classmethod
    def _expanded(cls, path: Path | None) -> Path | None:
        return None if path is None else path.expanduser()

    @model_validator(mode="after")
    def _certificate_with_key(self) -> Self:
        if (self.certificate_file is None) != (self.key_file is None):
            raise ValueError("set both certificate_file and key_file (mutual TLS), or neither")
        if self.key_password is not None and self.key_file is None:
            raise ValueError("key_password is set but key_file is not")
        return self


class KafkaConfig(Section):
    """Kafka connection and security, rendered for both kinds of client.

    The typed part (``security_protocol``, ``sasl``, ``tls``) is rendered by
    :mod:`cdc_shared.clients.connect` for librdkafka (confluent-kafka: admin, producers,
    consumers) and for the Java client (Spark's Kafka source and sink), whose settings
    differ. Pass-through for what it lacks: ``options`` go to both clients,
    ``librdkafka_options`` only to librdkafka, ``java_options`` (without Spark's
    ``kafka.`` prefix) only to the Java client; once security is on, none of them may
    set a key the typed part renders.
    """

    bootstrap_servers: str = "localhost:9092"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl: KafkaSaslConfig | None = None
    tls: KafkaTlsConfig | None = None
    options: dict[str, str] = Field(default_factory=dict, repr=False)
    librdkafka_options: dict[str, str] = Field(default_factory=dict, repr=False)
    java_options: dict[str, str] = Field(default_factory=dict, repr=False)

    @field_validator("options", "librdkafka_options", "java_options")
    @classmethod
    def _resolve_secrets(cls, options: dict[str, str]) -> dict[str, str]:
        return {k: resolve_reference(str(v)) for k, v in options.items()}

    @model_validator(mode="after")
    def _security_consistent(self) -> Self:
        protocol = self.security_protocol
        uses_sasl = protocol.startswith("SASL_")
        uses_tls = protocol.endswith("SSL")
        if uses_sasl and self.sasl is None:
            raise ValueError(f"security_protocol {protocol} needs kafka.sasl (mechanism, ...)")
        if not uses_sasl and self.sasl is not None:
            raise ValueError(
                f"kafka.sasl is set but security_protocol is {protocol}: use SASL_SSL "
                "(or SASL_PLAINTEXT) to authenticate with it"
            )
        if not uses_tls and self.tls is not None:
            raise ValueError(
                f"kafka.tls is set but security_protocol is {protocol}: use SSL or SASL_SSL"
            )
        if protocol != "PLAINTEXT":
            for name in ("options", "librdkafka_options", "java_options"):
                clash = sorted(KAFKA_SECURITY_KEYS.intersection(getattr(self, name)))
                if clash:
                    raise ValueError(
                        f"kafka.{name} sets {', '.join(clash)}, which the typed security "
                        "(security_protocol, sasl, tls) renders: remove it there"
                    )
        return self

    def redacted_options(self) -> dict[str, str]:
        """The options with secrets masked, for logs and ``cdc status``."""
        return redact(self.options)

    def describe(self) -> str:
        """Where and how the clients connect, for one-line errors (no secret)."""
        how: str = self.security_protocol
        if self.sasl is not None:
            how += f" {self.sasl.mechanism} as {self.sasl.username!r}"
        return f"{self.bootstrap_servers} ({how})"


class SchemaRegistryConfig(Section):
    """Schemas: a Confluent-compatible registry when ``url`` is set, else .avsc files.

    A registry request that fails for want of the registry (5xx, 401/403, a timeout after
    ``request_timeout_s``, no connection) is retried with backoff for about
    ``retry_budget_s``, then the service stops naming the registry: records are never
    quarantined because the registry could not answer.
    """

    url: str | None = None
    dirs: list[Path] = Field(default_factory=lambda: [Path("schemas")])
    options: dict[str, str] = Field(default_factory=dict, repr=False)
    retry_budget_s: float = Field(default=180.0, gt=0)
    request_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("options")
    @classmethod
    def _resolve_secrets(cls, options: dict[str, str]) -> dict[str, str]:
        return {k: resolve_reference(str(v)) for k, v in options.items()}


class ElasticsearchConfig(Section):
    """Elasticsearch connection; credentials are secrets and never printed."""

    hosts: list[str] = Field(default_factory=lambda: ["http://localhost:9200"], min_length=1)
    api_key: Secret | None = None
    username: str | None = None
    password: Secret | None = None
    ca_certs: Path | None = None
    verify_certs: bool = True
    request_timeout_s: float = Field(default=30.0, gt=0)
