"""DataFrames of rows held by the driver, made without Python on the executors.

``spark.createDataFrame(rows, schema)`` with Python rows makes an RDD of pickled rows
that pyspark's Python worker decodes on the executors, so every executor would need
Python with pyspark. From an Arrow table instead, PySpark sends the rows to the driver's
JVM as Arrow batches, which the JVM decodes itself (a local relation, or JVM tasks above
``spark.sql.execution.arrow.localRelationThreshold``): executors run no Python, and an
empty frame is an empty local relation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

#: A row: values in the schema's order, or a mapping by field name (absent: null).
DriverRow = Sequence[Any] | Mapping[str, Any]


def frame_from_rows(
    spark: SparkSession, rows: Iterable[DriverRow], schema: T.StructType
) -> DataFrame:
    """A DataFrame of ``rows`` with exactly ``schema``: types and nullability.

    Values are read as ``createDataFrame`` reads them (``StructType.toInternal``): a
    naive ``datetime`` of a timestamp column is local time, like those ``collect``
    returns. A null in a non-nullable column raises ``ValueError``, as
    ``createDataFrame``'s own check does; a value of the wrong type raises pyarrow's error.
    """
    columns: list[list[Any]] = [[] for _ in schema.fields]
    for row in rows:
        values = tuple(row.get(n) for n in schema.names) if isinstance(row, Mapping) else tuple(row)
        if len(values) != len(columns):
            raise ValueError(f"a row of {len(values)} values for {len(columns)} columns")
        for column, value in zip(columns, schema.toInternal(values), strict=True):
            column.append(value)
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    table = pa.Table.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(columns, arrow_schema, strict=True)],
        schema=arrow_schema,
    )
    nulls = [f.name for f in schema.fields if not f.nullable and table.column(f.name).null_count]
    if nulls:
        raise ValueError(f"null values in non-nullable columns {nulls}")
    return spark.createDataFrame(table, schema)
