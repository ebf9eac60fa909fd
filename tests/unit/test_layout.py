"""The storage layout and shared names: one definition every service and the CLI use."""

from __future__ import annotations

from cdc_shared.contracts.layout import (
    SERVICES,
    StorageLayout,
    command_name,
    display_name,
    publisher_progress_group,
)


def test_every_table_and_checkpoint_has_its_documented_place() -> None:
    layout = StorageLayout("s3a://bucket/cdc/")
    assert layout.bronze() == "s3a://bucket/cdc/bronze/_all"  # one table for every entity
    assert layout.legacy_bronze("orders") == "s3a://bucket/cdc/bronze/orders"
    assert layout.silver("orders") == "s3a://bucket/cdc/silver/orders"
    assert layout.tombstones("orders") == "s3a://bucket/cdc/silver/_tombstones/orders"
    assert layout.truncates("orders") == "s3a://bucket/cdc/silver/_truncates/orders"
    assert layout.quarantine("merger") == "s3a://bucket/cdc/quarantine/merger"
    assert layout.replay_ledger() == "s3a://bucket/cdc/quarantine/_replayed"
    assert layout.silver_versions() == "s3a://bucket/cdc/silver/_versions"
    assert layout.checkpoint("publisher_es", "default") == (
        "s3a://bucket/cdc/_streams/publisher_es/default"
    )
    # Where earlier releases kept a query per entity (or their one query): read to migrate.
    assert layout.legacy_checkpoint("publisher_es", "orders") == (
        "s3a://bucket/cdc/_checkpoints/publisher_es/orders"
    )
    assert StorageLayout("/data").change_schemas() == "/data/_schemas"


def test_a_service_has_one_section_name_and_one_spelling_for_people() -> None:
    assert SERVICES == ("ingestor", "merger", "publisher_kafka", "publisher_es")
    assert [display_name(s) for s in SERVICES] == [
        "ingestor",
        "merger",
        "publisher-kafka",
        "publisher-es",
    ]
    assert command_name("publisher_kafka") == "cdc-publisher-kafka"
    assert publisher_progress_group("cdc.orders") == "cdc-publisher-kafka.cdc.orders"
