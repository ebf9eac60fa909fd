"""The storage root read without a JVM: Delta tables through delta-rs, other files through pyarrow.

The read-only commands (``cdc status``, ``cdc quarantine list``, ``cdc maintenance
--dry-run``) need table versions, a table's history, properties and recorded progress
(``txn``), small column reads, commit files, a stream checkpoint's files and, for a
VACUUM dry run, the table's files and log. Starting Spark for that costs more than all
the reading: here delta-rs (the ``deltalake`` package) reads the tables, the same Delta
log the services' Delta Lake writes, and delta-rs' storage layer (as a pyarrow file
system) reads checkpoint and log files. :class:`DeltaLogState` is the
:class:`cdc_cli.checkpoints.StateReader` that does so, and the
``cdc_cli.table_state.TableState`` of a dry run.

Paths are the configured ones (``StorageLayout``): a local folder, or ``s3a://`` (Hadoop's
scheme, which the services use). Their mapping to delta-rs lives here only, so every
JVM-free reader reaches the storage the way the services' S3A does: ``s3a://bucket/key``
is ``s3://bucket/key`` to delta-rs (:func:`table_uri`), with the ``object_storage``
section's endpoint, region, path style and keys (:func:`delta_storage_options`); tables
and files are read with the same options. Without keys, delta-rs falls back on the AWS
default credential chain (environment, profile, instance or pod role), as S3A does.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from cdc_shared.clients.delta_rs import delta_storage_options, is_object_storage, table_uri
from cdc_shared.config.pipeline import PipelineConfig
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import TableNotFoundError
from deltalake.fs import DeltaStorageHandler
from pyarrow import fs as pafs

from cdc_cli.checkpoints import Commit

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyarrow import fs as pafs


class DeltaLogState:
    """A :class:`cdc_cli.checkpoints.StateReader` without a JVM, for one pipeline's root.

    Tables are opened once per path and kept, so the several readers of a table (the
    publishers of silver) share one snapshot, and a history already read is not read
    again. Commit timestamps are the commits' own (``commitInfo.timestamp``), where Delta
    Lake's history shows the commit file's modification time (unless in-commit timestamps
    are on): the two differ by how long the commit took to write.
    """

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self._options = delta_storage_options(config)
        self._root = config.storage_root.rstrip("/")
        self._store: pafs.FileSystem | None = None
        self._tables: dict[str, DeltaTable | None] = {}
        self._histories: dict[str, tuple[int, dict[int, Commit]]] = {}

    def _object_store(self, path: str) -> tuple[pafs.FileSystem, str]:
        """delta-rs' store for the object-storage root, and ``path`` relative to the root."""
        if path != self._root and not path.startswith(self._root + "/"):
            raise ValueError(f"{path} is not under the storage root {self._root}")
        if self._store is None:
            handler = DeltaStorageHandler(table_uri(self._root), self._options or None)
            self._store = pafs.PyFileSystem(handler)
        return self._store, path[len(self._root) :].lstrip("/")

    def _filesystem(self, path: str) -> tuple[pafs.FileSystem, str]:
        """The file system holding ``path`` and the path in it: local, or the root's store."""
        if is_object_storage(path):
            return self._object_store(path)

        return pafs.LocalFileSystem(), path

    def _listing(self, folder: str, recursive: bool) -> list[tuple[str, bool, int]] | None:
        """What is under ``folder``: (path relative to it, is a folder, modified in epoch ms).

        None when the folder does not exist. On object storage a folder is listed only
        when the store reports it; its objects' paths name it all the same.
        """
        store, base = self._filesystem(folder)
        if store.get_file_info(base).type != pafs.FileType.Directory:
            return None
        selector = pafs.FileSelector(base, recursive=recursive)
        folder_prefix = base.strip("/") + "/"
        return [
            (
                info.path.strip("/").partition(folder_prefix)[2],
                info.type == pafs.FileType.Directory,
                (info.mtime_ns or 0) // 1_000_000,
            )
            for info in store.get_file_info(selector)
        ]

    def newest_modification(self, folder: str) -> dt.datetime | None:
        """The newest modification time of an entry of ``folder``; None when it has none.

        As Hadoop's file system lists a folder: a local folder's checksum files
        (``.<name>.crc``) are not listed.
        """
        entries = self._listing(folder, recursive=False) or []
        times = [
            modified
            for name, _, modified in entries
            if is_object_storage(folder) or not _checksum_file(name)
        ]
        return dt.datetime.fromtimestamp(max(times) / 1000, dt.UTC) if times else None

    def list_names(self, path: str) -> list[str] | None:
        """Names of the entries in the folder ``path``; None when it does not exist.

        On object storage a folder is there when an object is under it.
        """
        if not is_object_storage(path):
            try:
                return os.listdir(path)
            except (FileNotFoundError, NotADirectoryError):
                return None

        store, folder = self._object_store(path)
        if store.get_file_info(folder).type != pafs.FileType.Directory:
            return None
        return [entry.base_name for entry in store.get_file_info(pafs.FileSelector(folder))]

    def read_text_if_exists(self, path: str) -> str | None:
        """The file ``path`` as UTF-8 text; None when there is no such file."""
        try:
            if not is_object_storage(path):
                return Path(path).read_text(encoding="utf-8")
            store, file = self._object_store(path)
            with store.open_input_stream(file) as stream:
                return bytes(stream.read()).decode("utf-8")
        except FileNotFoundError:
            return None

    def table(self, path: str) -> DeltaTable | None:
        """The Delta table at ``path`` at its latest version; None when there is none."""
        if path not in self._tables:
            try:
                table = DeltaTable(table_uri(path), storage_options=self._options or None)
            except TableNotFoundError:
                table = None
            self._tables[path] = table
        return self._tables[path]

    def table_version(self, path: str) -> int | None:
        """The latest version of the Delta table at ``path``; None when there is no table."""
        table = self.table(path)
        return None if table is None else int(table.version())

    def history(self, path: str, since: int = 0) -> dict[int, Commit]:
        """The versions at or after ``since`` still in the history of the table at ``path``.

        Only the commits from ``since`` to the latest version are read (delta-rs reads a
        history newest first), so a reader that is caught up costs one commit file.
        """
        table = self._existing(path)
        since = max(since, 0)
        cached = self._histories.get(path)
        if cached is None or cached[0] > since:
            newer = int(table.version()) - since + 1
            entries = table.history(newer if since > 0 else None) if newer > 0 else []
            commits = {int(e["version"]): _commit(e) for e in entries if "version" in e}
            cached = (since, commits)
            self._histories[path] = cached
        return {v: c for v, c in cached[1].items() if v >= since}

    def transaction_version(self, path: str, app_id: str) -> int | None:
        """The version ``app_id`` last recorded in the table at ``path`` (Delta's ``txn``).

        As the services read their progress at start (``cdc_shared.clients.delta_rs``).
        """
        written = self._existing(path).transaction_version(app_id)
        return None if written is None else int(written)

    def table_properties(self, path: str) -> dict[str, str]:
        """The table properties (``delta.*`` among them) of the Delta table at ``path``."""
        return dict(self._existing(path).metadata().configuration)

    def data_file_count(self, path: str) -> int:
        """The data files of the table's latest version (Delta's ``numFiles``)."""
        return int(self._existing(path).get_add_actions().num_rows)

    def column_max(
        self,
        path: str,
        column: str,
        version: int,
        where: Mapping[str, str] | None = None,
        below: dt.datetime | None = None,
    ) -> Any:
        """The greatest value of ``column`` in version ``version`` of the table at ``path``.

        ``where``: only the rows whose columns hold these values (a partition column's
        prunes the files read); ``below``: only the rows whose timestamp ``column`` is
        before it.
        """
        self._existing(path)
        table = DeltaTable(table_uri(path), version=version, storage_options=self._options or None)
        result = QueryBuilder().register("t", table)
        conditions = [f'"{name}" = {_sql_string(value)}' for name, value in (where or {}).items()]
        if below is not None:
            conditions.append(f'"{column}" < {_sql_timestamp(below)}')
        sql = f'SELECT max("{column}") AS m FROM t'
        if conditions:
            sql += " WHERE " + " AND ".join(conditions)
        rows = result.execute(sql).read_all()
        return rows.column("m").to_pylist()[0]

    def change_feed_min(
        self, path: str, column: str, since: int, until: int, where: Mapping[str, str]
    ) -> Any:
        """The least value of ``column`` among rows a range of versions changed.

        The versions after ``since`` up to ``until`` (the table's Change Data Feed), the
        rows whose columns hold the ``where`` values; None when there are none.
        """
        table = self._existing(path)
        predicate = " AND ".join(f"{name} = {_sql_string(v)}" for name, v in where.items())
        changes = table.load_cdf(
            starting_version=since + 1,
            ending_version=until,
            columns=[column],
            predicate=predicate or None,
        )
        values = pa.table(changes.read_all()).column(column)
        return pc.min(values).as_py()

    def count_before(
        self, path: str, column: str, moment: dt.datetime, where: Mapping[str, str] | None = None
    ) -> int:
        """Rows of the table at ``path`` whose timestamp ``column`` is before ``moment``.

        ``where``: only the rows whose columns hold these values.
        """
        self._existing(path)
        conditions = [f'"{column}" < {_sql_timestamp(moment)}']
        conditions += [f'"{name}" = {_sql_string(v)}' for name, v in (where or {}).items()]
        rows = self.query(f"SELECT count(*) AS n FROM t WHERE {' AND '.join(conditions)}", t=path)
        return int((rows or [{"n": 0}])[0]["n"])

    def vacuum_dry_run(self, path: str, hours: float, table_retention_hours: float) -> int:
        """How many paths Delta Lake's ``VACUUM ... RETAIN hours HOURS DRY RUN`` lists.

        Delta Lake's own rules (``VacuumCommand.gc``, full mode, as of Delta 4.4) on the
        table's latest version, so that the count is the one the services' Delta Lake
        gives, not delta-rs' own vacuum's (which lists other files: checksum files under
        ``_change_data``, and a deletion-vector file still in use):

        - the cutoff is now minus ``hours`` rounded to whole hours (as Delta rounds it);
        - kept: every file the latest version references (and the folders it is in), its
          deletion-vector files, and those of files removed at or after the cutoff whose
          removal the log still keeps (within ``table_retention_hours``, the table's
          ``delta.deletedFileRetentionDuration``);
        - listed: everything under the table but hidden names (``_``/``.``, except
          ``_change_data`` and partition folders), files modified before the cutoff, and
          folders with no such file: the entries that are not kept.
        """
        table = self._existing(path)
        now = int(time.time() * 1000)
        delete_before = now - math.floor(hours + 0.5) * 3_600_000
        removals_kept_after = now - round(table_retention_hours * 3_600_000)
        added, removed = self._file_actions(path, int(table.version()))
        kept: set[str] = set()
        for file, vector in added:
            kept.update(_kept_paths(file, vector))
        for file, vector, deleted_at in removed:
            if deleted_at >= delete_before and deleted_at > removals_kept_after:
                kept.update(_kept_paths(file, vector))
        partition_columns = list(table.metadata().partition_columns)
        counts: Counter[str] = Counter()
        for name, is_folder, modified in self._table_entries(path, partition_columns):
            if is_folder:
                counts[name] += 1
            elif modified < delete_before:
                counts.update(_folders_of(name))
                counts[name] += 1
        return sum(1 for name, n in counts.items() if n == 1 and name not in kept)

    def _existing(self, path: str) -> DeltaTable:
        table = self.table(path)
        if table is None:
            raise FileNotFoundError(f"there is no Delta table at {path}")
        return table

    def _table_entries(
        self, path: str, partition_columns: list[str]
    ) -> list[tuple[str, bool, int]]:
        """The entries VACUUM lists under the table: none with a hidden name on its path."""
        entries: dict[str, tuple[bool, int]] = {}
        for name, is_folder, modified in self._listing(path, recursive=True) or []:
            for folder in _folders_of(name):
                if not _hidden_on_path(folder, partition_columns):
                    entries.setdefault(folder, (True, 0))
            if not _hidden_on_path(name, partition_columns):
                entries[name] = (is_folder, modified)
        return [(name, is_folder, modified) for name, (is_folder, modified) in entries.items()]

    def _file_actions(
        self, path: str, version: int
    ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any, int]]]:
        """The state of the table's log at ``version``: its files and its kept removals.

        Files as (path, deletion vector), removals as (path, deletion vector, deletion
        time in epoch ms), replayed from the newest checkpoint at or before ``version``
        (classic, single or multi-part) and the commits after it, keyed as Delta keys
        them: by path and deletion vector.
        """
        log = f"{path.rstrip('/')}/_delta_log"
        checkpoint, parts = _checkpoint(self.list_names(log) or [], version, log)
        state: dict[tuple[str, Any], tuple[str, dict[str, Any]]] = {}
        if checkpoint >= 0:
            for part in parts:
                store, file = self._filesystem(f"{log}/{part}")
                names = pq.read_schema(file, filesystem=store).names
                kinds = [kind for kind in ("remove", "add") if kind in names]
                actions = pq.read_table(file, columns=kinds, filesystem=store)
                for kind in kinds:
                    for action in actions.column(kind).to_pylist():
                        if action is not None:
                            _replay(state, kind, action)
        for commit in range(checkpoint + 1, version + 1):
            text = self.read_text_if_exists(f"{log}/{commit:020d}.json")
            if text is None:
                raise FileNotFoundError(f"{log} has no commit {commit}: cannot read its state")
            for line in text.splitlines():
                action = json.loads(line) if line.strip() else {}
                for kind in ("add", "remove"):
                    if kind in action:
                        _replay(state, kind, action[kind])
        added = [(key[0], a.get("deletionVector")) for key, (k, a) in state.items() if k == "add"]
        removed = [
            (key[0], a.get("deletionVector"), int(a.get("deletionTimestamp") or 0))
            for key, (k, a) in state.items()
            if k == "remove"
        ]
        return added, removed

    def count_by(self, path: str, column: str) -> dict[str, int] | None:
        """Rows per value of ``column`` in the table at ``path``; None when there is no table.

        Counted by delta-rs' engine over that one column of the table's latest version.
        """
        rows = self.query(
            f'SELECT "{column}" AS value, count(*) AS n FROM t GROUP BY "{column}"', t=path
        )
        if rows is None:
            return None
        return dict(sorted((str(row["value"]), int(row["n"])) for row in rows))

    def query(self, sql: str, **tables: str) -> list[dict[str, Any]] | None:
        """The rows of the SQL ``sql`` over ``tables``; None when one of them is missing.

        ``tables`` maps the names ``sql`` uses to Delta table paths, each read at its
        latest version. Run by delta-rs' engine (DataFusion), which applies deletion
        vectors and column mapping, reads only the columns the query uses, and fails on a
        reader feature it does not know, with the feature named.
        """
        builder = QueryBuilder()
        for name, path in tables.items():
            table = self.table(path)
            if table is None:
                return None
            builder.register(name, table)
        result = builder.execute(sql).read_all()
        columns = {name: result.column(name).to_pylist() for name in result.column_names}
        return [
            dict(zip(columns, values, strict=True))
            for values in zip(*columns.values(), strict=True)
        ]


def _sql_timestamp(moment: dt.datetime) -> str:
    """``moment`` as a DataFusion UTC timestamp literal (microseconds, as Delta stores it)."""
    micros = round(moment.timestamp() * 1_000_000)
    return f"arrow_cast(to_timestamp_micros({micros}), 'Timestamp(Microsecond, Some(\"UTC\"))')"


def _sql_string(value: str) -> str:
    """``value`` as an SQL string literal (a quote in it doubled)."""
    return "'" + value.replace("'", "''") + "'"


def _commit(entry: dict[str, Any]) -> Commit:
    """One entry of delta-rs' history as a :class:`Commit`."""
    millis = int(entry.get("timestamp") or 0)
    moment = dt.datetime.fromtimestamp(millis / 1000, dt.UTC)
    return Commit(int(entry["version"]), moment, str(entry.get("operation")))


#: A classic checkpoint: one file, or part ``i`` of ``n``.
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")
#: A V2 checkpoint (table feature ``v2Checkpoint``), which :func:`_checkpoint` does not read.
_V2_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint\.[0-9a-fA-F-]{36}\.(json|parquet)$")
#: Z85, the alphabet of a deletion vector's encoded UUID (Delta's ``Base85Codec``).
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_ENCODED_UUID_LENGTH = 20


def _checkpoint(names: list[str], version: int, log: str) -> tuple[int, list[str]]:
    """The newest complete classic checkpoint at or before ``version``: (its version, files).

    (-1, []) when there is none. ValueError when a V2 checkpoint is newer: not read here.
    """
    parts: dict[tuple[int, int], set[int]] = {}
    for name in names:
        match = _CHECKPOINT.match(name)
        if match is not None and int(match[1]) <= version:
            total = int(match[3] or 1)
            parts.setdefault((int(match[1]), total), set()).add(int(match[2] or 1))
    complete = [key for key, found in parts.items() if found == set(range(1, key[1] + 1))]
    if not complete:
        newest, total = -1, 0
    else:
        newest, total = max(complete)
    v2 = [int(m[1]) for name in names if (m := _V2_CHECKPOINT.match(name)) and int(m[1]) <= version]
    if v2 and max(v2) > newest:
        raise ValueError(f"{log} has a V2 checkpoint (version {max(v2)}), which is not read here")
    if newest < 0:
        return -1, []
    if total == 1:
        return newest, [f"{newest:020d}.checkpoint.parquet"]
    return newest, [
        f"{newest:020d}.checkpoint.{i:010d}.{total:010d}.parquet" for i in range(1, total + 1)
    ]


def _vector_id(vector: dict[str, Any] | None) -> tuple[str, str, int | None] | None:
    """What tells deletion vectors apart (Delta's ``getDeletionVectorUniqueId``)."""
    if not vector:
        return None
    offset = vector.get("offset")
    return (
        str(vector["storageType"]),
        str(vector["pathOrInlineDv"]),
        None if offset is None else int(offset),
    )


def _replay(
    state: dict[tuple[str, Any], tuple[str, dict[str, Any]]], kind: str, action: dict[str, Any]
) -> None:
    """Apply one ``add`` or ``remove`` action: the newest action of a (path, vector) wins."""
    state[(unquote(str(action["path"])), _vector_id(action.get("deletionVector")))] = (kind, action)


def _vector_file(vector: dict[str, Any] | None) -> str | None:
    """The path, relative to the table, of a deletion vector stored in the table's folder.

    None for an inline vector or one at an absolute path (``p``), which VACUUM never
    deletes as part of the table.
    """
    if not vector or vector.get("storageType") != "u":
        return None
    encoded = str(vector["pathOrInlineDv"])
    prefix, code = encoded[:-_ENCODED_UUID_LENGTH], encoded[-_ENCODED_UUID_LENGTH:]
    decoded = b""
    for start in range(0, _ENCODED_UUID_LENGTH, 5):
        value = 0
        for char in code[start : start + 5]:
            value = value * 85 + _Z85.index(char)
        decoded += value.to_bytes(4, "big")
    name = f"deletion_vector_{uuid.UUID(bytes=decoded)}.bin"
    return f"{prefix}/{name}" if prefix else name


def _folders_of(path: str) -> list[str]:
    """The folders ``path`` (relative) is in, innermost first: ``a/b/c`` -> ``a/b``, ``a``."""
    return [str(p) for p in PurePosixPath(path).parents if str(p) != "."]


def _kept_paths(file: str, vector: dict[str, Any] | None) -> list[str]:
    """What a file of the log keeps from VACUUM: itself, its folders, its deletion vector."""
    if "://" in file or file.startswith("/"):
        return []  # outside the table (a shallow clone's): never listed under it
    vector_file = _vector_file(vector)
    return [file, *_folders_of(file), *([vector_file] if vector_file else [])]


def _hidden(name: str, partition_columns: list[str]) -> bool:
    """Whether VACUUM leaves a file or folder name alone (``DeltaTableUtils.isHiddenDirectory``)."""
    return (
        name.startswith((".", "_"))
        and not name.startswith(("_delta_index", "_change_data"))
        and not any(name.startswith(f"{column}=") for column in partition_columns)
    )


def _hidden_on_path(path: str, partition_columns: list[str]) -> bool:
    """Whether a name on ``path`` is hidden: VACUUM lists no folder below a hidden one."""
    return any(_hidden(name, partition_columns) for name in path.split("/"))


def _checksum_file(name: str) -> bool:
    """Whether ``name`` is a checksum file of Hadoop's local file system (``.<file>.crc``)."""
    return name.startswith(".") and name.endswith(".crc")
