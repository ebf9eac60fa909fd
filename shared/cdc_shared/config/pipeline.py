"""Typed pipeline configuration: one YAML file shared by every service.

The file is named by ``--config PATH`` or the ``CDC_CONFIG`` environment variable, and
any field can be overridden by an environment variable with the ``CDC_`` prefix and
``__`` for nesting (``CDC_KAFKA__BOOTSTRAP_SERVERS=host:9092``). The configuration is
validated once, at start; a bad field raises ``ConfigError`` naming it. Its sections:
``values`` (the value types they share), ``connections`` (the servers), ``services``
(each service's section), ``entities`` (the tables).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from cdc_shared.config.connections import (
    BUCKET_NAME,
    ElasticsearchConfig,
    KafkaConfig,
    ObjectStorageConfig,
    SchemaRegistryConfig,
    s3a_bucket,
)
from cdc_shared.config.entities import (
    DEFAULT_GROUP,
    EntityConfig,
    EntitySetConfig,
    RetentionConfig,
    TableGroupConfig,
    entity_conflict,
)
from cdc_shared.config.services import (
    ApplicationConfig,
    IngestorConfig,
    MergerConfig,
    PublisherEsConfig,
    PublisherKafkaConfig,
    SparkConfig,
)
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.layout import (
    StorageLayout,
)

CONFIG_ENV_VAR = "CDC_CONFIG"


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
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
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
            if bucket is not None and not BUCKET_NAME.match(bucket):
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
