"""The index behind an entity's alias: mapping from the Avro row schema, and settings.

The mapping is derived from the entity's newest Avro row schema (the record inside the
Debezium envelope's ``after``), so it is explicit and typed before the first document
arrives; the index is ``dynamic: strict``, so a field nobody mapped is an error (the
document goes to quarantine) rather than a guess. A silver column the Avro schema does
not describe falls back to a mapping from its Spark type.

Type choices (services/publisher_es/README.md, "Mapping"):

============================  ==================================================
Avro                          Elasticsearch
============================  ==================================================
boolean, int, long            boolean, integer, long
float, double                 float, double
string, enum, uuid            keyword (``text`` + ``.keyword`` if in text_fields)
decimal                       scaled_float (factor 10^scale) or keyword string
date                          date, ``strict_date``
timestamp-millis              date
timestamp-micros              date_nanos (keeps the microseconds)
bytes, fixed                  binary (base64)
record                        object
array of records              nested (each element matched on its own)
array of X                    X (Elasticsearch fields are multi-valued)
map                           flattened
============================  ==================================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.services import PublisherEsConfig
from elasticsearch import ApiError, Elasticsearch
from pyspark.sql import types as T

log = logging.getLogger(__name__)

#: Decimals with more digits than this lose precision as a double (scaled_float parses
#: through a double), so they are mapped and sent as strings whatever ``decimal_as`` says.
MAX_EXACT_DECIMAL_PRECISION = 15

#: Keyword values longer than this are kept in ``_source`` but not indexed, instead of
#: failing the document (Lucene's term limit is 32766 bytes; 8191 chars x 4 bytes fits).
KEYWORD_IGNORE_ABOVE = 8191

Properties = dict[str, Any]


class MappingError(ValueError):
    """An Avro or Spark type the mapping cannot express; the message names the field."""


def decimal_as_string(precision: int, settings: PublisherEsConfig) -> bool:
    """Whether a decimal of ``precision`` digits is mapped (and sent) as a keyword string."""
    return settings.decimal_as == "string" or precision > MAX_EXACT_DECIMAL_PRECISION


def _string_mapping(path: str, settings: PublisherEsConfig) -> Properties:
    if path in settings.text_fields:
        return {
            "type": "text",
            "fields": {"keyword": {"type": "keyword", "ignore_above": KEYWORD_IGNORE_ABOVE}},
        }
    return {"type": "keyword", "ignore_above": KEYWORD_IGNORE_ABOVE}


def _decimal_mapping(precision: int, scale: int, settings: PublisherEsConfig) -> Properties:
    if decimal_as_string(precision, settings):
        return {"type": "keyword"}
    return {"type": "scaled_float", "scaling_factor": 10**scale}


# --- Avro -----------------------------------------------------------------------------


def avro_properties(row_schema: Mapping[str, Any], settings: PublisherEsConfig) -> Properties:
    """The mapping ``properties`` of an Avro record schema (the entity's row)."""
    named: dict[str, Any] = {}
    return _record_properties(row_schema, "", settings, named)


def _record_properties(
    record: Mapping[str, Any], prefix: str, settings: PublisherEsConfig, named: dict[str, Any]
) -> Properties:
    _remember(record, named)
    properties: Properties = {}
    for field in record.get("fields", []):
        path = f"{prefix}{field['name']}"
        mapped = _avro_type_mapping(field["type"], path, settings, named)
        if mapped is not None:
            properties[field["name"]] = mapped
    return properties


def _remember(schema: Mapping[str, Any], named: dict[str, Any]) -> None:
    name = schema.get("name")
    if name:
        named[name] = schema
        namespace = schema.get("namespace")
        if namespace and "." not in name:
            named[f"{namespace}.{name}"] = schema


def _avro_type_mapping(
    schema: Any, path: str, settings: PublisherEsConfig, named: dict[str, Any]
) -> Properties | None:
    """The mapping of one Avro type at ``path`` (dotted), or None for a null-only type."""
    if isinstance(schema, list):
        return _union_mapping(schema, path, settings, named)
    if isinstance(schema, str):
        if schema == "null":
            return None
        if schema in named:
            return _avro_type_mapping(named[schema], path, settings, named)
        return _avro_primitive(schema, None, {}, path, settings)
    if not isinstance(schema, Mapping):
        raise MappingError(f"field {path!r}: unexpected Avro type {schema!r}")
    return _declared_type_mapping(schema, path, settings, named)


def _union_mapping(
    union: list[Any], path: str, settings: PublisherEsConfig, named: dict[str, Any]
) -> Properties | None:
    """An Avro union's mapping: its one non-null branch's, or a member per branch."""
    branches = [b for b in union if b != "null"]
    if not branches:
        return None
    if len(branches) == 1:
        return _avro_type_mapping(branches[0], path, settings, named)
    # Spark reads a multi-type union as a struct of member0, member1, ...
    members = {
        f"member{i}": _avro_type_mapping(b, f"{path}.member{i}", settings, named)
        for i, b in enumerate(branches)
    }
    return {"properties": {k: v for k, v in members.items() if v is not None}}


def _declared_type_mapping(
    schema: Mapping[str, Any], path: str, settings: PublisherEsConfig, named: dict[str, Any]
) -> Properties | None:
    """The mapping of an Avro type written as an object (``{"type": ...}``)."""
    kind = schema.get("type")
    if kind == "record":
        return {"properties": _record_properties(schema, f"{path}.", settings, named)}
    if kind == "enum":
        _remember(schema, named)
        return {"type": "keyword"}
    if kind == "array":
        items = schema["items"]
        resolved = named.get(items, items) if isinstance(items, str) else items
        inner = _avro_type_mapping(items, path, settings, named)
        if inner is None:
            return None
        if isinstance(resolved, Mapping) and resolved.get("type") == "record":
            return {"type": "nested", **inner}
        return inner
    if kind == "map":
        return {"type": "flattened"}
    if kind == "fixed":
        _remember(schema, named)
    if isinstance(kind, str) and kind in named:
        return _avro_type_mapping(named[kind], path, settings, named)
    if isinstance(kind, (list, dict)):
        return _avro_type_mapping(kind, path, settings, named)
    if isinstance(kind, str):
        return _avro_primitive(kind, schema.get("logicalType"), schema, path, settings)
    raise MappingError(f"field {path!r}: unexpected Avro type {schema!r}")


def _avro_primitive(
    kind: str,
    logical: str | None,
    schema: Mapping[str, Any],
    path: str,
    settings: PublisherEsConfig,
) -> Properties:
    if logical == "decimal":
        return _decimal_mapping(
            int(schema.get("precision", 38)), int(schema.get("scale", 0)), settings
        )
    if logical == "date":
        return {"type": "date", "format": "strict_date"}
    if logical in ("timestamp-millis", "local-timestamp-millis"):
        return {"type": "date"}
    if logical in ("timestamp-micros", "local-timestamp-micros"):
        return {"type": "date_nanos"}
    if logical == "uuid":
        return {"type": "keyword"}
    simple = {
        "boolean": {"type": "boolean"},
        "int": {"type": "integer"},
        "long": {"type": "long"},
        "float": {"type": "float"},
        "double": {"type": "double"},
        "bytes": {"type": "binary"},
        "fixed": {"type": "binary"},
    }
    if kind == "string":
        return _string_mapping(path, settings)
    if kind in simple:
        return dict(simple[kind])
    raise MappingError(f"field {path!r}: Avro type {kind!r} has no Elasticsearch mapping")


# --- Spark (columns the Avro schema does not describe) ----------------------------------


def spark_type_mapping(data_type: T.DataType, path: str, settings: PublisherEsConfig) -> Properties:
    """The mapping of a Spark type: the fallback for silver columns Avro does not name."""
    if isinstance(data_type, T.StructType):
        return {
            "properties": {
                f.name: spark_type_mapping(f.dataType, f"{path}.{f.name}", settings)
                for f in data_type.fields
            }
        }
    if isinstance(data_type, T.ArrayType):
        inner = spark_type_mapping(data_type.elementType, path, settings)
        if isinstance(data_type.elementType, T.StructType):
            return {"type": "nested", **inner}
        return inner
    if isinstance(data_type, T.MapType):
        return {"type": "flattened"}
    if isinstance(data_type, T.StringType):
        return _string_mapping(path, settings)
    if isinstance(data_type, T.DecimalType):
        return _decimal_mapping(data_type.precision, data_type.scale, settings)
    if isinstance(data_type, T.DateType):
        return {"type": "date", "format": "strict_date"}
    if isinstance(data_type, (T.TimestampType, T.TimestampNTZType)):
        return {"type": "date_nanos"}
    simple: dict[type[T.DataType], str] = {
        T.BooleanType: "boolean",
        T.ByteType: "byte",
        T.ShortType: "short",
        T.IntegerType: "integer",
        T.LongType: "long",
        T.FloatType: "float",
        T.DoubleType: "double",
        T.BinaryType: "binary",
    }
    for spark_type, es_type in simple.items():
        if isinstance(data_type, spark_type):
            return {"type": es_type}
    raise MappingError(f"column {path!r}: Spark type {data_type.simpleString()} has no mapping")


def entity_properties(
    row_schema: Mapping[str, Any] | None,
    silver_columns: T.StructType,
    settings: PublisherEsConfig,
) -> Properties:
    """Mapping properties for every silver row column: Avro first, Spark type otherwise."""
    from_avro = avro_properties(row_schema, settings) if row_schema is not None else {}
    properties: Properties = {}
    for field in silver_columns.fields:
        if field.name in from_avro:
            properties[field.name] = from_avro[field.name]
        else:
            properties[field.name] = spark_type_mapping(field.dataType, field.name, settings)
    return properties


# --- the index ----------------------------------------------------------------------


def index_settings(settings: PublisherEsConfig) -> dict[str, Any]:
    """Static and dynamic index settings; refresh and gc_deletes always explicit."""
    return {
        "index": {
            "number_of_shards": settings.shards,
            "number_of_replicas": settings.replicas,
            "refresh_interval": settings.refresh_interval,
            "gc_deletes": settings.gc_deletes,
        }
    }


def index_mappings(
    entity: EntityConfig, properties: Properties, version_source: str
) -> dict[str, Any]:
    """The full mapping: strict, with what the documents are and how they are versioned."""
    return {
        "dynamic": "strict",
        "_meta": {
            "cdc_entity": entity.name,
            "cdc_key": list(entity.key),
            "cdc_version": version_source,
        },
        "properties": properties,
    }


def first_index_name(alias: str) -> str:
    """The concrete index created behind ``alias`` on first start (a reindex adds -000002)."""
    return f"{alias}-000001"


#: ``_meta`` key set on an index created to be rebuilt from silver, removed once the rebuild
#: is complete: an index still carrying it is partial (a crash interrupted its rebuild).
REBUILD_PENDING = "cdc_rebuild_pending"


@dataclass(frozen=True)
class EnsuredIndex:
    """The write index behind the alias, as :func:`ensure_index` found or made it.

    ``rebuild_pending``: it still waits for a rebuild from silver (its ``_meta`` has
    :data:`REBUILD_PENDING`).
    """

    index: str
    created: bool
    rebuild_pending: bool


def ensure_index(
    es: Elasticsearch,
    alias: str,
    settings: PublisherEsConfig,
    mappings: Mapping[str, Any],
    *,
    on_conflict: Callable[[str], None] | None = None,
    to_rebuild: bool = False,
) -> EnsuredIndex:
    """Create ``<alias>-000001`` behind ``alias`` unless the alias exists; the index it names.

    When the alias already exists (a restart, or an index an operator swapped in), the
    dynamic settings (refresh interval, gc_deletes, replicas) are set to the configured
    values and fields the mapping lacks are added. A field mapped with another type is
    left alone (Elasticsearch cannot change it); ``on_conflict`` is told the reason, and
    documents that do not fit it will go to quarantine. ``to_rebuild``: an index created
    now is marked as waiting for a rebuild from silver (see :func:`finish_rebuild`).
    """
    if es.indices.exists_alias(name=alias):
        return _adopt(es, alias, settings, mappings, on_conflict, created=False)
    if es.indices.exists(index=alias):
        raise MappingError(
            f"{alias!r} is a concrete Elasticsearch index, not an alias: publisher-es writes "
            "through an alias so a reindex can swap the index. Reindex it into a new index "
            f"with the alias {alias!r}, or configure another es_index"
        )
    index = first_index_name(alias)
    created = dict(mappings)
    if to_rebuild:
        created["_meta"] = {**mappings.get("_meta", {}), REBUILD_PENDING: True}
    try:
        es.indices.create(
            index=index,
            settings=index_settings(settings),
            mappings=created,
            aliases={alias: {"is_write_index": True}},
        )
        log.info("index created", extra={"index": index, "alias": alias})
        made = True
    except ApiError as exc:
        # Another publisher created it first; the alias check below settles it.
        if exc.error != "resource_already_exists_exception":
            raise
        made = False
    if not es.indices.exists_alias(name=alias):
        raise MappingError(
            f"index {index!r} exists but the alias {alias!r} does not point at it: add the "
            "alias, or delete the index to let publisher-es create it"
        )
    return _adopt(es, alias, settings, mappings, on_conflict, created=made)


def finish_rebuild(es: Elasticsearch, alias: str, mappings: Mapping[str, Any]) -> None:
    """Remove the rebuild mark: the index behind ``alias`` holds silver's state in full."""
    es.indices.put_mapping(index=alias, meta=dict(mappings.get("_meta", {})))


def _adopt(
    es: Elasticsearch,
    alias: str,
    settings: PublisherEsConfig,
    mappings: Mapping[str, Any],
    on_conflict: Callable[[str], None] | None,
    *,
    created: bool,
) -> EnsuredIndex:
    indexes = list(es.indices.get_alias(name=alias).body)
    dynamic = index_settings(settings)["index"]
    es.indices.put_settings(
        index=alias,
        settings={
            "index": {
                k: dynamic[k] for k in ("refresh_interval", "gc_deletes", "number_of_replicas")
            }
        },
    )
    add_properties(es, alias, mappings["properties"], on_conflict)
    write_index = _write_index(es, alias, indexes)
    meta = _mappings_of(es, write_index).get("_meta", {})
    return EnsuredIndex(write_index, created, bool(meta.get(REBUILD_PENDING)))


def _mappings_of(es: Elasticsearch, index: str) -> dict[str, Any]:
    body: dict[str, Any] = es.indices.get_mapping(index=index).body
    for index_body in body.values():
        return dict(index_body.get("mappings", {}))
    return {}


def _write_index(es: Elasticsearch, alias: str, indexes: list[str]) -> str:
    if len(indexes) == 1:
        return indexes[0]
    for index, info in es.indices.get_alias(name=alias).body.items():
        if info.get("aliases", {}).get(alias, {}).get("is_write_index"):
            return str(index)
    raise MappingError(
        f"alias {alias!r} points at several indexes ({', '.join(sorted(indexes))}) and none is "
        "its write index: set is_write_index on the one publisher-es should write"
    )


def current_properties(es: Elasticsearch, alias: str) -> Properties:
    """The mapped top-level properties of the index behind ``alias``."""
    body = es.indices.get_mapping(index=alias).body
    merged: Properties = {}
    for index_body in body.values():
        merged.update(index_body.get("mappings", {}).get("properties", {}))
    return merged


def add_properties(
    es: Elasticsearch,
    alias: str,
    properties: Mapping[str, Any],
    on_conflict: Callable[[str], None] | None = None,
) -> None:
    """Add ``properties`` to the mapping; on a type conflict add only the missing fields."""
    try:
        es.indices.put_mapping(index=alias, properties=dict(properties))
        return
    except ApiError as exc:
        if exc.status_code != 400:
            raise
        reason = _reason(exc)
    existing = current_properties(es, alias)
    missing = {k: v for k, v in properties.items() if k not in existing}
    if on_conflict is not None:
        on_conflict(reason)
    if missing:
        es.indices.put_mapping(index=alias, properties=missing)


def _reason(exc: ApiError) -> str:
    info = exc.info if isinstance(exc.info, Mapping) else {}
    error = info.get("error", {})
    if isinstance(error, Mapping):
        return f"{error.get('type', exc.error)}: {error.get('reason', '')}"
    return str(exc.error)
