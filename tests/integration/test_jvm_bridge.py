"""The calls into the JVM beyond PySpark's public API answer as their callers expect."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cdc_shared.jvm import bridge as jvm_bridge
from pyspark.sql import SparkSession
from pyspark.sql import types as T

pytestmark = pytest.mark.integration


def test_hadoop_file_system_lists_and_reads_what_is_on_disk(
    spark: SparkSession, tmp_path: Path
) -> None:
    (tmp_path / "offsets").mkdir()
    (tmp_path / "offsets" / "0").write_text("v1\n{}\n", encoding="utf-8")
    fs, folder = jvm_bridge.hadoop_path(spark, str(tmp_path / "offsets"))
    assert [str(s.getPath().getName()) for s in fs.listStatus(folder)] == ["0"]
    assert jvm_bridge.read_text(spark, str(tmp_path / "offsets" / "0")) == "v1\n{}\n"
    assert jvm_bridge.read_text_if_exists(spark, str(tmp_path / "offsets" / "0")) == "v1\n{}\n"
    assert jvm_bridge.read_text_if_exists(spark, str(tmp_path / "offsets" / "1")) is None


def test_avro_types_read_as_from_avro_reads_them(spark: SparkSession) -> None:
    decimal = {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}
    assert jvm_bridge.spark_type_of_avro(spark, decimal) == T.DecimalType(10, 2)
    assert jvm_bridge.spark_type_of_avro(spark, ["null", "string"]) == T.StringType()


def test_avro_compatibility_tells_a_type_change(spark: SparkSession) -> None:
    def record(kind: str) -> str:
        return json.dumps({"type": "record", "name": "R", "fields": [{"name": "id", "type": kind}]})

    reader = jvm_bridge.avro_schema(spark, record("long"))
    promoted = jvm_bridge.avro_compatibility(
        spark, reader, jvm_bridge.avro_schema(spark, record("int"))
    )
    changed = jvm_bridge.avro_compatibility(
        spark, reader, jvm_bridge.avro_schema(spark, record("string"))
    )
    assert promoted.getCompatibility().toString() == "COMPATIBLE"
    assert changed.getCompatibility().toString() == "INCOMPATIBLE"


def test_jobs_are_counted_by_their_tag(spark: SparkSession) -> None:
    context = spark.sparkContext
    context.addJobTag("bridge-test")
    try:
        spark.range(10).count()
        spark.range(10).collect()
    finally:
        context.removeJobTag("bridge-test")
    deadline = time.monotonic() + 10  # jobs reach the tracker through the listener bus
    while jvm_bridge.jobs_with_tag(spark, "bridge-test") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert jvm_bridge.jobs_with_tag(spark, "bridge-test") >= 2
