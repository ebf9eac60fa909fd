"""The tables the pipeline replicates: entities, entity sets and table groups."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from cdc_shared.config.names import avro_namespace, es_index_problem, kafka_topic_problem
from cdc_shared.config.values import ColumnNames, ConfigError, Interval, Section

KAFKA_COORDINATE_SEQUENCE = ["kafka.partition", "kafka.offset"]


_IDENTIFIER = re.compile(r"^[a-z][a-z0-9_]*$")


#: How a source topic's values or keys are written (see EntityConfig).
Format = Literal["avro", "json"]


#: Debezium's ``decimal.handling.mode``: how JSON records carry decimals.
DecimalHandling = Literal["precise", "string", "double"]


#: Characters a key column's name cannot hold when history is on: the history's write
#: names the key in a SQL condition (Delta's ``replaceOn``), and its plans were built and
#: tested for plain names only.
HISTORY_KEY_FORBIDDEN = (",", ".", "`")


class HistoryConfig(Section):
    """An entity's SCD type 2 history table (``silver_history/<entity>``), off by default.

    A change to a tracked column starts a new version; a change to untracked columns only
    updates the current version in place. Tracked: ``track_columns`` only, or every row
    column but ``except_columns`` (one of the two; neither tracks every column).
    ``freshness``: how far the history may lag silver; its writes wait that long and then
    take every change since at once (the change topics and indexes never wait for it).
    """

    enabled: bool = False
    track_columns: ColumnNames | None = None
    except_columns: ColumnNames | None = None
    freshness: Interval | None = "60 seconds"

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


class EntityConfig(Section):
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
    columns: ColumnNames | None = None
    except_columns: ColumnNames | None = None
    # A null in an update keeps the column's current value (sources that send only the
    # changed fields): every non-key column (true) or the ones listed. Off: a relational
    # null is a real value.
    ignore_null_updates: bool | list[str] = False
    # The SCD type 2 history table beside silver (``HistoryConfig``).
    history: HistoryConfig = Field(default_factory=HistoryConfig)
    #: How long bronze keeps this table's rows (``cdc maintenance``); null: the pipeline's.
    bronze_retention_hours: float | None = Field(default=None, gt=0)

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


class EntitySetConfig(Section):
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
class RetentionConfig(Section):
    """How long the pipeline's logs keep their rows; ``cdc maintenance`` deletes older ones.

    ``bronze_hours``: bronze rows ingested longer ago than this (an entity's own
    ``bronze_retention_hours`` first), never a row the merger has not merged yet.
    ``quarantine_hours``: quarantined records, by when they were quarantined. ``null``
    (the default) keeps every row, as bronze and the quarantine are append-only logs.
    Rebuilding silver from bronze needs the rows retention deleted: the merger refuses
    it for a table whose rows were deleted (docs/operations.md, "Retention").
    """

    bronze_hours: float | None = Field(default=None, gt=0)
    quarantine_hours: float | None = Field(default=None, gt=0)

    def bronze_hours_of(self, entity: EntityConfig) -> float | None:
        """How long bronze keeps ``entity``'s rows (None: forever)."""
        return entity.bronze_retention_hours or self.bronze_hours


DEFAULT_GROUP = "default"


class TableGroupConfig(Section):
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
