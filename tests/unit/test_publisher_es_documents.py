"""The Spark side of publisher-es (no servers): change rows -> ids, versions, exact JSON."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import pytest
from cdc_publisher_es.documents import Action, arrow_actions, document_frame, document_id
from cdc_shared.config.services import PublisherEsConfig
from cdc_shared.streaming.changefeed import external_version
from pyspark.sql import SparkSession
from pyspark.sql import types as T

ROW = T.StructType(
    [
        T.StructField("a", T.StringType()),
        T.StructField("b", T.IntegerType()),
        T.StructField("amount", T.DecimalType(20, 4)),
        T.StructField("small", T.DecimalType(10, 2)),
        T.StructField("at", T.TimestampType()),
        T.StructField("day", T.DateType()),
        T.StructField("nested", T.StructType([T.StructField("d", T.DecimalType(30, 2))])),
        T.StructField("note", T.StringType()),
    ]
)
CHANGES = T.StructType(
    [
        T.StructField("op", T.StringType()),
        T.StructField("key", T.StructType([ROW["a"], ROW["b"]])),
        T.StructField("before", ROW),
        T.StructField("after", ROW),
        T.StructField("commit_version", T.LongType()),
        T.StructField("commit_timestamp", T.TimestampType()),
        T.StructField("source_sequence", T.ArrayType(T.LongType())),
    ]
)


def test_documents_have_unambiguous_ids_and_exact_values(spark: SparkSession) -> None:
    at = dt.datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=dt.UTC)
    after = (
        "x|y",
        7,
        Decimal("12345678901234.5678"),
        Decimal("0.10"),
        at,
        dt.date(2024, 2, 29),
        (Decimal("1234567890123456789012345678.91"),),
        None,
    )
    now = dt.datetime.now(dt.UTC)
    rows = [
        ("c", ("x|y", 7), None, after, 3, now, [5, 1]),
        ("d", ("a\\", 1), None, None, 4, now, [6, 2]),
        ("u", (None, 1), None, after, 5, now, [7, 3]),  # a null key part: no id
    ]
    changes = spark.createDataFrame(rows, CHANGES)
    settings = PublisherEsConfig(decimal_as="scaled_float")
    no_id: list[Action] = []
    frame = document_frame(changes, ["a", "b"], settings)
    got = list(arrow_actions(frame.toArrow(), no_id.append))
    index, delete = sorted(got, key=lambda a: a.op, reverse=True)
    assert [(a.doc_id, a.op, a.version, a.commit_version) for a in no_id] == [("", "index", 5, 5)]
    assert index.commit_timestamp == now

    assert index.doc_id == document_id(["x|y", 7]) == "x\\|y|7"
    assert delete.doc_id == document_id(["a\\", 1]) == "a\\\\|1"
    assert (index.version, delete.version) == (3, 4)  # composite sequence: commit version
    assert delete.op == "delete" and delete.source is None

    source = json.loads(index.source or "", parse_float=Decimal)
    assert source["amount"] == "12345678901234.5678"  # 20 digits: a string, exact
    assert source["small"] == Decimal("0.10")  # a JSON number, exact
    assert source["nested"]["d"] == "1234567890123456789012345678.91"
    assert dt.datetime.fromisoformat(source["at"]) == at  # UTC, microseconds kept
    assert source["day"] == "2024-02-29"
    assert "note" in source and source["note"] is None  # the full row, nulls included


VERSION_CASES = [
    ("c", [10], 3, 20),
    ("u", [11], 4, 22),
    ("d", [11], 5, 23),  # a delete shows the removed row's sequence: it must outrank it
    ("c", [12], 6, 24),  # a re-insert after the delete outranks the delete
    ("u", [1, 7], 9, 9),  # composite sequence: the commit version
    ("u", [-1], 10, 10),  # out of range: the commit version
    ("d", [(1 << 62) - 1], 11, (1 << 63) - 1),  # the largest sequence that fits
    ("u", [1 << 62], 12, 12),
    ("c", [], 13, 13),
]


def test_external_version_in_spark_is_the_shared_rule(spark: SparkSession) -> None:
    after = ("k", 1, None, None, None, None, None, None)
    now = dt.datetime.now(dt.UTC)
    rows = [
        (op, ("k", i), None, None if op == "d" else after, commit, now, sequence)
        for i, (op, sequence, commit, _) in enumerate(VERSION_CASES)
    ]
    frame = document_frame(spark.createDataFrame(rows, CHANGES), ["a", "b"], PublisherEsConfig())
    got = {a.doc_id: a for a in arrow_actions(frame.toArrow(), pytest.fail)}
    for i, (op, sequence, commit, version) in enumerate(VERSION_CASES):
        action = got[document_id(["k", i])]
        assert action.version == version == external_version(op, sequence, commit)
        assert action.op == ("delete" if op == "d" else "index")
