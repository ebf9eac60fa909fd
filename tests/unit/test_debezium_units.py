"""Debezium connector settings, the JSON reader schemas, the SQL workload: no server needed."""

from __future__ import annotations

import datetime as dt
import json
import signal
from decimal import Decimal
from pathlib import Path

import fastavro
import pytest
from cdc_devkit import infra
from cdc_devkit.debezium import (
    READER_SCHEMAS,
    Capture,
    connector_config,
    converter_config,
    entity_settings,
    reader_schema_path,
    reader_schemas,
)
from cdc_devkit.postgres import (
    CUSTOMERS,
    MARKER,
    ORDERS,
    TABLES,
    Column,
    Database,
    SqlWorkload,
    Table,
    literal,
    typed,
)
from cdc_devkit.postgres_pipeline import entity_name, table_of, write_postgres_pipeline
from cdc_ingestor.decode_json import shape_of
from cdc_shared.avro import load_schema_file
from cdc_shared.config.pipeline import load_config

DATABASE = Database("127.0.0.1", 5432, "cdc", "s3cret-pw", "shop")
CAPTURES = [
    Capture("run-avro", "runavro", "avro", "precise"),
    Capture("run-json", "runjson", "json", "string"),
    Capture("run-json-schemas", "runjsons", "json-schemas", "double"),
]


def test_avro_connectors_write_confluent_framing_through_apicurio() -> None:
    config = connector_config(CAPTURES[0], DATABASE, registry_api="http://r/apis/registry/v2")
    for part in ("key", "value"):
        prefix = f"{part}.converter"
        assert config[prefix] == "io.apicurio.registry.utils.converter.AvroConverter"
        assert config[f"{prefix}.apicurio.registry.url"] == "http://r/apis/registry/v2"
        assert config[f"{prefix}.apicurio.registry.as-confluent"] == "true"
        # Ids in the payload (not in headers), and the id the ccompat API serves.
        assert config[f"{prefix}.apicurio.registry.headers.enabled"] == "false"
        assert config[f"{prefix}.apicurio.registry.use-id"] == "contentId"
        assert config[f"{prefix}.apicurio.registry.auto-register"] == "true"
    with pytest.raises(ValueError, match="registry"):
        converter_config("avro", None)


@pytest.mark.parametrize(("capture", "schemas"), [(CAPTURES[1], "false"), (CAPTURES[2], "true")])
def test_json_connectors_use_connects_json_converter(capture: Capture, schemas: str) -> None:
    config = connector_config(capture, DATABASE)
    for part in ("key", "value"):
        assert config[f"{part}.converter"] == "org.apache.kafka.connect.json.JsonConverter"
        assert config[f"{part}.converter.schemas.enable"] == schemas
    assert not any("apicurio" in name for name in config)


def test_connector_settings_the_pipeline_relies_on() -> None:
    configs = [connector_config(c, DATABASE, registry_api="http://r") for c in CAPTURES]
    for capture, config in zip(CAPTURES, configs, strict=True):
        assert config["connector.class"] == "io.debezium.connector.postgresql.PostgresConnector"
        assert config["plugin.name"] == "pgoutput"
        assert config["skipped.operations"] == "none"  # else TRUNCATE is skipped
        assert config["time.precision.mode"] == "connect"
        assert config["decimal.handling.mode"] == capture.decimal_handling
        assert config["topic.prefix"] == capture.topic_prefix
        assert config["table.include.list"] == "public.customers,public.orders,public.cdc_marker"
        assert config["database.dbname"] == "shop"
    # Connectors on the same tables need their own slot and publication.
    assert len({c["slot.name"] for c in configs}) == len({c["publication.name"] for c in configs})
    assert len({c["slot.name"] for c in configs}) == 3
    assert all(c["slot.name"].replace("_", "").isalnum() for c in configs)


def test_the_password_is_not_in_a_databases_repr() -> None:
    assert "s3cret-pw" not in repr(DATABASE)
    assert "s3cret-pw" not in repr(DATABASE.on("other"))


def test_entities_read_each_format_and_order_by_the_lsn() -> None:
    avro = entity_settings(CAPTURES[0], CUSTOMERS, "avro_customers")
    assert avro == {
        "name": "avro_customers",
        "source_topic": "runavro.public.customers",
        "key": ["id"],
        "sequence_by": ["source.lsn"],
    }
    json_entity = entity_settings(CAPTURES[2], ORDERS, "json_schemas_orders")
    assert json_entity["value_format"] == json_entity["key_format"] == "json"
    assert json_entity["decimal_handling"] == "double"
    assert json_entity["key"] == ["order_id", "line_no"]
    assert Path(json_entity["value_schema"]).is_file()
    assert Path(json_entity["key_schema"]).is_file()


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_checked_in_reader_schemas_are_the_generated_ones(table: Table) -> None:
    for part in ("key", "value"):
        schema = reader_schemas(table)[part]
        path = reader_schema_path(table, part)
        assert path.parent == READER_SCHEMAS
        assert json.loads(path.read_text()) == schema, f"regenerate {path.name}"
        fastavro.parse_schema(schema)
        shape_of(load_schema_file(path), "precise")  # the JSON decoder can read it


def test_reader_values_make_every_non_key_column_optional_and_know_the_added_one() -> None:
    value = reader_schemas(CUSTOMERS)["value"]
    row = value["fields"][0]["type"][1]["fields"]
    by_name = {f["name"]: f for f in row}
    assert by_name["id"]["type"] == "int"
    assert by_name["tier"]["type"] == ["null", "string"] and by_name["tier"]["default"] is None
    assert by_name["balance"]["type"][1]["logicalType"] == "decimal"
    assert by_name["created_at"]["type"][1]["logicalType"] == "timestamp-millis"
    assert by_name["birth_date"]["type"][1]["logicalType"] == "date"
    assert by_name["updated_at"]["type"] == ["null", "string"]  # ZonedTimestamp
    assert all(
        isinstance(f["type"], list) and f["type"][0] == "null" for f in row if f["name"] != "id"
    )
    source = next(f for f in value["fields"] if f["name"] == "source")["type"]
    assert {"name": "lsn", "type": ["null", "long"], "default": None} in source["fields"]


def _all_sql(workload: SqlWorkload) -> list[str]:
    steps = [*workload.schema(), *workload.snapshot(), *workload.changes_steps()]
    return [s.sql for s in [*steps, workload.marker()]]


def test_the_workload_is_deterministic_and_does_every_kind_of_change() -> None:
    first = _all_sql(SqlWorkload(seed=3, customers=20, orders=30, changes=80, run="r1"))
    assert first == _all_sql(SqlWorkload(seed=3, customers=20, orders=30, changes=80, run="r1"))
    assert first != _all_sql(SqlWorkload(seed=4, customers=20, orders=30, changes=80, run="r1"))
    text = "\n".join(first)
    for statement in (
        "CREATE TABLE customers",
        "CREATE TABLE orders",
        "INSERT INTO customers",
        "UPDATE customers SET",
        "DELETE FROM customers",
        "UPDATE orders SET",
        "DELETE FROM orders",
        "ALTER TABLE customers ADD COLUMN tier text;",
        "TRUNCATE orders;",
    ):
        assert statement in text, statement
    assert any(s.startswith("UPDATE customers SET id = ") for s in first)  # the key changes
    assert first[-1].startswith(f"INSERT INTO {MARKER.name}") and "'r1'" in first[-1]
    # The new column is written only after it exists.
    altered = text.index("ALTER TABLE")
    assert "tier" not in text[:altered] and "tier" in text[altered + 40 :]


def test_the_workload_never_inserts_a_key_twice_while_it_exists() -> None:
    workload = SqlWorkload(seed=11, customers=30, orders=40, changes=300)
    live: set[str] = set()
    for step in [*workload.snapshot(), *workload.changes_steps()]:
        for line in step.sql.splitlines():
            if line.startswith("TRUNCATE orders"):
                live = {k for k in live if not k.startswith("orders")}
            elif line.startswith("  (") and "INSERT INTO orders" in step.sql:
                key = "orders" + ",".join(line.strip("(),; ").split(", ")[:2])
                assert key not in live, key
                live.add(key)
            elif line.startswith("DELETE FROM orders"):
                numbers = [w.rstrip(";") for w in line.split() if w.rstrip(";").isdigit()]
                live.discard("orders" + ",".join(numbers))
    assert len(live) > 10


def test_a_one_table_workload_truncates_that_table_then_moves_a_key_and_adds_a_column() -> None:
    workload = SqlWorkload(seed=2, customers=15, changes=60, tables=(CUSTOMERS,))
    assert [s.what for s in workload.schema()] == [
        "create cdc_filler (large random text)",
        "create customers",
        "create cdc_marker",
    ]
    assert len(workload.snapshot()) == 1
    steps = [s.sql for s in workload.changes_steps()]
    assert not any("orders" in sql for sql in steps)
    assert any(
        sql.startswith("DELETE FROM customers") or "\nDELETE FROM customers" in sql for sql in steps
    )
    order = [
        next(i for i, sql in enumerate(steps) if sql.startswith(start))
        for start in ("TRUNCATE customers", "UPDATE customers SET id = ", "ALTER TABLE customers")
    ]
    assert order == sorted(order)


def test_step_display_shortens_long_value_lists() -> None:
    snapshot = SqlWorkload(customers=12, orders=2).snapshot()
    shown = snapshot[0].display()
    assert shown.count("\n  (") == 2 and "... (10 more rows)" in shown
    assert snapshot[1].display() == snapshot[1].sql  # two rows: shown whole


def test_literals_and_typed_values_round_trip() -> None:
    text = Column("t", "text", "text")
    assert literal(text, "o'brien") == "'o''brien'"
    assert literal(text, None) == "NULL"
    stamp = Column("s", "timestamp(3)", "timestamp")
    naive = dt.datetime(2026, 3, 1, 9, 0, 0, 123000, tzinfo=dt.UTC).replace(tzinfo=None)
    assert literal(stamp, naive) == "'2026-03-01 09:00:00.123'"
    money = Column("m", "numeric(12,2)", "decimal", precision=12, scale=2)
    assert typed(money, Decimal("12.5")) == Decimal("12.50")
    assert typed(money, 3) == Decimal("3.00")
    assert typed(Column("d", "date", "date"), "2026-03-01") == dt.date(2026, 3, 1)
    zoned = typed(Column("z", "timestamptz(3)", "timestamptz"), "2026-03-01T09:00:00.5+00:00")
    assert zoned == dt.datetime(2026, 3, 1, 9, 0, 0, 500000, tzinfo=dt.UTC)


def test_one_pipeline_covers_every_connector_and_table(tmp_path: Path) -> None:
    served = infra.Endpoints("127.0.0.1:1", "http://127.0.0.1:2")
    path = write_postgres_pipeline(tmp_path, served, "http://127.0.0.1:3/ccompat", CAPTURES, "r")
    config = load_config(path)
    assert config.schema_registry.url == "http://127.0.0.1:3/ccompat"
    names = [e.name for e in config.entities]
    assert names == [entity_name(c, t) for c in CAPTURES for t in TABLES]
    assert {table_of(e) for e in config.entities} == set(TABLES)
    formats = {e.name: e.value_format for e in config.entities}
    assert formats["avro_orders"] == "avro" and formats["json_schemas_customers"] == "json"
    assert len({e.es_index_name for e in config.entities}) == len(names)


def test_local_postgres_and_connect_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_INFRA_POSTGRES_PORT", "15432")
    monkeypatch.setenv("CDC_INFRA_CONNECT_PORT", "18083")
    settings = infra.InfraSettings()
    served = infra.endpoints(settings, with_postgres=True)
    assert served.postgres == "127.0.0.1:15432"
    assert served.connect_url == "http://127.0.0.1:18083"
    assert infra.endpoints(settings).postgres is None
    assert infra.registry_core_url(settings).endswith("/apis/registry/v2")
    # Connect needs Kafka: it starts after it and stops before it.
    assert infra.SERVERS.index("connect") > infra.SERVERS.index("kafka")
    assert infra._STOP_SIGNALS["postgres"] is signal.SIGINT  # a fast shutdown
