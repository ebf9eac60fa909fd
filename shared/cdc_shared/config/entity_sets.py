"""Tables by pattern: the entities an ``entity_sets`` block selects from the broker's topics.

A whole database captured by one Debezium connector is tens to hundreds of topics. An
entity set names them at once: a regular expression over topic names (and/or a list),
minus exclusions; each matching topic becomes an entity whose name comes from the
pattern (the ``table`` group, else the first group, else the topic's last segment),
whose key columns come from the configuration or else from the topic's Debezium key
schema (its fields are the primary key), and whose change topic and index are templates
such as ``cdc.{table}``. Entities listed one by one keep working and win over a set that
matches their topic.

Resolution is split in two: :func:`resolve_entity_sets` is pure (topics and a key
lookup in, entities out) and :func:`with_discovered_entities` asks the broker for its
topics and the registry for key schemas, once, at start (:func:`load_pipeline`, after the
configuration is read). Every service and ``cdc`` command resolves the same way, so they
agree on the tables as long as the broker's topics do.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cdc_shared.avro import SchemaRegistry, subject_name
from cdc_shared.clients.connect import check_tls_files, make_admin
from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.entities import (
    EntityConfig,
    EntitySetConfig,
    entity_conflict,
    entity_name_from,
)
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.config.values import ConfigError

log = logging.getLogger(__name__)

#: How long the broker may take to list its topics at start.
LIST_TOPICS_TIMEOUT_S = 30.0

#: The key columns of a topic, from its key schema; None when no key schema is known.
KeyLookup = Callable[[str], list[str] | None]


def set_table_name(entity_set: EntitySetConfig, match: re.Match[str] | None, topic: str) -> str:
    """The entity name a set gives ``topic``: its name template, else the pattern's group.

    Without a template: the ``table`` group, else the first group that matched, else the
    topic's last dot-separated segment; lower-cased, other characters than letters,
    digits and ``_`` turned into ``_``.
    """
    fields = _template_fields(match, topic, table=None)
    if entity_set.name is not None:
        raw = entity_set.name.format(**fields)
    elif match is not None and match.groupdict().get("table") is not None:
        raw = match.group("table")
    elif match is not None and any(group is not None for group in match.groups()):
        raw = next(group for group in match.groups() if group is not None)
    else:
        raw = topic.rsplit(".", 1)[-1]
    return entity_name_from(raw)


def _template_fields(match: re.Match[str] | None, topic: str, table: str | None) -> dict[str, str]:
    groups = {k: v for k, v in (match.groupdict() if match else {}).items() if v is not None}
    fields = {**groups, "topic": topic}
    if table is not None:
        fields["table"] = table
    return fields


def set_selects(entity_set: EntitySetConfig, topic: str) -> tuple[bool, re.Match[str] | None]:
    """Whether ``entity_set`` selects ``topic``, and the pattern's match when it made the choice."""
    if any(re.fullmatch(pattern, topic) for pattern in entity_set.exclude):
        return False, None
    if entity_set.topics_regex is not None:
        match = re.fullmatch(entity_set.topics_regex, topic)
        if match is not None:
            return True, match
    return topic in entity_set.topics, None


def set_entity(
    entity_set: EntitySetConfig, topic: str, match: re.Match[str] | None, key_lookup: KeyLookup
) -> EntityConfig:
    """The entity ``entity_set`` makes of ``topic``, with its per-table overrides applied."""
    name = set_table_name(entity_set, match, topic)
    fields = _template_fields(match, topic, table=name)
    values: dict[str, Any] = {
        "name": name,
        "source_topic": topic,
        "sequence_by": list(entity_set.sequence_by),
        "value_format": entity_set.value_format,
        "key_format": entity_set.key_format,
        "decimal_handling": entity_set.decimal_handling,
        "freshness": entity_set.freshness,
        "change_topic": entity_set.change_topic.format(**fields),
        "es_index": entity_set.es_index.format(**fields),
    }
    if entity_set.key is not None:
        values["key"] = list(entity_set.key)
    values.update(entity_set.overrides.get(name, {}))
    if "key" not in values:
        key = key_lookup(topic)
        if not key:
            raise ConfigError(
                f"entity set {entity_set.label}: topic {topic!r} (table {name!r}) has no key "
                "schema to take its key columns from: give `key` in the set or in "
                f"`overrides.{name}.key`"
            )
        values["key"] = key
    try:
        return EntityConfig(**values)
    except ValueError as exc:
        raise ConfigError(
            f"entity set {entity_set.label}: topic {topic!r} makes an invalid entity: {exc}"
        ) from None


def resolve_entity_sets(
    config: PipelineConfig, topics: Iterable[str], key_lookup: KeyLookup
) -> list[EntityConfig]:
    """Every entity the configuration's sets select from ``topics``, ordered by name.

    A topic an entity lists by hand, or that is one of the pipeline's own outputs (a change
    topic, publisher-kafka's progress topic), is never selected; a topic two sets select
    is an error, as are two topics that make the same table name.
    """
    explicit = {entity.source_topic for entity in config.entities}
    outputs = {entity.change_topic_name for entity in config.entities}
    outputs.add(config.publisher_kafka.progress_topic)
    chosen: dict[str, tuple[EntitySetConfig, re.Match[str] | None]] = {}
    for topic in sorted(set(topics)):
        if topic in explicit or topic in outputs:
            continue
        for entity_set in config.entity_sets:
            selected, match = set_selects(entity_set, topic)
            if not selected:
                continue
            if topic in chosen:
                raise ConfigError(
                    f"topic {topic!r} is selected by two entity sets: "
                    f"{chosen[topic][0].label} and {entity_set.label}"
                )
            chosen[topic] = (entity_set, match)
    entities = [
        set_entity(entity_set, topic, match, key_lookup)
        for topic, (entity_set, match) in chosen.items()
    ]
    # A set's change topic must not feed another set (e.g. `.*` would select `cdc.x`).
    made_outputs = {entity.change_topic_name for entity in entities}
    entities = [entity for entity in entities if entity.source_topic not in made_outputs]
    problem = entity_conflict([*config.entities, *entities])
    if problem is not None:
        raise ConfigError(f"entity sets: {problem}")
    return sorted(entities, key=lambda entity: entity.name)


def _registry_key_lookup(config: PipelineConfig) -> KeyLookup:
    registries: list[SchemaRegistry] = []  # made on the first topic that needs it

    def key_fields(topic: str) -> list[str] | None:
        if not registries:
            registries.append(make_registry(config))
        versions = registries[0].versions(subject_name(topic, is_key=True))
        if not versions:
            return None
        return [field["name"] for field in versions[-1].parsed.get("fields", [])]

    return key_fields


def broker_topics(config: PipelineConfig) -> list[str]:
    """The broker's topic names (internal ones such as ``__consumer_offsets`` left out)."""
    admin = make_admin(config.kafka)
    try:
        metadata = admin.list_topics(timeout=LIST_TOPICS_TIMEOUT_S)
    except Exception as exc:  # KafkaException: the broker cannot be reached
        raise ConfigError(
            f"entity sets: cannot list the topics of {config.kafka.bootstrap_servers}: {exc}"
        ) from None
    return [name for name in metadata.topics if not name.startswith("__")]


#: The broker's topic names, for a configuration (``broker_topics``, or a test's list).
TopicLister = Callable[[PipelineConfig], list[str]]


def newly_selected(
    config: PipelineConfig, topics: TopicLister = broker_topics
) -> list[EntityConfig]:
    """The entities ``config``'s sets select now, beyond those ``config`` already has.

    Asks the broker for its topics and, for a topic whose key is not configured, the
    registry for its key schema. Used at start (every entity is new) and by a running
    service looking for tables that appeared since (``cdc_shared.streaming.discovery``).
    """
    uses_avro_keys = any(entity_set.key_format == "avro" for entity_set in config.entity_sets)
    key_lookup: KeyLookup = (
        _registry_key_lookup(config) if uses_avro_keys else (lambda _topic: None)
    )
    return resolve_entity_sets(config, topics(config), key_lookup)


def with_discovered_entities(
    config: PipelineConfig, topics: TopicLister = broker_topics
) -> PipelineConfig:
    """``config`` with the entities its sets select added (itself when it has no sets)."""
    if not config.entity_sets:
        return config
    discovered = newly_selected(config, topics)
    names = {entity.name for entity in discovered}
    for entity_set in config.entity_sets:
        unmatched = sorted(set(entity_set.overrides) - names)
        if unmatched:
            log.warning(
                "entity set %s: overrides for tables no topic makes (yet): %s",
                entity_set.label,
                ", ".join(unmatched),
            )
    log.info(
        "entity sets selected %d tables: %s",
        len(discovered),
        ", ".join(entity.name for entity in discovered) or "none",
    )
    return config.model_copy(update={"entities": [*config.entities, *discovered]})


def load_pipeline(path: str | Path | None = None) -> PipelineConfig:
    """The pipeline a service or command runs, with the tables its sets select.

    Its configuration (``load_config``: the file and the environment), the TLS files it
    names (``check_tls_files``), then the entities its ``entity_sets`` select (the
    broker's topics, the registry's key schemas), once.
    """
    config = load_config(path)
    check_tls_files(config.kafka)
    return with_discovered_entities(config)
