"""Names from configuration: Kafka topics, Elasticsearch indices, and Avro namespaces."""

from __future__ import annotations

import re

import fastavro
import pytest
from cdc_shared.config.names import avro_namespace, es_index_problem, kafka_topic_problem
from hypothesis import given
from hypothesis import strategies as st

AVRO_FULL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
KAFKA_TOPICS = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=40).filter(
    lambda topic: topic not in (".", "..")
)


@pytest.mark.parametrize(
    "topic", ["cdc.orders", "dbserver1.inventory.customers", "Orders_2024", "_private.x"]
)
def test_a_topic_that_is_a_valid_avro_name_is_its_own_namespace(topic: str) -> None:
    assert avro_namespace(topic) == topic


@pytest.mark.parametrize(
    ("topic", "cleaned"),
    [
        ("orders-cdc", "orders_cdc"),
        ("team-a.customers", "team_a.customers"),
        ("cdc.2024.orders", "cdc._2024.orders"),
        ("2024", "_2024"),
        ("a..b", "a._.b"),
        (".orders", "_.orders"),
        ("orders.", "orders._"),
        ("-", "_"),
    ],
)
def test_an_awkward_topic_is_cleaned_and_suffixed_with_its_hash(topic: str, cleaned: str) -> None:
    namespace = avro_namespace(topic)
    assert re.fullmatch(re.escape(cleaned) + r"_[0-9a-f]{8}", namespace)
    assert AVRO_FULL_NAME.fullmatch(namespace)


def test_topics_that_clean_up_alike_get_distinct_namespaces() -> None:
    names = {avro_namespace(t) for t in ("orders-cdc", "orders_cdc", "orders.cdc", "orders-cdc-")}
    assert len(names) == 4


@given(KAFKA_TOPICS)
def test_every_kafka_topic_gives_a_stable_namespace_avro_accepts(topic: str) -> None:
    assert kafka_topic_problem(topic) is None
    namespace = avro_namespace(topic)
    assert namespace == avro_namespace(topic)
    assert AVRO_FULL_NAME.fullmatch(namespace)
    record = {"type": "record", "name": "ChangeEvent", "namespace": namespace, "fields": []}
    assert fastavro.parse_schema(record)["name"] == f"{namespace}.ChangeEvent"


@pytest.mark.parametrize("topic", ["", ".", "..", "a b", "a/b", "ä", "x" * 250])
def test_invalid_kafka_topics_are_refused(topic: str) -> None:
    assert kafka_topic_problem(topic) is not None


@pytest.mark.parametrize("name", ["orders", "team-a.orders", "2024_orders", "a+b"])
def test_valid_index_names_pass(name: str) -> None:
    assert es_index_problem(name) is None


@pytest.mark.parametrize(
    "name", ["", ".", "Orders", "a b", "a,b", "a:b", "a*b", "-a", "_a", "+a", "é" * 128]
)
def test_invalid_index_names_are_refused(name: str) -> None:
    assert es_index_problem(name) is not None


def test_the_suffix_reserved_for_index_names_counts() -> None:
    assert es_index_problem("a" * 248, reserved_suffix=7) is None
    assert es_index_problem("a" * 249, reserved_suffix=7) is not None
