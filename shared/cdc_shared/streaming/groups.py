"""Table groups: which tables a service runs in each of its streaming queries.

A service runs one query per group of tables: the pipeline's ``groups`` (each with its
own trigger), and ``default`` for the tables no group names. ``--group`` runs only the
named groups; ``--entity`` runs the named tables as one group of their own (a
deployment that writes those tables: its checkpoint is named by them, and the writer
leases keep another deployment off them). A group of one table is a group like any other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cdc_shared.config.entities import DEFAULT_GROUP, EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import StreamingServiceConfig
from cdc_shared.config.values import ConfigError

#: The longest group name made of ``--entity`` names before it is a hash instead.
_NAMED_BY_TABLES_MAX = 60


@dataclass(frozen=True)
class TableGroup:
    """The tables of one of a service's queries, and how often the query triggers."""

    name: str
    entities: tuple[EntityConfig, ...]
    trigger_interval: str
    once: bool = False  # the query reads what is there, then stops (``--once``)

    @property
    def names(self) -> list[str]:
        """The tables' entity names."""
        return [entity.name for entity in self.entities]

    def with_entity(self, entity: EntityConfig) -> TableGroup:
        """The group with one more table (one that appeared while the service runs)."""
        return TableGroup(self.name, (*self.entities, entity), self.trigger_interval, self.once)


def table_groups(
    config: PipelineConfig,
    settings: StreamingServiceConfig,
    entity_names: list[str] | None = None,
    group_names: list[str] | None = None,
) -> list[TableGroup]:
    """The groups a service runs: every group with tables, or those asked for.

    ``entity_names`` (``--entity``): those tables as one group. ``group_names``
    (``--group``): only those groups. ConfigError for an unknown name, or for a
    selection that leaves no table.
    """
    if entity_names:
        entities = tuple(config.entity(name) for name in entity_names)
        return [TableGroup(group_named_by(entity_names), entities, settings.trigger_interval)]
    by_group: dict[str, list[EntityConfig]] = {}
    triggers: dict[str, str] = {}
    for entity in config.entities:
        name, trigger = config.group_of(entity.name)
        by_group.setdefault(name, []).append(entity)
        triggers[name] = trigger or settings.trigger_interval
    known = [g.name for g in config.groups] + [DEFAULT_GROUP]
    unknown = sorted(set(group_names or []) - set(known))
    if unknown:
        raise ConfigError(f"unknown groups {unknown}; the configuration has: {', '.join(known)}")
    chosen = [
        TableGroup(name, tuple(entities), triggers[name])
        for name, entities in by_group.items()
        if not group_names or name in group_names
    ]
    if not chosen:
        raise ConfigError("the configuration gives this service no tables to run")
    return chosen


def group_named_by(entity_names: list[str]) -> str:
    """The name of the group of ``--entity`` tables: stable for the same set of tables."""
    names = sorted(set(entity_names))
    joined = "tables-" + "-".join(names)
    if len(joined) <= _NAMED_BY_TABLES_MAX:
        return joined
    return "tables-" + hashlib.sha256(",".join(names).encode()).hexdigest()[:12]
