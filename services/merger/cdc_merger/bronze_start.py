"""Where a new merger stream starts reading bronze: its first commit, when bronze can replay it.

Without a ``startingVersion`` Delta's streaming source begins with the table's snapshot:
batch 0 is every file the table holds at that version. Spark asks the source for that
batch again at each restart of a stream that has committed no batch since (to set the
source up), and the source rebuilds the snapshot's file list with a Spark job to answer.
A table that stayed idle since its stream's first batch (most tables of a large
database) pays that job at every restart of the merger, the largest part of its restart
with many tables (docs/benchmarks.md). Read from bronze's first commit instead, batch 0
is made from the commit files themselves, as the publishers' streams (silver's Change
Data Feed from version 0) always were.

Starting from version 0 needs every file bronze's commits ever added to still be there
and the schema unchanged since the table was made: bronze is append-only, but auto
compaction (and ``cdc maintenance``) rewrites its small files, and a VACUUM later deletes
the originals (the stream skips the compactions themselves: they change no data). So a
new stream reads from the first commit only when bronze's log still holds every commit
since version 0 (at most ``MAX_COMMITS_CHECKED`` of them; a longer log is a table worth
its snapshot), its commits only append and compact, none after the first changes the
schema or properties, and every file they appended still exists. Otherwise it starts
with the snapshot, as before.

The choice is made once, for a stream with no planned batch, and kept in the stream's
checkpoint (``FROM_FIRST_COMMIT_MARKER``): Spark rebuilds batch 0 from the source's
options when it runs it again after a crash or sets the source up on a restart, so the
option must stay what it was when batch 0 was planned, whatever bronze became since.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

from cdc_shared.jvm_bridge import hadoop_path, read_text_if_exists, write_text
from cdc_shared.stream_checkpoint import HadoopFiles, planned_batches
from pyspark.sql import SparkSession

#: The longest bronze log (in commits) checked file by file before a new stream.
MAX_COMMITS_CHECKED = 100

#: The file in a merger checkpoint saying its stream reads bronze from its first commit.
FROM_FIRST_COMMIT_MARKER = "cdc_bronze_from_first_commit"

#: Actions a bronze commit may hold for its rows to be replayable (the first also makes
#: the table); ``add`` and ``remove`` only as appends and compactions (see below).
_APPEND_ACTIONS = frozenset({"add", "remove", "commitInfo", "txn"})
_CREATE_ACTIONS = _APPEND_ACTIONS | {"metaData", "protocol"}


def reads_from_first_commit(spark: SparkSession, bronze_path: str, checkpoint: str) -> bool:
    """Whether the merger's stream over ``bronze_path`` reads it from version 0.

    True for a stream whose checkpoint holds the marker; for a stream with no planned
    batch, decided now (``replayable_from_first_commit``) and, when true, marked.
    """
    marker = f"{checkpoint.rstrip('/')}/{FROM_FIRST_COMMIT_MARKER}"
    if read_text_if_exists(spark, marker) is not None:
        return True
    if planned_batches(HadoopFiles(spark), checkpoint):
        return False  # began with bronze's snapshot: it stays so
    if not replayable_from_first_commit(spark, bronze_path):
        return False
    write_text(spark, marker, "startingVersion 0\n")
    return True


def replayable_from_first_commit(spark: SparkSession, bronze_path: str) -> bool:
    """Whether a stream can read every row of ``bronze_path`` from its commits since version 0.

    See the module docstring for the conditions; anything unexpected in the log says no.
    """
    root = bronze_path.rstrip("/")
    fs, log_dir = hadoop_path(spark, f"{root}/_delta_log")
    if not fs.exists(log_dir):
        return False
    names = [str(status.getPath().getName()) for status in fs.listStatus(log_dir)]
    versions = sorted(int(name[:-5]) for name in names if _is_commit(name))
    if not versions or versions != list(range(len(versions))):
        return False  # version 0 cleaned up, or a gap
    if len(versions) > MAX_COMMITS_CHECKED:
        return False
    added: list[str] = []
    for version in versions:
        text = read_text_if_exists(spark, f"{root}/_delta_log/{version:020d}.json")
        if text is None:
            return False
        for line in text.splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            kind = next(iter(action))
            if kind not in (_CREATE_ACTIONS if version == 0 else _APPEND_ACTIONS):
                return False
            file = action[kind] if kind in ("add", "remove") else {}
            if kind == "remove" and file.get("dataChange", True):
                return False  # rows deleted: not an append-only log
            if kind == "add" and file.get("deletionVector"):
                return False
            if kind == "add" and file.get("dataChange", True):
                added.append(unquote(file["path"]))  # a compaction's (no data change) is skipped
    return all(_exists(spark, root, path) for path in added)


def _is_commit(name: str) -> bool:
    """Whether a ``_delta_log`` entry is a commit file (``<20 digits>.json``)."""
    return len(name) == 25 and name.endswith(".json") and name[:20].isdigit()


def _exists(spark: SparkSession, root: str, path: str) -> bool:
    """Whether a file an ``add`` action names (relative to the table, or absolute) exists."""
    absolute = path if "://" in path or path.startswith("/") else f"{root}/{path}"
    fs, file = hadoop_path(spark, absolute)
    return bool(fs.exists(file))
