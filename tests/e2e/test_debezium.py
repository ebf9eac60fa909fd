"""Real Debezium on a real PostgreSQL feeds the pipeline, in every source format it reads.

One database, one Kafka Connect worker, three connectors on the same table: Avro through
the registry (Apicurio's converter, Confluent framing), JsonConverter without schemas
(decimals as strings) and with schemas (decimals as doubles). A SQL workload runs on the
table (a snapshot's rows, inserts, updates, deletes, re-inserts, ``TRUNCATE``, a
primary-key change, ``ALTER TABLE ... ADD COLUMN``; a numeric, a date, timestamps with
and without a zone; a large text stored out of line under the default REPLICA IDENTITY, so
updates that leave it alone carry Debezium's unavailable-value placeholder, and inserts and
updates of one key land in one batch); the four services then run once, as one Spark
application, on one pipeline whose entities cover all three connectors. Silver, the
change topics and the indexes must each equal the database's table exactly, for every
format; the check itself is shown to catch a missing row and a wrong value.

The Avro entity keeps its history (SCD type 2). Its oracle is the database too: after
every statement of the workload (inside its transaction) the table is read, and each
key's versions are the distinct states its row went through (``TableVersions``). The
history must hold them, in order and column by column (the large text's real value, not
Debezium's placeholder), with only a live key's last version open; that check too is
shown to catch a placeholder, a missing version and a version left open.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from cdc_cli.application import Application
from cdc_devkit import infra
from cdc_devkit.checks import compare, silver_rows
from cdc_devkit.debezium import Capture, ConnectClient, start_captures, stop_captures, wait_captured
from cdc_devkit.postgres import CUSTOMERS, Database, SqlWorkload, TableVersions
from cdc_devkit.postgres_pipeline import (
    HistoryVersion,
    history_against_database,
    history_of,
    outputs_against_database,
    write_postgres_pipeline,
)
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.entity_sets import load_pipeline
from cdc_shared.contracts.bronze import entity_changes
from cdc_shared.contracts.layout import SERVICE_NAMES
from cdc_shared.contracts.unavailable import DEBEZIUM_PLACEHOLDER
from cdc_shared.streaming.tables import has_commits
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from support.servers import TEST_INFRA

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# One table carries every kind of change: each entity costs the services a stream start
# (about 30 s on 2 cores), and this test must stay within a few minutes.
TABLES = (CUSTOMERS,)


def _captures(run: str) -> list[Capture]:
    return [
        Capture(f"{run}-avro", f"{run}avro", "avro", "precise", TABLES),
        Capture(f"{run}-json", f"{run}json", "json", "string", TABLES),
        Capture(f"{run}-json-schemas", f"{run}jsons", "json-schemas", "double", TABLES),
    ]


def test_debezium_postgres_in_three_formats_reaches_every_output(
    local_servers: infra.Endpoints,
    registry_url: str,
    postgres_server: Database,
    connect_url: str,
    spark: SparkSession,
    tmp_path: Path,
) -> None:
    run = f"dbz{uuid.uuid4().hex[:6]}"
    connect = ConnectClient(connect_url)
    captures = _captures(run)
    workload = SqlWorkload(seed=5, customers=30, changes=90, run=run, tables=TABLES)
    database = postgres_server.create_database(run)
    try:
        versions = run_workload(workload, database, connect, captures)
        served = KafkaConfig(bootstrap_servers=local_servers.kafka_bootstrap_servers)
        assert wait_captured(served, captures) > 0
        # The Avro connector's tables are an entity set: found on the broker, keyed by
        # Debezium's key schema in the registry; the JSON ones are listed by hand.
        config_path = write_postgres_pipeline(
            tmp_path,
            local_servers,
            registry_url,
            captures,
            run,
            avro_as_entity_set=True,
            history=["avro_customers"],
        )
        config = load_pipeline(config_path)
        assert [e.name for e in config.entities] == [
            "json_customers",
            "json_schemas_customers",
            "avro_customers",
        ]
        assert config.entity("avro_customers").key == list(CUSTOMERS.key)
        assert [e.name for e in config.entities if e.history.enabled] == ["avro_customers"]

        Application(config, list(SERVICE_NAMES), once=True, spark=spark).run()

        # Every kind of change reached bronze in every format, nothing was refused.
        for entity in config.entities:
            bronze = entity_changes(spark, config.layout.bronze(), entity.name)
            ops = Counter(r["op"] for r in bronze.where("op is not null").collect())
            assert set(ops) == {"r", "c", "u", "d", "t"}, f"{entity.name}: ops {dict(ops)}"
            assert ops["t"] == 1, entity.name
            assert bronze.where("is_tombstone").count() == ops["d"], entity.name
            # Debezium sent its placeholder for the unchanged large values: the outputs
            # below must hold the real ones.
            unsent = bronze.where(F.col("after.notes") == DEBEZIUM_PLACEHOLDER).count()
            assert unsent >= 10, f"{entity.name}: {unsent} placeholders"
        quarantine = config.layout.quarantine("ingestor")
        if has_commits(spark, quarantine):
            refused = spark.read.format("delta").load(quarantine)
            assert refused.count() == 0, refused.select("error_kind", "error_message").take(5)

        differences = outputs_against_database(spark, config, database)
        described = "\n".join(d.describe() for d in differences)
        assert len(differences) == 3 * len(config.entities), described
        assert all(d.agrees for d in differences), described

        # Not vacuous: the table holds rows, the new column has values, and most of the
        # snapshot's keys are gone with the truncate (silver kept none of them either).
        customers = database.rows(CUSTOMERS)
        assert len(customers) >= 10
        assert any(row["tier"] is not None for row in customers.values())
        assert sum(len(row["notes"] or "") > 10_000 for row in customers.values()) >= 5
        assert len({(k,) for k in range(1, workload.customers + 1)} - set(customers)) >= 20

        # The comparison can fail: a row missing, or one value off, is reported.
        entity = config.entity("avro_customers")
        silver = silver_rows(spark, config, entity)
        first = next(iter(customers))
        assert not compare("x", customers, {k: v for k, v in silver.items() if k != first}).agrees
        changed = {**silver, first: {**silver[first], "vip": not silver[first]["vip"]}}
        assert compare("x", customers, changed).different == [first]

        # The Avro entity's history: the versions the database went through, per key.
        history = history_of(spark, config, entity)
        problems = history_against_database(CUSTOMERS, versions.versions, history)
        assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
        assert_history_check_can_fail(versions, history)
    finally:
        stop_captures(connect, postgres_server, run, captures)


def run_workload(
    workload: SqlWorkload, database: Database, connect: ConnectClient, captures: list[Capture]
) -> TableVersions:
    """The workload, captured from its snapshot on; the versions each customer went
    through, read from the database after every statement."""
    versions = TableVersions(CUSTOMERS)
    for step in workload.schema():
        database.execute(step.sql)
    for step in workload.snapshot():
        for state in database.execute_watching(step, CUSTOMERS):
            versions.observe(state)
    start_captures(connect, database, captures, infra.registry_core_url(TEST_INFRA))
    for step in workload.changes_steps():
        for state in database.execute_watching(step, CUSTOMERS):
            versions.observe(state)
    database.execute(workload.marker().sql)
    return versions


Versions = dict[tuple[object, ...], list[HistoryVersion]]


def assert_history_check_can_fail(versions: TableVersions, history: Versions) -> None:
    """Not vacuous: the history has every kind of version, and the check catches a version
    holding Debezium's placeholder, one missing and one left open."""
    everything = [(key, v) for key, vs in versions.versions.items() for v in vs]
    ended = Counter(v.ended for _, v in everything)
    assert ended["change"] >= 20 and ended["delete"] >= 20 and ended[None] >= 10, ended
    assert sum(len(vs) > 2 for vs in versions.versions.values()) >= 5
    # A closed version holding a large text: as if it held the placeholder instead.
    key, number = next(
        (key, n)
        for key, vs in history.items()
        for n, v in enumerate(vs)
        if v.end is not None and len(v.row["notes"] or "") > 10_000
    )
    row = history[key][number]
    unsent = HistoryVersion(row.start, row.end, {**row.row, "notes": DEBEZIUM_PLACEHOLDER})
    wrong = {**history, key: [*history[key][:number], unsent, *history[key][number + 1 :]]}
    (problem,) = history_against_database(CUSTOMERS, versions.versions, wrong)
    assert DEBEZIUM_PLACEHOLDER in problem and "notes" in problem, problem
    # A version missing: the key's count, and every version after it, differ.
    wrong = {**history, key: [*history[key][:number], *history[key][number + 1 :]]}
    assert history_against_database(CUSTOMERS, versions.versions, wrong)[0].startswith(
        f"{key}: {len(history[key]) - 1} versions"
    )
    # A closed version left open.
    reopened = HistoryVersion(row.start, None, row.row)
    wrong = {**history, key: [*history[key][:number], reopened, *history[key][number + 1 :]]}
    ended_by = versions.versions[key][number].ended
    assert history_against_database(CUSTOMERS, versions.versions, wrong) == [
        f"{key} version {number + 1}: open, but {ended_by} in the database"
    ]
