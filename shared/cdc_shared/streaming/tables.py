"""Delta tables as the services write them: creation, idempotent writes, retries.

Every table is created on first start with an explicit schema and properties. Appends
from ``foreachBatch`` carry ``txnAppId``/``txnVersion``, so a replayed micro-batch (a crash
after the Delta commit, before the checkpoint commit) writes nothing twice. A write
that loses a commit race with another writer of the table is retried (``on_conflict_retry``).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from delta.exceptions import (
    ConcurrentAppendException,
    ConcurrentDeleteDeleteException,
    ConcurrentDeleteReadException,
    ConcurrentTransactionException,
    ConcurrentWriteException,
    DeltaConcurrentModificationException,
    MetadataChangedException,
)
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_shared.clients.retry import retrying
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.quarantine import QUARANTINED_RECORD
from cdc_shared.contracts.silver import DELETED_AT
from cdc_shared.jvm.bridge import delta_table_files, hadoop_path
from cdc_shared.jvm.driver_frames import frame_from_rows


def not_quarantined_yet(spark: SparkSession, rows: DataFrame, quarantine_path: str) -> DataFrame:
    """``rows`` (quarantine rows) less the records the quarantine holds already.

    A batch read again under a new checkpoint quarantines its records again under a new
    ``txnAppId``, which the idempotent append cannot recognise; so each record is
    quarantined once, whatever reads it. Rows without Kafka coordinates are all new.
    Read only when a batch rejects records.
    """
    held = spark.read.format("delta").load(quarantine_path).select(*QUARANTINED_RECORD)
    new = rows.join(held, on=list(QUARANTINED_RECORD), how="left_anti")
    return new.select(*rows.columns)  # the join puts its columns first


#: Compact small files after a commit once enough have gathered (thresholds: the
#: ``spark.databricks.delta.autoCompact.*`` settings in ``cdc_shared.jvm.spark``), so a table
#: written every few seconds does not fragment between ``cdc maintenance`` runs.
AUTO_COMPACT = {"delta.autoOptimize.autoCompact": "true"}

#: Properties that only tune a table (no protocol change): set on tables made before.
TUNING_PROPERTIES = ("delta.autoOptimize.autoCompact", "delta.checkpointInterval")


def ensure_table(
    spark: SparkSession,
    path: str,
    schema: T.StructType,
    properties: Mapping[str, str],
    partition_by: list[str] | None = None,
) -> None:
    """Create the Delta table at ``path`` unless it exists (explicit schema and properties).

    A table that exists gets the tuning properties it lacks (``TUNING_PROPERTIES``).
    What a creation killed before its first commit left behind is cleared first.
    """
    clear_interrupted_creation(spark, path)
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
    for key, value in properties.items():
        builder = builder.property(key, value)
    if partition_by:
        builder = builder.partitionedBy(*partition_by)
    builder.execute()
    tuning = {k: v for k, v in properties.items() if k in TUNING_PROPERTIES}
    if tuning:
        have = table_properties(spark, path)
        missing = {k: v for k, v in tuning.items() if have.get(k) != v}
        if missing:
            settings = ", ".join(f"'{k}' = '{v}'" for k, v in missing.items())
            spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({settings})")


def table_properties(spark: SparkSession, path: str) -> dict[str, str]:
    """The properties of the Delta table at ``path`` (its metadata's, protocol features too).

    Read from the table's snapshot by ``SHOW TBLPROPERTIES``; ``DeltaTable.detail()``
    would also size the table with a Spark job over its files, 30x the time, once per
    table at every start (docs/benchmarks.md).
    """
    rows = spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()
    return {str(row["key"]): str(row["value"]) for row in rows}


def holds_no_rows(spark: SparkSession, path: str) -> bool:
    """Whether the Delta table at ``path`` holds no data file at its newest version.

    Read from the snapshot's checksum (``delta_table_files``): no Spark job, where
    reading an empty table to find nothing in it runs one. A table's first write skips
    what an empty table cannot hold this way (a first start does it for every table).
    """
    return delta_table_files(spark, path) == 0


def idempotent_append(
    frame: DataFrame, path: str, app_id: str, batch_id: int, *, merge_schema: bool = False
) -> None:
    """Append ``frame`` unless this (app id, batch id) already committed to the table."""
    writer = (
        frame.write.format("delta")
        .mode("append")
        .option("txnAppId", app_id)
        .option("txnVersion", batch_id)
    )
    if merge_schema:
        writer = writer.option("mergeSchema", "true")
    writer.save(path)


#: What a write records of how far its table has been written, atomically with it
#: (Delta's idempotent writes): the writer's app id and the source position it reached.
Progress = tuple[str, int]
#: Delta's session settings that make a DML command (MERGE) an idempotent write.
TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"


@contextmanager
def idempotent_dml(spark: SparkSession, progress: Progress | None) -> Iterator[None]:
    """Inside the block, a Delta DML command in ``spark`` records ``progress`` (or is skipped).

    Delta skips a write whose (app id, version) the table holds already, and records it
    with the commit otherwise. The settings belong to the session: each writer that runs
    beside another has a session of its own (``TableQueue``).
    """
    if progress is None:
        yield
        return
    spark.conf.set(TXN_APP_ID, progress[0])
    spark.conf.set(TXN_VERSION, str(progress[1]))
    try:
        yield
    finally:
        spark.conf.unset(TXN_APP_ID)
        spark.conf.unset(TXN_VERSION)


def app_id(service: str, entity: str, query_id: str) -> str:
    """The ``txnAppId`` of a service's stream: new with every new checkpoint (query id)."""
    return f"cdc-{service}-{entity}-{query_id}"


class SourceTableMissingError(ConfigError):
    """A service's source table does not exist (yet): its upstream service makes it."""


def wait_for_table(
    spark: SparkSession, path: str, wait_s: float, hint: str, log: logging.Logger
) -> None:
    """Wait until ``path`` is a Delta table (its writer creates it).

    SourceTableMissingError on timeout; ``hint`` tells the operator what creates the
    table (e.g. "start the merger").
    """
    deadline = time.monotonic() + wait_s
    next_log = 0.0
    while not has_commits(spark, path):
        now = time.monotonic()
        if now >= deadline:
            raise SourceTableMissingError(f"{path} is not a Delta table yet: {hint}")
        if now >= next_log:
            log.info("waiting for table", extra={"path": path})
            next_log = now + 30
        time.sleep(1)  # a look is a file listing: cheap enough to start soon after its writer


def has_commits(spark: SparkSession, path: str) -> bool:
    """Whether a Delta log with at least one commit exists at ``path`` (any file system).

    Asks the file system, not Delta: Delta caches what it found at a path, so a table
    created after the first look would stay invisible to ``DeltaTable.isDeltaTable``.
    """
    fs, log_dir = _delta_log(spark, path)
    return fs.exists(log_dir) and _holds_commits(fs, log_dir)


def clear_interrupted_creation(spark: SparkSession, path: str) -> None:
    """Remove a ``_delta_log`` that holds no commit: the remains of a killed creation.

    Delta makes the log folder (and ``_staged_commits``) before it writes commit 0; a
    process killed in between leaves a folder that makes every later create fail with
    DELTA_TABLE_NOT_FOUND. Without a commit there is no table, so nothing is lost.
    """
    fs, log_dir = _delta_log(spark, path)
    if fs.exists(log_dir) and not _holds_commits(fs, log_dir):
        logging.getLogger(__name__).warning(
            "removing an uncommitted Delta log left by an interrupted table creation",
            extra={"path": path},
        )
        fs.delete(log_dir, True)


def _delta_log(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """The Hadoop file system and path of the table's ``_delta_log`` folder."""
    return hadoop_path(spark, f"{path.rstrip('/')}/_delta_log")


def _holds_commits(fs: Any, log_dir: Any) -> bool:
    """Whether the log folder has a commit file or a checkpoint (a table's state)."""
    names = (str(status.getPath().getName()) for status in fs.listStatus(log_dir))
    return any(name.endswith(".json") or ".checkpoint." in name for name in names)


#: A commit that lost a race with another writer of the same table (e.g. the merger's
#: MERGE and ``cdc maintenance``'s OPTIMIZE): a write that is idempotent is simply retried.
CONFLICTS = (
    DeltaConcurrentModificationException,
    ConcurrentAppendException,
    ConcurrentDeleteReadException,
    ConcurrentDeleteDeleteException,
    ConcurrentTransactionException,
    ConcurrentWriteException,
    MetadataChangedException,
)

_T = TypeVar("_T")
_P = ParamSpec("_P")


def on_conflict_retry(write: Callable[_P, _T]) -> Callable[_P, _T]:
    """Retry an idempotent table write that lost a commit race (up to 6 attempts).

    Each retry is logged as a warning by the write's own module logger.
    """
    policy = retrying(
        lambda error: isinstance(error, CONFLICTS),
        initial_s=0.5,
        max_s=10,
        attempts=6,
        log=logging.getLogger(write.__module__),
        describe=lambda error, attempt: (
            f"write conflict on {write.__name__} ({type(error).__name__}); "
            f"retrying, attempt {attempt}"
        ),
    )
    return policy.wraps(write)


@on_conflict_retry
def record_progress(spark: SparkSession, path: str, progress: Progress) -> None:
    """A commit of nothing but ``progress`` to the Delta table at ``path``.

    For a batch that changes nothing in the table: its progress must still be known.
    """
    schema = spark.read.format("delta").load(path).schema
    idempotent_append(frame_from_rows(spark, [], schema), path, *progress)


@on_conflict_retry
def expire_tombstones(spark: SparkSession, tombstone_path: str, older_than: dt.datetime) -> int:
    """Delete the tombstones recorded before ``older_than``; returns how many went.

    The merger ages its tombstones by this, and so does ``cdc maintenance``.
    """
    table = DeltaTable.forPath(spark, tombstone_path)
    expired = F.col(DELETED_AT) < F.lit(older_than)
    count = table.toDF().where(expired).count()
    if count:
        table.delete(expired)
    return count
