r"""Change rows -> Elasticsearch bulk actions.

The heavy part runs in Spark (:func:`document_frame`): the document id, the external
version and the JSON source are built in the JVM, and the batch reaches the driver as
Arrow (:func:`arrow_actions`), so the driver only pairs strings with numbers. Spark's
``to_json`` writes decimals exactly as JSON numbers (or strings, see
:func:`cdc_publisher_es.mapping.decimal_as_string`), timestamps as ISO-8601 in UTC with
microseconds, dates as ``yyyy-MM-dd`` and binary as base64: every value in a form the
mapping accepts without loss.

Document id: the primary key. One key column gives its string form (``42``); a
composite key joins the parts' string forms with ``|`` after escaping ``\`` and ``|`` in
each part (``7|2``, ``a\|b|c``), so two different keys never share an id.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from cdc_shared.config.services import PublisherEsConfig
from cdc_shared.contracts.silver import SEQUENCE
from cdc_shared.streaming.changefeed import CHANGE_COLUMNS, MAX_SEQUENCE_FOR_VERSION, row_columns
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_publisher_es.mapping import decimal_as_string

#: Spark ``to_json`` options: full rows (nulls included), UTC timestamps with microseconds.
JSON_OPTIONS = {
    "ignoreNullFields": "false",
    "timeZone": "UTC",
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
    "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
    "dateFormat": "yyyy-MM-dd",
}

KEY_SEPARATOR = "|"

#: Columns of :func:`document_frame`, in the order of :class:`Action`'s fields.
DOCUMENT_COLUMNS = ("op", "doc_id", "version", "source", "commit_version", "commit_timestamp")


@dataclass(frozen=True, slots=True)
class Action:
    """One bulk action: index (inserts, updates) or delete, with its external version."""

    op: str  # "index" or "delete"
    doc_id: str
    version: int
    source: str | None  # JSON document; None for a delete
    commit_version: int
    commit_timestamp: dt.datetime

    def bulk(self, index: str) -> dict[str, Any]:
        """The action as ``elasticsearch.helpers`` takes it (raw JSON source passes through)."""
        action: dict[str, Any] = {
            "_op_type": self.op,
            "_index": index,
            "_id": self.doc_id,
            "version": self.version,
            "version_type": "external",
        }
        if self.source is not None:
            action["_source"] = self.source
        return action


def document_id(parts: Sequence[object]) -> str:
    """The document id of a key, exactly as :func:`document_frame` builds it in Spark."""
    if len(parts) == 1:
        return str(parts[0])
    escaped = (
        str(p).replace("\\", "\\\\").replace(KEY_SEPARATOR, "\\" + KEY_SEPARATOR) for p in parts
    )
    return KEY_SEPARATOR.join(escaped)


def _id_column(key: Sequence[str]) -> Column:
    parts = [F.col(f"key.`{k}`").cast("string") for k in key]
    if len(parts) == 1:
        return parts[0]
    escaped = [F.regexp_replace(F.regexp_replace(p, r"\\", r"\\\\"), r"\|", r"\\|") for p in parts]
    any_null = F.lit(False)
    for p in parts:
        any_null = any_null | p.isNull()
    return F.when(~any_null, F.concat_ws(KEY_SEPARATOR, *escaped))


def json_ready(column: Column, data_type: T.DataType, settings: PublisherEsConfig) -> Column:
    """``column`` with every decimal the mapping keeps as a string cast to a string."""
    if isinstance(data_type, T.DecimalType):
        return column.cast("string") if decimal_as_string(data_type.precision, settings) else column
    if isinstance(data_type, T.StructType):
        if not _has_string_decimal(data_type, settings):
            return column
        fields = [
            json_ready(column.getField(f.name), f.dataType, settings).alias(f.name)
            for f in data_type.fields
        ]
        return F.when(column.isNotNull(), F.struct(*fields))
    if isinstance(data_type, T.ArrayType) and _has_string_decimal(data_type, settings):
        element = data_type.elementType
        return F.transform(column, lambda x: json_ready(x, element, settings))
    if isinstance(data_type, T.MapType) and _has_string_decimal(data_type, settings):
        value = data_type.valueType
        return F.transform_values(column, lambda _k, v: json_ready(v, value, settings))
    return column


def _has_string_decimal(data_type: T.DataType, settings: PublisherEsConfig) -> bool:
    if isinstance(data_type, T.DecimalType):
        return decimal_as_string(data_type.precision, settings)
    if isinstance(data_type, T.StructType):
        return any(_has_string_decimal(f.dataType, settings) for f in data_type.fields)
    if isinstance(data_type, T.ArrayType):
        return _has_string_decimal(data_type.elementType, settings)
    if isinstance(data_type, T.MapType):
        return _has_string_decimal(data_type.valueType, settings)
    return False


def external_version_column(op: Column, sequence: Column, commit_version: Column) -> Column:
    """``changefeed.external_version`` as a Spark column (the same rule, in the JVM).

    (``cdc_shared.streaming.changefeed``.)

    One-column sequence in range: ``2 * sequence`` (+1 for a delete); otherwise the
    silver commit version.
    """
    first = F.get(sequence, 0).cast("long")  # null, not an error, when it is empty
    one_in_range = (
        (F.size(sequence) == 1) & (first >= 0) & (first <= F.lit(MAX_SEQUENCE_FOR_VERSION))
    )
    delete = F.when(op == "d", F.lit(1)).otherwise(F.lit(0))
    return F.when(one_in_range, first * 2 + delete).otherwise(commit_version.cast("long"))


def document_frame(
    changes: DataFrame, key: Sequence[str], settings: PublisherEsConfig
) -> DataFrame:
    """Shaped changes (``cdc_shared.streaming.changefeed.shape_changes``) -> ``DOCUMENT_COLUMNS``.

    ``op`` is the bulk operation (``index`` or ``delete``); ``source`` is the row after
    the change as JSON (null on delete); ``doc_id`` is null when a key part is null (such
    a change cannot be addressed and goes to quarantine).
    """
    after_type = changes.schema["after"].dataType
    return changes.select(
        F.when(F.col("op") == "d", F.lit("delete")).otherwise(F.lit("index")).alias("op"),
        _id_column(key).alias("doc_id"),
        external_version_column(
            F.col("op"), F.col("source_sequence"), F.col("commit_version")
        ).alias("version"),
        F.when(
            F.col("after").isNotNull(),
            F.to_json(json_ready(F.col("after"), after_type, settings), JSON_OPTIONS),
        ).alias("source"),
        F.col("commit_version").cast("long").alias("commit_version"),
        F.col("commit_timestamp"),
    )


def snapshot_document_frame(
    silver: DataFrame,
    key: Sequence[str],
    settings: PublisherEsConfig,
    version: int,
    timestamp: dt.datetime,
) -> DataFrame:
    """Silver's rows at ``version`` -> ``DOCUMENT_COLUMNS``, as the stream would index them.

    Each row is an insert with its ``_cdc_seq``, so it gets the id and external version
    rule of :func:`document_frame`; ``version`` (the snapshot's silver version) stands in
    for the commit version, which a snapshot does not record per row. That orders right
    with the feed: every row was last changed at ``version`` or before, so a replayed
    change of the snapshot is refused (409, same or lower version), and every later
    change has a greater commit version (or, with a one-column sequence, a greater
    sequence) and replaces the document.
    """
    columns = row_columns(silver.schema)
    row = F.struct(*[F.col(f"`{c}`") for c in columns])
    changes = silver.select(
        F.lit("c").alias("op"),
        F.struct(*[F.col(f"`{k}`") for k in key]).alias("key"),
        F.lit(None).alias("before"),
        row.alias("after"),
        F.lit(version).cast("long").alias("commit_version"),
        F.lit(timestamp).cast("timestamp").alias("commit_timestamp"),
        F.col(SEQUENCE).alias("source_sequence"),
    )
    return document_frame(changes.select(*CHANGE_COLUMNS), key, settings)


def arrow_actions(table: pa.Table, unaddressable: Callable[[Action], None]) -> Iterator[Action]:
    """The rows of ``document_frame(...).toArrow()`` as actions, one record batch at a time.

    A row without an id (a key part is null) is handed to ``unaddressable`` instead, with
    ``""`` for its id. Converting column by column keeps the Python objects to one batch.
    """
    for batch in table.select(list(DOCUMENT_COLUMNS)).to_batches():
        columns = [column.to_pylist() for column in batch.columns]
        for row in zip(*columns, strict=True):
            if row[1] is None:
                unaddressable(Action(row[0], "", *row[2:]))
            else:
                yield Action(*row)


def latest_per_document(actions: Iterable[Action]) -> tuple[list[Action], int]:
    """Keep the highest version of each id, in first-seen order; also how many were dropped.

    Elasticsearch would reject the dropped ones anyway (lower external version), so
    sending only the newest saves work and keeps an older change from ever following a
    newer one within a bulk window.
    """
    newest: dict[str, Action] = {}
    seen = 0
    for action in actions:
        seen += 1
        current = newest.get(action.doc_id)
        if current is None or action.version > current.version:
            newest[action.doc_id] = action
    return list(newest.values()), seen - len(newest)


def windows(actions: Iterable[Action], size: int) -> Iterator[list[Action]]:
    """``actions`` in lists of at most ``size``."""
    window: list[Action] = []
    for action in actions:
        window.append(action)
        if len(window) >= size:
            yield window
            window = []
    if window:
        yield window
