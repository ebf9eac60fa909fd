"""A table's batch is decoded with the writer schemas it uses, not every schema listed.

A file registry lists every table's schemas (and the change topics'): with a hundred
tables, a decode plan holding all of them made each table's decoding expression hundreds
of branches long, built and analysed on the driver every batch.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from cdc_devkit.workload import GeneratedMessage, WorkloadGenerator, WorkloadSpec
from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, decode
from cdc_ingestor.framing_headers import headers_by_topic
from cdc_ingestor.schema_learning import SchemaTracker
from cdc_shared.avro import FileSchemaRegistry
from pyspark.sql import Row, SparkSession
from support.entities import CUSTOMERS, ORDERS, SCHEMAS

pytestmark = pytest.mark.integration

OTHER_TABLES = 30


def _other_tables_schemas(folder: Path) -> None:
    """Orders' value schema as thirty other tables would register it (same shape)."""
    definition = json.loads((SCHEMAS / "dbserver1.inventory.orders-value.avsc").read_text())
    for n in range(OTHER_TABLES):
        copy = {**definition, "namespace": f"dbserver1.inventory.table{n}"}
        (folder / f"dbserver1.inventory.table{n}-value.avsc").write_text(json.dumps(copy))


def _event(message: GeneratedMessage) -> bool:
    return message.kind == "event" and message.value is not None


def test_a_batch_decodes_with_its_own_writers_as_with_every_listed_one(
    spark: SparkSession, tmp_path: Path
) -> None:
    _other_tables_schemas(tmp_path)
    registry = FileSchemaRegistry([SCHEMAS, tmp_path])
    spec = WorkloadSpec(events=300, keys=40, poison_share=0.05)
    orders = list(WorkloadGenerator([ORDERS], registry, spec).messages())
    # Records in orders' topic framed with schemas the registry lists for other topics:
    # customers' (cannot be read as orders) and another table's of orders' shape (can).
    customers = [m for m in WorkloadGenerator([CUSTOMERS], registry, spec).messages() if _event(m)]
    lookalike = registry.latest("dbserver1.inventory.table7-value").fingerprint
    reframed = [
        replace(m, value=m.value[:2] + lookalike + m.value[10:])
        for m in orders
        if _event(m) and m.value is not None
    ]
    when = dt.datetime(2026, 12, 5, tzinfo=dt.UTC)
    records = [
        (m.key, m.value, ORDERS.source_topic, 0, offset, when, 0)
        for offset, m in enumerate([*orders, *customers, *reframed])
    ]
    raw = spark.createDataFrame(records, KAFKA_SCHEMA)

    tracker = SchemaTracker(spark, ORDERS, registry)
    listed = tracker.update(raw)  # without the batch's headers: every listed schema
    headers = headers_by_topic(raw)[ORDERS.source_topic]
    narrowed = tracker.update(raw, headers)

    assert len(listed.value_writers) > OTHER_TABLES
    assert set(narrowed.value_writers) == headers[0] & set(listed.value_writers)
    assert len(narrowed.value_writers) == 4  # orders', customers' two versions, table7's
    assert set(narrowed.key_writers) == headers[1] & set(listed.key_writers)

    def outcome(plan: DecodePlan) -> list[Row]:
        return decode(spark, raw, plan, ORDERS.sequence_by).orderBy("kafka_offset").collect()

    whole, narrow = outcome(listed), outcome(narrowed)
    assert narrow == whole
    kinds = Counter(row.error_kind for row in narrow)
    assert kinds["incompatible_schema"] == len(customers)
    assert kinds[None] >= len(reframed)  # table7's shape decodes as orders'
    assert kinds["corrupt"] and kinds["unknown_schema"]
