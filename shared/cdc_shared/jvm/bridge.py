"""Every call from Python into the JVM beyond PySpark's public API, in one place.

PySpark exposes no public way to reach Hadoop's file system, Avro's Java library or
Spark's job status tracker, so these go through Py4J (``SparkContext._jvm``,
``_jsc``) and, for one type conversion, a private PySpark helper. Keeping them here
means a PySpark upgrade that moves any of them breaks one module, covered by the
tests of its callers.
"""

from __future__ import annotations

import json
import time
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.sql import Observation, SparkSession
from pyspark.sql import types as T


def java_class(spark: SparkSession, name: str) -> Any:
    """The Java class of fully qualified ``name`` in the driver's JVM, in one Py4J call.

    Py4J's ``jvm.org.apache.hadoop.fs.Path`` asks the JVM about each name on the way
    (``org``, ``org.apache``, ...), and each of those is a class lookup that fails only
    after searching every jar on the class path, ``org`` once per PySpark import: many
    times the cost of the whole name at once, paid by every file a service reads or
    writes through Hadoop (docs/benchmarks.md, "Py4J class lookups").
    """
    view = spark.sparkContext._jvm
    assert view is not None, "the SparkSession has no JVM gateway (stopped?)"
    return getattr(view, name)


def hadoop_path(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's file system for ``path`` and the path itself, as Spark configures them."""
    hadoop = java_class(spark, "org.apache.hadoop.fs.Path")(path)
    return hadoop.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hadoop


def set_hadoop_options(spark: SparkSession, options: dict[str, str]) -> None:
    """Set ``options`` on the session's Hadoop configuration (what file systems read)."""
    configuration = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in options.items():
        configuration.set(key, value)


def read_text(spark: SparkSession, path: str) -> str:
    """The content of the file ``path`` (any Hadoop file system) as UTF-8 text."""
    fs, file = hadoop_path(spark, path)
    stream = fs.open(file)
    try:
        return str(java_class(spark, "org.apache.commons.io.IOUtils").toString(stream, "UTF-8"))
    finally:
        stream.close()


def read_text_if_exists(spark: SparkSession, path: str) -> str | None:
    """The content of the file ``path`` as UTF-8 text; None when there is no such file.

    One open, no separate existence check (a round trip more on object storage).
    """
    try:
        return read_text(spark, path)
    except Py4JJavaError as exc:
        missing = java_class(spark, "java.lang.Class").forName("java.io.FileNotFoundException")
        if missing.isInstance(exc.java_exception):
            return None
        raise


def write_text(spark: SparkSession, path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to the file ``path``, replacing it (any Hadoop file system)."""
    fs, file = hadoop_path(spark, path)
    stream = fs.create(file, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def move(spark: SparkSession, source: str, target: str) -> None:
    """Move the file or folder ``source`` to ``target`` (a rename; on object storage a copy)."""
    fs, path = hadoop_path(spark, source)
    _, moved = hadoop_path(spark, target)
    if not fs.rename(path, moved):
        raise OSError(f"could not move {source} to {target}")


class HadoopFiles:
    """A checkpoint's files (``stream_checkpoint.CheckpointFiles``) through Hadoop.

    Hadoop's file systems read local paths and object storage alike.
    """

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

    def list_names(self, path: str) -> list[str] | None:
        """Names of the entries in the folder ``path``; None when it does not exist."""
        fs, folder = hadoop_path(self.spark, path)
        if not fs.exists(folder):
            return None
        return [str(status.getPath().getName()) for status in fs.listStatus(folder)]

    def read_text_if_exists(self, path: str) -> str | None:
        """The file ``path`` as UTF-8 text; None when there is no such file."""
        return read_text_if_exists(self.spark, path)


def move_aside(spark: SparkSession, checkpoint: str) -> str:
    """Move ``checkpoint`` aside (to ``<checkpoint>.<UTC time>``); where it went.

    A query that must start on a new checkpoint keeps its old one there (delete it at
    will). A name taken already (two moves in one second) gets a count after it.
    """
    files = HadoopFiles(spark)
    aside = f"{checkpoint.rstrip('/')}.{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    target, taken = aside, 0
    while files.list_names(target) is not None:
        taken += 1
        target = f"{aside}-{taken}"
    move(spark, checkpoint, target)
    return target


def delete_if_exists(spark: SparkSession, path: str) -> None:
    """Delete the file ``path`` if it is there."""
    fs, file = hadoop_path(spark, path)
    if fs.exists(file):
        fs.delete(file, False)


def _delta_log(spark: SparkSession, path: str) -> Any:
    """Delta's log of the table at ``path`` (one per table and JVM, with its snapshot)."""
    delta_log = java_class(spark, "org.apache.spark.sql.delta.DeltaLog")
    return delta_log.forTable(spark._jsparkSession, path)


def _newest_snapshot(spark: SparkSession, path: str) -> Any:
    """The table's newest snapshot: its log listed since the version loaded (no Spark job)."""
    log = _delta_log(spark, path)
    defaults = [getattr(log, f"update$default${i}")() for i in (1, 2, 3)]
    return log.update(*defaults)


def delta_table_bytes(spark: SparkSession, path: str) -> int:
    """Bytes of the files of the Delta table at ``path``, at the version this JVM last loaded.

    Delta's log of the table holds its newest snapshot (brought up to date by this
    process's own commits and by ``DeltaTable.forPath``). The size comes from that
    version's checksum, which Delta writes with every commit: no Spark job; without a
    checksum, Delta computes it from the table's state (a Spark job).
    """
    snapshot = _delta_log(spark, path).unsafeVolatileSnapshot()
    checksum = snapshot.checksumOpt()
    if checksum.isDefined():
        return int(checksum.get().tableSizeBytes())
    return int(snapshot.sizeInBytes())


def delta_table_files(spark: SparkSession, path: str) -> int:
    """Data files of the Delta table at ``path`` at its newest version (as the bytes above)."""
    snapshot = _newest_snapshot(spark, path)
    checksum = snapshot.checksumOpt()
    if checksum.isDefined():
        return int(checksum.get().numFiles())
    return int(snapshot.numOfFiles())


def observation_ready(observation: Observation) -> bool:
    """Whether the action an observation watched has run (``get`` would wait forever)."""
    return bool(observation._jo is not None and observation._jo.future().isCompleted())


def observation_collected(observation: Observation) -> bool:
    """Whether Spark collected ``observation``'s metrics (waits for its action to end).

    Spark ends an observation with no metrics when it ran none of the observed plan
    (adaptive execution can prove an empty micro-batch's input empty and skip it);
    ``Observation.get`` then fails on the empty row instead of returning the metrics.
    """
    assert observation._jo is not None, "observe a DataFrame before reading its metrics"
    return int(observation._jo.getRow().length()) > 0


def jobs_with_tag(spark: SparkSession, tag: str) -> int:
    """How many Spark jobs carry the job tag ``tag`` (running or done)."""
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    return len(tracker.getJobIdsForTag(tag))


def avro_schema(spark: SparkSession, definition: str) -> Any:
    """Avro's Java ``Schema`` parsed from its JSON ``definition``."""
    return java_class(spark, "org.apache.avro.Schema").Parser().parse(definition)


def avro_compatibility(spark: SparkSession, reader: Any, writer: Any) -> Any:
    """Avro's ``SchemaCompatibility`` result of reading ``writer``'s data with ``reader``."""
    compatibility = java_class(spark, "org.apache.avro.SchemaCompatibility")
    check = compatibility.checkReaderWriterCompatibility
    return check(reader, writer).getResult()


def spark_type_of_avro(spark: SparkSession, avro_type: Any) -> T.DataType:
    """Spark's own reading of an Avro type: the type ``from_avro`` would produce."""
    parsed = avro_schema(spark, json.dumps(avro_type))
    converters = java_class(spark, "org.apache.spark.sql.avro.SchemaConverters")
    sql_type = converters.toSqlType(parsed)
    return T._parse_datatype_json_string(sql_type.dataType().json())


def avro_schema_of_spark_type(spark: SparkSession, data_type: T.StructType) -> str:
    """The Avro schema (JSON) ``to_avro`` writes a non-null struct of ``data_type`` with.

    ``from_avro`` with it reads the same struct back (its top-level fields nullable).
    """
    java_type = java_class(spark, "org.apache.spark.sql.types.DataType").fromJson(data_type.json())
    converters = java_class(spark, "org.apache.spark.sql.avro.SchemaConverters")
    return str(converters.toAvroType(java_type, False, "row", "cdc").toString())


def delta_version(spark: SparkSession, path: str) -> int:
    """The version of the Delta table at ``path`` this JVM last loaded or committed.

    Up to date after this process's own commit to it (Delta moves its log's snapshot to
    the version it committed); no Spark job.
    """
    delta_log = java_class(spark, "org.apache.spark.sql.delta.DeltaLog")
    return int(delta_log.forTable(spark._jsparkSession, path).unsafeVolatileSnapshot().version())


def delete_tree(spark: SparkSession, path: str) -> None:
    """Delete the folder (or file) ``path`` and everything under it, if it is there."""
    fs, folder = hadoop_path(spark, path)
    if fs.exists(folder):
        fs.delete(folder, True)


def delta_transaction_version(spark: SparkSession, path: str, app_id: str) -> int | None:
    """The version ``app_id`` last wrote to the Delta table at ``path`` (its ``txnVersion``).

    From the table's newest snapshot (brought up to date); None when it never wrote it.
    """
    recorded = _newest_snapshot(spark, path).transactions().get(app_id)
    return int(recorded.get()) if recorded.isDefined() else None
