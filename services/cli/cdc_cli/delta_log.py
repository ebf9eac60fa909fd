"""The storage root read without a JVM: Delta tables through delta-rs, other files through pyarrow.

The read-only commands (``cdc status``; the read-only parts of ``cdc quarantine list``
and ``cdc maintenance --dry-run`` can follow) need table versions, a table's history,
small column reads and a stream checkpoint's files. Starting Spark for that costs more
than all the reading: here delta-rs (the ``deltalake`` package) reads the tables, the
same Delta log the services' Delta Lake writes, and delta-rs' storage layer (as a pyarrow
file system) reads checkpoint and log files. :class:`DeltaLogState` is the
:class:`cdc_cli.checkpoints.StateReader` that does so.

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
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cdc_shared.config import S3A_SCHEME, ObjectStorageConfig, PipelineConfig, s3a_bucket

from cdc_cli.checkpoints import Commit

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyarrow import fs as pafs

#: The region when neither the configuration nor the environment names one and the
#: endpoint is not AWS's (S3-compatible stores accept any).
DEFAULT_REGION = "us-east-1"


def is_object_storage(path: str) -> bool:
    """Whether ``path`` is on S3-compatible object storage (an ``s3a://`` URI)."""
    return path.lower().startswith(f"{S3A_SCHEME}://")


def table_uri(path: str) -> str:
    """``path`` as delta-rs names it: ``s3a://`` becomes ``s3://``; a local path unchanged."""
    if is_object_storage(path):
        return "s3://" + path.split("://", 1)[1]
    return path


def region(storage: ObjectStorageConfig, bucket: str) -> str:
    """The region to sign requests for: configured, else the environment's, else found.

    Without an endpoint (AWS S3 itself) and no region anywhere, the bucket's region is
    asked of S3 once; an S3-compatible store gets ``DEFAULT_REGION``.
    """
    chosen = storage.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if chosen:
        return chosen
    if storage.endpoint is None:
        from pyarrow.fs import resolve_s3_region

        return str(resolve_s3_region(bucket))
    return DEFAULT_REGION


def delta_storage_options(config: PipelineConfig) -> dict[str, str]:
    """delta-rs ``storage_options`` for the storage root (empty for a local root).

    The same settings as the root's S3A ones (``ObjectStorageConfig.hadoop_options``);
    holds the secret key when one is configured: never log the result.
    """
    bucket = s3a_bucket(config.storage_root)
    if bucket is None:
        return {}
    storage = config.object_storage
    options = {
        "AWS_REGION": region(storage, bucket),
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": str(not storage.path_style_access).lower(),
    }
    if storage.endpoint is not None:
        options["AWS_ENDPOINT_URL"] = storage.endpoint.rstrip("/")
        options["AWS_ALLOW_HTTP"] = str(storage.endpoint.startswith("http://")).lower()
    if storage.access_key is not None and storage.secret_key is not None:
        options["AWS_ACCESS_KEY_ID"] = storage.access_key.get_secret_value()
        options["AWS_SECRET_ACCESS_KEY"] = storage.secret_key.get_secret_value()
    return options


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
        from deltalake.fs import DeltaStorageHandler
        from pyarrow import fs as pafs

        if path != self._root and not path.startswith(self._root + "/"):
            raise ValueError(f"{path} is not under the storage root {self._root}")
        if self._store is None:
            handler = DeltaStorageHandler(table_uri(self._root), self._options or None)
            self._store = pafs.PyFileSystem(handler)
        return self._store, path[len(self._root) :].lstrip("/")

    def list_names(self, path: str) -> list[str] | None:
        """Names of the entries in the folder ``path``; None when it does not exist.

        On object storage a folder is there when an object is under it.
        """
        if not is_object_storage(path):
            try:
                return os.listdir(path)
            except (FileNotFoundError, NotADirectoryError):
                return None
        from pyarrow import fs as pafs

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
            from deltalake import DeltaTable
            from deltalake.exceptions import TableNotFoundError

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
        table = self.table(path)
        if table is None:
            raise FileNotFoundError(f"there is no Delta table at {path}")
        since = max(since, 0)
        cached = self._histories.get(path)
        if cached is None or cached[0] > since:
            newer = int(table.version()) - since + 1
            entries = table.history(newer if since > 0 else None) if newer > 0 else []
            commits = {int(e["version"]): _commit(e) for e in entries if "version" in e}
            cached = (since, commits)
            self._histories[path] = cached
        return {v: c for v, c in cached[1].items() if v >= since}

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
        from deltalake import QueryBuilder

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


def _commit(entry: dict[str, Any]) -> Commit:
    """One entry of delta-rs' history as a :class:`Commit`."""
    millis = int(entry.get("timestamp") or 0)
    moment = dt.datetime.fromtimestamp(millis / 1000, dt.UTC)
    return Commit(int(entry["version"]), moment, str(entry.get("operation")))
