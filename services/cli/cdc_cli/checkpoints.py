"""Reading what the services leave under the storage root: stream checkpoints and table versions.

Both ``cdc status`` and ``cdc maintenance`` need to know how far each stream got. A
Structured Streaming checkpoint records, per micro-batch ``n``, the end offsets of its
sources in ``offsets/<n>`` and marks the batch done with ``commits/<n>``; the offsets of the
last committed batch are where the stream resumes; telling whether a Delta source read
the version its offset names to the end can take one commit file of the table's log
(:func:`delta_position`). Files are read through Spark's Hadoop FileSystem, so the same
code serves a local storage root and object storage.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cdc_shared.jvm_bridge import hadoop_path, read_text, read_text_if_exists
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

# Delta's END_INDEX (Long.MaxValue - 100) marks "every file of this version was read".
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


def delta_position(
    offset: Any, files_in_version: Callable[[int], int | None] | None = None
) -> DeltaPosition:
    """The position of a Delta source from its checkpointed offset.

    ``reservoirVersion`` is the version in progress and ``index`` the last of its file
    actions read, counted from 0 in log order over the actions the stream reads (see
    :func:`indexed_file_count`); a negative index means none of them yet. A batch that
    reads a version to its end usually leaves the next version with index -1, but a Change
    Data Feed stream that read a version's ``cdc`` actions stays at that version with the
    index of the last one. So an index at the version's last file action also means the
    version was read to its end: ``files_in_version(version)``, asked only for an index
    that points at a file, tells how many file actions the stream indexes in the version
    (None when unknown). Without it, or when unknown, the version counts as not read
    completely, the cautious answer. An index at Delta's END_INDEX means read to the end.

    While the stream reads the table's snapshot (``isStartingVersion``) the index counts
    the snapshot's files, which are not counted here: the version counts as being read.
    """
    if not isinstance(offset, dict) or "reservoirVersion" not in offset:
        raise ValueError(f"not a Delta source offset: {offset!r}")
    version = int(offset["reservoirVersion"])
    index = int(offset.get("index", -1))
    snapshot = bool(offset.get("isStartingVersion", False))
    if index >= _END_INDEX_THRESHOLD:
        return DeltaPosition(version + 1, False)
    if not snapshot and index >= 0 and files_in_version is not None:
        files = files_in_version(version)
        if files is not None and 0 < files <= index + 1:
            return DeltaPosition(version + 1, False)
    return DeltaPosition(version, snapshot)


def indexed_file_count(commit: str, change_feed: bool) -> int:
    """How many file actions a Delta stream indexes in one commit (its log JSON).

    A stream of the Change Data Feed (``readChangeFeed``) reads a commit's ``cdc`` actions
    when it has any, else its ``add`` and ``remove`` actions that change data; a plain
    stream reads its ``add`` actions that change data.
    """
    actions = [json.loads(line) for line in commit.splitlines() if line.strip()]
    if change_feed:
        cdc = sum(1 for action in actions if "cdc" in action)
        if cdc:
            return cdc
    kinds = ("add", "remove") if change_feed else ("add",)
    return sum(
        1
        for action in actions
        for kind in kinds
        if kind in action and action[kind].get("dataChange", True)
    )


def commit_file_counter(
    spark: SparkSession, path: str, change_feed: bool
) -> Callable[[int], int | None]:
    """``files_in_version`` for :func:`delta_position` on the Delta table at ``path``.

    Each call reads one commit file of the table's log; None when that file is gone.
    """

    def files_in_version(version: int) -> int | None:
        commit = read_text_if_exists(spark, f"{path.rstrip('/')}/_delta_log/{version:020d}.json")
        return None if commit is None else indexed_file_count(commit, change_feed)

    return files_in_version


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
