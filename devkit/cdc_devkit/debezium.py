"""Debezium's PostgreSQL connector on Kafka Connect: connector settings, and the pipeline's view.

A :class:`Capture` is one connector on the source database, writing one of the formats
the ingestor reads: Avro in the Confluent wire format through the registry (Apicurio's
converter with ``apicurio.registry.as-confluent=true``), or Kafka Connect's
``JsonConverter`` with ``schemas.enable`` false or true. :func:`connector_config` is what
goes to Connect's REST API (``PUT /connectors/NAME/config``); :func:`entity_settings` is
the pipeline entity that reads the connector's topic for one table.

The settings the pipeline relies on, and why:

- ``skipped.operations=none``: Debezium skips ``TRUNCATE`` by default (``t``); the merger
  applies it as a keyless truncate event.
- ``time.precision.mode=connect``: dates and timestamps as Connect's logical types (Avro
  ``date``, ``timestamp-millis``), which silver, the change topics and the index type as
  dates and timestamps. (Debezium's default, ``adaptive``, writes ``MicroTimestamp`` as a
  bare long of microseconds: it would arrive as a number.) ``timestamptz`` is always a
  ``ZonedTimestamp`` ISO-8601 string.
- ``decimal.handling.mode``: ``precise`` (Avro ``decimal`` bytes, or base64 in JSON),
  ``string`` or ``double``; a JSON entity's ``decimal_handling`` must say the same.
- ``tombstones.on.delete=true`` (the default): a delete is followed by a null-value record,
  which the ingestor keeps in bronze as a tombstone.
- The sequence is ``source.lsn``: PostgreSQL's WAL position orders every change of a
  database, across partitions, which truncates need (docs/services.md, merger).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from cdc_shared.clients.connect import make_consumer
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entities import DecimalHandling
from confluent_kafka import Consumer, KafkaException, TopicPartition

from cdc_devkit.postgres import MARKER, TABLES, Column, Database, Table

ROOT = Path(__file__).resolve().parents[2]
#: Pinned reader schemas of the JSON entities (the Avro ones come from the registry).
READER_SCHEMAS = ROOT / "schemas" / "postgres"
POSTGRES_CONNECTOR = "io.debezium.connector.postgresql.PostgresConnector"
APICURIO_AVRO_CONVERTER = "io.apicurio.registry.utils.converter.AvroConverter"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
#: How a connector writes keys and values: Avro through the registry, or JSON without or
#: with the embedded schema (``schemas.enable``).
SourceFormat = Literal["avro", "json", "json-schemas"]
SOURCE_FORMATS: tuple[SourceFormat, ...] = ("avro", "json", "json-schemas")


@dataclass(frozen=True)
class Capture:
    """One Debezium connector: its name, topic prefix, format, decimal mode and tables.

    The replication slot and the publication are named after the connector, so several
    connectors can capture the same tables side by side.
    """

    name: str
    topic_prefix: str
    source_format: SourceFormat
    decimal_handling: DecimalHandling = "precise"
    tables: tuple[Table, ...] = TABLES  # the marker table is captured too

    @property
    def slot(self) -> str:
        """The replication slot (PostgreSQL: lower case, digits and ``_``)."""
        return "".join(c if c.isalnum() else "_" for c in self.name.lower())

    @property
    def publication(self) -> str:
        """The publication the connector creates for its tables (``filtered``)."""
        return f"{self.slot}_pub"

    @property
    def label(self) -> str:
        """The format as an identifier (``json_schemas``): names the pipeline's entities."""
        return self.source_format.replace("-", "_")

    def topic(self, table: Table) -> str:
        """The topic Debezium writes ``table``'s changes to."""
        return f"{self.topic_prefix}.public.{table.name}"


def converter_config(source_format: SourceFormat, registry_api: str | None) -> dict[str, str]:
    """Key and value converter settings of a connector writing ``source_format``.

    Avro: Apicurio's converter, registering each new schema under ``<topic>-key`` /
    ``<topic>-value`` (the Confluent subjects) through Apicurio's v2 API ``registry_api``,
    and framing records the Confluent way (magic byte, 4-byte id, payload; ids in the
    payload, not in headers) with the schema's content id, which is the id Apicurio's
    Confluent-compatible API serves.
    """
    settings: dict[str, str] = {}
    for part in ("key", "value"):
        prefix = f"{part}.converter"
        if source_format == "avro":
            if not registry_api:
                raise ValueError("Avro needs a schema registry (its Apicurio v2 API URL)")
            settings |= {
                prefix: APICURIO_AVRO_CONVERTER,
                f"{prefix}.apicurio.registry.url": registry_api,
                f"{prefix}.apicurio.registry.auto-register": "true",
                f"{prefix}.apicurio.registry.find-latest": "true",
                f"{prefix}.apicurio.registry.as-confluent": "true",
                # Else the ids travel in record headers and the payload has no framing.
                f"{prefix}.apicurio.registry.headers.enabled": "false",
                f"{prefix}.apicurio.registry.use-id": "contentId",
            }
        else:
            settings |= {
                prefix: JSON_CONVERTER,
                f"{prefix}.schemas.enable": str(source_format == "json-schemas").lower(),
            }
    return settings


def connector_config(
    capture: Capture,
    database: Database,
    registry_api: str | None = None,
    partitions: int = 3,
) -> dict[str, str]:
    """The connector's configuration for Connect's REST API (it holds the password)."""
    tables = (*capture.tables, MARKER)
    return {
        "connector.class": POSTGRES_CONNECTOR,
        "tasks.max": "1",
        "plugin.name": "pgoutput",
        "database.hostname": database.host,
        "database.port": str(database.port),
        "database.user": database.user,
        "database.password": database.password,
        "database.dbname": database.dbname,
        "topic.prefix": capture.topic_prefix,
        "table.include.list": ",".join(f"public.{t.name}" for t in tables),
        "slot.name": capture.slot,
        "publication.name": capture.publication,
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": "initial",
        "skipped.operations": "none",
        "tombstones.on.delete": "true",
        "time.precision.mode": "connect",
        "decimal.handling.mode": capture.decimal_handling,
        "topic.creation.default.partitions": str(partitions),
        "topic.creation.default.replication.factor": "1",
        **converter_config(capture.source_format, registry_api),
    }


def entity_settings(capture: Capture, table: Table, name: str) -> dict[str, Any]:
    """The pipeline entity (``entities[]``) that replicates ``table`` from ``capture``.

    JSON entities pin the reader schemas of ``schemas/postgres`` (the new column is in
    them from the start, optional); Avro entities read theirs from the registry.
    """
    entity: dict[str, Any] = {
        "name": name,
        "source_topic": capture.topic(table),
        "key": list(table.key),
        "sequence_by": ["source.lsn"],
    }
    if capture.source_format != "avro":
        entity |= {
            "value_format": "json",
            "key_format": "json",
            "decimal_handling": capture.decimal_handling,
            "key_schema": str(reader_schema_path(table, "key")),
            "value_schema": str(reader_schema_path(table, "value")),
        }
    return entity


# --- reader schemas of the JSON entities -------------------------------------------------

_AVRO_TYPES: dict[str, Any] = {
    "int": "int",
    "long": "long",
    "text": "string",
    "bool": "boolean",
    "date": {"type": "int", "logicalType": "date"},
    "timestamp": {"type": "long", "logicalType": "timestamp-millis"},
    "timestamptz": "string",  # io.debezium.time.ZonedTimestamp
}


def _avro_type(column: Column) -> Any:
    if column.kind == "decimal":
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": column.precision,
            "scale": column.scale,
        }
    return copy.deepcopy(_AVRO_TYPES[column.kind])


def reader_schema_path(table: Table, part: Literal["key", "value"]) -> Path:
    """Where the pinned reader schema of ``table``'s JSON keys or values lives."""
    return READER_SCHEMAS / f"pg-json.{table.name}-{part}.avsc"


def reader_schemas(table: Table) -> dict[str, dict[str, Any]]:
    """The reader schemas (``key``, ``value``) of ``table``'s topics in Connect JSON.

    The value is Debezium's envelope with what the pipeline reads: ``before``/``after``
    rows, ``source`` (``lsn`` orders the changes), ``op`` and ``ts_ms``. Every non-key
    column is optional (a delete's ``before`` carries only the key under the default
    replica identity), and the columns added midway are there from the start.
    """
    namespace = f"pg_json.{table.name}"
    key_columns = [c for c in table.all_columns if c.name in table.key]
    key = {
        "type": "record",
        "name": "Key",
        "namespace": namespace,
        "fields": [{"name": c.name, "type": _avro_type(c)} for c in key_columns],
    }
    row_fields = [
        {"name": c.name, "type": _avro_type(c)}
        if c.name in table.key
        else {"name": c.name, "type": ["null", _avro_type(c)], "default": None}
        for c in table.all_columns
    ]
    source = {
        "type": "record",
        "name": "Source",
        "namespace": "io.debezium.connector.postgresql",
        "fields": [
            {"name": "version", "type": "string"},
            {"name": "connector", "type": "string"},
            {"name": "name", "type": "string"},
            {"name": "ts_ms", "type": "long"},
            {"name": "db", "type": "string"},
            {"name": "schema", "type": "string"},
            {"name": "table", "type": "string"},
            {"name": "txId", "type": ["null", "long"], "default": None},
            {"name": "lsn", "type": ["null", "long"], "default": None},
        ],
    }
    value = {
        "type": "record",
        "name": "Envelope",
        "namespace": namespace,
        "fields": [
            {
                "name": "before",
                "type": ["null", {"type": "record", "name": "Value", "fields": row_fields}],
                "default": None,
            },
            {"name": "after", "type": ["null", "Value"], "default": None},
            {"name": "source", "type": source},
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": ["null", "long"], "default": None},
        ],
    }
    return {"key": key, "value": value}


def write_reader_schemas(folder: Path = READER_SCHEMAS) -> list[Path]:
    """Write every captured table's JSON reader schemas (how ``schemas/postgres`` is made)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for table in TABLES:
        for part, schema in reader_schemas(table).items():
            path = folder / reader_schema_path(table, part).name  # type: ignore[arg-type]
            path.write_text(json.dumps(schema, indent=2) + "\n")
            written.append(path)
    return written


# --- Kafka Connect's REST API --------------------------------------------------------


class ConnectError(RuntimeError):
    """Kafka Connect refused a request, or a connector failed."""


@dataclass(frozen=True)
class ConnectClient:
    """The few calls of Kafka Connect's REST API the demo and the tests make."""

    url: str
    timeout_s: float = 30.0

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        response = httpx.request(method, f"{self.url}{path}", json=body, timeout=self.timeout_s)
        if response.status_code >= 400:
            # Connect's errors name the setting, not its value (passwords are hidden).
            raise ConnectError(f"{method} {path}: {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def put(self, name: str, config: dict[str, str]) -> None:
        """Create or reconfigure the connector ``name``."""
        self._request("PUT", f"/connectors/{name}/config", config)

    def status(self, name: str) -> dict[str, Any]:
        """The connector's and its tasks' states (``RUNNING``, ``FAILED``, ...)."""
        status: dict[str, Any] = self._request("GET", f"/connectors/{name}/status")
        return status

    def delete(self, name: str) -> None:
        """Remove the connector (its replication slot stays: drop it with the database)."""
        self._request("DELETE", f"/connectors/{name}")

    def connectors(self) -> list[str]:
        """The names of the connectors the worker runs."""
        names: list[str] = self._request("GET", "/connectors")
        return names

    def wait_running(self, name: str, timeout_s: float = 60.0) -> None:
        """Wait until the connector and its task run; a failed one raises with its trace."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = self.status(name)
            except ConnectError:
                status = {}
            tasks = status.get("tasks", [])
            states = [status.get("connector", {}).get("state"), *(t.get("state") for t in tasks)]
            if "FAILED" in states:
                trace = next((t.get("trace", "") for t in tasks if t.get("trace")), "")
                raise ConnectError(f"connector {name} failed: {trace[:2000]}")
            if tasks and all(state == "RUNNING" for state in states):
                return
            if time.monotonic() > deadline:
                raise ConnectError(
                    f"connector {name} not running after {timeout_s:.0f} s: {states}"
                )
            time.sleep(0.5)


# --- a capture's life ----------------------------------------------------------------


def start_captures(
    connect: ConnectClient,
    database: Database,
    captures: list[Capture],
    registry_api: str | None = None,
    timeout_s: float = 90.0,
) -> None:
    """Add the connectors; return once each runs and streams from its replication slot.

    Each connector creates its slot and publication, reads the tables' current rows (the
    snapshot, ``op=r``), then streams from the slot: a change committed after this
    returns is captured, and so is one made during the snapshot (the slot keeps it).
    """
    for capture in captures:
        connect.put(capture.name, connector_config(capture, database, registry_api=registry_api))
    for capture in captures:
        connect.wait_running(capture.name, timeout_s)
    deadline = time.monotonic() + timeout_s
    wanted = {capture.slot for capture in captures}
    while not wanted <= database.active_slots():
        if time.monotonic() > deadline:
            missing = sorted(wanted - database.active_slots())
            raise ConnectError(f"replication slots {missing} not streaming after {timeout_s} s")
        time.sleep(0.5)


def wait_captured(kafka: KafkaConfig, captures: list[Capture], timeout_s: float = 120.0) -> int:
    """Wait until every connector wrote the marker row and its topics stop growing.

    Returns the records the topics hold. PostgreSQL's WAL is one order, so a connector
    that wrote the marker has read every change before it; the second wait lets the
    producer's last sends land.
    """
    consumer = make_consumer(kafka, f"cdc-capture-{uuid.uuid4().hex[:8]}")
    deadline = time.monotonic() + timeout_s
    try:
        while not all(_holds_records(consumer, c.topic(MARKER)) for c in captures):
            if time.monotonic() > deadline:
                raise ConnectError(f"the workload's marker row not captured in {timeout_s} s")
            time.sleep(0.5)
        topics = [c.topic(t) for c in captures for t in (*c.tables, MARKER)]
        before: int | None = None
        while (now := _total_end_offsets(consumer, topics)) is None or now != before:
            if time.monotonic() > deadline:
                raise ConnectError(f"the capture's topics still grow after {timeout_s} s")
            before = now
            time.sleep(1.0)
        return now
    finally:
        consumer.close()


def _total_end_offsets(consumer: Consumer, topics: list[str]) -> int | None:
    """The records the topics hold (end offsets summed); None while one has no leader."""
    total = 0
    for topic in topics:
        metadata = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return None
        for partition in metadata.partitions:
            try:
                total += consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=10
                )[1]
            except KafkaException:  # a topic just made: its leader is still being chosen
                return None
    return total


def _holds_records(consumer: Consumer, topic: str) -> bool:
    return bool(_total_end_offsets(consumer, [topic]))


def wait_snapshot(kafka: KafkaConfig, captures: list[Capture], timeout_s: float = 120.0) -> None:
    """Wait until every connector wrote records of every table (its snapshot's, at least).

    An Avro connector registers a table's schemas with its first record: a service
    started after this finds them in the registry.
    """
    consumer = make_consumer(kafka, f"cdc-capture-{uuid.uuid4().hex[:8]}")
    deadline = time.monotonic() + timeout_s
    try:
        while not all(_holds_records(consumer, c.topic(t)) for c in captures for t in c.tables):
            if time.monotonic() > deadline:
                raise ConnectError(f"the connectors' snapshots not in Kafka after {timeout_s} s")
            time.sleep(0.5)
    finally:
        consumer.close()


def stop_captures(
    connect: ConnectClient,
    server: Database,
    dbname: str,
    captures: list[Capture],
    drop_database: bool = True,
    timeout_s: float = 30.0,
) -> None:
    """Remove the connectors, their replication slots and the database.

    Without slots the server keeps no WAL for them. ``drop_database`` false keeps the
    database (and its tables) to look at. Safe to call for connectors that were never added.
    """
    for capture in captures:
        with contextlib.suppress(ConnectError):
            connect.delete(capture.name)
    database = server.on(dbname)
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(RuntimeError):  # the database was never made
        while database.active_slots() and time.monotonic() < deadline:
            time.sleep(0.5)
    if drop_database:
        server.drop_database(dbname)
    else:
        server.drop_slots(dbname)
