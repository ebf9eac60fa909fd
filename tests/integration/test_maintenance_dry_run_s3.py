"""``cdc maintenance --dry-run`` without a JVM on S3-compatible storage.

The same tables, log files and checkpoint written under a local root and under an
``s3a://`` root of the local S3 server (by delta-rs and plain writes, no Spark) read
alike through :class:`cdc_cli.delta_log.DeltaLogState`: listings, modification times,
checkpoint files, file actions, commit files and what they record (the ingestor's
positions, the merger's progress), older versions. That the local reads agree with Delta
Lake's own is ``test_cli_ops.test_maintenance_dry_run_without_a_jvm_reads_what_spark_reads``.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from cdc_cli.checkpoints import DeltaLog, recorded_positions
from cdc_cli.delta_log import DeltaLogState, delta_storage_options, table_uri
from cdc_cli.maintenance import ServicesMayRunError, run_maintenance
from cdc_devkit import infra
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.writer_lease import LocalLeaseStore, WriterLease
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from pyarrow import fs as pafs

pytestmark = [pytest.mark.integration, pytest.mark.s3]

ENTITY = {"name": "customers", "source_topic": "t", "key": ["id"], "sequence_by": ["lsn"]}
LONG_AGO = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)


def _fill(config: PipelineConfig, files: pafs.FileSystem, prefix: str) -> None:
    """Bronze and silver (three appends and an OPTIMIZE each), old tombstones, and a
    merger group checkpoint. Each bronze append records the ingestor's position, as the
    ingestor does; silver's log records the bronze version each append merged through,
    as the merger does: the last one, so the merger needs nothing of bronze."""
    options = delta_storage_options(config) or None
    layout = config.layout
    now = dt.datetime.now(dt.UTC)
    for batch in range(3):
        rows = {
            "entity": pa.array(["customers"]),
            "id": pa.array([batch], pa.int64()),
            "ingested_at": pa.array([now], pa.timestamp("us", tz="UTC")),
        }
        positions = {"group": "default", "positions": {"t": {"0": batch + 1}}, "held": {}}
        metadata = {"userMetadata": json.dumps({"cdc_ingestor": positions})}
        write_deltalake(
            table_uri(layout.bronze()),
            pa.table(rows),
            mode="append",
            partition_by=["entity"],
            storage_options=options,
            commit_properties=CommitProperties(custom_metadata=metadata),
        )
        merged = CommitProperties(app_transactions=[Transaction("cdc-merger", batch)])
        write_deltalake(
            table_uri(layout.silver("customers")),
            pa.table({"id": rows["id"]}),
            mode="append",
            storage_options=options,
            commit_properties=merged,
        )
    for path in (layout.bronze(), layout.silver("customers")):
        DeltaTable(table_uri(path), storage_options=options).optimize.compact()
    tombstones = {
        "id": pa.array([1, 2, 3], pa.int64()),
        "deleted_at": pa.array([LONG_AGO, LONG_AGO, now], pa.timestamp("us", tz="UTC")),
    }
    write_deltalake(
        table_uri(layout.tombstones("customers")), pa.table(tombstones), storage_options=options
    )
    checkpoint = f"{prefix}/_streams/merger/default"
    offset = {"sourceVersion": 1, "reservoirVersion": 3, "index": -1, "isStartingVersion": False}
    files.create_dir(f"{checkpoint}/offsets", recursive=True)
    files.create_dir(f"{checkpoint}/commits", recursive=True)
    with files.open_output_stream(f"{checkpoint}/offsets/0") as stream:
        stream.write(f'v1\n{{"batchWatermarkMs":0}}\n{json.dumps(offset)}'.encode())
    with files.open_output_stream(f"{checkpoint}/commits/0") as stream:
        stream.write(b'v1\n{"nextBatchWatermarkMs":0}')


def _s3_root(endpoint: str) -> tuple[PipelineConfig, pafs.FileSystem, str]:
    """A pipeline on a fresh ``s3a://`` root of the local S3 server, that server's file
    system, and the root as its bucket/prefix."""
    prefix = f"{infra.S3_BUCKET}/pytest-{uuid.uuid4().hex[:8]}"
    remote = PipelineConfig(
        storage_root=f"s3a://{prefix}",
        entities=[ENTITY],
        object_storage={
            "endpoint": endpoint,
            "path_style_access": True,
            "region": infra.S3_REGION,
            "access_key": infra.S3_ACCESS_KEY,
            "secret_key": infra.S3_SECRET_KEY,
        },
    )
    s3 = pafs.S3FileSystem(
        access_key=infra.S3_ACCESS_KEY,
        secret_key=infra.S3_SECRET_KEY,
        endpoint_override=endpoint,
        region=infra.S3_REGION,
        force_virtual_addressing=False,
    )
    return remote, s3, prefix


def test_a_dry_run_reads_an_s3_root_as_a_local_one(tmp_path: Path, s3_endpoint: str) -> None:
    local = PipelineConfig(storage_root=str(tmp_path / "root"), entities=[ENTITY])
    remote, s3, prefix = _s3_root(s3_endpoint)
    _fill(local, pafs.LocalFileSystem(), local.storage_root)
    _fill(remote, s3, prefix)

    reports = []
    for config in (local, remote):
        state = DeltaLogState(config)
        layout = config.layout
        bronze, silver = layout.bronze(), layout.silver("customers")
        checkpoint = config.layout.checkpoint("merger", "default")
        assert state.newest_modification(f"{checkpoint}/commits") is not None
        assert state.newest_modification(f"{checkpoint}/missing") is None
        # 0 hours: the three files each OPTIMIZE replaced.
        assert [state.vacuum_dry_run(p, 0, 168) for p in (bronze, silver)] == [3, 3]
        assert state.column_max(bronze, "ingested_at", 1, {"entity": "customers"}) is not None
        assert state.transaction_version(silver, "cdc-merger") == 2
        log = DeltaLog(state, bronze)
        assert recorded_positions(log, {"t": "customers"})["t"].offsets == {"0": 3}
        report = run_maintenance(
            config, dry_run=True, ignore_services=("publisher_kafka", "publisher_es")
        ).to_dict()
        reports.append(report)
    for report in reports:
        for table in report["tables"]:
            table["tombstones_note"] = (table["tombstones_note"] or "").split(" before ")[0]
    assert reports[0] == reports[1]
    tables = {t["table"]: t for t in reports[1]["tables"]}
    assert tables["bronze"]["files"] == tables["silver/customers"]["files"] == 1
    assert tables["silver/_tombstones/customers"]["tombstones_expired"] == 2
    assert reports[1]["needs"] == []  # the merger merged bronze's last append


def test_a_forced_dry_run_finds_a_writer_lease_on_s3_without_a_jvm(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--force-short-retention`` looks for live writer leases: on an ``s3a://`` root
    the dry run reads them as it reads the tables, without starting Spark."""
    remote, s3, prefix = _s3_root(s3_endpoint)
    _fill(remote, s3, prefix)

    def no_spark(*_args: object) -> None:
        raise AssertionError("the dry run started a Spark session")

    monkeypatch.setattr("cdc_shared.jvm.spark.build_spark_session", no_spark)

    def forced_dry_run() -> None:  # VACUUM below Delta's minimum, forced
        run_maintenance(
            remote,
            dry_run=True,
            force_short_retention=True,
            vacuum_hours=0.0,
            quiet=dt.timedelta(0),  # the commits _fill just made are no sign of a service
            ignore_services=("publisher_kafka", "publisher_es"),
        )

    forced_dry_run()  # no lease, no other sign of a service: allowed

    # A lease held by this process (alive), written where the merger's would be.
    local = WriterLease(LocalLeaseStore(), str(tmp_path / "lease"), "merger")
    local.acquire()
    lease_file = remote.layout.writer_lease("merger", "customers").removeprefix("s3a://")
    with s3.open_output_stream(lease_file) as stream:
        stream.write((tmp_path / "lease").read_bytes())
    with pytest.raises(ServicesMayRunError, match=r"writer lease .*merger.*customers"):
        forced_dry_run()
    local.release()
