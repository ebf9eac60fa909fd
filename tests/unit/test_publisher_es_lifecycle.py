"""publisher-es's index lifecycle without servers: the rebuild's documents, a lost index's stop."""

from __future__ import annotations

import datetime as dt
import json

from cdc_publisher_es.documents import document_id, snapshot_document_frame
from cdc_publisher_es.index_lifecycle import IndexLostError
from cdc_shared.config.services import PublisherEsConfig
from cdc_shared.streaming.changefeed import external_version
from cdc_shared.streaming.failures import read_failure
from pyspark.sql import SparkSession
from pyspark.sql import types as T

SILVER = T.StructType(
    [
        T.StructField("id", T.LongType()),
        T.StructField("line", T.IntegerType()),
        T.StructField("name", T.StringType()),
        T.StructField("_cdc_seq", T.ArrayType(T.LongType())),
        T.StructField("_cdc_op", T.StringType()),
        T.StructField("_cdc_source_ts", T.TimestampType()),
        T.StructField("_cdc_commit_ts", T.TimestampType()),
    ]
)


def test_rebuild_documents_carry_the_ids_and_versions_the_stream_gives(
    spark: SparkSession,
) -> None:
    now = dt.datetime.now(dt.UTC)
    silver = spark.createDataFrame(
        [
            (1, 1, "one", [40], "c", now, now),  # one-column sequence: 2 * sequence
            (2, 1, "a|b", [7, 3], "u", now, now),  # composite: the snapshot's version
            (3, 2, None, [1 << 62], "r", now, now),  # out of range: the snapshot's version
        ],
        SILVER,
    )
    settings = PublisherEsConfig()
    rows = snapshot_document_frame(silver, ["id", "line"], settings, 9, now).collect()
    assert {r.doc_id: r.version for r in rows} == {
        document_id([1, 1]): external_version("c", [40], 9),
        document_id([2, 1]): external_version("u", [7, 3], 9),
        document_id([3, 2]): external_version("c", [1 << 62], 9),
    }
    assert {r.doc_id: r.version for r in rows} == {"1|1": 80, "2|1": 9, "3|2": 9}
    assert {r.op for r in rows} == {"index"} and {r.commit_version for r in rows} == {9}
    sources = {r.doc_id: json.loads(r.source) for r in rows}
    assert sources["2|1"] == {"id": 2, "line": 1, "name": "a|b"}  # no _cdc_* metadata
    assert sources["3|2"] == {"id": 3, "line": 2, "name": None}  # nulls kept, as streamed


def test_a_lost_index_stops_the_service_by_its_type_with_its_own_line() -> None:
    lost = IndexLostError(
        "publisher_es stream for entity 'customers' stopped: the Elasticsearch index behind "
        "the alias 'c' vanished (publisher_es.on_missing_index: stop). To rebuild it ..."
    )
    failure = lost.failure()
    assert not failure.transient and not failure.entity_only
    assert failure.message.startswith("stopped: the Elasticsearch index behind the alias 'c'")
    assert failure.message.endswith("To rebuild it ...")
    assert read_failure("customers", lost, None) == failure  # no text reader: its type
