"""Faults that must fail loudly and never lose silently: a producer switching to a writer
schema the reader cannot resolve, and a full disk under the storage root."""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cdc_devkit.workload import GeneratedMessage, produce
from cdc_ingestor.main import start
from cdc_ingestor.positions import recorded_positions
from cdc_shared.avro import AvroDecoder, AvroEncoder, FileSchemaRegistry, KnownSchema, parse_schema
from cdc_shared.clients.connect import make_consumer
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.failures import StreamFailedError
from cdc_shared.streaming.runner import StreamRunner
from confluent_kafka import TopicPartition
from pyspark.sql import SparkSession
from support.ingestion import bronze, generate, launch_ingestor, quarantine, topic_offsets
from support.pipelines import Pipeline, PipelineFactory
from support.waiting import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The full-disk test's tmpfs: room for the JVM's needs (checkpoint, Delta logs) and a few
#: batches of bronze, not for the whole topic.
SMALL_DISK_MB = 4


def topic_values(kafka: KafkaConfig, topic: str) -> dict[tuple[int, int], bytes | None]:
    """Every record's value by (partition, offset), read back with a plain consumer."""
    wanted = topic_offsets(kafka, topic)
    consumer = make_consumer(kafka, group_id=f"read-back-{topic}")
    partitions = {p for p, _ in wanted}
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    values: dict[tuple[int, int], bytes | None] = {}
    try:
        while len(values) < len(wanted):
            message = consumer.poll(10)
            assert message is not None, f"read {len(values)} of {len(wanted)} records back"
            assert message.error() is None, message.error()
            values[(int(message.partition() or 0), int(message.offset() or 0))] = message.value()
    finally:
        consumer.close()
    assert set(values) == wanted
    return values


def variant(schema: KnownSchema, change: Callable[[dict[str, Any]], None]) -> KnownSchema:
    """``schema`` with ``change`` applied to its row record (Debezium's ``Value``)."""
    definition = copy.deepcopy(dict(schema.definition))
    row = next(b for b in definition["fields"][0]["type"] if isinstance(b, dict))
    change(row)
    return parse_schema(definition)


def retype_id(row: dict[str, Any]) -> None:
    """``id`` int -> string: no Avro promotion either way."""
    next(f for f in row["fields"] if f["name"] == "id")["type"] = "string"


def drop_email(row: dict[str, Any]) -> None:
    """``email`` removed: the reader requires it and has no default for it."""
    row["fields"] = [f for f in row["fields"] if f["name"] != "email"]


def rewrite(
    messages: list[GeneratedMessage],
    decoder: AvroDecoder,
    writer: KnownSchema,
    convert: Callable[[dict[str, Any]], dict[str, Any]],
) -> Iterator[GeneratedMessage]:
    """The (non-tombstone) messages re-encoded with ``writer``, their rows ``convert``ed."""
    encoder = AvroEncoder(writer)
    for message in messages:
        envelope = decoder.decode(message.value)
        if envelope is None:
            continue
        for side in ("before", "after"):
            if envelope[side] is not None:
                envelope[side] = convert(envelope[side])
        yield GeneratedMessage(
            message.entity, message.topic, message.key, encoder.encode(envelope), "event"
        )


def write_schema(folder: Path, name: str, schema: KnownSchema) -> None:
    """Deploy ``schema`` as the file ``name`` of a registry folder."""
    (folder / name).write_text(json.dumps(schema.definition))


#: The reason a quarantined record's message gives: for the retyped writer (True), else.
WHY = {
    True: "id: type_mismatch: reader type: INT not compatible with writer type: STRING",
    False: "email: the writer schema has no such field and the reader's has no default",
}


def run_in_thread(runner: StreamRunner) -> tuple[threading.Thread, list[BaseException]]:
    """``runner.run()`` in a thread; what it raised, if anything, lands in the list."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, failed


def assert_incompatible(row: Any, writer: KnownSchema, reader: KnownSchema, retyped: bool) -> None:
    """A quarantined record names its kind, both schemas and why they do not resolve."""
    assert row.error_kind == "incompatible_schema", row.error_message
    assert f"value writer schema fingerprint:{writer.fingerprint.hex()}" in row.error_message
    assert f"reader schema fingerprint:{reader.fingerprint.hex()}" in row.error_message
    assert WHY[retyped] in row.error_message


def quarantining(config: PipelineConfig) -> PipelineConfig:
    """``config`` with ``ingestor.on_incompatible_schema: quarantine`` (it is frozen)."""
    ingestor = config.ingestor.model_copy(update={"on_incompatible_schema": "quarantine"})
    return config.model_copy(update={"ingestor": ingestor})


def stop_customers_with(
    spark: SparkSession,
    pipeline: Pipeline,
    runner: StreamRunner,
    landed_first: int,
    deploy_and_produce: Callable[[], object],
    orders: int,
) -> str:
    """Run the ingestor until customers is held while orders go on in the group's query;
    the error the service ended with."""
    thread, failed = run_in_thread(runner)
    try:
        wait_for(lambda: landed(spark, pipeline) == landed_first)
        deploy_and_produce()  # while the ingestor runs

        def customers_stopped() -> bool:
            customers = runner.health()["streams"].get("customers", {})  # held: by its name
            problem = customers.get("problem") or ""
            return problem.startswith("stopped")

        wait_for(customers_stopped, timeout_s=300)
        wait_for(lambda: bronze(spark, pipeline, "orders").count() == orders, timeout_s=300)
        assert not failed and thread.is_alive(), f"orders stopped too: {failed}"
        assert runner.queries["default"].isActive  # the group's query goes on
    finally:
        runner.request_stop()
        thread.join(180)
    assert len(failed) == 1 and isinstance(failed[0], StreamFailedError), failed
    return str(failed[0])


def test_incompatible_writer_schema_holds_its_table_then_can_be_quarantined(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A producer deploys, as the subject's newest version, a value schema whose ``id`` is a
    string (the reader's is an int), and another producer writes with a schema lacking a
    required field. By default (docs/design.md) customers is held with a clear error: none
    of its records is written from its first record of the batch that brought such a
    record, and bronze's commits record where it was held, while orders go on in the same
    query; the service exits with that error. Restarted with ``on_incompatible_schema:
    quarantine``, the table is read again from where it was held: the incompatible
    records go to quarantine as ``incompatible_schema`` with an error logged, and
    compatible records before, between and after them reach bronze: nothing is lost or
    doubled."""
    caplog.set_level(logging.INFO)
    pipeline = make_pipeline(
        entities=("customers", "orders"),
        ingestor={"trigger_interval": "1 second", "metrics_port": 0},
    )
    topic = pipeline.topic("customers")
    registry = FileSchemaRegistry([pipeline.schema_dir])
    v1 = registry.latest(f"{topic}-value")
    retyped, without_email = variant(v1, retype_id), variant(v1, drop_email)
    load = generate(pipeline, events=3200, keys=200, poison_share=0, redelivery_share=0)
    good = [m for m in load if m.entity == "customers"]
    orders = [m for m in load if m.entity == "orders"]
    decoder = AvroDecoder(registry, v1)
    bad_type = list(rewrite(good[900:1000], decoder, retyped, lambda r: {**r, "id": str(r["id"])}))
    bad_field = list(
        rewrite(
            good[1000:1100],
            decoder,
            without_email,
            lambda r: {k: v for k, v in r.items() if k != "email"},
        )
    )
    first = good[:800]
    then = [*good[800:900], *bad_type, *good[900:1000], *bad_field, *good[1000:]]

    produce(kafka_config, iter(first + orders[:400]))

    def deploy_and_produce() -> None:
        # The retyped schema as the subject's version 2 (the newest), the other under a
        # subject of its own.
        write_schema(pipeline.schema_dir, f"{topic}-value.v2.avsc", retyped)
        write_schema(pipeline.schema_dir, f"{topic}-legacy-value.avsc", without_email)
        produce(kafka_config, iter(then + orders[400:]))

    runner = start(pipeline.config, once=False, spark=spark)
    stop = stop_customers_with(spark, pipeline, runner, len(first), deploy_and_produce, len(orders))
    assert "table 'customers' stopped:" in stop and "cannot be resolved" in stop, stop
    assert "on_incompatible_schema: quarantine" in stop, stop
    assert "\n" not in stop, stop
    rows = bronze(spark, pipeline, "customers").select("kafka_partition", "kafka_offset")
    before_the_stop = {(r.kafka_partition, r.kafka_offset) for r in rows.collect()}
    assert len(first) <= len(before_the_stop) < len(good)
    assert quarantine(spark, pipeline).count() == 0, "quarantined although the default stops"
    values = topic_values(kafka_config, topic)
    assert_held_from_its_first_record(spark, pipeline, before_the_stop, set(values))

    # The operator chooses to set such records aside: the table is read again from there.
    start(quarantining(pipeline.config), once=True, spark=spark).run()

    # The oracle: the topic read back, each record classified by its framing header.
    writers = {retyped.header: retyped, without_email.header: without_email}
    expected = {c: writers[v[:10]] for c, v in values.items() if v and v[:10] in writers}
    assert len(expected) == len(bad_type) + len(bad_field)
    assert not before_the_stop & set(expected), "an incompatible record reached bronze"

    rows = quarantine(spark, pipeline).where(f"kafka_topic = '{topic}'").collect()
    quarantined = {(r.kafka_partition, r.kafka_offset): r for r in rows}
    assert len(quarantined) == len(rows), "a record quarantined twice"
    assert set(quarantined) == set(expected)
    for coordinates, writer in expected.items():
        assert_incompatible(quarantined[coordinates], writer, v1, writer is retyped)
        assert quarantined[coordinates].raw_value == values[coordinates]

    in_bronze = assert_bronze_holds_the_rest(spark, pipeline, set(values), set(quarantined))
    assert len(in_bronze) == len(good)
    table = bronze(spark, pipeline, "customers")
    assert table.schema["after"].dataType["id"].dataType.simpleString() == "int"  # type: ignore[index]
    assert table.where("after.email is null and after is not null").count() == 0
    assert_orders_once_and_nothing_held(spark, pipeline, len(orders))
    assert_stop_logged(caplog)


def assert_orders_once_and_nothing_held(
    spark: SparkSession, pipeline: Pipeline, orders: int
) -> None:
    """Orders went on beside the held table: each record once; no table is held now."""
    entity = pipeline.config.entity("customers")
    assert not recorded_positions(spark, pipeline.config.layout.bronze(), [entity]).held
    rows = bronze(spark, pipeline, "orders").select("kafka_partition", "kafka_offset")
    assert rows.count() == rows.distinct().count() == orders


def assert_held_from_its_first_record(
    spark: SparkSession,
    pipeline: Pipeline,
    in_bronze: set[tuple[int, int]],
    topic: set[tuple[int, int]],
) -> None:
    """Customers is held from its first record of a batch: bronze's commits record it
    held, and bronze holds exactly the records below its held position, none past it."""
    entity = pipeline.config.entity("customers")
    recorded = recorded_positions(spark, pipeline.config.layout.bronze(), [entity])
    assert "cannot be resolved" in recorded.held.get("customers", ""), recorded
    held_at = recorded.positions[entity.source_topic]
    assert in_bronze == {(p, o) for p, o in topic if o < held_at.get(str(p), 0)}


def assert_stop_logged(caplog: pytest.LogCaptureFixture) -> None:
    """An error was logged for the incompatible records; the restart read the held table
    again from where it was held."""
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("incompatible" in m for m in errors), errors
    messages = [r.getMessage() for r in caplog.records]
    assert "a table held by an earlier run is read again from where it was held" in messages


def assert_bronze_holds_the_rest(
    spark: SparkSession,
    pipeline: Pipeline,
    topic: set[tuple[int, int]],
    quarantined: set[tuple[int, int]],
) -> set[tuple[int, int]]:
    """Bronze holds every record of the topic not in quarantine, once; returns its offsets."""
    rows = bronze(spark, pipeline, "customers").select("kafka_partition", "kafka_offset")
    in_bronze = [(r.kafka_partition, r.kafka_offset) for r in rows.collect()]
    assert len(in_bronze) == len(set(in_bronze)), "duplicate offsets in bronze"
    assert not set(in_bronze) & quarantined, "records both in bronze and in quarantine"
    assert set(in_bronze) | quarantined == topic, "records neither in bronze nor in quarantine"
    return set(in_bronze)


def landed(spark: SparkSession, pipeline: Pipeline) -> int:
    """Records in bronze and quarantine so far (-1 before the tables exist)."""
    try:
        return bronze(spark, pipeline, "customers").count() + quarantine(spark, pipeline).count()
    except Exception:
        return -1


def mount_tmpfs(folder: Path, size_mb: int, remount: bool = False) -> None:
    """A tmpfs of ``size_mb`` at ``folder`` (or the mounted one resized); fails the test
    with mount's own words when it cannot."""
    command = (
        ["mount", "-o", f"remount,size={size_mb}m", str(folder)]
        if remount
        else ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(folder)]
    )
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(
            f"cannot mount a {size_mb} MiB tmpfs at {folder} (this test needs root and "
            f"mount): {done.stderr.strip()}"
        )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs for a storage root, unmounted afterwards whatever happened."""
    if os.geteuid() != 0:
        pytest.fail("the full-disk test mounts a tmpfs and must run as root")
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mount_tmpfs(folder, SMALL_DISK_MB)
    try:
        yield folder
    finally:
        for _ in range(10):  # a JVM that just exited may still hold files for a moment
            if subprocess.run(["umount", str(folder)], check=False).returncode == 0:
                break
            time.sleep(1)
        else:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)


def wide_rows(pipeline: Pipeline, events: int) -> list[GeneratedMessage]:
    """Valid change events whose ``last_name`` carries 8 KiB of incompressible text."""
    registry = FileSchemaRegistry([pipeline.schema_dir])
    v1 = registry.latest(f"{pipeline.topic('customers')}-value")
    noise = random.Random(7)
    return list(
        rewrite(
            generate(pipeline, events=events, keys=events, poison_share=0, redelivery_share=0),
            AvroDecoder(registry, v1),
            v1,
            lambda r: {**r, "last_name": base64.b64encode(noise.randbytes(6144)).decode()},
        )
    )


def test_full_disk_stops_clearly_commits_nothing_half_way_and_resumes(
    spark: SparkSession,
    kafka_config: KafkaConfig,
    make_pipeline: PipelineFactory,
    small_disk: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The storage root on a 4 MiB tmpfs and more than that to ingest: the ingestor stops
    (exit 1) with one line saying no space is left under the storage root; bronze stays
    readable with whole batches only; once the disk is grown, a restart lands every record
    exactly once."""
    pipeline = make_pipeline(
        entities=("customers",),
        storage_root=str(small_disk),
        ingestor={
            "max_offsets_per_trigger": 150,
            "metrics_port": free_port(),
            "metrics_host": "127.0.0.1",
        },
    )
    topic = pipeline.topic("customers")
    messages = wide_rows(pipeline, 700)
    volume = sum(len(m.value or b"") for m in messages)
    assert volume > 1.4 * SMALL_DISK_MB * 2**20, volume
    report = produce(kafka_config, iter(messages))
    assert report.produced == len(messages)

    log = tmp_path / "ingestor.log"
    first = launch_ingestor(pipeline, log, "--once")
    assert first.wait(300) == 1, f"the ingestor did not fail on a full disk; see {log}"
    failure = [
        json.loads(line)["msg"]
        for line in log.read_text().splitlines()
        if '"level": "error", "logger": "cdc_ingestor"' in line
    ]
    assert len(failure) == 1, f"not one error line from the ingestor; see {log}"
    # The group's query failed: it is named (every table of the group stopped with it).
    assert "'default' stopped: no space left on device under the storage root" in failure[0]
    assert str(small_disk) in failure[0], failure[0]

    # Nothing half-way: bronze reads, its log has every version, and it holds whole batches
    # in order: a gap-free prefix of each partition.
    table = pipeline.config.layout.bronze()
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").orderBy("version").collect()
    assert [h.version for h in history] == list(range(len(history)))
    appended = sum(
        int(h.operationMetrics["numOutputRows"]) for h in history if h.operation == "WRITE"
    )
    rows = bronze(spark, pipeline, "customers").select("kafka_partition", "kafka_offset")
    by_partition: dict[int, list[int]] = {}
    for row in rows.collect():
        by_partition.setdefault(row.kafka_partition, []).append(row.kafka_offset)
    landed = sum(len(offsets) for offsets in by_partition.values())
    assert 0 < landed == appended < len(messages), (landed, appended)
    for offsets in by_partition.values():
        assert sorted(offsets) == list(range(len(offsets)))

    mount_tmpfs(small_disk, 10 * SMALL_DISK_MB, remount=True)
    monkeypatch.setenv("CDC_INGESTOR__MAX_OFFSETS_PER_TRIGGER", "1000")  # the rest at once
    second = launch_ingestor(pipeline, log, "--once")
    assert second.wait(300) == 0, f"the ingestor did not resume; see {log}"
    quarantined = {
        (r.kafka_partition, r.kafka_offset)
        for r in quarantine(spark, pipeline).where(f"kafka_topic = '{topic}'").collect()
    }
    assert not quarantined
    in_bronze = assert_bronze_holds_the_rest(
        spark, pipeline, topic_offsets(kafka_config, topic), quarantined
    )
    assert len(in_bronze) == len(messages)
