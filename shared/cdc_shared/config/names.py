"""Names the pipeline takes from its configuration, and names it derives from them.

Kafka topics and Elasticsearch indices are checked against their servers' rules when the
configuration loads, so a bad name stops a service at start with the field named, not
on its first batch. Avro names are derived from change topics (see ``avro_namespace``).
"""

from __future__ import annotations

import hashlib
import re

#: Kafka's rule: 1-249 of ``[a-zA-Z0-9._-]``, and neither ``.`` nor ``..``.
_KAFKA_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")

#: Characters Elasticsearch refuses in an index or alias name (besides upper case).
_ES_FORBIDDEN = set('\\/*?"<>| ,#:')
_ES_MAX_BYTES = 255

#: One segment of an Avro name or namespace.
_AVRO_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AVRO_INVALID = re.compile(r"[^A-Za-z0-9_]")


def kafka_topic_problem(topic: str) -> str | None:
    """Why ``topic`` is not a valid Kafka topic name, or None when it is."""
    if topic in (".", ".."):
        return f"{topic!r} is not allowed as a Kafka topic name"
    if not _KAFKA_TOPIC.fullmatch(topic):
        return (
            "a Kafka topic name is 1-249 characters of letters, digits, '.', '_' and '-', "
            f"got {topic!r}"
        )
    return None


def es_index_problem(name: str, reserved_suffix: int = 0) -> str | None:
    """Why ``name`` cannot name an Elasticsearch index or alias, or None when it can.

    ``reserved_suffix`` bytes are kept free for what is appended to the name (the
    publisher's indices are ``<alias>-000001``).
    """
    limit = _ES_MAX_BYTES - reserved_suffix
    forbidden = sorted(_ES_FORBIDDEN.intersection(name))
    if not name or name in (".", ".."):
        return f"{name!r} cannot name an Elasticsearch index"
    if name != name.lower():
        return f"an Elasticsearch index name is lower case, got {name!r}"
    if forbidden:
        return f"an Elasticsearch index name cannot contain {''.join(forbidden)!r}, got {name!r}"
    if name[0] in "-_+":
        return f"an Elasticsearch index name cannot start with '-', '_' or '+', got {name!r}"
    if len(name.encode()) > limit:
        return f"an Elasticsearch index name here is at most {limit} bytes, got {name!r}"
    return None


def avro_namespace(topic: str) -> str:
    """The Avro namespace of the records published to ``topic``: valid, stable, distinct.

    A topic that is already a valid Avro name is its own namespace. Otherwise each
    character Avro refuses becomes ``_``, a segment that is empty or starts with a digit
    gets a leading ``_``, and the last segment ends in ``_`` and the first 8 hex digits
    of the topic's SHA-256, so two topics that clean up alike (``orders-cdc`` and
    ``orders_cdc``) never share a namespace: ``orders-cdc`` -> ``orders_cdc_<hash>``,
    ``cdc.2024.orders`` -> ``cdc._2024.orders_<hash>``.
    """
    segments = topic.split(".")
    if all(_AVRO_SEGMENT.fullmatch(segment) for segment in segments):
        return topic
    cleaned = [_avro_segment(segment) for segment in segments]
    cleaned[-1] += "_" + hashlib.sha256(topic.encode()).hexdigest()[:8]
    return ".".join(cleaned)


def _avro_segment(segment: str) -> str:
    cleaned = _AVRO_INVALID.sub("_", segment)
    return cleaned if _AVRO_SEGMENT.fullmatch(cleaned) else f"_{cleaned}"
