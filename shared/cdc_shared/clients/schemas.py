"""Which Avro schemas belong to an entity, and the registry the configuration asks for.

An entity's key and value schemas are the files its configuration pins, or else the
subjects of its source topic (TopicNameStrategy). All versions of the value subject are
known, oldest first: producers may write any of them; readers use the newest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdc_shared.avro import (
    ConfluentSchemaRegistry,
    FileSchemaRegistry,
    KnownSchema,
    SchemaRegistry,
    UnknownSchemaError,
    load_schema_file,
    subject_name,
)
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig


@dataclass(frozen=True)
class EntitySchemas:
    """The key schema and every version of the value (envelope) schema of one entity."""

    key: KnownSchema
    values: tuple[KnownSchema, ...]  # oldest first

    @property
    def value(self) -> KnownSchema:
        """The newest value schema: the reader schema of every consumer."""
        return self.values[-1]

    @property
    def key_fields(self) -> list[str]:
        """Names of the key record's fields, in order."""
        return [f["name"] for f in self.key.parsed["fields"]]

    def row_schema(self, version: KnownSchema | None = None) -> dict[str, Any]:
        """The row record (Debezium's ``Value``) inside a value schema's ``after`` field."""
        envelope = (version or self.value).parsed
        return envelope_row_schema(envelope)


def envelope_row_schema(envelope: dict[str, Any]) -> dict[str, Any]:
    """The record type of a Debezium envelope's ``after`` (and ``before``) field."""
    for field in envelope.get("fields", []):
        if field["name"] == "after":
            branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
            for branch in branches:
                if isinstance(branch, dict) and branch.get("type") == "record":
                    return branch
    # `after` may reference the record by name when `before` defined it first.
    for field in envelope.get("fields", []):
        if field["name"] == "before":
            for branch in field["type"]:
                if isinstance(branch, dict) and branch.get("type") == "record":
                    return branch
    raise UnknownSchemaError(
        f"{envelope.get('name')} is not a Debezium envelope: no record-typed 'after' field"
    )


def _pinned_or_subject(
    registry: SchemaRegistry, pinned: Path | None, subject: str
) -> tuple[KnownSchema, ...]:
    if pinned is not None:
        schema = load_schema_file(pinned)
        same_subject = registry.versions(schema.subject or subject)
        if any(v.fingerprint == schema.fingerprint for v in same_subject):
            index = next(
                i for i, v in enumerate(same_subject) if v.fingerprint == schema.fingerprint
            )
            return tuple(same_subject[: index + 1])
        return (schema,)
    versions = registry.versions(subject)
    if not versions:
        raise UnknownSchemaError(
            f"no schema for subject {subject!r}: add {subject}.avsc to a schema_registry.dirs "
            "folder, register it, or pin the file in the entity's configuration"
        )
    return tuple(versions)


def entity_schemas(entity: EntityConfig, registry: SchemaRegistry) -> EntitySchemas:
    """Key and value schemas of ``entity``: pinned files, else its topic's subjects.

    A pinned value schema is the newest version used: versions after it are ignored.
    """
    key = _pinned_or_subject(registry, entity.key_schema, subject_name(entity.source_topic, True))
    values = _pinned_or_subject(
        registry, entity.value_schema, subject_name(entity.source_topic, False)
    )
    return EntitySchemas(key=key[-1], values=values)


def make_registry(config: PipelineConfig) -> SchemaRegistry:
    """The registry the configuration names: Confluent-compatible HTTP, else the files.

    Files are every ``.avsc`` under ``schema_registry.dirs``, the entities' pinned files,
    and (for a local storage root) the derived schemas under ``<storage_root>/_schemas``.
    An HTTP registry retries its faults for ``schema_registry.retry_budget_s``.
    """
    pinned = [
        path
        for entity in config.entities
        for path in (entity.key_schema, entity.value_schema)
        if path is not None
    ]
    storage = config.storage_root
    write_dir = None if "://" in storage else Path(config.layout.change_schemas())
    files = FileSchemaRegistry(config.schema_registry.dirs, pinned, write_dir=write_dir)
    settings = config.schema_registry
    if settings.url:
        return ConfluentSchemaRegistry(
            settings.url,
            settings.options,
            files=files,
            retry_budget_s=settings.retry_budget_s,
            request_timeout_s=settings.request_timeout_s,
        )
    return files


CHANGE_EVENT_OPS = ("c", "u", "d")


def change_event_schemas(
    entity: EntityConfig, schemas: EntitySchemas
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The key and value schemas of the entity's change topic (publisher-kafka's contract).

    The value is a ``ChangeEvent`` record: ``op`` (c/u/d), the ``key``, ``before`` and
    ``after`` rows (``after`` null on delete; ``before`` only when configured), the silver
    ``commit_version`` and ``commit_timestamp``, and the ``source_sequence`` the merger
    ordered the change by. The records' namespace is the change topic made a valid Avro
    name (``names.avro_namespace``). Rows follow the newest source schema, less the columns
    the entity's column selection leaves out, so a compatible source change becomes a
    compatible change-event change.
    """
    namespace = entity.change_event_namespace
    key = copy.deepcopy(dict(schemas.key.definition))
    key.update(name="Key", namespace=namespace)
    key.pop("connect.name", None)
    row = copy.deepcopy(envelope_row_schema(dict(schemas.value.definition)))
    row.update(name="Row", namespace=namespace)
    row.pop("connect.name", None)
    # The entity's column selection: silver, and so its changes, lack the other columns.
    dropped = entity.dropped_columns([f["name"] for f in row["fields"]], strict=False)
    row["fields"] = [f for f in row["fields"] if f["name"] not in dropped]
    value = {
        "type": "record",
        "name": "ChangeEvent",
        "namespace": namespace,
        "doc": f"A change of {entity.name} as applied to the silver table.",
        "fields": [
            {"name": "op", "type": "string", "doc": "c (insert), u (update) or d (delete)"},
            {"name": "key", "type": key},
            {
                "name": "before",
                "type": ["null", row],
                "default": None,
                "doc": "The row before an update or delete, when the publisher is configured "
                "to include it.",
            },
            {
                "name": "after",
                "type": ["null", "Row"],
                "default": None,
                "doc": "The row after an insert or update; null on delete.",
            },
            {
                "name": "commit_version",
                "type": "long",
                "doc": "Version of the silver Delta table that committed the change.",
            },
            {
                "name": "commit_timestamp",
                "type": {"type": "long", "logicalType": "timestamp-millis"},
                "doc": "Commit time of that silver version.",
            },
            {
                "name": "source_sequence",
                "type": {"type": "array", "items": "long"},
                "doc": "The entity's sequence_by values of the source event: changes of one "
                "key arrive in increasing order of it.",
            },
        ],
    }
    return key, value
