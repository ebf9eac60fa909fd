from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.config.values import ConfigError, redact

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
storage_root: /tmp/cdc-data
spark: {master: "local[2]", conf: {spark.sql.shuffle.partitions: "3"}}
kafka:
  bootstrap_servers: "broker:9092"
  options: {security.protocol: SASL_SSL, sasl.mechanism: PLAIN, sasl.username: app,
            sasl.password: "${env:TEST_SASL_PASSWORD}"}
schema_registry: {url: null, dirs: [schemas]}
elasticsearch: {hosts: ["http://es:9200"], api_key: "${file:%(key_file)s}"}
entities:
  - name: customers
    source_topic: dbserver1.inventory.customers
    key: [id]
    sequence_by: [source.lsn]
    change_topic: cdc.inventory.customers
    es_index: customers
  - name: orders
    source_topic: dbserver1.inventory.orders
    key: [order_id, line_no]
"""


@pytest.fixture
def good_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    key_file = tmp_path / "es.key"
    key_file.write_text("es-api-key-value\n")
    monkeypatch.setenv("TEST_SASL_PASSWORD", "hunter2-sasl")
    path = tmp_path / "pipeline.yaml"
    path.write_text(GOOD % {"key_file": key_file})
    return path


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def test_good_file_loads_with_defaults(good_file: Path) -> None:
    config = load_config(good_file)
    assert config.storage_root == "/tmp/cdc-data"
    assert config.spark.master == "local[2]"
    assert config.spark.conf == {"spark.sql.shuffle.partitions": "3"}
    assert config.kafka.options["sasl.password"] == "hunter2-sasl"
    assert config.elasticsearch.api_key is not None
    assert config.elasticsearch.api_key.get_secret_value() == "es-api-key-value"
    customers, orders = config.entities
    assert customers.sequence_by == ["source.lsn"]
    assert customers.change_topic_name == "cdc.inventory.customers"
    assert orders.key == ["order_id", "line_no"]
    assert orders.sequence_by == ["kafka.partition", "kafka.offset"]
    assert orders.change_topic_name == "cdc.orders"
    assert orders.es_index_name == "orders"
    assert config.layout.bronze() == "/tmp/cdc-data/bronze/_all"
    assert config.layout.checkpoint("merger", "default") == "/tmp/cdc-data/_streams/merger/default"
    # No groups configured: every table is in the group ``default``, at each service's trigger.
    assert config.groups == []
    assert config.group_of("orders") == ("default", None)
    for section in (config.ingestor, config.merger, config.publisher_kafka, config.publisher_es):
        assert section.tables_at_once == 2
        assert section.batch_budget == "10 seconds"
        assert section.max_table_delay == "60 seconds"
        assert section.trigger_interval == "5 seconds"
    assert config.ingestor.fail_on_data_loss is True
    assert config.publisher_es.progress_index == "cdc-publisher-es-progress"


def test_groups_take_tables_by_name_or_pattern_the_first_that_matches(tmp_path: Path) -> None:
    text = (
        "groups:\n"
        "  - {name: hot, tables: [orders, 'order_*'], trigger_interval: '1 second'}\n"
        "  - {name: cold, tables: ['*_archive', order_lines]}\n"
        "merger: {tables_at_once: 4, batch_budget: '30 seconds', max_table_delay: '2 minutes'}\n"
    )
    config = load_config(write(tmp_path, text))
    assert config.group_of("orders") == ("hot", "1 second")
    assert config.group_of("order_lines") == ("hot", "1 second")  # the first group naming it
    assert config.group_of("orders_archive") == ("cold", None)  # None: each service's trigger
    assert config.group_of("customers") == ("default", None)  # named by no group
    assert config.merger.tables_at_once == 4
    assert config.merger.batch_budget == "30 seconds"
    assert config.merger.max_table_delay == "2 minutes"
    assert config.ingestor.tables_at_once == 2  # each service's section is its own


def test_config_path_from_env(good_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_CONFIG", str(good_file))
    assert load_config().entities[0].name == "customers"


def test_env_overrides_file(good_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_KAFKA__BOOTSTRAP_SERVERS", "other:19092")
    monkeypatch.setenv("CDC_STORAGE_ROOT", "s3a://bucket/cdc")
    config = load_config(good_file)
    assert config.kafka.bootstrap_servers == "other:19092"
    assert config.kafka.options["sasl.mechanism"] == "PLAIN"  # the rest of the section stays
    assert config.storage_root == "s3a://bucket/cdc"


def test_secrets_never_in_repr_or_redacted_options(good_file: Path) -> None:
    config = load_config(good_file)
    text = repr(config) + str(config) + str(config.model_dump())
    assert "hunter2-sasl" not in repr(config)
    assert "es-api-key-value" not in text
    assert config.kafka.redacted_options()["sasl.password"] == "***"
    assert config.kafka.redacted_options()["sasl.username"] == "app"
    assert redact({"basic.auth.user.info": "u:p"}) == {"basic.auth.user.info": "***"}


def test_unknown_entity_lists_known_ones(good_file: Path) -> None:
    config = load_config(good_file)
    with pytest.raises(ConfigError, match=r"unknown entity 'nope'.*customers, orders"):
        config.select_entities(["nope"])
    assert [e.name for e in config.select_entities(None)] == ["customers", "orders"]


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("entities: [{name: c, source_topic: t, key: []}]", "entities.0.key", "at least 1"),
        (
            "entities: [{name: Bad-Name, source_topic: t, key: [id]}]",
            "entities.0.name",
            "lower-case",
        ),
        ("entities: [{name: c, key: [id]}]", "entities.0.source_topic", "Field required"),
        ("entities: [{name: c, source_topic: t, key: [id, id]}]", "entities.0.key", "unique"),
        (
            "entities: [{name: c, source_topic: t, key: [id], columns: [a, a]}]",
            "entities.0.columns",
            "column names must be unique",
        ),
        (
            "entities: [{name: c, source_topic: t, key: [id], history: {track_columns: []}}]",
            "entities.0.history.track_columns",
            "at least 1",
        ),
        ("retention: {bronze_hours: 0}", "retention.bronze_hours", "greater than 0"),
        (
            "entities: [{name: c, source_topic: t, key: [id], colour: red}]",
            "entities.0.colour",
            "Extra inputs",
        ),
        ("kafka: {bootstrap_servers: [1, 2]}", "kafka.bootstrap_servers", "string"),
        ("elasticsearch: {hosts: []}", "elasticsearch.hosts", "at least 1"),
        ("spark: {conf: {a: {b: c}}}", "spark.conf.a", "string"),
        ("storage_rot: /x", "storage_rot", "Extra inputs"),
        (
            "entities: [{name: a, source_topic: t, key: [id]},"
            " {name: a, source_topic: u, key: [id]}]",
            "(top level)",
            "two entities share the name 'a'",
        ),
        (
            "entities: [{name: c, source_topic: 'orders cdc', key: [id]}]",
            "entities.0.source_topic",
            "letters, digits, '.', '_' and '-'",
        ),
        (
            "entities: [{name: c, source_topic: t, key: [id], change_topic: '..'}]",
            "entities.0.change_topic",
            "not allowed as a Kafka topic name",
        ),
        (
            "publisher_kafka: {progress_topic: 'progress/topic'}",
            "publisher_kafka.progress_topic",
            "Kafka topic name",
        ),
        (
            "entities: [{name: c, source_topic: t, key: [id], es_index: Orders}]",
            "entities.0.es_index",
            "lower case",
        ),
        (
            "entities: [{name: c, source_topic: t, key: [id], es_index: 'a#b'}]",
            "entities.0.es_index",
            "cannot contain '#'",
        ),
        (
            "entities: [{name: c, source_topic: t, key: [id], es_index: _orders}]",
            "entities.0.es_index",
            "cannot start with",
        ),
        (
            "kafka: {options: {sasl.password: '${env:CDC_TEST_UNSET_VAR}'}}",
            "kafka.options",
            "CDC_TEST_UNSET_VAR",
        ),
        # One query per group of tables: the one-query switch of earlier releases is gone.
        ("ingestor: {one_query: true}", "ingestor.one_query", "Extra inputs"),
        ("merger: {batch_budget: soon}", "merger.batch_budget", "not an interval"),
        (
            "publisher_es: {max_table_delay: '5 fortnights'}",
            "publisher_es.max_table_delay",
            "not an interval",
        ),
        (
            "publisher_kafka: {tables_at_once: 0}",
            "publisher_kafka.tables_at_once",
            "greater than or equal to 1",
        ),
        ("groups: [{name: default, tables: [a]}]", "groups.0.name", "names the tables no group"),
        ("groups: [{name: Hot-Tables, tables: [a]}]", "groups.0.name", "lower-case letters"),
        ("groups: [{name: hot, tables: []}]", "groups.0.tables", "at least 1"),
        (
            "groups: [{name: hot, tables: [a], trigger_interval: often}]",
            "groups.0.trigger_interval",
            "not an interval",
        ),
        (
            "groups: [{name: hot, tables: [a]}, {name: hot, tables: [b]}]",
            "(top level)",
            "groups ['hot'] are named twice",
        ),
    ],
)
def test_bad_field_is_named(tmp_path: Path, text: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    assert f"{field}:" in str(error.value)
    assert message in str(error.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_not_yaml_or_not_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "entities: [unclosed"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_bad_env_override_is_named(good_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_ELASTICSEARCH__REQUEST_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match=r"elasticsearch.request_timeout_s: .*greater than 0"):
        load_config(good_file)


def _entity(**selection: object) -> EntityConfig:
    return EntityConfig(name="orders", source_topic="db.orders", key=["id", "line"], **selection)


def test_a_column_selection_keeps_the_key_and_names_real_columns() -> None:
    row = ["id", "line", "product", "amount", "note"]
    assert _entity().dropped_columns(row) == []
    assert _entity(columns=["amount"]).dropped_columns(row) == ["product", "note"]
    assert _entity(except_columns=["note"]).dropped_columns(row) == ["note"]
    with pytest.raises(ConfigError, match=r"entities\[orders\]\.columns: \['amont'\] are not"):
        _entity(columns=["amont"]).dropped_columns(row)
    with pytest.raises(ValueError, match="set columns or except_columns, not both"):
        _entity(columns=["amount"], except_columns=["note"])
    with pytest.raises(ValueError, match=r"except_columns names key columns \['line'\]"):
        _entity(except_columns=["line"])


def test_ignore_null_updates_takes_every_column_or_real_ones() -> None:
    row = ["id", "line", "product", "amount"]
    assert _entity().null_update_columns(row) == []
    assert _entity(ignore_null_updates=True).null_update_columns(row) == ["product", "amount"]
    assert _entity(ignore_null_updates=["amount"]).null_update_columns(row) == ["amount"]
    with pytest.raises(ConfigError, match=r"entities\[orders\]\.ignore_null_updates: \['x'\]"):
        _entity(ignore_null_updates=["x"]).null_update_columns(row)
    with pytest.raises(ValueError, match=r"ignore_null_updates names key columns \['id'\]"):
        _entity(ignore_null_updates=["id"])


def test_metrics_endpoints_bind_loopback_unless_configured_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/metrics and /health answer this host only by default; a deployment says 0.0.0.0."""
    import inspect
    import os

    from cdc_shared.config.pipeline import PipelineConfig
    from cdc_shared.streaming.runner import StreamRunner

    for name in [n for n in os.environ if n.startswith("CDC_")]:
        monkeypatch.delenv(name)
    sections = ("ingestor", "merger", "publisher_kafka", "publisher_es", "application")
    defaults = PipelineConfig()
    assert {s: getattr(defaults, s).metrics_host for s in sections} == dict.fromkeys(
        sections, "127.0.0.1"
    )
    runner_default = inspect.signature(StreamRunner).parameters["metrics_host"].default
    assert runner_default == "127.0.0.1"
    # The override the deployments use: one variable per service, the rest stays loopback.
    monkeypatch.setenv("CDC_PUBLISHER_ES__METRICS_HOST", "0.0.0.0")
    path = tmp_path / "pipeline.yaml"
    path.write_text("publisher_es: {metrics_port: 9104}\n", encoding="utf-8")
    config = load_config(path)
    assert config.publisher_es.metrics_host == "0.0.0.0"
    assert config.publisher_es.metrics_port == 9104
    assert config.publisher_kafka.metrics_host == "127.0.0.1"


def test_history_is_off_by_default_and_tracks_named_columns() -> None:
    row = ["id", "line", "product", "amount", "note"]
    assert not _entity().history.enabled
    tracked = _entity(history={"enabled": True, "track_columns": ["amount"]})
    assert tracked.history_untracked_columns(row) == ["product", "note"]
    excepted = _entity(history={"enabled": True, "except_columns": ["note"]})
    assert excepted.history_untracked_columns(row) == ["note"]
    assert _entity(history={"enabled": True}).history_untracked_columns(row) == []
    with pytest.raises(
        ConfigError, match=r"entities\[orders\]\.history\.track_columns: \['amont'\]"
    ):
        _entity(history={"enabled": True, "track_columns": ["amont"]}).history_untracked_columns(
            row
        )
    with pytest.raises(ValueError, match="set track_columns or except_columns, not both"):
        _entity(history={"track_columns": ["amount"], "except_columns": ["note"]})
    with pytest.raises(ValueError, match=r"history names key columns \['line'\]"):
        _entity(history={"except_columns": ["line"]})


def test_history_refuses_key_names_its_write_cannot_take() -> None:
    """The history's write names the key in a SQL condition (Delta's replaceOn), written
    and tested for plain names."""
    for name in ("order.id", "a,b", "we`ird"):
        with pytest.raises(ValueError, match=r"history is on and key columns \['"):
            EntityConfig(name="o", source_topic="t", key=[name], history={"enabled": True})
        assert EntityConfig(name="o", source_topic="t", key=[name]).key == [name]
    EntityConfig(name="o", source_topic="t", key=["order_id", "line"], history={"enabled": True})


def test_a_bad_history_field_is_named_with_its_path(tmp_path: Path) -> None:
    text = (
        "entities:\n  - name: orders\n    source_topic: db.orders\n    key: [id]\n"
        "    history: {enabled: true, track_column: [amount]}\n"
    )
    with pytest.raises(ConfigError, match=r"entities\.0\.history\.track_column"):
        load_config(write(tmp_path, text))


def test_the_example_pipelines_keep_the_history_of_customers() -> None:
    """The example shows history on one entity, on columns its rows have (else the merger
    stops at start); the secured and cluster-S3 examples carry its entities, indexes aside
    (the compose and Kubernetes files are compared in their own tests)."""

    def entities(name: str) -> list[EntityConfig]:
        document = yaml.safe_load((ROOT / "deploy" / "local" / name).read_text())
        return PipelineConfig(entities=document["entities"]).entities

    example = entities("pipeline.yaml")
    assert [e.name for e in example if e.history.enabled] == ["customers"]
    customers = example[0]
    schema = json.loads((ROOT / "schemas" / f"{customers.source_topic}-value.avsc").read_text())
    (before,) = [f for f in schema["fields"] if f["name"] == "before"]  # "after" names it
    (row,) = [t for t in before["type"] if t != "null"]
    columns = [f["name"] for f in row["fields"]]
    assert customers.history_untracked_columns(columns) == ["phone", "created_at"]
    shown = [e.model_dump(exclude={"es_index"}) for e in example]
    for name in ("pipeline-secured.yaml", "pipeline-cluster-s3.yaml"):
        assert [e.model_dump(exclude={"es_index"}) for e in entities(name)] == shown, name
