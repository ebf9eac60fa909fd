"""Kafka and Elasticsearch clients built from the pipeline configuration.

Security options (``security.*``, ``sasl.*``, API keys) pass through unchanged; they are
never logged: use :func:`cdc_shared.config.redact` for anything printed.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from elasticsearch import Elasticsearch

from cdc_shared.config import ElasticsearchConfig, KafkaConfig


def kafka_client_config(config: KafkaConfig, **overrides: Any) -> dict[str, Any]:
    """librdkafka settings: bootstrap servers, the pass-through options, then overrides."""
    return {"bootstrap.servers": config.bootstrap_servers, **config.options, **overrides}


def spark_kafka_options(config: KafkaConfig) -> dict[str, str]:
    """Options for Spark's Kafka source and sink (``kafka.``-prefixed client settings)."""
    options = {"kafka.bootstrap.servers": config.bootstrap_servers}
    options.update({f"kafka.{k}": v for k, v in config.options.items()})
    return options


def make_producer(config: KafkaConfig, **overrides: Any) -> Producer:
    """A confluent-kafka producer with the pipeline's connection and security settings."""
    return Producer(kafka_client_config(config, **overrides))


def make_consumer(config: KafkaConfig, group_id: str, **overrides: Any) -> Consumer:
    """A confluent-kafka consumer in ``group_id`` (auto commit off unless overridden)."""
    settings = {"group.id": group_id, "enable.auto.commit": False, **overrides}
    return Consumer(kafka_client_config(config, **settings))


def make_admin(config: KafkaConfig, **overrides: Any) -> AdminClient:
    """A confluent-kafka admin client."""
    return AdminClient(kafka_client_config(config, **overrides))


def make_elasticsearch(config: ElasticsearchConfig) -> Elasticsearch:
    """An Elasticsearch client; API key or basic auth when configured."""
    kwargs: dict[str, Any] = {
        "hosts": list(config.hosts),
        "request_timeout": config.request_timeout_s,
        "verify_certs": config.verify_certs,
    }
    if config.ca_certs is not None:
        kwargs["ca_certs"] = str(config.ca_certs)
    if config.api_key is not None:
        kwargs["api_key"] = config.api_key.get_secret_value()
    elif config.username is not None and config.password is not None:
        kwargs["basic_auth"] = (config.username, config.password.get_secret_value())
    return Elasticsearch(**kwargs)
