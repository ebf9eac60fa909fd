"""The operator commands against a real pipeline: status, quarantine, maintenance, verify.

One pipeline (customers, in a group of its own, ``people``) is built once for the module
by running the real services: generate -> produce -> ingest -> merge -> publish-kafka,
plus silver indexed into Elasticsearch the way publisher-es writes it (publisher-es
itself never runs: it shows as not started). The tests then run in file order, each
leaving the pipeline as the next one expects (noted per test); a few build pipelines of
their own.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cdc_cli import quarantine
from cdc_cli.delta_log import DeltaLogState
from cdc_cli.maintenance import run_maintenance
from cdc_cli.spark_state import SparkState
from cdc_cli.status import collect_status
from cdc_cli.stream_needs import bronze_needs, silver_needs
from cdc_devkit.workload import GeneratedMessage, ProduceReport, produce
from cdc_merger.apply import ERROR_KIND, ERROR_MESSAGE
from cdc_merger.main import start as start_merger
from cdc_merger.merging import quarantine_rows
from cdc_merger.silver_tables import SILVER_PROPERTIES
from cdc_publisher_es.progress import IndexProgress
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.clients.delta_rs import transaction_versions
from cdc_shared.config.connections import ElasticsearchConfig, KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.contracts.bronze import entity_changes
from cdc_shared.contracts.layout import MERGER_PROGRESS_APP
from cdc_shared.streaming.tables import idempotent_append, record_progress
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from support.ingestion import bronze, generate, generate_across_schema_change, ingest_once
from support.ops import (
    build_pipeline,
    cdc,
    cdc_json,
    index_documents,
    replay_origins,
    silver_documents,
)
from support.pipelines import Pipeline
from support.publishing import publish_once
from support.silver import merge_once, without_auto_compaction
from support.waiting import free_port

pytestmark = pytest.mark.integration

ENTITY = "customers"
GROUP = "people"


@dataclass
class World:
    """The module's pipeline and what was produced into it."""

    pipeline: Pipeline
    report: ProduceReport
    late_v2: list[GeneratedMessage]  # written with a schema the ingestor does not know yet
    redelivered: list[GeneratedMessage]  # valid records delivered a second time
    documents: dict[str, dict[str, object]]  # what Elasticsearch holds, by id

    @property
    def config_args(self) -> tuple[str, str]:
        return ("--config", str(self.pipeline.path))


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    spark: SparkSession,
    kafka_config: KafkaConfig,
    es_config: ElasticsearchConfig,
) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("cli-ops")
    pipeline = build_pipeline(
        folder,
        kafka_config,
        es_config,
        # A group of its own: status names it, and its queries' checkpoints.
        groups=[{"name": GROUP, "tables": [ENTITY]}],
        ingestor={"metrics_port": 0},
        # Several bronze commits, each merged by a batch of its own: several silver
        # commits. Deletion vectors at every size: the readers without a JVM must read them.
        merger={
            "metrics_port": 0,
            "max_files_per_trigger": 1,
            "deletion_vectors_from_mib": 0,
        },
        publisher_kafka={"metrics_port": 0},
    )
    # The producer knows value schema v2 from the start; the pipeline learns it later.
    messages, switch = generate_across_schema_change(
        pipeline,
        ENTITY,
        folder,
        events=800,
        keys=150,
        poison_share=0.02,
        redelivery_share=0.02,
        delete_share=0.15,
        schema_change_at=0.8,
    )
    v2 = messages[switch].value[2:10]  # type: ignore[index]
    late_v2 = [m for m in messages[switch:] if m.value and m.value[2:10] == v2][:20]

    report = produce(kafka_config, iter(messages[:switch]))
    with without_auto_compaction(spark):  # so `cdc maintenance` finds files to compact
        ingest_once(pipeline, spark, max_offsets=200)
        merge_once(pipeline, spark)
    publish_once(pipeline, spark)
    documents = silver_documents(spark, pipeline.config, ENTITY)
    index_documents(es_config, pipeline.config.entity(ENTITY).es_index_name, documents)
    yield World(pipeline, report, late_v2, messages[:5], documents)
    es = make_elasticsearch(es_config)
    es.indices.delete(index=pipeline.config.entity(ENTITY).es_index_name, ignore_unavailable=True)
    es.close()


def _entity_status(world: World) -> dict[str, object]:
    report = cdc_json("status", *world.config_args)
    (status,) = report["entities"]
    return {
        "bronze": status["bronze_version"],
        "silver": status["silver_version"],
        **{s["service"]: s["lag"] for s in status["streams"]},
        "quarantine": report["quarantine"].get("ingestor", {}).get(ENTITY),
    }


def _version(spark: SparkSession, path: str) -> int:
    return int(DeltaTable.forPath(spark, path).history(1).head()["version"])  # type: ignore[index]


def _last_write(spark: SparkSession, path: str) -> int:
    """The table's newest version but compactions (bronze's auto compaction may follow)."""
    history = DeltaTable.forPath(spark, path).history().where("operation != 'OPTIMIZE'")
    return int(history.agg(F.max("version")).first()[0])  # type: ignore[index]


def _merger_progress(config: PipelineConfig, entity: str = ENTITY) -> int | None:
    """The bronze version silver's log says the entity is merged through."""
    return transaction_versions(
        config, {entity: config.layout.silver(entity)}, MERGER_PROGRESS_APP
    )[entity]


def test_status_after_one_pass_shows_no_lag(world: World, spark: SparkSession) -> None:
    config = world.pipeline.config
    status = _entity_status(world)
    assert status == {
        "bronze": _version(spark, config.layout.bronze()),
        "silver": _version(spark, config.layout.silver(ENTITY)),
        "ingestor": 0,
        "merger": 0,
        "publisher_kafka": 0,
        "publisher_es": None,  # never started: no progress document
        "quarantine": len(world.report.poison),
    }
    assert len(world.report.poison) > 0
    # Where each table stands, in its group: bronze's record, silver's progress.
    (entity,) = cdc_json("status", *world.config_args)["entities"]
    assert entity["group"] == GROUP
    streams = {s["service"]: s for s in entity["streams"]}
    assert {s["group"] for s in streams.values()} == {GROUP}
    assert streams["ingestor"]["note"] == f"written to bronze v{status['bronze']}"
    assert streams["merger"]["note"] == f"merged through bronze v{_merger_progress(config)}"
    assert streams["merger"]["batch"] is not None and streams["ingestor"]["batch"] is not None
    assert streams["publisher_es"]["batch"] is None  # its group's query never ran

    text = cdc("status", *world.config_args)
    assert text.exit_code == 0, text.output
    assert f"{ENTITY}  (group {GROUP}; bronze v" in text.stdout
    assert "publisher_es" in text.stdout and "not started" in text.stdout


def test_status_without_a_jvm_reads_what_spark_reads(world: World, spark: SparkSession) -> None:
    """The default engine (delta-rs, checkpoint files read directly) reports exactly what
    the Spark engine reads of the same tables and checkpoints (silver with deletion
    vectors and a change feed), in a process that never imports PySpark."""
    through_spark = collect_status(world.pipeline.config, spark=spark, engine="spark")
    script = (
        "import json, sys\n"
        "from cdc_cli.status import collect_status\n"
        "from cdc_shared.config.pipeline import load_config\n"
        f"report = collect_status(load_config({str(world.pipeline.path)!r}))\n"
        "assert 'pyspark' not in sys.modules, 'PySpark was imported'\n"
        "print(json.dumps(report.to_dict()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(json.dumps(through_spark.to_dict()))


def _copy_of_the_world(world: World, folder: Path) -> Path:
    """A copy of the world's storage root (file times kept), and its pipeline file with
    every metrics port off."""
    root = folder / "root"
    shutil.copytree(world.pipeline.config.storage_root, root)
    document = yaml.safe_load(Path(_maintenance_config(world, "copy")[1]).read_text())
    document["storage_root"] = str(root)
    document["merger"]["tombstone_retention_hours"] = 0.0003
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _backdate(table: str, hours: float) -> None:
    """Make every file of a local table but its log ``hours`` old."""
    moment = time.time() - hours * 3600
    for file in Path(table).rglob("*"):
        if file.is_file() and "_delta_log" not in file.parts:
            os.utime(file, (moment, moment))


def test_maintenance_dry_run_without_a_jvm_reads_what_spark_reads(
    world: World, spark: SparkSession, tmp_path: Path
) -> None:
    """The dry run's default engine (delta-rs, the logs and checkpoint files read
    directly) reports what the Spark engine (Delta Lake's own VACUUM DRY RUN) does.

    On a copy of the pipeline whose silver has files 200 hours old that an OPTIMIZE
    removed just now (their removal, which the log keeps for 168 hours, keeps them and
    their old deletion vectors from a 168-hour VACUUM, not from a 0-hour one), old change
    data if an update wrote any, and newer deletion vectors.
    """
    config = load_config(_copy_of_the_world(world, tmp_path))
    path = config.layout.silver(ENTITY)
    silver = DeltaTable.forPath(spark, path)
    keys = sorted(int(key) for key in world.documents)
    with without_auto_compaction(spark):
        silver.update(F.col("id") == keys[0], {"email": F.lit("changed@example.com")})
        silver.delete(F.col("id") == keys[1])
        _backdate(path, hours=200)
        silver.delete(F.col("id").isin(keys[2], keys[-1]))
        silver.optimize().executeCompaction()
    in_use = {Path(f).name for f in spark.read.format("delta").load(path).inputFiles()}
    cutoff = time.time() - 168 * 3600
    unused_old = [
        f
        for f in Path(path).glob("*.parquet")
        if f.name not in in_use and f.stat().st_mtime < cutoff
    ]
    assert len(unused_old) >= 3, unused_old
    old = spark.sql(f"VACUUM delta.`{path}` RETAIN 168 HOURS DRY RUN").count()

    forced = {"force_short_retention": True, "quiet": dt.timedelta(0)}
    publishers = ("publisher_es", "publisher_kafka")  # publisher-kafka: behind the deletes
    settings: list[dict[str, Any]] = [
        {},  # publisher-es never ran: it holds VACUUM back to version 0
        {"vacuum_hours": 0, **forced, "ignore_services": publishers},
        {"vacuum_hours": 1.4, **forced, "ignore_services": publishers},
    ]
    for options in settings:
        through_spark = run_maintenance(
            config, dry_run=True, engine="spark", spark=spark, **options
        ).to_dict()
        without_jvm = run_maintenance(config, dry_run=True, **options).to_dict()
        assert without_jvm["tables"] == through_spark["tables"], options
        # Commit times: the commit's own (delta-rs) or its log file's (Delta Lake's history).
        for needs in (without_jvm["needs"], through_spark["needs"]):
            for need in needs:
                need["since"] = dt.datetime.fromisoformat(need.pop("since"))
        assert len(without_jvm["needs"]) == len(through_spark["needs"])
        for ours, theirs in zip(without_jvm["needs"], through_spark["needs"], strict=True):
            assert abs(ours.pop("since") - theirs.pop("since")) < dt.timedelta(seconds=2)
            assert ours == theirs, options
        if options.get("vacuum_hours") == 0:  # every file no longer in use, new or old
            vacuumed = {t["table"]: t["vacuumed_files"] for t in without_jvm["tables"]}
            assert vacuumed[f"silver/{ENTITY}"] >= old + len(unused_old)
        assert without_jvm["notices"] == through_spark["notices"] == [], options


def test_maintenance_leaves_an_earlier_releases_tables_alone_and_says_so(
    world: World, spark: SparkSession, tmp_path: Path
) -> None:
    """On a copy of the pipeline: an entity's bronze table and stream checkpoints of the
    releases before one bronze are named, never maintained; once silver's log records
    the merger's drain of that table, it can be deleted."""
    config = load_config(_copy_of_the_world(world, tmp_path))
    old_bronze = config.layout.legacy_bronze(ENTITY)
    spark.range(3).write.format("delta").save(old_bronze)
    checkpoint = Path(config.layout.legacy_checkpoint("merger", ENTITY))
    (checkpoint / "commits").mkdir(parents=True)
    ignored = {"ignore_services": ("publisher_es",)}

    for engine in ("delta-rs", "spark"):
        report = run_maintenance(config, dry_run=True, engine=engine, spark=spark, **ignored)
        assert f"bronze/{ENTITY}" not in {t.table for t in report.tables}
        (table, checkpoints) = report.notices
        assert table.startswith(f"bronze/{ENTITY}: ") and "drains it" in table
        assert checkpoints.startswith(str(checkpoint.parent)) and f"({ENTITY})" in checkpoints
    text = cdc("maintenance", "--config", str(tmp_path / "pipeline.yaml"), "--dry-run")
    assert text.exit_code == 0, text.output
    assert f"note: bronze/{ENTITY}: " in text.stdout

    record_progress(spark, config.layout.silver(ENTITY), ("cdc-merger-legacy", 1))  # drained
    report = run_maintenance(config, dry_run=True, **ignored)
    assert "it can be deleted" in report.notices[0]
    assert _version(spark, old_bronze) == 0  # never touched


def test_a_publisher_lags_by_the_silver_versions_with_changes_after_its_progress(
    tmp_path: Path, spark: SparkSession, kafka_config: KafkaConfig, es_config: ElasticsearchConfig
) -> None:
    """publisher-es's progress is its alias's document (or, before its first start of this
    release, the stream checkpoint of an earlier release): status measures silver's
    versions with changes after it, and VACUUM keeps what those need. A version without
    a change (an OPTIMIZE) is no lag.

    A silver table of its own, not the module's pipeline.
    """
    config = build_pipeline(tmp_path, kafka_config, es_config).config
    silver = config.layout.silver(ENTITY)
    properties = ", ".join(f"'{k}' = '{v}'" for k, v in SILVER_PROPERTIES.items())
    updates = spark.createDataFrame([(1, "b"), (4, "n")], "id BIGINT, name STRING")
    with without_auto_compaction(spark):  # the MERGE stays the last version
        spark.sql(
            f"CREATE TABLE delta.`{silver}` USING delta TBLPROPERTIES ({properties}) "
            "AS SELECT id, 'a' AS name FROM range(3)"
        )
        (
            DeltaTable.forPath(spark, silver)
            .alias("s")
            .merge(updates.alias("u"), "s.id = u.id")
            .whenMatchedUpdateAll()
            .whenNotMatchedInsertAll()
            .execute()
        )  # an update: the version has cdc files
    merged = _version(spark, silver)
    entity = config.entity(ENTITY)
    ignored = ("merger", "publisher_kafka")

    def publisher_es() -> tuple[int | None, str]:
        (status,) = collect_status(config, [ENTITY], spark).entities
        stream = status.stream("publisher_es")
        return stream.lag, stream.note

    assert publisher_es() == (None, "not started")
    # The checkpoint an earlier release's stream left, having read version 1 (the MERGE)
    # to its end: its next batch would start at version 2.
    checkpoint = Path(config.layout.legacy_checkpoint("publisher_es", ENTITY))
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    offset = {"reservoirVersion": merged + 1, "index": -1, "isStartingVersion": False}
    (checkpoint / "offsets" / "0").write_text(f'v1\n{{"batchWatermarkMs":0}}\n{json.dumps(offset)}')
    (checkpoint / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}')
    lag, note = publisher_es()
    assert lag == 0 and "by an earlier release" in note

    es = make_elasticsearch(es_config)
    progress = IndexProgress(es, config.publisher_es.progress_index)
    alias = entity.es_index_name
    try:
        progress.write(alias, ENTITY, merged - 1)  # behind the MERGE: it needs it
        assert publisher_es() == (1, f"indexed up to silver v{merged - 1}")
        (need,) = silver_needs(config, entity, SparkState(spark), ignored)
        assert (need.service, need.table, need.version) == ("publisher_es", f"silver/{ENTITY}", 1)

        progress.write(alias, ENTITY, merged)
        assert publisher_es() == (0, f"indexed up to silver v{merged}")
        DeltaTable.forPath(spark, silver).optimize().executeCompaction()  # no change
        assert publisher_es()[0] == 0
        assert silver_needs(config, entity, SparkState(spark), ignored) == []  # VACUUM at will

        DeltaTable.forPath(spark, silver).delete("id = 2")  # a version not published yet
        assert publisher_es()[0] == 1
        (need,) = silver_needs(config, entity, SparkState(spark), ignored)
        assert need.version == _version(spark, silver)
    finally:
        es.delete(index=config.publisher_es.progress_index, id=alias, refresh=True)
        es.close()


def test_quarantine_list_and_show_match_the_generated_poison(world: World) -> None:
    groups = cdc_json("quarantine", "list", *world.config_args, "--entity", ENTITY)["groups"]
    expected = Counter(kind for _, _, _, kind in world.report.poison)
    assert {g["error_kind"]: g["rows"] for g in groups} == dict(expected)
    assert all(g["service"] == "ingestor" and g["replayed"] == 0 for g in groups)

    shown = cdc_json(
        "quarantine", "show", *world.config_args, "--service", "ingestor", "--limit", "3"
    )["records"]
    assert len(shown) == 3
    poisoned = {f"{t}/{p}@{o}" for t, p, o, _ in world.report.poison}
    assert {r["coordinates"] for r in shown} <= poisoned

    text = cdc("quarantine", "show", *world.config_args, "--service", "ingestor", "--limit", "1")
    assert text.exit_code == 0, text.output
    assert "value" in text.stdout and "bytes  hex" in text.stdout

    bad = cdc("quarantine", "show", *world.config_args, "--service", "nope")
    assert bad.exit_code == 2 and "unknown service" in bad.output


def test_verify_agrees_then_reports_a_document_deleted_from_es(
    world: World, es_config: ElasticsearchConfig
) -> None:
    report = cdc_json("verify", *world.config_args)
    assert report["ok"] is True
    (entity,) = report["entities"]
    assert entity["silver_rows"] == len(world.documents)
    assert {t["target"]: t["rows"] for t in entity["targets"]} == {
        "elasticsearch": len(world.documents),
        "change_topic": len(world.documents),
    }
    # A few hundred rows make one bucket; no bucket differs.
    assert [(t["buckets"], t["buckets_differing"]) for t in entity["targets"]] == [(1, 0)] * 2

    index = world.pipeline.config.entity(ENTITY).es_index_name
    victim = sorted(world.documents)[0]
    es = make_elasticsearch(es_config)
    try:
        es.delete(index=index, id=victim, refresh=True)
        result = cdc("verify", *world.config_args, "--json", "--buckets", "8")
        assert result.exit_code == 1, result.output
        (entity,) = json.loads(result.stdout)["entities"]
        targets = {t["target"]: t for t in entity["targets"]}
        topic_side = targets["change_topic"]
        assert (topic_side["missing"], topic_side["buckets_differing"]) == (0, 0)
        assert topic_side["buckets"] == 8
        es_side = targets["elasticsearch"]
        assert (es_side["missing"], es_side["extra"], es_side["different"]) == (1, 0, 0)
        assert es_side["examples"] == {"missing": [f"id={victim}"]}
        assert (es_side["buckets"], es_side["buckets_differing"]) == (8, 1)  # drilled into one

        text = cdc("verify", *world.config_args, "--target", "elasticsearch", "--buckets", "8")
        assert text.exit_code == 1 and f"missing: id={victim}" in text.stdout
        assert "1 of 8 buckets differ" in text.stdout
    finally:
        index_documents(es_config, index, {victim: world.documents[victim]})
        es.close()


def _maintenance_config(world: World, name: str, **merger: object) -> tuple[str, str]:
    """``--config`` for the world's pipeline with every metrics port off (nothing to probe
    but what a test sets) and these merger settings."""
    document = yaml.safe_load(world.pipeline.path.read_text())
    for section in ("ingestor", "merger", "publisher_kafka", "publisher_es", "application"):
        document[section] = {**document.get(section, {}), "metrics_port": 0}
    document["merger"].update(merger)
    path = world.pipeline.path.with_name(f"maintenance-{name}.yaml")
    path.write_text(yaml.safe_dump(document))
    return ("--config", str(path))


def _tombstones(spark: SparkSession, world: World) -> DataFrame:
    return spark.read.format("delta").load(world.pipeline.config.layout.tombstones(ENTITY))


def _dry_run_then_run(world: World, spark: SparkSession, *args: str) -> dict[str, Any]:
    """``cdc maintenance --dry-run`` then the run; the run's tables.

    The dry run commits to no table; it counts the files the run's OPTIMIZE then
    bin-packs, and its VACUUM lists at most what the run's deletes (the run's OPTIMIZE
    replaces files too).
    """
    layout = world.pipeline.config.layout
    paths = (layout.bronze(), layout.silver(ENTITY), layout.tombstones(ENTITY))

    def versions() -> list[int]:
        return [DeltaTable.forPath(spark, p).history(1).first()["version"] for p in paths]

    before = versions()
    planned = cdc_json(*args, "--dry-run")
    assert planned["dry_run"] is True and versions() == before
    would = {t["table"]: t for t in planned["tables"]}
    tables = {t["table"]: t for t in cdc_json(*args)["tables"]}
    assert set(would) == set(tables)
    silver = f"silver/{ENTITY}"
    assert would[silver]["optimized_files_removed"] is None
    assert tables[silver]["optimized_files_removed"] == would[silver]["files"] > 1
    for table in would:
        assert tables[table]["vacuumed_files"] >= would[table]["vacuumed_files"] >= 0, table
        assert tables[table]["tombstones_expired"] == would[table]["tombstones_expired"], table
    return tables


def test_maintenance_vacuums_below_deltas_minimum_only_with_every_service_stopped(
    world: World, spark: SparkSession
) -> None:
    """VACUUM 0 is refused (Delta's 7-day minimum) unless forced with the services stopped;
    tombstones then age by the ingest time the merger reached, not the wall clock."""
    tombstone_rows = _tombstones(spark, world).count()
    assert tombstone_rows > 0
    no_expiry = ("--ignore-service", "publisher_es", "--no-tombstone-expiry")

    # Every stream is caught up (publisher-es ignored): only Delta's minimum stands.
    refused = cdc("maintenance", *world.config_args, "--vacuum-hours", "0", *no_expiry)
    assert refused.exit_code == 1, refused.output
    assert "below Delta's minimum" in refused.output
    for table in ("bronze", f"silver/{ENTITY}"):  # tombstones: not touched
        assert f"{table}: 168 hours (delta.deletedFileRetentionDuration not set" in refused.output

    port = free_port()
    live = _maintenance_config(world, "live", metrics_port=port)
    forced = ("maintenance", "--vacuum-hours", "0", "--force-short-retention")
    runner = start_merger(load_config(Path(live[1])), spark=spark)  # a merger running
    try:
        refused = cdc(*forced, *live, *no_expiry, "--quiet-minutes", "0")
    finally:
        runner.stop_now()
    assert refused.exit_code == 1, refused.output
    assert f"merger: http://127.0.0.1:{port}/health answers" in refused.output

    # Stopped now, but bronze and silver were written within the last hour.
    refused = cdc(*forced, *live, *no_expiry, "--quiet-minutes", "60")
    assert refused.exit_code == 1, refused.output
    assert "bronze: WRITE committed version" in refused.output and "within 60" in refused.output
    assert f"merger's checkpoint of group {GROUP} progressed" in refused.output
    time.sleep(3)  # every service stopped before this: 3 quiet seconds (0.05 minutes)
    stopped = (*forced, "--quiet-minutes", "0.05")

    # Forced, the streams' needs still hold: publisher-es never ran, it needs version 0.
    refused = cdc(*stopped, *live, "--no-optimize", "--no-tombstone-expiry")
    assert refused.exit_code == 1, refused.output
    assert f"silver/{ENTITY}: publisher_es still needs version 0" in refused.output

    # Tombstones older by the wall clock than a one-second retention, but the merger has
    # merged nothing ingested after them: none expires (the wall clock would expire all).
    hours = 0.0003
    newest = _tombstones(spark, world).agg(F.max("deleted_at")).first()[0]
    assert newest.astimezone(dt.UTC) < dt.datetime.now(dt.UTC) - dt.timedelta(hours=hours)
    short = _maintenance_config(world, "short", metrics_port=port, tombstone_retention_hours=hours)
    tables = _dry_run_then_run(
        world,
        spark,
        *stopped,
        *short,
        "--ignore-service",
        "publisher_es",
        "--tombstone-retention-hours",
        str(hours),
    )
    assert set(tables) == {  # the quarantine tables too: an erasure deletes there
        "bronze",
        *[f"quarantine/{service}" for service in ("ingestor", "merger", "publisher_kafka")],
        f"silver/{ENTITY}",
        f"silver/_tombstones/{ENTITY}",
    }
    assert tables[f"silver/_tombstones/{ENTITY}"]["tombstones_expired"] == 0
    assert (
        "hours of bronze ingest time" in tables[f"silver/_tombstones/{ENTITY}"]["tombstones_note"]
    )
    assert _tombstones(spark, world).count() == tombstone_rows
    silver = tables[f"silver/{ENTITY}"]
    assert silver["optimized_files_removed"] > silver["optimized_files_added"] == 1
    # Vacuumed: at least the files compaction replaced (0 hours keeps nothing unreferenced).
    assert silver["vacuumed_files"] >= silver["optimized_files_removed"]

    # merger.tombstone_retention_hours: null keeps them, and no option can shorten that.
    kept = _maintenance_config(world, "kept", tombstone_retention_hours=None)
    refused = cdc(
        "maintenance", *kept, "--no-optimize", "--no-vacuum", "--tombstone-retention-hours", "0"
    )
    assert refused.exit_code == 1 and "null: tombstones are kept" in refused.output
    report = cdc_json("maintenance", *kept, "--no-optimize", "--no-vacuum")
    result = {t["table"]: t for t in report["tables"]}[f"silver/_tombstones/{ENTITY}"]
    assert result["tombstones_expired"] == 0 and "null" in result["tombstones_note"]
    assert _tombstones(spark, world).count() == tombstone_rows

    # OPTIMIZE commits add no data: streams skip them, so they are not lag.
    status = _entity_status(world)
    assert (status["merger"], status["publisher_kafka"]) == (0, 0)
    assert cdc_json("verify", *world.config_args, "--target", "change_topic")["ok"] is True


def test_status_shows_the_backlog_and_maintenance_refuses_what_the_merger_needs(
    world: World, spark: SparkSession, kafka_config: KafkaConfig
) -> None:
    """The ingestor runs while the merger is stopped: the table's merger progress stays
    behind bronze, which holds the VACUUM of bronze back.

    Leaves: the late v2 records quarantined as unknown_schema, not merged.
    """
    config = world.pipeline.config
    produce(kafka_config, iter(world.late_v2 + world.redelivered))
    assert _entity_status(world)["ingestor"] == len(world.late_v2) + len(world.redelivered)

    progress = _merger_progress(config)
    ingest_once(world.pipeline, spark)
    status = _entity_status(world)
    assert status["ingestor"] == 0
    assert status["merger"] == 1  # the bronze commit of the re-delivered records
    assert status["quarantine"] == len(world.report.poison) + len(world.late_v2)
    needed = _last_write(spark, config.layout.bronze())  # the re-delivered records' commit
    assert progress is not None and progress < needed
    rows = entity_changes(spark, config.layout.bronze(), ENTITY, needed - 1, needed).count()
    (entity,) = cdc_json("status", *world.config_args)["entities"]
    (merger,) = [s for s in entity["streams"] if s["service"] == "merger"]
    assert merger["note"] == f"merged through bronze v{progress}, {rows:,} rows to merge"

    # Forced below Delta's minimum with nothing to probe and no quiet period: the
    # services' needs alone decide.
    args = (*_maintenance_config(world, "stopped"), "--no-optimize", "--ignore-service")
    args = (*args, "publisher_es", "--force-short-retention", "--quiet-minutes", "0")
    refused = cdc("maintenance", *args, "--vacuum-hours", "0", "--no-tombstone-expiry")
    assert refused.exit_code == 1
    assert f"bronze: merger still needs version {needed}" in refused.output
    assert f"{ENTITY} merged through version {progress}" in refused.output
    refused = cdc("maintenance", *args, "--no-vacuum", "--tombstone-retention-hours", "0")
    assert refused.exit_code == 1 and "refusing to expire tombstones" in refused.output
    assert "shorter than merger.tombstone_retention_hours (168 hours)" in refused.output
    allowed = cdc("maintenance", *args, "--vacuum-hours", "1", "--no-tombstone-expiry")
    assert allowed.exit_code == 0, allowed.output


def test_maintenance_expires_tombstones_by_the_ingest_time_the_merger_reached(
    world: World, spark: SparkSession
) -> None:
    """Leaves: the re-delivered records merged, the first pass's tombstones expired."""
    hours = 0.0003  # about a second
    args = (*_maintenance_config(world, "expiry", tombstone_retention_hours=hours), "--no-vacuum")
    args = (*args, "--no-optimize", "--tombstone-retention-hours", str(hours))
    events = bronze(spark, world.pipeline, ENTITY)
    tip = events.agg(F.max("ingested_at")).first()[0]
    newest = _tombstones(spark, world).agg(F.max("deleted_at")).first()[0]
    # Bronze has events ingested after every tombstone plus the retention, unmerged yet.
    assert tip - dt.timedelta(hours=hours) > newest
    report = cdc_json("maintenance", *args)
    expiry = {t["table"]: t for t in report["tables"]}[f"silver/_tombstones/{ENTITY}"]
    assert expiry["tombstones_expired"] == 0, expiry
    # Aged by the last merged event's ingest time: before the unmerged ones', read although
    # bronze's version the merger merged through lost its files to the VACUUM above.
    merged_until = dt.datetime.fromisoformat(expiry["tombstones_note"].rsplit(" ", 1)[1])
    assert merged_until < tip.astimezone(dt.UTC) - dt.timedelta(hours=hours)

    merge_once(world.pipeline, spark)  # 168-hour retention: the merger expires nothing
    cutoff = tip - dt.timedelta(hours=hours)  # all of bronze is merged now
    expected = _tombstones(spark, world).where(F.col("deleted_at") < F.lit(cutoff)).count()
    remaining = _tombstones(spark, world).count() - expected
    assert expected > 0
    planned = cdc_json("maintenance", *args, "--dry-run")
    would = {t["table"]: t for t in planned["tables"]}[f"silver/_tombstones/{ENTITY}"]
    assert would["tombstones_expired"] == expected and "would expire" in would["tombstones_note"]
    assert _tombstones(spark, world).count() == remaining + expected  # none expired yet
    report = cdc_json("maintenance", *args)
    expiry = {t["table"]: t for t in report["tables"]}[f"silver/_tombstones/{ENTITY}"]
    assert expiry["tombstones_expired"] == expected, expiry
    assert _tombstones(spark, world).count() == remaining


def _ingested(spark: SparkSession, world: World) -> int:
    return bronze(spark, world.pipeline, ENTITY).count()


def test_replay_twice_injects_each_record_once(world: World, spark: SparkSession) -> None:
    """Leaves: the v2 records replayed and ingested."""
    world.pipeline.add_schema_version(ENTITY, 2)  # the fix: the writer schema is deployed
    v2 = "error_kind = 'unknown_schema' AND error_message LIKE '%{}%'"
    fingerprint = world.late_v2[0].value[2:10].hex().upper()  # type: ignore[index]
    where = v2.format(fingerprint)
    before = _ingested(spark, world)

    first = cdc_json(
        "quarantine", "replay", *world.config_args, "--entity", ENTITY, "--where", where
    )
    assert first["selected"] == first["produced"] == len(world.late_v2)
    second = cdc_json(
        "quarantine", "replay", *world.config_args, "--entity", ENTITY, "--where", where
    )
    assert (second["selected"], second["already_replayed"], second["produced"]) == (
        len(world.late_v2),
        len(world.late_v2),
        0,
    )

    ingest_once(world.pipeline, spark)
    assert _ingested(spark, world) == before + len(world.late_v2)
    ledger_path = world.pipeline.config.layout.replay_ledger()
    ledger = spark.read.format("delta").load(ledger_path).collect()
    assert {r.state for r in ledger} == {"done"}
    landed = {(r.replayed_partition, r.replayed_offset) for r in ledger}
    rows = bronze(spark, world.pipeline, ENTITY).select("kafka_partition", "kafka_offset")
    assert landed <= {(r.kafka_partition, r.kafka_offset) for r in rows.collect()}

    groups = cdc_json("quarantine", "list", *world.config_args, "--entity", ENTITY)["groups"]
    unknown = next(g for g in groups if g["error_kind"] == "unknown_schema")
    assert unknown["replayed"] == len(world.late_v2)


def test_replay_after_a_crash_between_produce_and_confirm_produces_nothing_twice(
    world: World, spark: SparkSession, kafka_config: KafkaConfig
) -> None:
    config = world.pipeline.config
    where = "error_kind = 'corrupt'"
    crashed = quarantine.Replay(config, ENTITY, spark, where)
    crashed.ensure_ledger()
    _, _, candidates = crashed.select()
    assert candidates
    crashed.produce(crashed.record_intent(candidates))  # ... and the process dies here

    with pytest.raises(quarantine.QuarantineError, match="has not finished"):
        quarantine.replay(config, ENTITY, where, spark=spark)
    result = quarantine.replay(config, ENTITY, where, recover=True, spark=spark)
    assert (result.recovered, result.produced) == (len(candidates), 0)

    origins = Counter(replay_origins(kafka_config, config.entity(ENTITY).source_topic))
    corrupt = {f"{crashed.topic}/{c.partition}/{c.offset}" for c in candidates}
    assert {o: n for o, n in origins.items() if o in corrupt} == dict.fromkeys(corrupt, 1)
    assert all(n == 1 for n in origins.values())


def test_quarantine_lists_and_shows_the_mergers_rows(world: World, spark: SparkSession) -> None:
    """What the merger quarantines (bronze events it cannot apply, each with the bronze
    version its write reached and ``source_table`` bronze) is listed, shown and counted
    like any service's quarantine; only the ingestor's replays.

    Leaves: three of the entity's bronze events in the merger's quarantine.
    """
    config = world.pipeline.config
    version = _version(spark, config.layout.bronze())
    events = bronze(spark, world.pipeline, ENTITY).orderBy("kafka_partition", "kafka_offset")
    rejected = (
        events.limit(3)
        .withColumn(ERROR_KIND, F.lit("null_key"))
        .withColumn(ERROR_MESSAGE, F.lit("key column id is null"))
    )
    # As the merger's write quarantines them (cdc_merger.merging.TableMerge.write).
    rows = quarantine_rows(rejected, ENTITY, version)
    app = f"{MERGER_PROGRESS_APP}-{ENTITY}"
    idempotent_append(rows, config.layout.quarantine("merger"), app, version)
    written = spark.read.format("delta").load(config.layout.quarantine("merger")).collect()
    assert {(r.source_table, r.batch_id) for r in written} == {("bronze", version)}
    coordinates = {f"{r.kafka_topic}/{r.kafka_partition}@{r.kafka_offset}" for r in written}
    assert len(coordinates) == 3

    groups = cdc_json("quarantine", "list", *world.config_args, "--service", "merger")
    assert groups["groups"] == [
        {"service": "merger", "entity": ENTITY, "error_kind": "null_key", "rows": 3, "replayed": 0}
    ]
    shown = cdc_json("quarantine", "show", *world.config_args, "--service", "merger")["records"]
    assert {r["coordinates"] for r in shown} == coordinates
    assert all(r["error_message"] == "key column id is null" for r in shown)
    assert all(json.loads(bytes.fromhex(r["raw_value"]))["op"] for r in shown)  # the event
    assert cdc_json("status", *world.config_args)["quarantine"]["merger"] == {ENTITY: 3}
    text = cdc("status", *world.config_args)
    assert f"merger           3 rows ({ENTITY} 3)" in text.stdout

    refused = cdc(
        "quarantine", "replay", *world.config_args, "--service", "merger", "--entity", ENTITY
    )
    assert refused.exit_code == 2 and "only the ingestor's quarantine" in refused.output


def test_verify_reports_a_row_deleted_from_silver(world: World, spark: SparkSession) -> None:
    victim = sorted(world.documents)[1]
    silver = DeltaTable.forPath(spark, world.pipeline.config.layout.silver(ENTITY))
    silver.delete(F.col("id") == int(victim))

    result = cdc("verify", *world.config_args, "--json")
    assert result.exit_code == 1
    (entity,) = json.loads(result.stdout)["entities"]
    assert entity["silver_rows"] == len(world.documents) - 1
    for target in entity["targets"]:
        assert (target["missing"], target["extra"], target["different"]) == (0, 1, 0)
        assert target["examples"] == {"extra": [f"id={victim}"]}
        assert (target["buckets"], target["buckets_differing"]) == (1, 1)


def test_an_idle_table_holds_nothing_back_and_a_stopped_one_holds_bronze(
    tmp_path: Path, spark: SparkSession, kafka_config: KafkaConfig, es_config: ElasticsearchConfig
) -> None:
    """Two tables in one bronze. A table without changes keeps its merger progress at its
    last change however far bronze moves on: it is not behind, and holds no version of
    bronze from VACUUM. A table whose merger is stopped while its rows come in is behind
    by the bronze versions holding them, and bronze keeps them for it.

    A pipeline of its own.
    """
    pipeline = build_pipeline(
        tmp_path,
        kafka_config,
        es_config,
        entities=("customers", "orders"),
        ingestor={"metrics_port": 0},
        merger={"metrics_port": 0},
    )
    config = pipeline.config
    messages = generate(pipeline, events=120, keys=30, poison_share=0.0)
    first, later = messages[: len(messages) // 2], messages[len(messages) // 2 :]

    def of(entity: str) -> list[GeneratedMessage]:
        return [m for m in later if m.entity == entity]

    def merge_orders() -> None:  # the orders table's merger alone (a group of its own)
        start_merger(config, entity_names=["orders"], once=True, spark=spark).run()

    def lags() -> dict[str, int | None]:
        report = collect_status(config)
        return {e.entity: e.stream("merger").lag for e in report.entities}

    produce(kafka_config, iter(first))
    ingest_once(pipeline, spark)
    merge_once(pipeline, spark)
    assert lags() == {"customers": 0, "orders": 0}

    # Only orders changes: customers stays idle at its progress.
    idle_at = _merger_progress(config, "customers")
    produce(kafka_config, iter(of("orders")[:10]))
    ingest_once(pipeline, spark)
    merge_orders()
    assert idle_at is not None and idle_at < _version(spark, config.layout.bronze())
    assert lags() == {"customers": 0, "orders": 0}
    assert bronze_needs(config, SparkState(spark)) == []  # VACUUM at will

    # customers changes while its merger is stopped; orders' goes on.
    produce(kafka_config, iter(of("customers")))
    ingest_once(pipeline, spark)
    waiting = _last_write(spark, config.layout.bronze())
    produce(kafka_config, iter(of("orders")[10:]))
    ingest_once(pipeline, spark)
    merge_orders()
    assert lags() == {"customers": 1, "orders": 0}
    (need,) = bronze_needs(config, SparkState(spark))
    assert (need.service, need.table, need.version) == ("merger", "bronze", waiting)
    assert need.note == f"customers merged through version {idle_at}"
    assert bronze_needs(config, DeltaLogState(config)) == [need]  # read without a JVM too

    merge_once(pipeline, spark)  # its merger back: caught up, nothing held
    assert lags() == {"customers": 0, "orders": 0}
    assert bronze_needs(config, SparkState(spark)) == []
