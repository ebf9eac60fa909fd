"""Delta tables read without a JVM (delta-rs, the ``deltalake`` package): where they are.

The services read a few things of their targets' Delta logs at start (each table's
progress: ``transaction_versions``) and the CLI's read-only commands read tables and
logs, both without Spark. Paths are the configured ones (``StorageLayout``): a local
folder, or ``s3a://`` (Hadoop's scheme, which Spark uses). Their mapping to delta-rs
lives here only, so every JVM-free reader reaches the storage the way the services' S3A
does: ``s3a://bucket/key`` is ``s3://bucket/key`` to delta-rs (:func:`table_uri`), with
the ``object_storage`` section's endpoint, region, path style and keys
(:func:`delta_storage_options`). Without keys, delta-rs falls back on the AWS default
credential chain (environment, profile, instance or pod role), as S3A does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable
from pyarrow.fs import resolve_s3_region

from cdc_shared.config.connections import S3A_SCHEME, ObjectStorageConfig, s3a_bucket
from cdc_shared.config.pipeline import PipelineConfig

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


@dataclass(frozen=True)
class LogState:
    """What a Delta table's log says: its latest version, and an app id's last write."""

    version: int
    transaction: int | None


def read_logs(
    config: PipelineConfig, paths: dict[str, str], app_id: str
) -> dict[str, LogState | None]:
    """Each table's :class:`LogState` for ``app_id``, by name (None: no such table).

    ``paths``: name -> table path. Read without a JVM; ``transaction`` is the version
    ``app_id`` last wrote (Delta's ``txnVersion``), None when it never wrote the table.
    """
    options = delta_storage_options(config) or None
    states: dict[str, LogState | None] = {}
    for name, path in paths.items():
        uri = table_uri(path)
        if not DeltaTable.is_deltatable(uri, options):
            states[name] = None
            continue
        table = DeltaTable(uri, storage_options=options)
        written = table.transaction_version(app_id)
        states[name] = LogState(int(table.version()), None if written is None else int(written))
    return states


def transaction_versions(
    config: PipelineConfig, paths: dict[str, str], app_id: str
) -> dict[str, int | None]:
    """The version ``app_id`` last wrote (Delta's ``txnVersion``) to each table, by name.

    None for a table that does not exist or that ``app_id`` never wrote.
    """
    return {
        name: None if state is None else state.transaction
        for name, state in read_logs(config, paths, app_id).items()
    }


def change_feed_rows(config: PipelineConfig, path: str) -> list[dict[str, Any]]:
    """Every row of a small table's Change Data Feed, with ``_commit_version`` (none: no table).

    For a log read whole (the erasure log); read without a JVM.
    """
    options = delta_storage_options(config) or None
    uri = table_uri(path)
    if not DeltaTable.is_deltatable(uri, options):
        return []
    feed = DeltaTable(uri, storage_options=options).load_cdf(starting_version=0)
    return list(pa.table(feed.read_all()).to_pylist())
