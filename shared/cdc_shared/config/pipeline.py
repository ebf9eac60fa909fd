"""Typed pipeline configuration: one YAML file shared by every service.

The file is named by ``--config PATH`` or the ``CDC_CONFIG`` environment variable, and
any field can be overridden by an environment variable with the ``CDC_`` prefix and
``__`` for nesting (``CDC_KAFKA__BOOTSTRAP_SERVERS=host:9092``). Values of the form
``${env:NAME}`` or ``${file:PATH}`` are read from the environment or a file, so secrets
need not be written in the YAML. The configuration is validated once, at start; a bad
field raises :class:`ConfigError` naming it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from cdc_shared.config.names import avro_namespace, es_index_problem, kafka_topic_problem
from cdc_shared.contracts.layout import (
    INGESTOR,
    MERGER,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    SERVICE_NAMES,
    StorageLayout,
    display_name,
)

CONFIG_ENV_VAR = "CDC_CONFIG"
KAFKA_COORDINATE_SEQUENCE = ["kafka.partition", "kafka.offset"]

_REFERENCE = re.compile(r"^\$\{(env|file):([^}]+)\}$")
_IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]*$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: Seconds per unit of a processing-time interval (``interval_seconds``).
_UNIT_S = {
    **dict.fromkeys(("ms", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("s", "second", "seconds"), 1.0),
    **dict.fromkeys(("min", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hour", "hours"), 3600.0),
}
_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)
_SECRET_WORDS = (
    "password",
    "secret",
    "api_key",
    "apikey",
    "token",
    "credential",
    "user.info",
    "access.key",
)


#: How a source topic's values or keys are written (see EntityConfig).
Format = Literal["avro", "json"]
#: Debezium's ``decimal.handling.mode``: how JSON records carry decimals.
DecimalHandling = Literal["precise", "string", "double"]


class ConfigError(ValueError):
    """The pipeline configuration is missing, unreadable or invalid."""


def interval_seconds(text: str) -> float | None:
    """A processing-time interval such as ``5 seconds`` or ``500 ms``, in seconds.

    None when ``text`` is not a number and a unit (milliseconds, seconds, minutes,
    hours): Spark may still take it, but it cannot be compared.
    """
    match = _INTERVAL.match(text)
    unit = _UNIT_S.get(match.group(2).lower()) if match else None
    return None if match is None or unit is None else float(match.group(1)) * unit


def _an_interval(text: str) -> str:
    """``text`` if ``interval_seconds`` reads it; ValueError if not."""
    if interval_seconds(text) is None:
        raise ValueError(
            f"not an interval: a number and a unit (ms, seconds, minutes, hours), got {text!r}"
        )
    return text


#: A processing-time interval such as ``5 seconds`` or ``500 ms`` (``interval_seconds``).
Interval = Annotated[str, AfterValidator(_an_interval)]
#: A TCP port; 0 where the field says so means "none".
Port = Annotated[int, Field(ge=0, lt=65536)]


def is_secret_option(name: str) -> bool:
    """Whether a pass-through option (e.g. ``sasl.password``) holds a secret."""
    lowered = name.lower()
    return (
        any(word in lowered for word in _SECRET_WORDS)
        or lowered.endswith(".jaas.config")
        or lowered.endswith("keystore.key")
    )


def redact(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` fit for logs: secret-looking values replaced by ``***``."""
    return {k: ("***" if is_secret_option(k) else v) for k, v in options.items()}


def _resolve_reference(value: str) -> str:
    match = _REFERENCE.match(value)
    if match is None:
        return value
    kind, target = match.groups()
    if kind == "env":
        if target not in os.environ:
            raise ValueError(f"environment variable {target!r} is not set")
        return os.environ[target]
    try:
        return Path(target).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read secret file {target!r}: {exc.strerror}") from None


def _resolved(value: object) -> object:
    return _resolve_reference(value) if isinstance(value, str) else value


#: A value that may be a reference resolved at load: ``${env:NAME}`` or ``${file:PATH}``.
Resolved = Annotated[str, BeforeValidator(_resolved)]
#: A secret (never printed), given or referenced as ``Resolved`` is.
Secret = Annotated[SecretStr, BeforeValidator(_resolved)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: The scheme of object-storage roots this configuration maps to Hadoop's S3A settings.
S3A_SCHEME = "s3a"
#: S3A's provider for a fixed access key and secret key (``fs.s3a.access.key`` / ``secret.key``).
S3A_STATIC_CREDENTIALS = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"


class ObjectStorageConfig(_Section):
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


class SparkConfig(_Section):
    """Where Spark runs and any Spark configuration to pass through.

    The pipeline adds the storage root's Hadoop settings (``object_storage``) when it is
    validated: they hold secrets, so they live in a private attribute, out of reprs.
    """

    master: str = "local[*]"
    conf: dict[str, str] = Field(default_factory=dict)
    _hadoop: dict[str, str] = PrivateAttr(default_factory=dict)

    def hadoop_options(self) -> dict[str, str]:
        """Hadoop settings for the storage root (``fs.s3a.bucket.*``; may hold secrets)."""
        return dict(self._hadoop)


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


class KafkaSaslConfig(_Section):
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


class KafkaTlsConfig(_Section):
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


class KafkaConfig(_Section):
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
        return {k: _resolve_reference(str(v)) for k, v in options.items()}

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


class SchemaRegistryConfig(_Section):
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
        return {k: _resolve_reference(str(v)) for k, v in options.items()}


class ElasticsearchConfig(_Section):
    """Elasticsearch connection; credentials are secrets and never printed."""

    hosts: list[str] = Field(default_factory=lambda: ["http://localhost:9200"], min_length=1)
    api_key: Secret | None = None
    username: str | None = None
    password: Secret | None = None
    ca_certs: Path | None = None
    verify_certs: bool = True
    request_timeout_s: float = Field(default=30.0, gt=0)


class StreamingServiceConfig(_Section):
    """Settings every streaming service shares: its trigger, endpoint and table queue.

    Each micro-batch writes the tables it changed through a work queue (docs/design.md,
    "The runtime"): ``tables_at_once`` side by side, taking in turn the table with the
    most new rows and the one whose oldest unwritten change is longest past
    ``max_table_delay``; no table's write starts once the batch has run ``batch_budget``
    (those left wait for the next batch).
    """

    trigger_interval: str = Field(default="5 seconds", min_length=1)
    metrics_port: Port = 0  # 0: no metrics/health server
    metrics_host: str = "127.0.0.1"  # loopback; a container or pod reached from outside: 0.0.0.0
    tables_at_once: int = Field(default=2, ge=1)
    batch_budget: Interval = "10 seconds"
    max_table_delay: Interval = "60 seconds"


class IngestorConfig(StreamingServiceConfig):
    """The ingestor: Kafka source options."""

    starting_offsets: str = "earliest"  # earliest, latest, or Spark's per-partition JSON
    max_offsets_per_trigger: int | None = Field(default=1_000_000, gt=0)
    metrics_port: Port = 9101
    # Records whose writer schema the reader cannot resolve: stop the entity (docs/design.md),
    # or quarantine them as incompatible_schema and go on.
    on_incompatible_schema: Literal["stop", "quarantine"] = "stop"
    # Records Kafka deleted before they were read stop the ingestor (false: read on from the
    # oldest record Kafka has; for one run, to accept such a gap).
    fail_on_data_loss: bool = True


class MergerConfig(StreamingServiceConfig):
    """The merger: Delta source limits per micro-batch, and how long tombstones are kept.

    A tombstone keeps a late, older event from resurrecting a deleted key. It is expired
    once bronze has received ``tombstone_retention_hours`` of events after it (bronze's
    ingest time, so a lagging merger never expires what its backlog still needs); the
    merger checks every ``tombstone_expiry_interval_s``. ``null`` keeps them forever.

    ``unavailable_value_placeholder`` is the source's marker for a value it did not send
    (Debezium's ``unavailable.value.placeholder``; ``hex:`` then hex octets, as there): a
    column carrying it keeps its prior value (``cdc_shared.contracts.unavailable``). ``null`` stores
    every value as sent.

    ``deletion_vectors_from_mib``: the size from which a silver's MERGEs mark changed
    rows in deletion vectors; a smaller silver's rewrite the files they change, which is
    cheaper there (``cdc_merger.write_mode``). 0: deletion vectors at every size.
    """

    max_files_per_trigger: int | None = Field(default=1000, gt=0)
    max_bytes_per_trigger: str | None = None  # e.g. "512m"; with files, the first limit wins
    tombstone_retention_hours: float | None = Field(default=168.0, gt=0)
    tombstone_expiry_interval_s: float = Field(default=3600.0, gt=0)
    deletion_vectors_from_mib: float = Field(default=2.0, ge=0)
    unavailable_value_placeholder: str | None = Field(
        default="__debezium_unavailable_value", min_length=1
    )
    metrics_port: Port = 9102

    @field_validator("unavailable_value_placeholder")
    @classmethod
    def _placeholder_readable(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("hex:"):
            try:
                if not bytes.fromhex(value[4:]):
                    raise ValueError("empty")
            except ValueError:
                raise ValueError(
                    f"{value!r}: after 'hex:' must come hexadecimal octets, e.g. 'hex:5f5f'"
                ) from None
        return value


class ChangeFeedConfig(StreamingServiceConfig):
    """Publishers: where to start reading silver's Change Data Feed, and batch limits.

    Without a starting version or timestamp, a first start publishes every change since
    the table was created (version 0); later starts resume from the checkpoint.
    """

    starting_version: int | None = Field(default=None, ge=0)
    starting_timestamp: str | None = None  # e.g. "2026-01-31 00:00:00"
    max_files_per_trigger: int | None = Field(default=1000, gt=0)
    max_bytes_per_trigger: str | None = None

    @model_validator(mode="after")
    def _one_start(self) -> Self:
        if self.starting_version is not None and self.starting_timestamp is not None:
            raise ValueError("set starting_version or starting_timestamp, not both")
        return self


class PublisherKafkaConfig(ChangeFeedConfig):
    """publisher-kafka: change topics, transactions, and the event's optional parts."""

    metrics_port: Port = 9103
    include_before: bool = False  # fill ``before`` on updates and deletes
    delete_tombstones: bool = False  # a null-value record after each delete (compaction)
    topic_partitions: int = Field(default=3, gt=0)
    topic_replication_factor: int = Field(default=1, gt=0)
    progress_topic: str = Field(default="_cdc_publisher_progress", min_length=1)
    transaction_timeout_ms: int = Field(default=60_000, gt=0)
    retry_attempts: int = Field(default=10, gt=0)  # per transaction, on retriable errors
    max_backoff_s: float = Field(default=30.0, gt=0)

    @field_validator("progress_topic")
    @classmethod
    def _valid_topic(cls, topic: str) -> str:
        problem = kafka_topic_problem(topic)
        if problem:
            raise ValueError(problem)
        return topic


class PublisherEsConfig(ChangeFeedConfig):
    """publisher-es: index settings, mapping choices, bulk sizes and retries."""

    metrics_port: Port = 9104
    text_fields: list[str] = Field(default_factory=list)  # strings analysed as text
    # string: exact keyword strings (any cluster); scaled_float: numbers, exact up to 15
    # digits, needs the mapper-extras module (in the default distribution)
    decimal_as: Literal["scaled_float", "string"] = "string"
    refresh_interval: str = "1s"
    gc_deletes: str = "1h"  # how long a delete's version is remembered (replay window)
    shards: int = Field(default=1, gt=0)
    replicas: int = Field(default=0, ge=0)
    chunk_size: int = Field(default=1000, gt=0)
    max_chunk_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    max_retries: int = Field(default=8, ge=0)  # per chunk, on 429 and 5xx
    initial_backoff_s: float = Field(default=0.5, gt=0)
    max_backoff_s: float = Field(default=30.0, gt=0)
    # The index behind the alias is gone although its progress records published changes:
    # rebuild it from silver's current state, or stop (exit 1) and say how.
    on_missing_index: Literal["rebuild", "stop"] = "rebuild"
    # Where each alias's progress (the last silver version published) is kept.
    progress_index: str = Field(default="cdc-publisher-es-progress", min_length=1)


class ApplicationConfig(_Section):
    """``cdc run``: several services as streaming queries of one Spark application.

    One ``/health`` and ``/metrics`` endpoint serves them all (each service's own
    ``metrics_port`` is then unused). Spark's FAIR scheduler shares the cores between
    one pool per service, in proportion to ``pool_weights``: the merger's batches are
    the pipeline's critical path, so by default it gets the largest share.
    """

    metrics_port: Port = 9100  # 0: no metrics/health server
    metrics_host: str = "127.0.0.1"  # loopback; a container or pod reached from outside: 0.0.0.0
    pool_weights: dict[str, int] = Field(
        default_factory=lambda: {
            display_name(INGESTOR): 2,
            display_name(MERGER): 3,
            display_name(PUBLISHER_KAFKA): 1,
            display_name(PUBLISHER_ES): 1,
        }
    )

    @field_validator("pool_weights")
    @classmethod
    def _known_services(cls, weights: dict[str, int]) -> dict[str, int]:
        normalised = {display_name(name): weight for name, weight in weights.items()}
        unknown = sorted(set(normalised) - set(SERVICE_NAMES))
        if unknown:
            raise ValueError(f"unknown services {unknown}; known: {', '.join(SERVICE_NAMES)}")
        if any(weight < 1 for weight in normalised.values()):
            raise ValueError("pool weights must be at least 1")
        return normalised

    def weight(self, service: str) -> int:
        """The service's pool weight (1 when not set)."""
        return self.pool_weights.get(service, 1)


#: Characters a key column's name cannot hold when history is on: the history's write
#: names the key in a SQL condition (Delta's ``replaceOn``), and its plans were built and
#: tested for plain names only.
HISTORY_KEY_FORBIDDEN = (",", ".", "`")


class HistoryConfig(_Section):
    """An entity's SCD type 2 history table (``silver_history/<entity>``), off by default.

    A change to a tracked column starts a new version; a change to untracked columns only
    updates the current version in place. Tracked: ``track_columns`` only, or every row
    column but ``except_columns`` (one of the two; neither tracks every column).
    ``freshness``: how far the history may lag silver; its writes wait that long and then
    take every change since at once (the change topics and indexes never wait for it).
    """

    enabled: bool = False
    track_columns: list[str] | None = Field(default=None, min_length=1)
    except_columns: list[str] | None = Field(default=None, min_length=1)
    freshness: Interval | None = "60 seconds"

    @field_validator("track_columns", "except_columns")
    @classmethod
    def _names_unique(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            raise ValueError(f"column names must be unique, got {names}")
        return names

    @model_validator(mode="after")
    def _one_selection(self) -> HistoryConfig:
        if self.track_columns is not None and self.except_columns is not None:
            raise ValueError("set track_columns or except_columns, not both")
        return self

    def untracked_columns(self, row: list[str], key: list[str]) -> list[str]:
        """The non-key columns of ``row`` whose changes make no new version."""
        if self.track_columns is not None:
            return [c for c in row if c not in key and c not in set(self.track_columns)]
        return [c for c in row if c in set(self.except_columns or [])]


class EntityConfig(_Section):
    """One replicated table: its source topic, key, ordering and outputs."""

    name: str
    source_topic: str = Field(min_length=1)
    key: list[str] = Field(min_length=1)
    sequence_by: list[str] = Field(
        default_factory=lambda: list(KAFKA_COORDINATE_SEQUENCE), min_length=1
    )
    key_schema: Path | None = None
    value_schema: Path | None = None
    change_topic: str | None = None
    es_index: str | None = None
    # How the source topic's values and keys are written: Avro (Confluent or single-object
    # framing) or Kafka Connect's JsonConverter (schemas.enable true or false, per record).
    value_format: Format = "avro"
    key_format: Format = "avro"
    # JSON decimals as Debezium's decimal.handling.mode writes them (precise: base64).
    decimal_handling: DecimalHandling = "precise"
    # At most how often each service runs a batch for this table (e.g. "60 seconds"): a cold
    # table batched less often leaves the cores to the hot ones. Null: every trigger.
    freshness: Interval | None = None
    # The row's columns silver (and from it the change topic and the index) keeps: only
    # ``columns`` (the key always), or all but ``except_columns``; bronze keeps every one.
    columns: list[str] | None = Field(default=None, min_length=1)
    except_columns: list[str] | None = Field(default=None, min_length=1)
    # A null in an update keeps the column's current value (sources that send only the
    # changed fields): every non-key column (true) or the ones listed. Off: a relational
    # null is a real value.
    ignore_null_updates: bool | list[str] = False
    # The SCD type 2 history table beside silver (``HistoryConfig``).
    history: HistoryConfig = Field(default_factory=HistoryConfig)

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, name: str) -> str:
        if not _IDENTIFIER.match(name):
            raise ValueError(
                "must be lower-case letters, digits and '_', starting with a letter "
                f"(it names tables and folders), got {name!r}"
            )
        return name

    @field_validator("source_topic", "change_topic")
    @classmethod
    def _valid_topic(cls, topic: str | None) -> str | None:
        problem = None if topic is None else kafka_topic_problem(topic)
        if problem:
            raise ValueError(problem)
        return topic

    @field_validator("es_index")
    @classmethod
    def _valid_index(cls, index: str | None) -> str | None:
        # The publisher's indices behind the alias are ``<alias>-000001`` and on.
        problem = None if index is None else es_index_problem(index, reserved_suffix=7)
        if problem:
            raise ValueError(problem)
        return index

    @field_validator("key")
    @classmethod
    def _key_columns_unique(cls, key: list[str]) -> list[str]:
        if len(set(key)) != len(key):
            raise ValueError(f"key columns must be unique, got {key}")
        return key

    @field_validator("columns", "except_columns")
    @classmethod
    def _column_names_unique(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            raise ValueError(f"column names must be unique, got {names}")
        return names

    @model_validator(mode="after")
    def _one_column_selection(self) -> EntityConfig:
        if self.columns is not None and self.except_columns is not None:
            raise ValueError("set columns or except_columns, not both")
        keys = sorted(set(self.key) & set(self.except_columns or []))
        if keys:
            raise ValueError(f"except_columns names key columns {keys}: the key is always kept")
        listed = self.ignore_null_updates if isinstance(self.ignore_null_updates, list) else []
        keys = sorted(set(self.key) & set(listed))
        if keys:
            raise ValueError(f"ignore_null_updates names key columns {keys}: a key is never null")
        history = self.history.track_columns or self.history.except_columns or []
        keys = sorted(set(self.key) & set(history))
        if keys:
            raise ValueError(
                f"history names key columns {keys}: the key identifies a version, never tracked"
            )
        unplain = [k for k in self.key if any(c in k for c in HISTORY_KEY_FORBIDDEN)]
        if self.history.enabled and unplain:
            raise ValueError(
                f"history is on and key columns {unplain} have one of "
                f"{' '.join(HISTORY_KEY_FORBIDDEN)} in their names: the history replaces a "
                "key's versions by a Delta replaceOn condition, written for plain column names"
            )
        return self

    def history_untracked_columns(self, row: list[str]) -> list[str]:
        """The columns of ``row`` (silver's row columns) whose change makes no new version.

        A name ``history`` gives that the row lacks (or that the column selection leaves
        out) is a configuration error, as for ``columns``.
        """
        history = self.history
        listed = history.track_columns or history.except_columns or []
        unknown = sorted(set(listed) - set(row))
        if unknown:
            field = "track_columns" if history.track_columns is not None else "except_columns"
            raise ConfigError(
                f"entities[{self.name}].history.{field}: {unknown} are not columns of its "
                f"silver rows (they have {', '.join(row)})"
            )
        return history.untracked_columns(row, self.key)

    def null_update_columns(self, row: list[str]) -> list[str]:
        """The columns of ``row`` whose null in an update keeps the current value."""
        if self.ignore_null_updates is True:
            return [c for c in row if c not in self.key]
        listed = self.ignore_null_updates or []
        unknown = sorted(set(listed) - set(row))
        if unknown:
            raise ConfigError(
                f"entities[{self.name}].ignore_null_updates: {unknown} are not columns of its "
                f"rows (they have {', '.join(row)})"
            )
        return [c for c in row if c in set(listed)]

    def dropped_columns(self, row: list[str], strict: bool = True) -> list[str]:
        """The columns of ``row`` (a source row's column names) silver does not keep.

        ``strict``: a name the selection gives that the row lacks is a configuration error
        (a typo would otherwise narrow nothing, or keep nothing, silently); the merger
        checks it against bronze, which holds every column any source schema had.
        """
        selection = self.columns if self.columns is not None else self.except_columns
        unknown = sorted(set(selection or []) - set(row))
        if unknown and strict:
            field = "columns" if self.columns is not None else "except_columns"
            raise ConfigError(
                f"entities[{self.name}].{field}: {unknown} are not columns of its rows "
                f"(they have {', '.join(row)})"
            )
        if self.columns is not None:
            kept = set(self.columns) | set(self.key)
            return [c for c in row if c not in kept]
        return [c for c in row if c in set(self.except_columns or [])]

    @property
    def change_topic_name(self) -> str:
        """The publisher-kafka output topic (default ``cdc.<name>``)."""
        return self.change_topic or f"cdc.{self.name}"

    @property
    def change_event_namespace(self) -> str:
        """The Avro namespace of the change topic's records (``names.avro_namespace``)."""
        return avro_namespace(self.change_topic_name)

    @property
    def es_index_name(self) -> str:
        """The publisher-es index alias (default: the entity name)."""
        return self.es_index or self.name


#: EntityConfig fields an entity set's ``overrides`` may set per table.
ENTITY_OVERRIDABLE = frozenset(EntityConfig.model_fields) - {"name", "source_topic"}
_TEMPLATE_FIELD = re.compile(r"\{([^{}]*)\}")


def entity_name_from(raw: str) -> str:
    """An entity name made of any text: lower case, other characters than ``[a-z0-9_]`` as ``_``.

    A name that would start with a digit or ``_`` gets a ``t`` in front.
    """
    name = re.sub(r"[^a-z0-9_]", "_", raw.lower())
    return name if _IDENTIFIER.match(name) else f"t{name}"


def entity_conflict(entities: list[EntityConfig]) -> str | None:
    """Why ``entities`` cannot run side by side (a shared name, topic, index...), or None."""
    for attribute in (
        "name",
        "source_topic",
        "change_topic_name",
        "change_event_namespace",
        "es_index_name",
    ):
        seen: set[str] = set()
        for entity in entities:
            value = getattr(entity, attribute)
            if value in seen:
                return f"two entities share the {attribute} {value!r}"
            seen.add(value)
    return None


class EntitySetConfig(_Section):
    """Many tables at once: the source topics a pattern selects (``entity_sets`` in the file).

    Each selected topic becomes an entity (cdc_shared.config.entity_sets resolves them at start,
    from the broker's topic list). Templates (``name``, ``change_topic``, ``es_index``)
    take ``{table}`` (the entity name), ``{topic}`` and the pattern's named groups.
    """

    topics_regex: str | None = None  # full match over topic names
    topics: list[str] = Field(default_factory=list)  # topics selected by name
    exclude: list[str] = Field(default_factory=list)  # topic names or full-match patterns
    name: str | None = None  # template; default: the `table` group, the first, the last segment
    key: list[str] | None = Field(default=None, min_length=1)  # default: the key schema's fields
    sequence_by: list[str] = Field(
        default_factory=lambda: list(KAFKA_COORDINATE_SEQUENCE), min_length=1
    )
    change_topic: str = "cdc.{table}"
    es_index: str = "{table}"
    value_format: Format = "avro"
    key_format: Format = "avro"
    decimal_handling: DecimalHandling = "precise"
    freshness: Interval | None = None  # every table's; the hot ones' set back in ``overrides``
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per table name

    @field_validator("topics_regex")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression ({exc}): {pattern!r}") from None
        return pattern

    @field_validator("exclude")
    @classmethod
    def _excludes_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            cls._compiles(pattern)
        return patterns

    @field_validator("overrides")
    @classmethod
    def _known_override_fields(cls, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
        for table, fields in overrides.items():
            unknown = sorted(set(fields) - ENTITY_OVERRIDABLE)
            if unknown:
                raise ValueError(
                    f"{table}: cannot override {unknown}; a table may override: "
                    f"{', '.join(sorted(ENTITY_OVERRIDABLE))}"
                )
        return overrides

    @model_validator(mode="after")
    def _selects_and_templates(self) -> Self:
        if self.topics_regex is None and not self.topics:
            raise ValueError("give topics_regex, topics, or both")
        groups = set(re.compile(self.topics_regex).groupindex) if self.topics_regex else set()
        for attribute, known in (
            ("name", groups | {"topic"}),
            ("change_topic", groups | {"topic", "table"}),
            ("es_index", groups | {"topic", "table"}),
        ):
            template = getattr(self, attribute)
            if template is None:
                continue
            unknown = sorted(set(_TEMPLATE_FIELD.findall(template)) - known)
            if unknown:
                raise ValueError(
                    f"{attribute} template {template!r} names {unknown}; it may use: "
                    f"{', '.join('{' + k + '}' for k in sorted(known))}"
                )
        return self

    @property
    def label(self) -> str:
        """How errors name this set: its pattern, else its first topics."""
        return repr(self.topics_regex) if self.topics_regex else repr(self.topics[:3])


#: The group of the tables no configured group names (``groups``).
DEFAULT_GROUP = "default"


class TableGroupConfig(_Section):
    """Tables every service runs in one streaming query of their own (``groups``).

    ``tables``: entity names or shell patterns (``orders_*``); a table matching two groups
    belongs to the first. ``trigger_interval``: the group's queries' trigger in every
    service (default: each service's own). The tables no group names form the group
    ``default``.
    """

    name: str
    tables: list[str] = Field(min_length=1)
    trigger_interval: Interval | None = None

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, name: str) -> str:
        if not _IDENTIFIER.match(name):
            raise ValueError(
                "must be lower-case letters, digits and '_', starting with a letter "
                f"(it names checkpoints), got {name!r}"
            )
        if name == DEFAULT_GROUP:
            raise ValueError(f"{DEFAULT_GROUP!r} names the tables no group names")
        return name

    def selects(self, entity: str) -> bool:
        """Whether the group names ``entity`` (by name or pattern)."""
        return any(fnmatch.fnmatchcase(entity, pattern) for pattern in self.tables)


class PipelineConfig(BaseSettings):
    """The whole pipeline configuration (docs/design.md, "Pipeline configuration")."""

    model_config = SettingsConfigDict(
        env_prefix="CDC_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    storage_root: str = "./data"
    object_storage: ObjectStorageConfig = Field(default_factory=ObjectStorageConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    schema_registry: SchemaRegistryConfig = Field(default_factory=SchemaRegistryConfig)
    elasticsearch: ElasticsearchConfig = Field(default_factory=ElasticsearchConfig)
    entities: list[EntityConfig] = Field(default_factory=list)
    entity_sets: list[EntitySetConfig] = Field(default_factory=list)
    # How often a running service asks the broker for topics its entity sets now select.
    entity_discovery_interval_s: float = Field(default=5.0, gt=0)
    groups: list[TableGroupConfig] = Field(default_factory=list)
    ingestor: IngestorConfig = Field(default_factory=IngestorConfig)
    merger: MergerConfig = Field(default_factory=MergerConfig)
    publisher_kafka: PublisherKafkaConfig = Field(default_factory=PublisherKafkaConfig)
    publisher_es: PublisherEsConfig = Field(default_factory=PublisherEsConfig)
    application: ApplicationConfig = Field(default_factory=ApplicationConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Environment variables override the file's values (passed as init values)."""
        return env_settings, init_settings

    @field_validator("storage_root")
    @classmethod
    def _absolute_local_root(cls, root: str) -> str:
        # Delta reads a relative location as a table name; services may run elsewhere.
        if "://" in root:
            scheme = root.split("://", 1)[0]
            if scheme.lower() in ("s3", "s3n"):
                raise ValueError(
                    f"use s3a://... ({scheme}:// has no file system in Hadoop 3), got {root!r}"
                )
            bucket = s3a_bucket(root)
            if bucket is not None and not _BUCKET.match(bucket):
                raise ValueError(
                    "an s3a root is s3a://<bucket>[/<prefix>] with a bucket name of 3-63 "
                    f"lower-case letters, digits, '.' and '-', got {root!r}"
                )
            return root.rstrip("/")
        return str(Path(root).expanduser().resolve())

    @model_validator(mode="after")
    def _storage_settings_to_spark(self) -> Self:
        # Every SparkSession is built from ``spark``: it carries the root's S3A settings.
        options = self.s3a_options
        if options:
            self.spark._hadoop = {**self.spark._hadoop, **options}
        return self

    @model_validator(mode="after")
    def _entities_distinct(self) -> Self:
        problem = entity_conflict(self.entities)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _groups_distinct(self) -> Self:
        names = [group.name for group in self.groups]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"groups {twice} are named twice")
        return self

    def group_of(self, entity: str) -> tuple[str, str | None]:
        """The group ``entity`` belongs to and its trigger interval (None: the service's)."""
        for group in self.groups:
            if group.selects(entity):
                return group.name, group.trigger_interval
        return DEFAULT_GROUP, None

    def entity(self, name: str) -> EntityConfig:
        """The entity called ``name``; a clear error listing the known ones otherwise."""
        for entity in self.entities:
            if entity.name == name:
                return entity
        known = ", ".join(e.name for e in self.entities) or "none"
        raise ConfigError(f"unknown entity {name!r}; the configuration defines: {known}")

    def learn_entity(self, entity: EntityConfig) -> None:
        """Add a table an entity set selected while the services run (unless known).

        Called by ``cdc_shared.streaming.discovery`` as it starts the table's stream, so
        every lookup by name in this process (``entity``) finds it from then on.
        """
        if all(known.name != entity.name for known in self.entities):
            self.entities.append(entity)

    def select_entities(self, names: list[str] | None) -> list[EntityConfig]:
        """The entities a service should run: ``names`` if given, else all of them."""
        if not names:
            return list(self.entities)
        return [self.entity(n) for n in names]

    @property
    def s3a_options(self) -> dict[str, str]:
        """Hadoop's S3A settings for an ``s3a://`` root's bucket (empty for other roots).

        Holds the secret key: pass it to Spark, never to a log (``redact`` masks it).
        """
        bucket = s3a_bucket(self.storage_root)
        return {} if bucket is None else self.object_storage.hadoop_options(bucket)

    @property
    def layout(self) -> StorageLayout:
        """Every table and checkpoint path under ``storage_root``."""
        return StorageLayout(self.storage_root)


def _format_validation_error(source: str, error: ValidationError) -> str:
    lines = [f"invalid pipeline configuration in {source}:"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None) -> PipelineConfig:
    """Read, resolve and validate the pipeline configuration: the file and the environment.

    ``path`` defaults to ``$CDC_CONFIG``; with neither, only defaults and ``CDC_*``
    environment variables apply. Reads nothing else: the entities of ``entity_sets``,
    which the broker and the registry decide, are added at start
    (``cdc_shared.config.entity_sets.load_pipeline``).
    """
    chosen = path if path is not None else os.environ.get(CONFIG_ENV_VAR)
    data: dict[str, Any] = {}
    source = "environment"
    if chosen is not None:
        file = Path(chosen)
        source = str(file)
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"configuration file {file} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"configuration file {file} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"configuration file {file} must hold a mapping at the top level")
        data = loaded or {}
    try:
        return PipelineConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(source, exc)) from None
