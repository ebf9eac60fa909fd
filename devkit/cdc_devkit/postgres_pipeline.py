"""The pipeline over Debezium's topics of a real PostgreSQL, and its outputs against the database.

One pipeline configuration replicates every captured table from every connector (one
entity per connector and table), whatever format each connector writes. Its verdict
needs no model of the workload: silver, the change topics and the indexes must each hold
exactly what the database's tables hold at the end, key by key and column by column; an
entity's history must hold the versions each key went through in the database
(``TableVersions``, from the table's state after every statement).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.silver import END, START
from pyspark.sql import SparkSession

from cdc_devkit import infra
from cdc_devkit.checks import (
    Difference,
    change_topic_state,
    compare,
    index_rows,
    same_value,
    silver_rows,
)
from cdc_devkit.debezium import Capture, entity_settings
from cdc_devkit.local_run import write_pipeline_config
from cdc_devkit.postgres import MARKER, TABLES, Database, Key, RowVersion, Table


def entity_name(capture: Capture, table: Table) -> str:
    """The pipeline entity of one table from one connector (``json_schemas_orders``)."""
    return f"{capture.label}_{table.name}"


def table_of(entity: EntityConfig) -> Table:
    """The captured table an entity replicates (from its Debezium topic's last segment)."""
    name = entity.source_topic.rsplit(".", 1)[-1]
    return next(t for t in TABLES if t.name == name)


def write_postgres_pipeline(
    workdir: Path,
    served: infra.Endpoints,
    registry_url: str,
    captures: list[Capture],
    run: str,
    avro_as_entity_set: bool = False,
    history: Collection[str] = (),
) -> Path:
    """The pipeline file: every table of every capture, the registry at ``registry_url``.

    Based on the demo's pipeline (loopback servers, free metrics ports, small Spark), with
    its entities replaced; change topics and indexes are named after ``run``. With
    ``avro_as_entity_set``, each Avro capture's tables are one entity set over its
    topics instead (same entity names, keys taken from Debezium's key schemas). The
    entities ``history`` names keep their history (every column tracked; in a set, as
    an override of that table).
    """
    path = write_pipeline_config(workdir, served, prefix=run)
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    document["schema_registry"] = {"url": registry_url, "dirs": []}
    as_set = [c for c in captures if avro_as_entity_set and c.source_format == "avro"]
    document["entities"] = [
        {
            **entity_settings(capture, table, entity_name(capture, table)),
            "change_topic": f"{run}.cdc.{entity_name(capture, table)}",
            "es_index": f"{run}-{entity_name(capture, table)}".replace("_", "-"),
            **_history(entity_name(capture, table), history),
        }
        for capture in captures
        if capture not in as_set
        for table in capture.tables
    ]
    document["entity_sets"] = [_entity_set(capture, run, history) for capture in as_set]
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _history(name: str, history: Collection[str]) -> dict[str, Any]:
    """An entity's ``history`` setting: on (every column tracked) when ``history`` names it."""
    return {"history": {"enabled": True}} if name in history else {}


def _entity_set(capture: Capture, run: str, history: Collection[str] = ()) -> dict[str, Any]:
    """Every table ``capture`` writes but the marker, named as ``entity_name`` names them."""
    names = [entity_name(capture, table) for table in capture.tables]
    return {
        "topics_regex": re.escape(f"{capture.topic_prefix}.public.") + "(?P<table>.+)",
        "exclude": [re.escape(capture.topic(MARKER))],
        "name": f"{capture.label}_{{table}}",
        "sequence_by": ["source.lsn"],
        "change_topic": f"{run}.cdc.{{table}}",
        "es_index": f"{run}-{{table}}",
        "overrides": {name: _history(name, history) for name in names if name in history},
    }


def outputs_against_database(
    spark: SparkSession, config: PipelineConfig, database: Database
) -> list[Difference]:
    """Silver, the change topic and the index of every entity, each against its table."""
    tables = {table_of(entity) for entity in config.entities}
    expected = {table.name: database.rows(table) for table in tables}
    differences = []
    for entity in config.entities:
        want = expected[table_of(entity).name]
        differences += [
            compare(f"silver/{entity.name}", want, silver_rows(spark, config, entity)),
            compare(
                f"topic {entity.change_topic_name}", want, change_topic_state(config, entity).rows
            ),
            compare(f"index {entity.es_index_name}", want, index_rows(config, entity)),
        ]
    return differences


@dataclass(frozen=True)
class HistoryVersion:
    """One row of an entity's history: its period in the entity's sequence, and its values."""

    start: tuple[int, ...]
    end: tuple[int, ...] | None  # None: the key's current version
    row: dict[str, Any]


def history_of(
    spark: SparkSession, config: PipelineConfig, entity: EntityConfig
) -> dict[Key, list[HistoryVersion]]:
    """The entity's history table: each key's versions in ``__start_at`` order."""
    versions: dict[Key, list[HistoryVersion]] = {}
    for r in spark.read.format("delta").load(config.layout.history(entity.name)).collect():
        row = r.asDict()
        end = None if row[END] is None else tuple(row[END])
        version = HistoryVersion(tuple(row[START]), end, row)
        versions.setdefault(tuple(row[k] for k in entity.key), []).append(version)
    return {key: sorted(vs, key=lambda v: v.start) for key, vs in versions.items()}


def history_against_database(
    table: Table,
    expected: dict[Key, list[RowVersion]],
    history: dict[Key, list[HistoryVersion]],
) -> list[str]:
    """Where an entity's history differs from the versions the database went through.

    Per key, in order: as many versions, each holding the row's values while it held
    them (every column of ``table``); every version closed but the current one of a key
    the table still holds (a deleted or truncated key has none open); a version a change
    ended ends where the next begins, one a delete ended before the next (a re-insert)
    begins. Empty: they agree.
    """
    columns = [c.name for c in table.all_columns]
    problems = []
    for key in sorted(expected.keys() | history.keys(), key=repr):
        want, got = expected.get(key, []), history.get(key, [])
        if len(want) != len(got):
            problems.append(f"{key}: {len(got)} versions, the database went through {len(want)}")
        for number, (version, row) in enumerate(zip(want, got, strict=False), start=1):
            at = f"{key} version {number}"
            differing = [
                f"{c} {_shown(row.row.get(c))} (database: {_shown(version.row[c])})"
                for c in columns
                if not same_value(version.row[c], row.row.get(c))
            ]
            if differing:
                problems.append(f"{at}: {'; '.join(differing)}")
            if (version.ended is None) != (row.end is None):
                state = "open" if row.end is None else f"closed at {list(row.end)}"
                problems.append(f"{at}: {state}, but {version.ended or 'current'} in the database")
                continue
            following = got[number] if number < len(got) else None
            if row.end is None or following is None:
                continue
            if version.ended == "change" and row.end != following.start:
                problems.append(
                    f"{at}: changed at {list(row.end)}, next begins {list(following.start)}"
                )
            if version.ended == "delete" and not row.end < following.start:
                problems.append(
                    f"{at}: deleted at {list(row.end)}, next begins {list(following.start)}"
                )
    return problems


def _shown(value: Any) -> str:
    """A value for a problem's line: a long text by its start and length."""
    if isinstance(value, str) and len(value) > 40:
        return f"{value[:12]!r}... ({len(value):,} characters)"
    return repr(value)
