"""Reading what the services leave under the storage root: stream checkpoints and table versions.

Both ``cdc status`` and ``cdc maintenance`` need to know how far each stream got. A
Structured Streaming checkpoint records, per micro-batch ``n``, the end offsets of its
sources in ``offsets/<n>`` and marks the batch done with ``commits/<n>``; the offsets of the
last committed batch are where the stream resumes. Files are read through Spark's Hadoop
FileSystem, so the same code serves a local storage root and object storage.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from cdc_shared.jvm_bridge import hadoop_path, read_text
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

# Delta marks "every file of this version was read" with an index at or near Long.MaxValue.
_END_INDEX_THRESHOLD = 1 << 62


@dataclass(frozen=True)
class CommittedBatch:
    """The last micro-batch a stream committed, and its sources' end offsets (parsed JSON)."""

    batch_id: int
    sources: tuple[Any, ...]


def list_names(spark: SparkSession, path: str) -> list[str] | None:
    """Names of the entries in the folder ``path``; None when it does not exist."""
    fs, folder = hadoop_path(spark, path)
    if not fs.exists(folder):
        return None
    return [str(status.getPath().getName()) for status in fs.listStatus(folder)]


def last_committed_batch(spark: SparkSession, checkpoint: str) -> CommittedBatch | None:
    """The last committed batch of the stream checkpointed at ``checkpoint``; None if none.

    A batch planned but not committed (``offsets/<n>`` without ``commits/<n>``) is run again
    from the previous batch's end on restart, so it is ignored here.
    """
    commits = list_names(spark, f"{checkpoint.rstrip('/')}/commits")
    done = [int(name) for name in commits or [] if name.isdigit()]
    if not done:
        return None
    batch_id = max(done)
    text = read_text(spark, f"{checkpoint.rstrip('/')}/offsets/{batch_id}")
    lines = text.splitlines()
    # Line 1 is the format version, line 2 the batch metadata, then one line per source.
    sources = tuple(None if line.strip() == "-" else json.loads(line) for line in lines[2:])
    return CommittedBatch(batch_id, sources)


@dataclass(frozen=True)
class DeltaPosition:
    """Where a Delta source stands: the first version it has not read completely.

    ``snapshot`` is true while it is still reading the table's snapshot at that version
    (a first start without a starting version), rather than the version's own changes.
    """

    next_version: int
    snapshot: bool


def delta_position(offset: Any) -> DeltaPosition:
    """The position of a Delta source from its checkpointed offset.

    ``reservoirVersion`` is the version in progress: with ``index`` -1 none of its files
    were read, with a file index some were (so the version is still needed); an end index
    means the version was read to its end.
    """
    if not isinstance(offset, dict) or "reservoirVersion" not in offset:
        raise ValueError(f"not a Delta source offset: {offset!r}")
    version = int(offset["reservoirVersion"])
    index = int(offset.get("index", -1))
    snapshot = bool(offset.get("isStartingVersion", False))
    if index >= _END_INDEX_THRESHOLD:
        return DeltaPosition(version + 1, False)
    return DeltaPosition(version, snapshot)


@dataclass(frozen=True)
class Commit:
    """One version of a Delta table: when it was committed and by what operation."""

    version: int
    timestamp: dt.datetime
    operation: str

    @property
    def changes_data(self) -> bool:
        """Whether streams read anything from it (OPTIMIZE, VACUUM... add no data)."""
        return self.operation not in NO_DATA_OPERATIONS


#: Operations whose commits a Delta stream skips: they add no data (``dataChange=false``)
#: or only change metadata.
NO_DATA_OPERATIONS = frozenset(
    {
        "OPTIMIZE",
        "VACUUM START",
        "VACUUM END",
        "SET TBLPROPERTIES",
        "UNSET TBLPROPERTIES",
        "UPGRADE PROTOCOL",
        "CREATE TABLE",
    }
)


def table_history(spark: SparkSession, path: str) -> dict[int, Commit]:
    """Every version still in the history of the Delta table at ``path``."""
    rows = (
        DeltaTable.forPath(spark, path)
        .history()
        .select("version", "timestamp", "operation")
        .collect()
    )
    return {
        int(r["version"]): Commit(int(r["version"]), as_utc(r["timestamp"]), str(r["operation"]))
        for r in rows
    }


def data_commits_from(history: dict[int, Commit], version: int) -> list[Commit]:
    """The commits at or after ``version`` that a stream reads data from, oldest first."""
    return [history[v] for v in sorted(history) if v >= version and history[v].changes_data]


def is_delta_table(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` holds a Delta table."""
    return bool(DeltaTable.isDeltaTable(spark, path))


def table_version(spark: SparkSession, path: str) -> int | None:
    """The latest version of the Delta table at ``path``; None when there is no table."""
    if not is_delta_table(spark, path):
        return None
    row = DeltaTable.forPath(spark, path).history(1).select("version").head()
    return None if row is None else int(row["version"])


def as_utc(value: dt.datetime) -> dt.datetime:
    """A timestamp from Spark as an aware UTC datetime.

    PySpark's ``collect`` returns naive datetimes in the Python process's local time zone,
    which ``astimezone`` assumes for naive values.
    """
    return value.astimezone(dt.UTC)
