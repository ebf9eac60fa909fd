"""The example entities on their example topics, for tests without a pipeline file."""

from __future__ import annotations

from pathlib import Path

from cdc_shared.config.entities import EntityConfig

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
CUSTOMERS = EntityConfig(
    name="customers",
    source_topic="dbserver1.inventory.customers",
    key=["id"],
    sequence_by=["source.lsn"],
)
ORDERS = EntityConfig(
    name="orders",
    source_topic="dbserver1.inventory.orders",
    key=["order_id", "line_no"],
    sequence_by=["source.ts_ms", "source.lsn"],
)
