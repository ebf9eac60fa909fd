"""The ingestor's Kafka reader: what it asks of the broker, and what the pipeline overrides."""

from __future__ import annotations

from typing import Any, cast

from cdc_ingestor.ingestion import FETCH_MAX_WAIT, FETCH_MAX_WAIT_MS, kafka_reader
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig
from pyspark.sql import DataFrameReader


class RecordingReader:
    """Records the options a reader is given, the last one for a name winning (as Spark's)."""

    def __init__(self) -> None:
        self.settings: dict[str, str] = {}

    def format(self, source: str) -> RecordingReader:
        self.settings["format"] = source
        return self

    def option(self, name: str, value: Any) -> RecordingReader:
        self.settings[name] = str(value)
        return self

    def options(self, **values: Any) -> RecordingReader:
        for name, value in values.items():
            self.option(name, value)
        return self


def read_options(config: PipelineConfig) -> dict[str, str]:
    reader = RecordingReader()
    kafka_reader(cast(DataFrameReader, reader), config, "a,b", "earliest")
    return reader.settings


def test_the_broker_is_asked_to_answer_fetches_at_once() -> None:
    settings = read_options(PipelineConfig(kafka=KafkaConfig(bootstrap_servers="b:9092")))
    assert settings[f"kafka.{FETCH_MAX_WAIT}"] == FETCH_MAX_WAIT_MS
    assert int(FETCH_MAX_WAIT_MS) < 500  # Kafka's default, which each partition read waited
    assert settings["subscribe"] == "a,b" and settings["includeHeaders"] == "true"


def test_the_pipelines_java_options_override_the_fetch_wait() -> None:
    kafka = KafkaConfig(bootstrap_servers="b:9092", java_options={FETCH_MAX_WAIT: "250"})
    assert read_options(PipelineConfig(kafka=kafka))[f"kafka.{FETCH_MAX_WAIT}"] == "250"
