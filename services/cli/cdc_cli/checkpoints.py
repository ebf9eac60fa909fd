"""Reading what the services leave under the storage root: stream checkpoints and table versions.

Both ``cdc status`` and ``cdc maintenance`` need to know how far each stream got. A
Structured Streaming checkpoint records, per micro-batch ``n``, the end offsets of its
sources in ``offsets/<n>`` and marks the batch done with ``commits/<n>``; the offsets of the
last committed batch are where the stream resumes (read by
:mod:`cdc_shared.stream_checkpoint`, which the ingestor shares); telling whether a Delta source read
the version its offset names to the end can take one commit file of the table's log
(:func:`delta_position`).

Files and tables are read through a :class:`StateReader`, so the same rules serve two
ways of reading, each for a local storage root and object storage alike:
:class:`SparkState`, through Spark's Hadoop FileSystem and Delta Lake (the services' own
view, for commands that hold a session anyway), and
:class:`cdc_cli.delta_log.DeltaLogState`, without a JVM (delta-rs and plain file reads),
for read-only commands that must answer in a second. The functions that take a
SparkSession instead of a reader read through :class:`SparkState`. Nothing here imports
PySpark until a Spark reader is used: importing it alone costs a read-only command a
noticeable part of its time.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cdc_shared.stream_checkpoint import CommittedBatch, HadoopFiles
from cdc_shared.stream_checkpoint import last_committed_batch as read_last_committed_batch

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Delta's END_INDEX (Long.MaxValue - 100) marks "every file of this version was read".
_END_INDEX_THRESHOLD = 1 << 62


@runtime_checkable
class StateReader(Protocol):
    """Read access to the files and Delta tables under a storage root (paths as configured)."""

    def list_names(self, path: str) -> list[str] | None:
        """Names of the entries in the folder ``path``; None when it does not exist."""
        ...

    def read_text_if_exists(self, path: str) -> str | None:
        """The file ``path`` as UTF-8 text; None when there is no such file."""
        ...

    def table_version(self, path: str) -> int | None:
        """The latest version of the Delta table at ``path``; None when there is no table."""
        ...

    def history(self, path: str, since: int = 0) -> dict[int, Commit]:
        """The versions at or after ``since`` still in the history of the table at ``path``.

        The table must exist (see :meth:`table_version`).
        """
        ...

    def count_by(self, path: str, column: str) -> dict[str, int] | None:
        """Rows per value of ``column`` in the table at ``path``; None when there is no table."""
        ...


def state_reader(source: StateReader | SparkSession) -> StateReader:
    """``source`` itself when it is a reader, else a :class:`SparkState` on the session."""
    return source if isinstance(source, StateReader) else SparkState(source)


def list_names(source: StateReader | SparkSession, path: str) -> list[str] | None:
    """Names of the entries in the folder ``path``; None when it does not exist."""
    return state_reader(source).list_names(path)


def last_committed_batch(
    source: StateReader | SparkSession, checkpoint: str
) -> CommittedBatch | None:
    """The last committed batch of the stream checkpointed at ``checkpoint``; None if none.

    (:func:`cdc_shared.stream_checkpoint.last_committed_batch`, through either reader.)
    """
    return read_last_committed_batch(state_reader(source), checkpoint)


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
    source: StateReader | SparkSession, path: str, change_feed: bool
) -> Callable[[int], int | None]:
    """``files_in_version`` for :func:`delta_position` on the Delta table at ``path``.

    Each call reads one commit file of the table's log; None when that file is gone.
    """
    reader = state_reader(source)

    def files_in_version(version: int) -> int | None:
        commit = reader.read_text_if_exists(f"{path.rstrip('/')}/_delta_log/{version:020d}.json")
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


def data_commits_from(history: dict[int, Commit], version: int) -> list[Commit]:
    """The commits at or after ``version`` that a stream reads data from, oldest first."""
    return [history[v] for v in sorted(history) if v >= version and history[v].changes_data]


def is_delta_table(spark: SparkSession, path: str) -> bool:
    """Whether ``path`` holds a Delta table."""
    from delta.tables import DeltaTable

    return bool(DeltaTable.isDeltaTable(spark, path))


def table_version(spark: SparkSession, path: str) -> int | None:
    """The latest version of the Delta table at ``path``; None when there is no table."""
    return SparkState(spark).table_version(path)


def as_utc(value: dt.datetime) -> dt.datetime:
    """A timestamp from Spark as an aware UTC datetime.

    PySpark's ``collect`` returns naive datetimes in the Python process's local time zone,
    which ``astimezone`` assumes for naive values.
    """
    return value.astimezone(dt.UTC)


class SparkState(HadoopFiles):
    """A :class:`StateReader` through a SparkSession: Hadoop's file systems and Delta Lake.

    Timestamps are those of Delta Lake's history: the commit file's modification time,
    unless the table has in-commit timestamps.
    """

    def table_version(self, path: str) -> int | None:
        """The latest version of the Delta table at ``path``; None when there is no table."""
        from delta.tables import DeltaTable

        if not is_delta_table(self.spark, path):
            return None
        row = DeltaTable.forPath(self.spark, path).history(1).select("version").head()
        return None if row is None else int(row["version"])

    def history(self, path: str, since: int = 0) -> dict[int, Commit]:
        """The versions at or after ``since`` still in the history of the table at ``path``."""
        from delta.tables import DeltaTable

        rows = (
            DeltaTable.forPath(self.spark, path)
            .history()
            .where(f"version >= {int(since)}")
            .select("version", "timestamp", "operation")
            .collect()
        )
        return {
            int(r["version"]): Commit(
                int(r["version"]), as_utc(r["timestamp"]), str(r["operation"])
            )
            for r in rows
        }

    def count_by(self, path: str, column: str) -> dict[str, int] | None:
        """Rows per value of ``column`` in the table at ``path``; None when there is no table."""
        if not is_delta_table(self.spark, path):
            return None
        rows = self.spark.read.format("delta").load(path).groupBy(column).count().collect()
        return {str(r[column]): int(r["count"]) for r in rows}
