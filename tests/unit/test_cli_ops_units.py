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
    DeltaLog,
    TopicPosition,
    change_feed_versions,
    data_commits_from,
    indexed_file_count,
    merger_backlog,
    parse_commit,
    position_at,
    recorded_positions,
)
from cdc_cli.liveness import health_answer, health_endpoints
from cdc_cli.quarantine import preview
from cdc_cli.retention import (
    RetentionMinimum,
    RetentionTooShortError,
    check_vacuum_minimum,
    interval_hours,
)
from cdc_cli.stream_needs import (
    SAFETY_MARGIN,
    StreamNeed,
    check_vacuum_retention,
    merger_log_notices,
)
from cdc_cli.tombstone_expiry import tombstone_retention
from cdc_cli.verify import RowShape, canonical, compare
from cdc_devkit.infra import Endpoints
from cdc_devkit.local_run import EXAMPLE_CONFIG, write_pipeline_config
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.streaming.observability import HealthServer
from pyspark.sql import types as T

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


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


def _bronze_commit(
    version: int,
    rows: dict[str, int],
    positions: dict[str, dict[str, int]] | None = None,
    held: dict[str, str] | None = None,
    operation: str = "WRITE",
) -> str:
    """A bronze commit file as Delta Lake writes the ingestor's append (trimmed): one
    file per entity with its row count, the ingestor's record in ``userMetadata``."""
    info: dict[str, object] = {"timestamp": 1_767_225_600_000 + version, "operation": operation}
    if positions is not None:
        record = {"group": "default", "positions": positions, "held": held or {}}
        info["userMetadata"] = json.dumps({"cdc_ingestor": record})
    actions: list[dict[str, object]] = [{"commitInfo": info}]
    for entity, count in rows.items():
        add = {
            "path": f"entity={entity}/part-{version}.parquet",
            "partitionValues": {"entity": entity},
            "dataChange": operation != "OPTIMIZE",
            "stats": json.dumps({"numRecords": count}),
        }
        actions.append({"add": add})
    return "\n".join(json.dumps(action) for action in actions)


class LogFiles:
    """A table's commit files in memory, as a StateReader reads them; counts the reads."""

    def __init__(self, path: str, commits: dict[int, str]) -> None:
        self.path = path
        self.commits = commits
        self.read: list[int] = []

    def list_names(self, path: str) -> list[str] | None:
        return None

    def read_text_if_exists(self, path: str) -> str | None:
        version = int(path.rsplit("/", 1)[1].removesuffix(".json"))
        self.read.append(version)
        return self.commits.get(version)

    def table_version(self, path: str) -> int | None:
        return max(self.commits) if path == self.path else None

    def history(self, path: str, since: int = 0) -> dict[int, Commit]:
        raise NotImplementedError

    def count_by(self, path: str, column: str) -> dict[str, int] | None:
        raise NotImplementedError

    def transaction_version(self, path: str, app_id: str) -> int | None:
        raise NotImplementedError


class Root(LogFiles):
    """Bronze's commit files, and what silver's logs record of the merger's progress."""

    def __init__(
        self, config: PipelineConfig, commits: dict[int, str], progress: dict[str, int]
    ) -> None:
        super().__init__(config.layout.bronze(), commits)
        self.progress = {config.layout.silver(e): p for e, p in progress.items()}
        self.properties: dict[str, str] = {}

    def table_version(self, path: str) -> int | None:
        return 0 if path in self.progress else super().table_version(path)

    def transaction_version(self, path: str, app_id: str) -> int | None:
        return self.progress.get(path) if app_id == "cdc-merger" else None

    def table_properties(self, path: str) -> dict[str, str]:
        return self.properties


def test_a_merger_progress_beyond_bronzes_log_retention_is_said() -> None:
    """An idle table needs none of bronze's files, but a merger query on a new checkpoint
    reads bronze's log from its progress: once Delta may have removed it, say so."""
    entities = [
        {"name": name, "source_topic": topic, "key": ["id"], "sequence_by": ["lsn"]}
        for name, topic in (("customers", "c"), ("orders", "o"))
    ]
    config = PipelineConfig(storage_root="/root", entities=entities)
    root = Root(config, _bronze().commits, {"customers": 3, "orders": 7})  # committed in January
    now = dt.datetime(2026, 6, 1, tzinfo=dt.UTC)
    (notice,) = merger_log_notices(config, root, now)  # type: ignore[arg-type]
    assert notice.startswith("bronze: customers is merged through version 3, older than")
    root.properties = {"delta.logRetentionDuration": "interval 365 days"}
    assert merger_log_notices(config, root, now) == []  # type: ignore[arg-type]
    root.progress = dict.fromkeys(root.progress, 7)  # every table at bronze's latest version
    root.properties = {}
    assert merger_log_notices(config, root, now) == []  # type: ignore[arg-type]


def test_a_bronze_commit_says_whose_rows_it_adds_and_where_the_ingestor_stands() -> None:
    text = _bronze_commit(
        7, {"customers": 3, "orders": 2}, {"t.customers": {"0": 10}}, {"orders": "stopped"}
    )
    commit = parse_commit(7, text)
    assert commit.entity_rows == {"customers": 3, "orders": 2}
    assert commit.ingestor is not None
    assert commit.ingestor.positions == {"t.customers": {"0": 10}}
    assert commit.ingestor.held == {"orders": "stopped"}
    assert commit.change_feed_files == 2  # an append: its adds are the change feed
    compacted = parse_commit(8, _bronze_commit(8, {"customers": 5}, operation="OPTIMIZE"))
    assert compacted.entity_rows == {} and compacted.ingestor is None
    assert compacted.change_feed_files == 0
    # Retention's DELETE rewrites the files it keeps rows of: they are no new rows.
    retained = parse_commit(9, _bronze_commit(9, {"customers": 4}, operation="DELETE"))
    assert retained.entity_rows == {} and retained.ingestor is None


def _bronze() -> LogFiles:
    """Bronze of two tables of two groups: customers (topic c) and orders (topic o)."""
    return LogFiles(
        "bronze",
        {
            0: _bronze_commit(0, {}, operation="CREATE TABLE"),
            1: _bronze_commit(1, {"customers": 4}, {"c": {"0": 4}}),
            2: _bronze_commit(2, {"orders": 2}, {"o": {"0": 2}}),
            3: _bronze_commit(3, {"customers": 1}, {"c": {"0": 5}}),
            4: _bronze_commit(4, {}, {"c": {"0": 7}}),  # two records, both quarantined
            5: _bronze_commit(5, {"orders": 6}, {"o": {"0": 8}}),
            6: _bronze_commit(6, {"customers": 9}, operation="OPTIMIZE"),
            7: _bronze_commit(7, {"orders": 1}, {"o": {"0": 9}}),
        },
    )


def test_the_merger_backlog_is_the_versions_after_its_progress_with_rows_of_the_table() -> None:
    files = _bronze()
    bronze = DeltaLog(files, "bronze")
    backlog = merger_backlog(bronze, "orders", "o", 2, {"0": 9})
    assert [c.version for c in backlog.versions] == [5, 7]
    assert (backlog.count, backlog.rows, backlog.oldest) == (2, 7, 5)
    # Caught up, or only compactions and other tables' rows since: nothing to read.
    assert merger_backlog(bronze, "orders", "o", 7, {"0": 9}).count == 0
    assert merger_backlog(bronze, "customers", "c", 3, None).count == 0
    # Nothing merged yet: every version with its rows, back to the log's start.
    assert [c.version for c in merger_backlog(bronze, "customers", "c", -1, None).versions] == [
        1,
        3,
    ]


def test_an_idle_table_costs_no_read_beyond_where_its_progress_stood() -> None:
    """Its progress stays at its last change however far bronze moves on: where the
    ingestor wrote its topic, at most, is no further than at the progress: done."""
    files = _bronze()
    backlog = merger_backlog(DeltaLog(files, "bronze"), "customers", "c", 4, {"0": 7})
    assert backlog.count == 0
    assert max(files.read) == 4  # where the topic stood at the progress: nothing after it
    # Told nothing of the topic, it reads back from the newest commit, and stops at the
    # first that names the topic no further than the progress: nothing older is unmerged.
    # Here a group of both tables, whose every commit names both topics.
    group = {0: _bronze_commit(0, {}, operation="CREATE TABLE")}
    group[1] = _bronze_commit(1, {"customers": 4}, {"c": {"0": 4}, "o": {"0": 0}})
    for version in range(2, 301):
        group[version] = _bronze_commit(
            version, {"orders": 1}, {"c": {"0": 4}, "o": {"0": version}}
        )
    files = LogFiles("bronze", group)
    assert merger_backlog(DeltaLog(files, "bronze"), "customers", "c", 1, None).count == 0
    assert min(v for v in files.read if v > 1) > 200  # the newest few dozen, not 299


def test_a_lost_commit_after_the_progress_counts_and_is_said() -> None:
    files = _bronze()
    del files.commits[5]
    backlog = merger_backlog(DeltaLog(files, "bronze"), "orders", "o", 2, {"0": 9})
    assert (backlog.count, backlog.unreadable, backlog.rows) == (2, (5,), None)


def test_the_newest_commit_naming_a_topic_says_its_position_and_whether_it_is_held() -> None:
    files = _bronze()
    files.commits[8] = _bronze_commit(8, {}, {"o": {"0": 9}}, {"orders": "registry down"})
    positions = recorded_positions(DeltaLog(files, "bronze"), {"c": "customers", "o": "orders"})
    assert positions["c"] == TopicPosition(4, "default", {"0": 7}, None)
    assert positions["o"] == TopicPosition(8, "default", {"0": 9}, "registry down")
    assert position_at(DeltaLog(files, "bronze"), "o", 4) == {"0": 2}
    assert position_at(DeltaLog(files, "bronze"), "o", 1) == {}  # not written before


def test_a_publisher_lags_by_the_silver_versions_whose_change_feed_holds_changes() -> None:
    """A MERGE that matched nothing (the merger's progress alone) and an OPTIMIZE hold no
    change: a publisher that did not publish after them is not behind."""
    empty_merge = (
        json.dumps({"commitInfo": {"operation": "MERGE"}})
        + "\n"
        + json.dumps({"txn": {"appId": "cdc-merger", "version": 9}})
    )
    silver = LogFiles(
        "silver",
        {1: MERGE_COMMIT, 2: empty_merge, 3: OPTIMIZE_COMMIT, 4: DELETE_COMMIT},
    )
    changed, unreadable = change_feed_versions(DeltaLog(silver, "silver"), 1)
    assert ([c.version for c in changed], unreadable) == ([4], [])
    changed, _ = change_feed_versions(DeltaLog(silver, "silver"), 4)
    assert changed == []


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
    return StreamNeed(service, "bronze", 4, since, "customers merged through version 3")


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
    """``cdc chaos --tables 24``'s pipeline: a valid file, no name shared."""
    served = Endpoints("127.0.0.1:1", "http://127.0.0.1:2")
    path = write_pipeline_config(tmp_path, served, tables=24)
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


def test_the_names_the_cli_reads_without_pyspark_are_the_services_own() -> None:
    """The read-only commands name what the services write without importing them (their
    modules import PySpark): the one name kept outside ``cdc_shared.contracts.layout`` agrees."""
    from cdc_cli import status
    from cdc_publisher_es import progress

    assert status.ES_PROGRESS_FIELD in progress._MAPPINGS["properties"]
