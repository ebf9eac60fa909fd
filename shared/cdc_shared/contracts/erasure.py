"""The erasure log: requests to forget keys (``cdc erase``), and how far each got.

``<root>/_erasure`` is a Delta table (Change Data Feed on) the ``cdc erase`` command
appends to; one commit per invocation, and that commit's version is the request's id
(read back as the feed's ``_commit_version``: concurrent invocations cannot collide).
A request row names one key of one entity (the key as a JSON object, ``key_text``) and
``bronze_version``, bronze's latest version when the request was recorded: the changes
of the key up to it are erased, a change reaching bronze after it is new data.

The merger, silver's and the history's only writer, applies a request to both in order
(``cdc_merger.erasure``) and records it in each table's own log: Delta's idempotent-write
app id ``ERASURE_APP`` with the request id as its version, so silver's log says which
requests it took. The CLI records its own steps (bronze's and the quarantine's rows
deleted, the tables purged) as rows of the same table whose ``step`` is set.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_shared.jvm.driver_frames import frame_from_rows

#: The app id of an erasure in silver's and the history's log; ``txnVersion``: the request id.
ERASURE_APP = "cdc-erasure"
#: The erasure log's columns. A request's row: ``step`` and ``request`` null (its id is
#: its commit's version). A step the CLI did: ``step`` set, ``request`` the request's id.
LOG_SCHEMA = T.StructType(
    [
        T.StructField("request", T.LongType(), True),
        T.StructField("entity", T.StringType(), False),
        T.StructField("key", T.StringType(), True),
        T.StructField("bronze_version", T.LongType(), True),
        T.StructField("step", T.StringType(), True),
        T.StructField("recorded_at", T.TimestampType(), False),
    ]
)
LOG_PROPERTIES = {"delta.enableChangeDataFeed": "true", "delta.appendOnly": "true"}
#: The Change Data Feed's column of a row's commit version.
COMMIT_VERSION = "_commit_version"
#: The CLI's steps, in order, after the merger took the request.
BRONZE_DELETED = "bronze_deleted"
QUARANTINE_DELETED = "quarantine_deleted"
PURGED = "purged"
STEPS = (BRONZE_DELETED, QUARANTINE_DELETED, PURGED)


def key_text(key: Mapping[str, Any]) -> str:
    """A key as the log holds it: a JSON object, its columns sorted (one text per key)."""
    return json.dumps(dict(key), sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class ErasureRequest:
    """One ``cdc erase`` invocation for one entity: its keys, and bronze's version then."""

    request: int  # the erasure log's version of its commit
    entity: str
    keys: tuple[str, ...]  # key_text of each key
    bronze_version: int
    recorded_at: dt.datetime

    def key_values(self) -> list[dict[str, Any]]:
        """The keys as column -> value."""
        return [json.loads(k) for k in self.keys]


def requests_of(rows: list[dict[str, Any]]) -> list[ErasureRequest]:
    """The log's request rows (``step`` null) as requests, oldest first, one per entity each.

    ``rows``: the log's change feed rows (each with its ``_commit_version``).
    """
    grouped: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["step"] is None:
            grouped.setdefault((int(row[COMMIT_VERSION]), row["entity"]), []).append(row)
    return [
        ErasureRequest(
            request=request,
            entity=entity,
            keys=tuple(sorted({r["key"] for r in group})),
            bronze_version=int(group[0]["bronze_version"]),
            recorded_at=group[0]["recorded_at"],
        )
        for (request, entity), group in sorted(grouped.items())
    ]


def steps_done(rows: list[dict[str, Any]]) -> dict[int, dict[str, dt.datetime]]:
    """Per request id, the CLI's steps done (``STEPS``) and when."""
    done: dict[int, dict[str, dt.datetime]] = {}
    for row in rows:
        if row["step"] is not None:
            done.setdefault(int(row["request"]), {})[row["step"]] = row["recorded_at"]
    return done


def typed_keys(
    spark: SparkSession, texts: list[str], key: list[str], silver: T.StructType
) -> DataFrame:
    """Keys (each a ``key_text``) as rows of silver's key columns typed as silver's, and ``text``.

    A value that does not cast to silver's type reads null (the CLI refuses those).
    """
    schema = T.StructType([T.StructField(k, silver[k].dataType, True) for k in key])
    text = T.StructType([T.StructField("text", T.StringType(), False)])
    frame = frame_from_rows(spark, [(t,) for t in texts], text)
    parsed = frame.select("text", F.from_json("text", schema).alias("k"))
    return parsed.select("text", *[F.col(f"k.`{k}`").alias(k) for k in key])
