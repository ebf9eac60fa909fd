"""``cdc run``'s wiring without Spark: which services, their pools, their endpoints."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cdc_cli.application import (
    Application,
    fair_scheduler_conf,
    select_services,
    without_service_endpoints,
)
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import SparkConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.contracts.layout import SERVICE_NAMES
from cdc_shared.jvm.spark import DRIVER_MEMORY, driver_memory, with_sized_heap


def test_services_default_to_all_four_in_pipeline_order() -> None:
    assert select_services(None) == list(SERVICE_NAMES)
    assert select_services(["publisher_es", "ingestor"]) == ["ingestor", "publisher-es"]


def test_an_unknown_service_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown services \['mergr'\]; known: ingestor"):
        select_services(["mergr"])


def test_each_service_gets_a_fair_pool_with_its_weight(tmp_path: Path) -> None:
    config = PipelineConfig(application={"pool_weights": {"merger": 5, "publisher_es": 2}})
    conf = fair_scheduler_conf(config, ["ingestor", "merger", "publisher-es"], tmp_path)
    assert conf["spark.scheduler.mode"] == "FAIR"
    pools = ET.parse(conf["spark.scheduler.allocation.file"]).getroot().findall("pool")
    weights = {p.get("name"): int(p.findtext("weight") or 0) for p in pools}
    assert weights == {"ingestor": 1, "merger": 5, "publisher-es": 2}


def test_pool_weights_name_known_services_and_are_positive() -> None:
    with pytest.raises(ValueError, match="unknown services"):
        PipelineConfig(application={"pool_weights": {"ingester": 1}})
    with pytest.raises(ValueError, match="at least 1"):
        PipelineConfig(application={"pool_weights": {"merger": 0}})


def test_the_application_serves_the_only_endpoint() -> None:
    config = without_service_endpoints(PipelineConfig())
    ports = [
        config.ingestor.metrics_port,
        config.merger.metrics_port,
        config.publisher_kafka.metrics_port,
        config.publisher_es.metrics_port,
    ]
    assert ports == [0, 0, 0, 0]
    assert config.application.metrics_port == 9100
    assert config.merger.trigger_interval == PipelineConfig().merger.trigger_interval


def _tables(count: int) -> list[dict[str, object]]:
    return [{"name": f"t{i}", "source_topic": f"db.t{i}", "key": ["id"]} for i in range(count)]


def test_the_driver_heap_grows_with_the_tables_unless_configured() -> None:
    """Sized per table stream (a table of a service); at least Spark's own 1 GiB."""
    two = Application(PipelineConfig(entities=_tables(2)), list(SERVICE_NAMES))
    assert two.spark_config().conf["spark.driver.memory"] == "1024m"
    many = Application(PipelineConfig(entities=_tables(100)), list(SERVICE_NAMES))
    assert many.spark_config().conf["spark.driver.memory"] == "1792m"  # 512 + 3 x 400
    one_service = Application(PipelineConfig(entities=_tables(100)), ["merger"])
    assert one_service.spark_config().conf["spark.driver.memory"] == "1024m"
    configured = PipelineConfig(entities=_tables(24), spark={"conf": {"spark.driver.memory": "3g"}})
    assert (
        Application(configured, list(SERVICE_NAMES)).spark_config().conf["spark.driver.memory"]
        == "3g"
    )
    assert driver_memory(1000) == "3584m"  # 3,512 rounded up to 256 MiB


def test_a_service_alone_sizes_its_heap_for_its_tables_unless_configured() -> None:
    """One deployment per service: a table stream per table."""
    assert with_sized_heap(SparkConfig(), 2).conf[DRIVER_MEMORY] == "1024m"
    assert with_sized_heap(SparkConfig(), 400).conf[DRIVER_MEMORY] == "1792m"
    own = SparkConfig(conf={DRIVER_MEMORY: "3g", "spark.ui.enabled": "true"})
    assert with_sized_heap(own, 400) == own
    kept = with_sized_heap(SparkConfig(conf={"spark.ui.enabled": "true"}), 400).conf
    assert kept == {DRIVER_MEMORY: "1792m", "spark.ui.enabled": "true"}
