"""Schema-registry faults are not bad records: retried, then a loud stop, never quarantine.

The real registry (Apicurio) sits behind a switchable loopback proxy
(``support.registry_proxy``) that stages the faults: HTTP 503, HTTP 401, connections
closed without an answer; a port nothing listens on stands for a registry out of reach.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cdc_devkit.workload import (
    GeneratedMessage,
    WorkloadGenerator,
    WorkloadSpec,
    produce,
    register_source_schemas,
)
from cdc_ingestor.main import start
from cdc_shared.avro import (
    AvroDecoder,
    ConfluentSchemaRegistry,
    FileSchemaRegistry,
    SchemaRegistryUnavailableError,
    UnknownSchemaError,
    read_header,
    subject_name,
)
from cdc_shared.avro.framing import confluent_header
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.streaming.failures import StreamFailedError
from cdc_shared.streaming.runner import StreamRunner
from pyspark.sql import SparkSession
from support.ingestion import bronze, quarantine, topic_offsets
from support.pipelines import SCHEMAS, Pipeline, PipelineFactory
from support.registry_proxy import RegistryProxy, registry_proxy
from support.waiting import free_port, wait_for

pytestmark = pytest.mark.integration

V2 = SCHEMAS / "dbserver1.inventory.customers-value.v2.avsc"
Row = tuple[Any, Any, Any, Any]


@pytest.fixture
def proxy(registry_url: str) -> Any:
    with registry_proxy(registry_url) as serving:
        yield serving


def _retries(caplog: pytest.LogCaptureFixture, registry: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING
        and "schema registry" in r.getMessage()
        and getattr(r, "registry", None) == registry
    ]


def test_registry_answers_are_told_apart(
    registry_url: str, proxy: RegistryProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """404 is the record's fault, asked once; 503, 401, a closed or refused connection are
    the registry's: retried (a warning each), then an error naming the registry."""
    caplog.set_level(logging.WARNING, logger="cdc_shared.avro")
    direct = ConfluentSchemaRegistry(registry_url)
    subject = f"pytest-outage-{free_port()}-value"
    known = direct.register(subject, json.loads(V2.read_text()))
    header = read_header(known.header)
    registry = ConfluentSchemaRegistry(proxy.url, retry_budget_s=0.3)

    with pytest.raises(UnknownSchemaError, match="does not know schema id"):
        registry.resolve(read_header(confluent_header(2**31 - 1)))
    assert registry.versions(f"{subject}-none") == []
    assert proxy.requests["forward"] == 2, "a 404 is an answer: asked once, not retried"

    for mode, answer in (("503", "answered HTTP 503"), ("401", "answered HTTP 401")):
        proxy.fail(mode)
        before = proxy.requests[mode]
        with pytest.raises(SchemaRegistryUnavailableError, match=answer) as raised:
            registry.resolve(header)
        assert proxy.requests[mode] - before >= 2, f"{mode} was not retried"
        assert proxy.url in str(raised.value)
        with pytest.raises(SchemaRegistryUnavailableError, match=answer):
            registry.versions(subject)  # not "no versions"
        with pytest.raises(SchemaRegistryUnavailableError, match=answer):
            registry.latest(subject)  # not "no such subject"
    proxy.fail("close")
    with pytest.raises(SchemaRegistryUnavailableError, match="did not answer"):
        registry.resolve(header)
    refused = f"http://user:s3cret@127.0.0.1:{free_port()}/apis/ccompat/v7"
    with pytest.raises(SchemaRegistryUnavailableError, match="ConnectError") as raised:
        ConfluentSchemaRegistry(refused, retry_budget_s=0.3).resolve(header)
    assert "s3cret" not in str(raised.value)
    assert f"127.0.0.1:{refused.rsplit(':', 1)[1]}" in str(raised.value)

    retried = _retries(caplog, proxy.url)
    assert len(retried) >= 7 and all("retrying" in r.getMessage() for r in retried)
    assert all(r.attempt >= 1 and r.retry_in_s > 0 for r in retried)  # type: ignore[attr-defined]

    # A short outage is ridden out: the answer comes once the registry is back.
    proxy.fail("503")
    threading.Timer(1.0, proxy.fail, ["forward"]).start()
    healed = ConfluentSchemaRegistry(proxy.url, retry_budget_s=20.0).resolve(header)
    assert healed.fingerprint == known.fingerprint


def _deploy(registry_url: str, topic: str, version: int) -> None:
    """A producer deploys value schema ``version`` (a new id), straight at Apicurio.

    Version 3 is version 2 with one more optional column.
    """
    definition = json.loads(V2.read_text())
    if version == 3:
        row = next(f for f in definition["fields"] if f["name"] == "before")["type"][1]
        row["fields"].append({"name": "nickname", "type": ["null", "string"], "default": None})
    ConfluentSchemaRegistry(registry_url).register(subject_name(topic, False), definition)


def _load(registry_url: str, pipeline: Pipeline, **spec: Any) -> list[GeneratedMessage]:
    """Changes written with the subject's newest schema (snapshot rows with the first)."""
    direct = ConfluentSchemaRegistry(registry_url)
    shape = WorkloadSpec(poison_share=0, redelivery_share=0, schema_change_at=0.0, **spec)
    return list(WorkloadGenerator(pipeline.config.entities, direct, shape).messages())


def _as_produced(messages: list[GeneratedMessage], registry_url: str) -> list[Row]:
    """(op, id, loyalty_tier, writer schema) of each message, decoded by the test alone."""
    decoder = AvroDecoder(ConfluentSchemaRegistry(registry_url))
    rows: list[Row] = []
    for message in messages:
        if message.value is None:
            rows.append((None, None, None, None))  # a tombstone
            continue
        envelope = decoder.decode(message.value)
        assert envelope is not None
        row = envelope["after"] or envelope["before"]
        writer = f"id:{read_header(message.value).schema_id}"
        rows.append((envelope["op"], row["id"], row.get("loyalty_tier"), writer))
    return rows


def _as_landed(record: Any) -> Row:
    """(op, id, loyalty_tier, writer schema) of a bronze row."""
    if record.is_tombstone:
        return (None, None, None, None)
    row = record.after or record.before
    return (record.op, row.id, row.loyalty_tier, record.writer_schema)


def test_a_registry_outage_quarantines_nothing_and_past_its_budget_stops(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    registry_url: str,
    proxy: RegistryProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The running ingestor meets a new schema id while the registry answers 503: it
    retries until the registry is back and every record reaches bronze. Then an outage
    longer than the retry budget holds the table, naming the registry: nothing of its
    batch is written, and the service exits with that line when stopped. Nothing is ever
    quarantined; once the registry answers, a restart writes the held records."""
    caplog.set_level(logging.WARNING, logger="cdc_shared.avro")
    pipeline = make_pipeline(
        entities=("customers",),
        schema_registry={"url": proxy.url, "retry_budget_s": 6.0},
        ingestor={"trigger_interval": "500 milliseconds", "metrics_port": 0},
    )
    topic = pipeline.topic("customers")
    files = FileSchemaRegistry([pipeline.schema_dir])
    register_source_schemas(pipeline.config.entities, ConfluentSchemaRegistry(registry_url), files)
    runner = start(pipeline.config, spark=spark)  # knows v1 only
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(runner.run)
        try:
            _deploy(registry_url, topic, 2)
            messages = _load(registry_url, pipeline, events=300, keys=60)
            # Heals after four answers: within our budget, past the registry client's own
            # retries (max.retries 3, which the code before this fix relied on).
            proxy.fail("503", answers=4)
            report = produce(kafka_config, iter(messages))
            offsets = topic_offsets(kafka_config, topic)
            wait_for(lambda: bronze(spark, pipeline, "customers").count() >= len(messages), 60)
            landed = bronze(spark, pipeline, "customers").collect()

            # An outage past the budget: the service stops, naming the registry.
            _deploy(registry_url, topic, 3)
            later = _load(registry_url, pipeline, events=50, keys=20, snapshot_rows=0)
            proxy.fail("503")
            produce(kafka_config, iter(later))
            wait_for(lambda: _held(runner, "customers"), 90)
            runner.request_stop()
            with pytest.raises(StreamFailedError) as stopped:
                running.result(timeout=180)
        finally:
            runner.request_stop()

    assert proxy.requests["503"] >= 4 + 2
    retried = _retries(caplog, proxy.url)
    assert len(retried) >= 4 + 1, "a warning for each retry"
    # The table is held with the registry's one line.
    stop = str(stopped.value)
    assert "table 'customers' stopped: " in stop, stop
    assert "nothing of the table's batch was written or quarantined" in stop, stop
    assert proxy.url in stop and "HTTP 503" in stop, stop
    assert "Traceback" not in stop, stop
    assert quarantine(spark, pipeline).count() == 0

    # Bronze holds every record of the first load once, as produced (the oracle: the
    # records decoded straight from Apicurio), and none of the load that met the stop.
    assert report.produced == len(messages) == len(offsets)
    assert sorted((r.kafka_partition, r.kafka_offset) for r in landed) == sorted(offsets)
    expected = _as_produced(messages, registry_url)
    got = [_as_landed(r) for r in landed]
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert any(e[2] for e in expected), "the load uses v2's new column"
    assert bronze(spark, pipeline, "customers").count() == len(messages)

    # The registry answers again: the restart reads the held table from where it was held.
    proxy.fail("forward")
    start(pipeline.config, once=True, spark=spark).run()
    rows = bronze(spark, pipeline, "customers").select("kafka_partition", "kafka_offset")
    assert sorted(tuple(r) for r in rows.collect()) == sorted(topic_offsets(kafka_config, topic))
    assert quarantine(spark, pipeline).count() == 0


def _held(runner: StreamRunner, entity: str) -> bool:
    """Whether ``entity`` is held: ``/health`` lists it stopped, by its name."""
    problem = runner.health()["streams"].get(entity, {}).get("problem") or ""
    return problem.startswith("stopped")
