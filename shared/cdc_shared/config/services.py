"""Each service's section of the configuration, and Spark's."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from cdc_shared.config.names import kafka_topic_problem
from cdc_shared.config.values import Interval, Port, Section
from cdc_shared.contracts.layout import (
    INGESTOR,
    MERGER,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    SERVICE_NAMES,
    display_name,
)


class SparkConfig(Section):
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


class StreamingServiceConfig(Section):
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


class ApplicationConfig(Section):
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
