"""Reading what the services leave under the storage root: table logs, progress, checkpoints.

Both ``cdc status`` and ``cdc maintenance`` need to know how far each service got with
each table. The services keep that in their targets' own logs (``docs/design.md``, "The
runtime"):

- the ingestor records, in each bronze commit's ``userMetadata``, how far each topic of
  its group is written (``cdc_ingestor.positions``); its group's stream checkpoint
  (``_streams/ingestor/<group>``) says where the Kafka source stands;
- the merger records, in each silver commit, the bronze version the table is merged
  through (Delta's idempotent-write ``txn``, app id :data:`MERGER_PROGRESS_APP`);
- the publishers keep theirs in their targets (read by :mod:`cdc_cli.status`).

Which bronze versions hold a table's rows, how many, and what the ingestor recorded is
read from bronze's commit files (:class:`DeltaLog`): the same bytes whichever reader
reads them, and no data file. A stream checkpoint's last committed batch is read by
:mod:`cdc_shared.contracts.stream_checkpoint`, which the services share.

Files and tables are read through a :class:`StateReader`, so the same rules serve two
ways of reading, each for a local storage root and object storage alike:
:class:`cdc_cli.delta_log.DeltaLogState`, without a JVM (delta-rs and plain file reads),
for read-only commands that must answer in a second, and
:class:`cdc_cli.spark_state.SparkState`, through Spark's Hadoop FileSystem and Delta Lake
(the services' own view, for commands that hold a session anyway). Nothing here imports
PySpark (:mod:`cdc_cli.table_state` chooses the reader).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import ENTITY_COLUMN, INGESTOR_COMMIT_KEY, POSITIONS_COMMITS_READ
from cdc_shared.contracts.stream_checkpoint import (
    last_committed_batch,
    parse_offsets,
    planned_batches,
)

#: Commit files read side by side: each read mostly waits on storage.
_READ_THREADS = 8
_READ_AHEAD = 64
#: A checkpoint a group's query moved aside to start on a new one (``move_aside``).
_ASIDE = re.compile(r"\.\d{8}T\d{6}(-\d+)?$")

#: The one bronze table, as the commands name it.
BRONZE = "bronze"
#: Offsets by topic, then partition (as Spark's Kafka source writes them): the next one.
Offsets = dict[str, dict[str, int]]


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

    def transaction_version(self, path: str, app_id: str) -> int | None:
        """The version ``app_id`` last recorded in the table at ``path`` (Delta's ``txn``).

        None when it never wrote the table; the table must exist.
        """
        ...


def streams_folder(config: PipelineConfig, service: str) -> str:
    """``<root>/_streams/<service>``: where a service's group checkpoints are."""
    return config.layout.checkpoint(service, "_").rsplit("/", 1)[0]


def group_checkpoints(reader: StateReader, streams: str, first: str | None = None) -> list[str]:
    """The group checkpoints of one service (``<root>/_streams/<service>``), ``first`` first.

    ``first`` is the group the configuration gives a table (listed even when it has no
    checkpoint yet); the others (ad-hoc groups of ``--entity``, groups renamed since, the
    merger's drains of earlier releases' tables) follow. Checkpoints moved aside are left
    out.
    """
    names = [
        name
        for name in reader.list_names(streams) or []
        if not name.startswith(".") and not name.endswith(".json") and not _ASIDE.search(name)
    ]
    ordered = ([first] if first else []) + sorted(n for n in names if n != first)
    return [f"{streams.rstrip('/')}/{name}" for name in ordered]


def kafka_ends(
    reader: StateReader, checkpoint: str, topic: str, planned: bool = False
) -> tuple[int, dict[str, int]] | None:
    """Where the Kafka source of a checkpoint stands in ``topic``: (batch id, offsets).

    The last committed batch's end offsets (where the query resumes), or with ``planned``
    the last planned batch's (the furthest its writes may have reached). None when the
    checkpoint has no such batch, or its source does not read ``topic``.
    """
    if planned:
        batches = planned_batches(reader, checkpoint)
        if not batches:
            return None
        text = reader.read_text_if_exists(f"{checkpoint.rstrip('/')}/offsets/{batches[-1]}")
        sources = parse_offsets(text) if text else ()
        batch_id = batches[-1]
    else:
        batch = last_committed_batch(reader, checkpoint)
        if batch is None:
            return None
        sources, batch_id = batch.sources, batch.batch_id
    ends = sources[0] if sources and isinstance(sources[0], dict) else {}
    offsets = ends.get(topic)
    if not isinstance(offsets, dict):
        return None
    return batch_id, {str(p): int(o) for p, o in offsets.items()}


def indexed_file_count(commit: str, change_feed: bool) -> int:
    """How many file actions a Delta stream indexes in one commit (its log JSON).

    A reader of the Change Data Feed (``readChangeFeed``) reads a commit's ``cdc`` actions
    when it has any, else its ``add`` and ``remove`` actions that change data; a plain
    reader its ``add`` actions that change data. A commit where this is 0 holds no change
    for either (an OPTIMIZE, a MERGE that matched nothing, a metadata change).
    """
    return _indexed([json.loads(line) for line in commit.splitlines() if line.strip()], change_feed)


def _indexed(actions: list[dict[str, Any]], change_feed: bool) -> int:
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


# --- one table's log, commit by commit ------------------------------------------------------


@dataclass(frozen=True)
class IngestorRecord:
    """What the ingestor recorded with a bronze commit: its group, positions, held tables."""

    group: str
    positions: Offsets
    held: dict[str, str]  # entity -> why


@dataclass(frozen=True)
class LogCommit:
    """What one commit file of a Delta table says (its actions, not its data files)."""

    version: int
    timestamp: dt.datetime  # the commit's own (``commitInfo``; in-commit timestamp if any)
    operation: str
    change_feed_files: int  # what a reader of the Change Data Feed reads in it
    #: Rows added (``dataChange``) per value of the ``entity`` partition column; None for
    #: an entity when a file of it has no row count in its statistics.
    entity_rows: dict[str, int | None]
    ingestor: IngestorRecord | None


def parse_commit(version: int, text: str) -> LogCommit:
    """One commit file (its JSON lines) as a :class:`LogCommit`."""
    actions = [json.loads(line) for line in text.splitlines() if line.strip()]
    info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
    millis = int(info.get("inCommitTimestamp") or info.get("timestamp") or 0)
    rows: dict[str, int | None] = {}
    # A DELETE's adds (retention's, in bronze) are the rows it kept, rewritten: not new.
    added_rows = [] if info.get("operation") == "DELETE" else actions
    for action in added_rows:
        add = action.get("add")
        if add is None or not add.get("dataChange", True):
            continue
        entity = (add.get("partitionValues") or {}).get(ENTITY_COLUMN)
        if entity is None:
            continue
        added = _row_count(add.get("stats"))
        before = rows.get(entity, 0)
        rows[entity] = None if added is None or before is None else before + added
    return LogCommit(
        version,
        dt.datetime.fromtimestamp(millis / 1000, dt.UTC),
        str(info.get("operation")),
        _indexed(actions, change_feed=True),
        rows,
        _ingestor_record(info.get("userMetadata")),
    )


def _row_count(stats: Any) -> int | None:
    """``numRecords`` of an ``add`` action's statistics (a JSON string), if there."""
    if not isinstance(stats, str):
        return None
    try:
        count = json.loads(stats).get("numRecords")
    except (ValueError, AttributeError):
        return None
    return None if count is None else int(count)


def _ingestor_record(metadata: Any) -> IngestorRecord | None:
    """The ingestor's record in a commit's ``userMetadata`` (``cdc_ingestor.positions``)."""
    if not isinstance(metadata, str):
        return None
    try:
        record = json.loads(metadata).get(INGESTOR_COMMIT_KEY)
    except (ValueError, AttributeError):
        return None
    if not isinstance(record, dict):
        return None
    positions = {
        str(topic): {str(p): int(o) for p, o in offsets.items()}
        for topic, offsets in (record.get("positions") or {}).items()
    }
    held = {str(e): str(why) for e, why in (record.get("held") or {}).items()}
    return IngestorRecord(str(record.get("group")), positions, held)


class DeltaLog:
    """One Delta table's commits, read from its log's commit files and kept once read.

    Both readers read the same files, so both tell the same. A commit file the log no
    longer holds (cleaned up after ``delta.logRetentionDuration``) reads as None.
    """

    def __init__(self, reader: StateReader, path: str) -> None:
        self.reader = reader
        self.path = path.rstrip("/")
        self.latest = reader.table_version(path)  # None: no table
        self._commits: dict[int, LogCommit | None] = {}

    def commit(self, version: int) -> LogCommit | None:
        """Version ``version``'s commit; None when its file is gone."""
        if version not in self._commits:
            text = self.reader.read_text_if_exists(f"{self.path}/_delta_log/{version:020d}.json")
            self._commits[version] = None if text is None else parse_commit(version, text)
        return self._commits[version]

    def read(self, versions: list[int]) -> None:
        """Read the commits of ``versions`` not read yet, side by side."""
        missing = [v for v in versions if v not in self._commits]
        if len(missing) < 2:
            for version in missing:
                self.commit(version)
            return
        with ThreadPoolExecutor(min(_READ_THREADS, len(missing))) as pool:
            list(pool.map(self.commit, missing))

    def newest_first(self, start: int, stop: int) -> Iterator[tuple[int, LogCommit | None]]:
        """The commits from version ``start`` down to ``stop`` (both included), newest first.

        Read ahead a few dozen at a time, so a caller that stops early reads little more.
        """
        version = start
        while version >= max(stop, 0):
            chunk = list(range(version, max(version - _READ_AHEAD, stop - 1, -1), -1))
            self.read(chunk)
            for each in chunk:
                yield each, self._commits[each]
            version = chunk[-1] - 1


# --- the ingestor's positions, the merger's progress ----------------------------------------


@dataclass(frozen=True)
class TopicPosition:
    """How far a topic is written to bronze, as the newest bronze commit naming it says."""

    version: int
    group: str
    offsets: dict[str, int]
    held: str | None  # why the topic's table is held, when it is


def recorded_positions(
    bronze: DeltaLog, topics: Mapping[str, str], limit: int = POSITIONS_COMMITS_READ
) -> dict[str, TopicPosition]:
    """Each topic's position in the newest of bronze's latest ``limit`` commits naming it.

    ``topics``: topic -> the entity it feeds (the ingestor records held tables by entity).
    A topic no commit among them names is absent.
    """
    found: dict[str, TopicPosition] = {}
    if bronze.latest is None:
        return found
    for version, commit in bronze.newest_first(bronze.latest, bronze.latest - limit + 1):
        record = None if commit is None else commit.ingestor
        if record is None:
            continue
        for topic, offsets in record.positions.items():
            if topic in topics and topic not in found:
                held = record.held.get(topics[topic])
                found[topic] = TopicPosition(version, record.group, offsets, held)
        if len(found) == len(topics):
            break
    return found


def position_at(
    bronze: DeltaLog, topic: str, version: int, limit: int = POSITIONS_COMMITS_READ
) -> dict[str, int] | None:
    """Where ``topic`` stood in bronze at ``version``: the newest commit up to it naming it.

    Empty when bronze's log from its creation to ``version`` names it nowhere (nothing of
    it written yet); None when that cannot be told within ``limit`` commits.
    """
    for each, commit in bronze.newest_first(version, version - limit + 1):
        if commit is None:
            return None
        if commit.ingestor is not None and topic in commit.ingestor.positions:
            return commit.ingestor.positions[topic]
        if each == 0:
            return {}
    return None


def within(offsets: Mapping[str, int], bound: Mapping[str, int]) -> bool:
    """Whether every partition's offset is at or below ``bound``'s (absent: 0)."""
    return all(int(offset) <= int(bound.get(p, 0)) for p, offset in offsets.items())


@dataclass(frozen=True)
class Backlog:
    """A table's bronze versions after its merger progress that hold rows of it."""

    entity: str
    versions: tuple[LogCommit, ...] = ()  # oldest first
    unreadable: tuple[int, ...] = ()  # versions whose commit file is gone: may hold rows

    @property
    def count(self) -> int:
        """Versions the merger still has to read for the table (an unreadable one counts)."""
        return len(self.versions) + len(self.unreadable)

    @property
    def rows(self) -> int | None:
        """The table's rows in them; None when a commit's statistics do not tell."""
        counts = [commit.entity_rows[self.entity] for commit in self.versions]
        if self.unreadable or any(count is None for count in counts):
            return None
        return sum(count or 0 for count in counts)

    @property
    def oldest(self) -> int | None:
        """The oldest version the merger still needs; None when caught up."""
        versions = [c.version for c in self.versions] + list(self.unreadable)
        return min(versions, default=None)


def merger_backlog(
    bronze: DeltaLog,
    entity: str,
    topic: str,
    progress: int,
    ingested: Mapping[str, int] | None,
) -> Backlog:
    """The bronze versions after ``progress`` holding rows of ``entity`` (its ``topic``).

    ``ingested``: the furthest the ingestor may have written ``topic`` (None: unknown).
    When that is no further than where the topic stood at ``progress`` in bronze's own
    record, nothing of the table came after: no commit is read beyond that record (an
    idle table's progress stays at its last change however far bronze moves on).
    Otherwise bronze's commits are read from the newest back to ``progress``, stopping at
    a commit that names the topic no further than it stood at ``progress``: the
    ingestor writes a record once, so no earlier commit holds a row the merger has not.
    A ``progress`` of -1 (nothing merged: the merger reads the table from bronze's start)
    reads back to the oldest commit the log still holds.
    """
    if bronze.latest is None or progress >= bronze.latest:
        return Backlog(entity)
    merged = position_at(bronze, topic, progress) if progress >= 0 else {}
    if merged is not None and ingested is not None and within(ingested, merged):
        return Backlog(entity)
    versions: list[LogCommit] = []
    unreadable: list[int] = []
    for version, commit in bronze.newest_first(bronze.latest, progress + 1):
        if commit is None:
            if progress < 0:  # the log's start, cleaned up: nothing merged needs it
                break
            unreadable.append(version)
            continue
        if entity in commit.entity_rows:
            versions.append(commit)
        elif (
            merged is not None
            and commit.ingestor is not None
            and topic in commit.ingestor.positions
            and within(commit.ingestor.positions[topic], merged)
        ):
            break
    return Backlog(entity, tuple(reversed(versions)), tuple(sorted(unreadable)))


def change_feed_versions(log: DeltaLog, progress: int) -> tuple[list[LogCommit], list[int]]:
    """The versions after ``progress`` whose Change Data Feed holds changes, oldest first.

    With the versions whose commit file is gone (they may hold changes) apart.
    """
    changed: list[LogCommit] = []
    unreadable: list[int] = []
    if log.latest is None:
        return changed, unreadable
    for version, commit in log.newest_first(log.latest, progress + 1):
        if commit is None:
            unreadable.append(version)
        elif commit.change_feed_files > 0:
            changed.append(commit)
    return list(reversed(changed)), sorted(unreadable)


def as_utc(value: dt.datetime) -> dt.datetime:
    """A timestamp from Spark as an aware UTC datetime.

    PySpark's ``collect`` returns naive datetimes in the Python process's local time zone,
    which ``astimezone`` assumes for naive values.
    """
    return value.astimezone(dt.UTC)
