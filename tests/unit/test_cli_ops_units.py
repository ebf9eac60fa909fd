"""Broker-free parts of the operator commands: offsets, retention checks, hashing, previews."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from cdc_cli.checkpoints import (
    Commit,
    DeltaPosition,
    data_commits_from,
    delta_position,
    indexed_file_count,
)
from cdc_cli.maintenance import (
    SAFETY_MARGIN,
    RetentionMinimum,
    RetentionTooShortError,
    StreamNeed,
    check_vacuum_minimum,
    check_vacuum_retention,
    health_answer,
    health_endpoints,
    interval_hours,
    tombstone_retention,
)
from cdc_cli.quarantine import preview
from cdc_cli.verify import RowShape, canonical, compare
from cdc_devkit.infra import Endpoints
from cdc_devkit.local_run import EXAMPLE_CONFIG, write_pipeline_config
from cdc_shared.config import EntityConfig, PipelineConfig, load_config
from cdc_shared.layout import SERVICES
from cdc_shared.observability import HealthServer
from pyspark.sql import types as T

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def test_delta_position_reads_the_next_version_to_read() -> None:
    # Caught up after version 4: Delta points at version 5, no file read.
    assert delta_position({"reservoirVersion": 5, "index": -1}).next_version == 5
    # Half-way through version 3's files: version 3 is still needed.
    assert delta_position({"reservoirVersion": 3, "index": 1}).next_version == 3
    # Reading the first snapshot.
    assert delta_position({"reservoirVersion": 1, "index": 0, "isStartingVersion": True}).snapshot
    # Version read to its end.
    assert delta_position({"reservoirVersion": 7, "index": (1 << 63) - 101}).next_version == 8
    with pytest.raises(ValueError, match="not a Delta source offset"):
        delta_position({"topic": {"0": 1}})


# Silver's log as Delta 4.4 writes it (trimmed): a MERGE that updated two rows and inserted
# one (deletion vectors on), a DELETE through a deletion vector, an OPTIMIZE.
MERGE_COMMIT = "\n".join(
    json.dumps(action)
    for action in [
        {"commitInfo": {"operation": "MERGE", "readVersion": 1}},
        {"add": {"path": "part-00000-a.parquet", "size": 1130, "dataChange": True}},
        {"add": {"path": "part-00001-b.parquet", "size": 1137, "dataChange": True}},
        {"cdc": {"path": "_change_data/cdc-00000-c.parquet", "size": 1260, "dataChange": False}},
        {"cdc": {"path": "_change_data/cdc-00001-d.parquet", "size": 1269, "dataChange": False}},
        {"add": {"path": "part-00001-e.parquet", "dataChange": True, "deletionVector": {}}},
        {"remove": {"path": "part-00001-e.parquet", "dataChange": True}},
    ]
)
DELETE_COMMIT = "\n".join(
    json.dumps(action)
    for action in [
        {"commitInfo": {"operation": "DELETE", "readVersion": 2}},
        {"add": {"path": "part-00001-e.parquet", "dataChange": True, "deletionVector": {}}},
        {"remove": {"path": "part-00001-e.parquet", "dataChange": True, "deletionVector": {}}},
    ]
)
OPTIMIZE_COMMIT = "\n".join(
    json.dumps(action)
    for action in [
        {"commitInfo": {"operation": "OPTIMIZE"}},
        {"add": {"path": "part-00000-f.parquet", "dataChange": False}},
        {"remove": {"path": "part-00000-a.parquet", "dataChange": False}},
    ]
)


def test_a_stream_indexes_cdc_files_when_a_commit_has_them_else_files_that_change_data() -> None:
    assert indexed_file_count(MERGE_COMMIT, change_feed=True) == 2  # the cdc actions
    assert indexed_file_count(MERGE_COMMIT, change_feed=False) == 3  # the adds
    assert indexed_file_count(DELETE_COMMIT, change_feed=True) == 2  # add + remove
    assert indexed_file_count(DELETE_COMMIT, change_feed=False) == 1
    assert indexed_file_count(OPTIMIZE_COMMIT, change_feed=True) == 0


def test_a_change_feed_stream_at_the_last_cdc_file_of_a_version_has_read_it() -> None:
    # The offset a publisher's checkpoint holds once it read silver's version 2 (the MERGE
    # above, 2 cdc files) and caught up: Delta stays at version 2, index of the last file.
    offset = {
        "sourceVersion": 1,
        "reservoirId": "a10fcfe3-8f51-428b-a8d4-36ef357a64a5",
        "reservoirVersion": 2,
        "index": 1,
        "isStartingVersion": False,
    }
    commits = {2: MERGE_COMMIT, 3: DELETE_COMMIT}

    def files_in_version(version: int) -> int | None:
        return indexed_file_count(commits[version], change_feed=True)

    assert delta_position(offset, files_in_version) == DeltaPosition(3, False)
    # Without the commit (or when it is gone), the version counts as not read completely.
    assert delta_position(offset).next_version == 2
    assert delta_position(offset, lambda version: None).next_version == 2
    # Half-way through a version's files (a batch limit split its add and remove): needed.
    half_way = {**offset, "reservoirVersion": 3, "index": 0}
    assert delta_position(half_way, files_in_version).next_version == 3
    # Before any file of it (-1), or a snapshot being read: the commit is not asked for.
    asked: list[int] = []

    def counting(version: int) -> int | None:
        asked.append(version)
        return 1

    assert delta_position({**offset, "index": -1}, counting).next_version == 2
    assert delta_position({**offset, "index": 0, "isStartingVersion": True}, counting).snapshot
    assert asked == []


def test_optimize_and_vacuum_commits_are_not_data() -> None:
    history = {
        v: Commit(v, NOW, op)
        for v, op in enumerate(["CREATE TABLE", "WRITE", "OPTIMIZE", "VACUUM START", "MERGE"])
    }
    assert [c.version for c in data_commits_from(history, 0)] == [1, 4]
    assert [c.version for c in data_commits_from(history, 2)] == [4]
    assert data_commits_from(history, 5) == []


def _need(hours_ago: float, service: str = "merger") -> StreamNeed:
    since = NOW - dt.timedelta(hours=hours_ago)
    return StreamNeed(service, "bronze/customers", 4, since, "checkpoint batch 9")


def test_vacuum_retention_must_cover_the_oldest_unread_version_plus_margin() -> None:
    need = _need(10)
    needed = 10 + SAFETY_MARGIN.total_seconds() / 3600
    assert need.hours(NOW) == pytest.approx(needed)
    check_vacuum_retention([need], 11, NOW)
    with pytest.raises(RetentionTooShortError, match="merger still needs version 4") as error:
        check_vacuum_retention([need, _need(1, "publisher_es")], 10, NOW)
    assert "publisher_es" not in str(error.value)  # 10 hours is enough for that one
    check_vacuum_retention([], 0, NOW)  # nothing lags: any retention is safe


def test_delta_retention_intervals_read_as_hours() -> None:
    assert interval_hours("interval 7 days") == interval_hours("interval 1 week") == 168
    assert interval_hours("1 day 12 hours") == 36
    assert interval_hours("INTERVAL 30 minutes") == 0.5
    for bad in ("interval 1 month", "7", "interval many days", ""):
        with pytest.raises(ValueError, match="interval"):
            interval_hours(bad)


def test_vacuum_below_a_tables_delta_minimum_is_refused_naming_it() -> None:
    minimums = [
        RetentionMinimum("bronze/customers", 168, "not set: Delta's default"),
        RetentionMinimum("silver/customers", 2, "= 'interval 2 hours'"),
    ]
    check_vacuum_minimum(minimums, 168)
    with pytest.raises(RetentionTooShortError, match="below Delta's minimum") as error:
        check_vacuum_minimum(minimums, 24)
    assert "bronze/customers: 168 hours" in str(error.value)
    assert "silver/customers" not in str(error.value)  # 24 hours is enough for that one
    assert "--vacuum-hours 168 or more" in str(error.value)


def test_tombstone_retention_comes_from_the_configuration_and_may_only_grow() -> None:
    assert tombstone_retention(168, None) == 168
    assert tombstone_retention(None, None) is None  # null: kept forever
    assert tombstone_retention(168, 200) == 200
    with pytest.raises(RetentionTooShortError, match=r"shorter than merger\.tombstone_retention"):
        tombstone_retention(168, 24)
    with pytest.raises(RetentionTooShortError, match="null: tombstones are kept"):
        tombstone_retention(None, 1000)


def test_every_configured_health_port_is_probed_and_a_service_answering_counts() -> None:
    config = PipelineConfig.model_validate(
        {
            "ingestor": {"metrics_port": 0},
            "merger": {"metrics_port": 9102, "metrics_host": "10.0.0.7"},
            "publisher_kafka": {"metrics_port": 0},
            "publisher_es": {"metrics_port": 9104, "metrics_host": "::1"},
            "application": {"metrics_port": 9100},
        }
    )
    assert health_endpoints(config) == [
        ("merger", "http://10.0.0.7:9102/health"),
        ("publisher-es", "http://[::1]:9104/health"),
        ("cdc run", "http://127.0.0.1:9100/health"),  # bound to every address: probed here
    ]
    server = HealthServer("127.0.0.1", 0, lambda: {"status": "failed"}).start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        assert health_answer(f"{url}/health") == "answers 503"  # failing, but running
        assert health_answer(f"{url}/other") is None  # 404: not a service's /health
    finally:
        server.stop()
    assert health_answer(f"{url}/health") is None  # connection refused: nothing runs there


def test_values_from_every_side_hash_alike() -> None:
    ts = T.TimestampType()
    micros = 1_767_225_600_123_000
    assert canonical(ts, "2026-01-01T00:00:00.123000+00:00") == micros
    assert canonical(ts, dt.datetime(2026, 1, 1, 0, 0, 0, 123000, tzinfo=dt.UTC)) == micros
    assert canonical(ts, "2026-01-01T01:00:00.123+01:00") == micros
    assert canonical(T.DecimalType(10, 2), 12.5) == canonical(T.DecimalType(10, 2), "12.50")
    assert canonical(T.DecimalType(10, 2), Decimal("12.5")) == "12.50"
    assert canonical(T.DateType(), dt.date(2026, 1, 2)) == canonical(T.DateType(), "2026-01-02")
    assert canonical(T.BinaryType(), b"\x00\xff") == canonical(T.BinaryType(), "AP8=")


def test_compare_lists_missing_extra_and_different_keys() -> None:
    schema = T.StructType(
        [
            T.StructField("id", T.IntegerType()),
            T.StructField("name", T.StringType()),
            T.StructField("_cdc_seq", T.ArrayType(T.LongType())),
        ]
    )
    shape = RowShape.of(schema, EntityConfig(name="c", source_topic="t", key=["id"]))
    rows = [{"id": i, "name": f"n{i}", "_cdc_seq": [i]} for i in range(4)]
    silver = {shape.key_of(r): shape.hash_of(r) for r in rows}
    target = dict(silver)
    del target[(0,)]
    target[(1,)] = shape.hash_of({"id": 1, "name": "changed"})
    target[(9,)] = shape.hash_of({"id": 9, "name": "n9"})
    # Metadata columns are not content: another sequence, same hash.
    assert shape.hash_of({**rows[2], "_cdc_seq": [99]}) == silver[(2,)]

    result = compare("elasticsearch", "idx", shape, silver, target)
    assert (result.missing, result.extra, result.different, result.ok) == (1, 1, 1, False)
    assert result.examples == {"missing": ["id=0"], "extra": ["id=9"], "different": ["id=1"]}


def test_preview_shows_length_hex_and_escaped_bytes() -> None:
    assert preview(None) == "<null>"
    text = preview(b"\xc3\x01abc" * 10, width=4)
    assert text.startswith("50 bytes  hex c3 01 61 62...")
    assert "b'\\xc3\\x01ab'..." in text


def test_local_run_gives_each_service_its_own_metrics_port(tmp_path: Path) -> None:
    """The demo's four services each get a distinct free port (one shared port is fatal)."""
    served = Endpoints("127.0.0.1:1", "http://127.0.0.1:2")
    for _ in range(20):
        document = yaml.safe_load(write_pipeline_config(tmp_path, served).read_text())
        sections = ("ingestor", "merger", "publisher_kafka", "publisher_es")
        ports = {document[s]["metrics_port"] for s in sections}
        assert len(ports) == len(sections) and all(p > 0 for p in ports)


def test_local_run_copies_the_example_into_many_tables_each_with_its_own_names(
    tmp_path: Path,
) -> None:
    """``cdc chaos --tables 24 --one-query``'s pipeline: a valid file, no name shared."""
    served = Endpoints("127.0.0.1:1", "http://127.0.0.1:2")
    path = write_pipeline_config(tmp_path, served, tables=24, one_query=True)
    config = load_config(path)
    assert len(config.entities) == 24
    for names in (
        [e.name for e in config.entities],
        [e.source_topic for e in config.entities],
        [e.change_topic for e in config.entities],
        [e.es_index for e in config.entities],
    ):
        assert len(set(names)) == 24, names
    example = yaml.safe_load(EXAMPLE_CONFIG.read_text())["entities"]
    first = [f"{e['name']}_t00{i}" for i, e in enumerate(example)]
    assert [e.name for e in config.entities[: len(example)]] == first
    assert all(config.runs_one_query(service) for service in SERVICES)
