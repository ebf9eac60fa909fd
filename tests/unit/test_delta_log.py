"""Reading the storage root without a JVM (cdc_cli.delta_log): storage options, tables, files.

Tables here are written by delta-rs itself (no Spark in unit tests); the integration
tests (test_cli_ops, test_object_storage) read what the services' Delta Lake wrote, on
local disk and on S3, and compare with the Spark engine.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from cdc_cli.checkpoints import group_checkpoints, kafka_ends, last_committed_batch
from cdc_cli.delta_log import DeltaLogState, _vector_file, delta_storage_options, table_uri
from cdc_shared.config.pipeline import PipelineConfig
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake


def _s3_config(**storage: object) -> PipelineConfig:
    return PipelineConfig(storage_root="s3a://cdc-bucket/prod", object_storage=storage)


def test_an_s3a_root_maps_to_the_same_storage_for_delta_rs() -> None:
    config = _s3_config(
        endpoint="http://127.0.0.1:9000/",
        path_style_access=True,
        region="eu-west-1",
        access_key="AKIA-local",
        secret_key="s3cr3t",
    )
    assert delta_storage_options(config) == {
        "AWS_REGION": "eu-west-1",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "AKIA-local",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    }
    assert table_uri(config.layout.silver("customers")) == "s3://cdc-bucket/prod/silver/customers"


def test_without_keys_or_path_style_delta_rs_uses_the_default_chain_and_virtual_hosts() -> None:
    options = delta_storage_options(
        _s3_config(endpoint="https://minio.internal:9000", region="us-east-1")
    )
    assert options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] == "true"
    assert options["AWS_ALLOW_HTTP"] == "false"
    assert "AWS_ACCESS_KEY_ID" not in options and "AWS_SECRET_ACCESS_KEY" not in options


def test_a_local_root_needs_no_options(tmp_path: Path) -> None:
    config = PipelineConfig(storage_root=str(tmp_path))
    assert delta_storage_options(config) == {}
    assert table_uri(config.layout.silver("orders")) == str(tmp_path / "silver" / "orders")


def _write(path: str, operations: list[tuple[str, list[str]]]) -> None:
    """One delta-rs commit per (mode, entities) pair: rows with those entity values."""
    for mode, entities in operations:
        rows = pa.table({"entity": pa.array(entities, pa.string())})
        write_deltalake(path, rows, mode=mode)  # type: ignore[arg-type]


def test_versions_history_and_counts_of_a_table(tmp_path: Path) -> None:
    config = PipelineConfig(storage_root=str(tmp_path))
    path = config.layout.quarantine("ingestor")
    _write(path, [("append", ["a", "b"]), ("append", ["a"]), ("append", ["c", "a"])])
    DeltaTable(path).optimize.compact()  # version 3: no data change

    state = DeltaLogState(config)
    assert state.table_version(path) == 3
    assert sorted(state.history(path)) == [0, 1, 2, 3]
    newest = state.history(path, since=2)
    assert sorted(newest) == [2, 3]
    assert [c.changes_data for _, c in sorted(newest.items())] == [True, False]
    assert sorted(state.history(path, since=1)) == [1, 2, 3]  # further back than read before
    assert state.history(path, since=9) == {}
    assert state.count_by(path, "entity") == {"a": 3, "b": 1, "c": 1}


def test_the_progress_a_writer_recorded_and_a_column_read_at_a_version(tmp_path: Path) -> None:
    """What the merger records in silver's log (an app id's ``txn``), read as delta-rs
    reads it at the services' start; the newest value of one entity's rows, time travelled."""
    config = PipelineConfig(storage_root=str(tmp_path))
    path = config.layout.bronze()
    day = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for version, (entity, value) in enumerate([("a", 1), ("b", 5), ("a", 3), ("a", 9)]):
        rows = pa.table(
            {
                "entity": pa.array([entity]),
                "at": pa.array([day + dt.timedelta(hours=value)], pa.timestamp("us", tz="UTC")),
            }
        )
        app = CommitProperties(app_transactions=[Transaction("cdc-merger", version * 10)])
        write_deltalake(
            path,
            rows,
            mode="append",
            partition_by=["entity"],
            commit_properties=app,
            configuration={"delta.enableChangeDataFeed": "true"},
        )
    state = DeltaLogState(config)
    assert state.transaction_version(path, "cdc-merger") == 30
    assert state.transaction_version(path, "another") is None

    def at(hours: int) -> dt.datetime:
        return day + dt.timedelta(hours=hours)

    assert state.column_max(path, "at", 2, {"entity": "a"}) == at(3)  # version 3's 9 not yet
    assert state.column_max(path, "at", 2) == at(5)
    assert state.column_max(path, "at", 2, {"entity": "it's none"}) is None
    assert state.column_max(path, "at", 3, {"entity": "a"}, below=at(9)) == at(3)
    # The rows versions 2 and 3 added (the Change Data Feed after version 1).
    assert state.change_feed_min(path, "at", 1, 3, {"entity": "a"}) == at(3)
    assert state.change_feed_min(path, "at", 1, 3, {"entity": "b"}) is None


def test_a_missing_table_or_folder_is_none_not_an_error(tmp_path: Path) -> None:
    config = PipelineConfig(storage_root=str(tmp_path))
    state = DeltaLogState(config)
    missing = config.layout.silver("customers")
    assert state.table_version(missing) is None
    assert state.count_by(missing, "entity") is None
    assert state.list_names(config.layout.checkpoint("merger", "default")) is None
    assert state.read_text_if_exists(f"{missing}/_delta_log/{0:020d}.json") is None
    with pytest.raises(FileNotFoundError, match="no Delta table"):
        state.history(missing)


def test_the_last_committed_and_planned_batch_of_a_group_checkpoint(tmp_path: Path) -> None:
    """The ingestor's group checkpoint: where its Kafka source stands in each topic."""
    config = PipelineConfig(storage_root=str(tmp_path))
    checkpoint = Path(config.layout.checkpoint("ingestor", "default"))
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    offsets = {
        0: {"t1": {"0": 3, "1": 0}, "t2": {"0": 1}},
        1: {"t1": {"0": 5, "1": 2}, "t2": {"0": 1}},
        2: {"t1": {"0": 9, "1": 2}, "t2": {"0": 4}},
    }
    for batch, offset in offsets.items():
        metadata = {"batchWatermarkMs": 0, "batchTimestampMs": 1}
        text = f"v1\n{json.dumps(metadata)}\n{json.dumps(offset)}"
        (checkpoint / "offsets" / str(batch)).write_text(text)
    for batch in (0, 1):  # batch 2 planned, not committed
        (checkpoint / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    (checkpoint / "commits" / ".1.crc").write_bytes(b"\0")

    state = DeltaLogState(config)
    batch = last_committed_batch(state, str(checkpoint))
    assert batch is not None
    assert (batch.batch_id, batch.sources) == (1, (offsets[1],))
    assert kafka_ends(state, str(checkpoint), "t1") == (1, {"0": 5, "1": 2})
    assert kafka_ends(state, str(checkpoint), "t1", planned=True) == (2, {"0": 9, "1": 2})
    assert kafka_ends(state, str(checkpoint), "t3") is None
    aside = Path(f"{checkpoint}.20260101T000000")
    aside.mkdir()
    streams = str(checkpoint.parent)
    (checkpoint.parent / "tables-orders").mkdir()
    assert group_checkpoints(state, streams, "orders") == [
        f"{streams}/orders",
        f"{streams}/default",
        f"{streams}/tables-orders",
    ]

    (checkpoint / "offsets" / "1").unlink()
    with pytest.raises(FileNotFoundError, match="committed batch 1 but has no offsets/1"):
        last_committed_batch(state, str(checkpoint))


def test_status_reads_start_no_jvm_and_import_no_spark(tmp_path: Path) -> None:
    """The JVM-free reader imports neither PySpark nor Delta Lake's Python package."""
    config = PipelineConfig(storage_root=str(tmp_path))
    _write(config.layout.bronze(), [("append", ["a"])])
    script = (
        "import sys\n"
        "from cdc_shared.config.pipeline import PipelineConfig\n"
        "from cdc_cli.status import collect_status\n"
        f"config = PipelineConfig(storage_root={str(tmp_path)!r}, entities=[{{"
        "'name': 'customers', 'source_topic': 't', 'key': ['id'], 'sequence_by': ['lsn']}])\n"
        "from cdc_cli.status import quarantine_counts\n"
        "from cdc_cli.table_state import DELTA_RS, open_state\n"
        "reader, _ = open_state(config, DELTA_RS, 'cdc-status')\n"
        "print(reader.table_version(config.layout.bronze()))\n"
        "print(reader.transaction_version(config.layout.bronze(), 'cdc-merger'))\n"
        "print(quarantine_counts(config, reader))\n"
        "print(sorted(m for m in ('pyspark', 'delta', 'py4j') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0", "None", "{}", "[]"]


def test_a_deletion_vector_file_is_named_as_delta_names_it() -> None:
    """The example of Delta's protocol: a random prefix, then the Z85-encoded UUID."""
    vector = {"storageType": "u", "pathOrInlineDv": "ab^-aqEH.-t@S}K{vb[*k^", "offset": 4}
    assert _vector_file(vector) == "ab/deletion_vector_d2c639aa-8816-431a-aaf6-d3fe2512ff61.bin"
    assert (
        _vector_file(
            {
                "storageType": "i",
                "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L",
            }
        )
        is None
    )


def _backdate(path: Path, hours: float) -> None:
    moment = time.time() - hours * 3600
    os.utime(path, (moment, moment))


def test_vacuum_dry_run_lists_what_deltas_vacuum_would(tmp_path: Path) -> None:
    """Delta Lake's rules: unreferenced files older than the cutoff, folders with no such
    file, never a hidden name; files removed after the cutoff stay while their removal is
    kept (the table's retention)."""
    config = PipelineConfig(storage_root=str(tmp_path))
    path = config.layout.silver("customers")
    _write(path, [("append", ["a"]), ("append", ["b"])])
    replaced = {p.name for p in Path(path).glob("*.parquet")}
    DeltaTable(path).optimize.compact()  # removes both files now
    table = Path(path)
    for name in replaced:
        _backdate(table / name, 48)  # written two days ago, removed now
    (table / "_change_data").mkdir()
    old_change = table / "_change_data" / "cdc-00000.c000.snappy.parquet"
    old_change.write_bytes(b"x")
    _backdate(old_change, 48)
    (table / "_change_data" / ".cdc-00000.c000.snappy.parquet.crc").write_bytes(b"x")
    (table / "empty-folder").mkdir()
    (table / ".hidden-file").write_bytes(b"x")
    _backdate(table / ".hidden-file", 48)
    (table / "_hidden-folder").mkdir()
    stray = table / "stray.parquet"  # in no commit, but new
    stray.write_bytes(b"x")

    state = DeltaLogState(config)
    # 24 hours: the two replaced files were removed after the cutoff and are kept; listed
    # are the old change-data file and the empty folder (not _change_data: it has a file).
    assert state.vacuum_dry_run(path, 24, 168) == 2
    # A table retention of 0: the log no longer keeps those removals, so their files go.
    assert state.vacuum_dry_run(path, 24, 0) == 2 + 2
    # 0.4 hours rounds to 0 as in Delta: every unreferenced file goes, the new stray one
    # too (_change_data still has a file listed, so it is not an empty folder).
    assert state.vacuum_dry_run(path, 0.4, 168) == 2 + 2 + 1


def test_maintenance_dry_run_starts_no_jvm_and_imports_no_spark(tmp_path: Path) -> None:
    """``cdc maintenance --dry-run`` reads through delta-rs and files: no SparkSession."""
    config = PipelineConfig(storage_root=str(tmp_path))
    for path in (config.layout.bronze(), config.layout.silver("customers")):
        _write(path, [("append", ["a"]), ("append", ["b"]), ("append", ["c"])])
    pipeline = tmp_path / "pipeline.yaml"
    entity = {"name": "customers", "source_topic": "t", "key": ["id"], "sequence_by": ["lsn"]}
    pipeline.write_text(json.dumps({"storage_root": str(tmp_path), "entities": [entity]}))
    args = ["maintenance", "--config", str(pipeline), "--dry-run", "--json"]
    args += ["--ignore-service", "publisher_es", "--ignore-service", "publisher_kafka"]
    report, modules = _cli_in_a_fresh_process(
        args,
        "import sys\nprint(sorted(m for m in ('pyspark', 'delta', 'py4j') if m in sys.modules))",
    )
    assert modules == "[]"
    tables = {t["table"]: t for t in report["tables"]}
    assert set(tables) == {"bronze", "silver/customers"}
    assert report["needs"] == [] and report["notices"] == []
    for table in tables.values():
        assert (table["files"], table["vacuumed_files"]) == (3, 0)
        assert table["optimized_files_removed"] is None


def test_quarantine_list_starts_no_jvm(tmp_path: Path) -> None:
    """``cdc quarantine list`` counts through delta-rs, the ledger joined: no SparkContext
    (its module imports PySpark, for show and replay, but never starts a JVM)."""
    config = PipelineConfig(storage_root=str(tmp_path))
    coordinates = {
        "kafka_topic": pa.array(["t", "t", "t"], pa.string()),
        "kafka_partition": pa.array([0, 0, 1], pa.int32()),
        "kafka_offset": pa.array([5, 9, 2], pa.int64()),
    }
    quarantined = {
        "service": pa.array(["ingestor"] * 3, pa.string()),
        "entity": pa.array(["customers"] * 3, pa.string()),
        "error_kind": pa.array(["corrupt", "corrupt", "unknown_schema"], pa.string()),
        **coordinates,
    }
    write_deltalake(config.layout.quarantine("ingestor"), pa.table(quarantined))
    ledger = {
        "service": pa.array(["ingestor"], pa.string()),
        **{name: column.slice(1, 1) for name, column in coordinates.items()},
        "state": pa.array(["done"], pa.string()),
    }
    write_deltalake(config.layout.replay_ledger(), pa.table(ledger))
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(json.dumps({"storage_root": str(tmp_path)}))
    report, no_jvm = _cli_in_a_fresh_process(
        ["quarantine", "list", "--config", str(pipeline), "--json"],
        "from pyspark import SparkContext\n"
        "print(SparkContext._gateway is None and SparkContext._active_spark_context is None)",
    )
    assert no_jvm == "True"
    assert report["groups"] == [
        {
            "service": "ingestor",
            "entity": "customers",
            "error_kind": "corrupt",
            "rows": 2,
            "replayed": 1,
        },
        {
            "service": "ingestor",
            "entity": "customers",
            "error_kind": "unknown_schema",
            "rows": 1,
            "replayed": 0,
        },
    ]


def test_the_log_state_is_the_same_read_from_a_checkpoint(tmp_path: Path) -> None:
    """Files and kept removals replayed from commits alone, or from a checkpoint and the
    commits after it, are the same; the files are those delta-rs reads."""
    config = PipelineConfig(storage_root=str(tmp_path))
    path = config.layout.bronze()
    _write(path, [("append", ["a"]), ("append", ["b"]), ("append", ["c"])])
    DeltaTable(path).optimize.compact()
    _write(path, [("append", ["d"])])
    version = DeltaTable(path).version()

    def state() -> tuple[list[Any], list[Any]]:
        added, removed = DeltaLogState(config)._file_actions(path, version)
        return sorted(added), sorted((file, vector) for file, vector, _ in removed)

    from_commits = state()
    DeltaTable(path).create_checkpoint()
    assert any(".checkpoint." in name for name in os.listdir(f"{path}/_delta_log"))
    _write(path, [("append", ["e"])])  # after the checkpoint: not in the state read at version
    assert state() == from_commits
    added, removed = from_commits
    assert len(added) == 2 and len(removed) == 3
    in_use = DeltaTable(path, version=version).get_add_actions().column("path").to_pylist()
    assert sorted(file for file, _ in added) == sorted(in_use)


def _cli_in_a_fresh_process(args: list[str], probe: str) -> tuple[Any, str]:
    """Run ``cdc <args>`` (JSON out) in a new Python process, then ``probe`` there.

    Returns the command's JSON report and the last line ``probe`` printed: what the
    command left loaded in the process (modules, a JVM) is seen by nothing else.
    """
    script = (
        "from typer.testing import CliRunner\n"
        "from cdc_cli.main import app\n"
        f"result = CliRunner().invoke(app, {args!r})\n"
        "assert result.exit_code == 0, result.output\n"
        "print(result.stdout)\n"
        f"{probe}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    *report, probed = done.stdout.strip().splitlines()
    return json.loads("\n".join(report)), probed
