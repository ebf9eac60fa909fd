"""The services against a secured broker: SASL_SSL (SCRAM-SHA-512), a PEM CA, ACLs.

Debezium-style records produced by the admin land in bronze exactly once through the
ingestor's own principal, which may only read its source topics; a wrong password stops
the service at start with one line naming the broker and the mechanism, and so does a
broker certificate that fails verification (a CA bundle that did not sign it, or past its
dates), with OpenSSL's reason; the password shows in no log and no Spark plan.
publisher-kafka's transactions run with only its rows of the ACL table
(deploy/kafka-acls/README.md); a revoked Write on one change topic stops that entity's
stream alone, naming the permission, and a restart once it is granted again publishes
every change exactly once. Then ``cdc run``, ``cdc status`` and ``cdc verify`` on the same
pipeline, each as its own principal with its rows of the table.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trustme
import yaml
from cdc_devkit.workload import ProduceReport, ensure_topics, produce
from cdc_ingestor.kafka_watch import KafkaWatch
from cdc_ingestor.main import SERVICE, start
from cdc_ingestor.positions import recorded_positions
from cdc_publisher_kafka.main import SERVICE as PUBLISHER_SERVICE
from cdc_publisher_kafka.main import start as start_publisher
from cdc_publisher_kafka.progress import Progress
from cdc_publisher_kafka.transactions import TransactionalPublisher
from cdc_shared.clients.connect import make_consumer, spark_kafka_options
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.config.services import PublisherKafkaConfig
from cdc_shared.contracts.layout import publisher_progress_group
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.service import run_to_exit_code
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType
from pyspark.sql import SparkSession
from support.ingestion import (
    assert_bronze_exactly_once,
    bronze,
    generate,
    launch_ingestor,
    topic_offsets,
)
from support.ops import cdc, cdc_json
from support.pipelines import Pipeline, PipelineFactory
from support.publishing import assert_change_topics_exactly_once, change_records
from support.secured_kafka import (
    ADMIN,
    APPLICATION,
    INGESTOR,
    OPERATOR,
    PASSWORD_ENV,
    PUBLISHER,
    SecuredBroker,
    acl_table,
    secured_broker,
)
from support.silver import merge_once
from support.waiting import wait_for

pytestmark = [pytest.mark.integration]

__all__ = ["secured_broker"]

#: The one line of a service's stderr that is not JSON: the Java launcher's, before
#: logging starts (Spark 4 runs with the incubating vector module).
JAVA_LAUNCHER_LINE = "WARNING: Using incubator modules: jdk.incubator.vector"
#: What the ingestor's principal needs on each source topic (deploy/kafka-acls/README.md).
SOURCE_TOPIC_GRANTS = (AclOperation.READ, AclOperation.DESCRIBE)


def run_ingestor(pipeline: Pipeline) -> int:
    """The ingestor's ``--once`` run, in this process (its SparkSession is the test's):
    ``cdc-ingestor``'s own path from configuration to exit code."""
    return run_to_exit_code(
        SERVICE, str(pipeline.path), lambda config: start(config, once=True).run()
    )


@pytest.fixture
def secured_pipeline(
    make_pipeline: PipelineFactory, secured_broker: SecuredBroker, monkeypatch: pytest.MonkeyPatch
) -> Pipeline:
    """Two entities on the secured broker; the ingestor's principal reads their topics only."""
    monkeypatch.setenv(PASSWORD_ENV, secured_broker.password(INGESTOR))
    pipeline = make_pipeline(ingestor={"trigger_interval": "1 second", "metrics_port": 0})
    document = yaml.safe_load(pipeline.path.read_text())
    document["kafka"] = secured_broker.kafka_section(INGESTOR, PASSWORD_ENV)
    pipeline.path.write_text(yaml.safe_dump(document))
    topics = [entity.source_topic for entity in pipeline.config.entities]
    ensure_topics(secured_broker.kafka_config(ADMIN), topics)
    for topic in topics:
        secured_broker.allow(INGESTOR, ResourceType.TOPIC, topic, SOURCE_TOPIC_GRANTS)
    return pipeline


def test_pipeline_through_sasl_ssl_exactly_once_across_revoked_acls(
    spark: SparkSession,
    secured_broker: SecuredBroker,
    secured_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Exactly once through SASL_SSL, across a revoked ACL: Read on one source topic taken
    back while the ingestor runs holds that table with one line naming the missing
    permission, and the group's query goes on without its topic, the other table's records
    landing; restored and restarted, nothing is lost.
    Then publisher-kafka the same way (:func:`publish_across_a_revoked_write`)."""
    caplog.set_level(logging.INFO)
    admin = secured_broker.kafka_config(ADMIN)
    messages = generate(secured_pipeline, events=100, keys=20, poison_share=0)
    half = len(messages) // 2
    report = produce(admin, iter(messages[:half]))
    password = secured_broker.password(INGESTOR)
    revoked = secured_pipeline.topic("customers")
    runners: list[StreamRunner] = []
    exit_codes: list[int] = []

    def run(config: PipelineConfig) -> None:
        runners.append(start(config))
        runners[0].run()

    service = threading.Thread(
        target=lambda: exit_codes.append(run_to_exit_code(SERVICE, str(secured_pipeline.path), run))
    )
    service.start()
    try:
        both = (revoked, secured_pipeline.topic("orders"))
        wait_for(lambda: bool(exit_codes) or caught_up(runners, admin, *both), 600)
        secured_broker.revoke(INGESTOR, ResourceType.TOPIC, revoked, (AclOperation.READ,))
        report.add(produce(admin, iter(messages[half:])))
        wait_for(
            lambda: (
                bool(exit_codes)  # the service ended
                or (
                    "customers" in stopped_streams(runners[0])
                    and caught_up(runners, admin, secured_pipeline.topic("orders"))
                )
            ),
            600,
        )
        assert not exit_codes, caplog.text[-3000:]  # the service goes on
        assert stopped_streams(runners[0]) == {"customers"}  # orders still runs
        assert runners[0].queries["default"].isActive  # the group's query, without the topic
    finally:
        if runners:
            runners[0].request_stop()
        service.join(120)
    assert exit_codes == [1]
    assert_held_for_a_refused_read(caplog, revoked)
    assert landed(spark, secured_pipeline, "customers") < len(topic_offsets(admin, revoked))

    secured_broker.allow(INGESTOR, ResourceType.TOPIC, revoked, SOURCE_TOPIC_GRANTS)
    assert run_ingestor(secured_pipeline) == 0, caplog.text[-3000:]
    assert_bronze_exactly_once(spark, secured_pipeline, admin, report)

    # The password reaches Spark only in the JAAS line: masked in the query's plans.
    kafka = secured_pipeline.config.kafka
    query = (
        spark.readStream.format("kafka")
        .options(**spark_kafka_options(kafka))
        .option("subscribe", secured_pipeline.topic("customers"))
        .option("startingOffsets", "earliest")
        .load()
        .writeStream.format("noop")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    plans = query._jsq.explainInternal(True)
    assert "StreamingDataSourceV2" in plans or "MicroBatchScan" in plans or "kafka" in plans
    assert password not in plans
    logged = caplog.text + "".join(capfd.readouterr())  # the JVM's output too
    assert "batch" in caplog.text
    assert password not in logged and secured_broker.password(ADMIN) not in logged

    publish_across_a_revoked_write(spark, secured_broker, secured_pipeline, monkeypatch, caplog)
    run_then_operate_through_the_cli(
        spark, secured_broker, secured_pipeline, report, monkeypatch, caplog, capfd
    )


def test_the_group_goes_on_without_a_table_whose_topic_read_is_revoked(
    spark: SparkSession,
    secured_broker: SecuredBroker,
    secured_pipeline: Pipeline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--once``, Read on one source topic revoked: one Kafka read serves every table of
    the group, so the query holds that table where it stood (bronze's commits record it)
    and goes on without its topic. The other table's records all land; the service exits
    1, naming the refused table. Granted again, the next start reads it from where it was
    held: bronze holds every record of both topics exactly once."""
    caplog.set_level(logging.INFO)
    admin = secured_broker.kafka_config(ADMIN)
    messages = generate(secured_pipeline, events=200, keys=20, poison_share=0)
    report = produce(admin, iter(messages[:100]))
    assert run_ingestor(secured_pipeline) == 0, caplog.text[-3000:]
    revoked = secured_pipeline.topic("customers")
    secured_broker.revoke(INGESTOR, ResourceType.TOPIC, revoked, (AclOperation.READ,))
    report.add(produce(admin, iter(messages[100:])))
    before = landed(spark, secured_pipeline, "customers")
    caplog.clear()
    assert run_ingestor(secured_pipeline) == 1, caplog.text[-3000:]
    assert f"refused Read on topic {revoked!r} to User:{INGESTOR}" in caplog.text
    assert "went on without table 'customers', held back" in caplog.text
    assert_bronze_exactly_once(spark, secured_pipeline, admin, report, ["orders"])
    assert landed(spark, secured_pipeline, "customers") == before
    assert before < len(topic_offsets(admin, revoked))
    held = held_in_bronze(spark, secured_pipeline)
    assert list(held) == ["customers"], held
    assert f"refused Read on topic {revoked!r}" in held["customers"], held

    secured_broker.allow(INGESTOR, ResourceType.TOPIC, revoked, SOURCE_TOPIC_GRANTS)
    caplog.clear()
    assert run_ingestor(secured_pipeline) == 0, caplog.text[-3000:]
    messages_logged = [r.getMessage() for r in caplog.records]
    taken_up = "a table held by an earlier run is read again from where it was held"
    assert taken_up in messages_logged, caplog.text[-3000:]
    assert_bronze_exactly_once(spark, secured_pipeline, admin, report)  # both
    assert held_in_bronze(spark, secured_pipeline) == {}


def held_in_bronze(spark: SparkSession, pipeline: Pipeline) -> dict[str, str]:
    """The tables the ingestor holds, each with why (bronze's latest commits say)."""
    config = pipeline.config
    return recorded_positions(spark, config.layout.bronze(), config.entities).held


def assert_held_for_a_refused_read(caplog: pytest.LogCaptureFixture, topic: str) -> None:
    """Customers alone was held, with one line naming the refused Read on ``topic``."""
    stops = [r for r in caplog.records if r.getMessage().startswith("stream stopped; the other")]
    assert [getattr(r, "entity", None) for r in stops] == ["customers"]
    reason: str = getattr(stops[0], "reason", "")
    assert "\n" not in reason
    assert f"refused Read on topic {topic!r} to User:{INGESTOR}" in reason
    assert "--operation Read" in reason and "loses nothing" in reason


def stopped_streams(runner: StreamRunner) -> set[str]:
    """The entities whose stream the runner stopped alone (``/health`` says "stopped")."""
    streams = runner.health()["streams"]
    return {e for e, s in streams.items() if str(s["problem"]).startswith("stopped")}


def caught_up(runners: list[StreamRunner], kafka: KafkaConfig, *topics: str) -> bool:
    """Whether the running ingestor's group query read ``topics`` to the end (from its
    progress: no Spark job beside the service's own)."""
    if not runners:
        return False
    query = runners[0].queries.get("default")
    progress = query.lastProgress if query is not None else None
    if not progress:
        return False
    ends = progress["sources"][0]["endOffset"]
    ends = json.loads(ends) if isinstance(ends, str) else ends
    for topic in topics:
        read = {int(p): o for p, o in ends.get(topic, {}).items() if o > 0}
        if read != high_watermarks(kafka, topic):
            return False
    return True


def high_watermarks(kafka: KafkaConfig, topic: str) -> dict[int, int]:
    """The offset after the last record of each partition of ``topic``."""
    ends: dict[int, int] = {}
    for partition, offset in topic_offsets(kafka, topic):
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    return ends


def landed(spark: SparkSession, pipeline: Pipeline, entity: str) -> int:
    """How many records bronze holds for ``entity`` (-1 before its table exists)."""
    try:
        return bronze(spark, pipeline, entity).count()
    except Exception:
        return -1


def run_publisher(pipeline: Pipeline, spark: SparkSession) -> int:
    """publisher-kafka's ``--once`` run in this process: configuration to exit code."""
    return run_to_exit_code(
        PUBLISHER_SERVICE,
        str(pipeline.path),
        lambda config: start_publisher(config, once=True, spark=spark).run(),
    )


def publish_across_a_revoked_write(
    spark: SparkSession,
    secured_broker: SecuredBroker,
    secured_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bronze of ``secured_pipeline`` merged, then publisher-kafka with DescribeConfigs
    (read at start), then Write (in a transaction) on one change topic revoked: each time
    that table is held with one line naming the missing permission, nothing of its
    transaction is visible, and the other table of the group goes on: its topic equals
    silver's feed. Granted again and restarted, every change is published exactly once
    (the held table from its progress, which stayed where it was)."""
    merge_once(secured_pipeline, spark)
    caplog.clear()
    admin = secured_broker.kafka_config(ADMIN)
    # publisher-kafka as its own principal, with its rows of deploy/kafka-acls only.
    run = secured_pipeline.run
    document = yaml.safe_load(secured_pipeline.path.read_text())
    document["kafka"] = secured_broker.kafka_section(PUBLISHER, PASSWORD_ENV)
    document["publisher_kafka"] = {
        "progress_topic": f"pytest-{run}-progress",
        "metrics_port": 0,
        "retry_attempts": 3,  # the old code retried the refused transaction
        "max_backoff_s": 1,
    }
    secured_pipeline.path.write_text(yaml.safe_dump(document))
    monkeypatch.setenv(PASSWORD_ENV, secured_broker.password(PUBLISHER))
    topics = grant_publisher_rows(secured_broker, secured_pipeline)
    revoked = topics["customers"]

    def stopped_alone(operation: str) -> None:
        """Only customers stopped, with one line naming ``operation`` on its topic; its
        topic holds nothing committed, the orders topic equals silver's feed."""
        stops = [r for r in caplog.records if r.getMessage().startswith("stream stopped; the")]
        assert [getattr(r, "entity", None) for r in stops] == ["customers"], caplog.text[-3000:]
        reason: str = getattr(stops[0], "reason", "")
        assert "\n" not in reason
        assert f"refused {operation} on topic {revoked!r} to User:{PUBLISHER}" in reason
        assert f"--operation {operation} --topic {revoked}" in reason, reason
        assert change_records(secured_pipeline, admin, "customers") == []  # nothing half-written
        assert assert_change_topics_exactly_once(
            spark, secured_pipeline, admin, entities={"orders"}
        )

    # Refused while the streams start (the topic's size limit is read before any
    # transaction): that entity alone stops, the other starts and publishes.
    describe_configs = (AclOperation.DESCRIBE_CONFIGS,)
    with refused(secured_broker, revoked, describe_configs):
        assert run_publisher(secured_pipeline, spark) == 1
    stopped_alone("DescribeConfigs")

    # Refused in the middle of a transaction.
    caplog.clear()
    secured_broker.revoke(PUBLISHER, ResourceType.TOPIC, revoked, (AclOperation.WRITE,))
    assert run_publisher(secured_pipeline, spark) == 1
    stopped_alone("Write")
    assert "loses nothing" in caplog.text

    # Granted again: the next start takes customers up from where it was held.
    secured_broker.allow(PUBLISHER, ResourceType.TOPIC, revoked, (AclOperation.WRITE,))
    assert run_publisher(secured_pipeline, spark) == 0, caplog.text[-3000:]
    published = assert_change_topics_exactly_once(spark, secured_pipeline, admin)
    assert all(n > 0 for n in published.values())
    assert secured_broker.password(PUBLISHER) not in caplog.text


def grant_publisher_rows(broker: SecuredBroker, pipeline: Pipeline) -> dict[str, str]:
    """publisher-kafka's rows of deploy/kafka-acls on ``pipeline``'s change topics (made
    by the admin: no Create grant), progress topic, transactional ids and groups; the
    change topics by entity."""
    config = pipeline.config
    topics = {e.name: e.change_topic_name for e in config.entities}
    progress_topic = config.publisher_kafka.progress_topic
    ensure_topics(broker.kafka_config(ADMIN), [*topics.values(), progress_topic], partitions=1)
    read_write = (AclOperation.WRITE, AclOperation.DESCRIBE, AclOperation.READ)
    for topic in topics.values():
        broker.allow(
            PUBLISHER, ResourceType.TOPIC, topic, (*read_write, AclOperation.DESCRIBE_CONFIGS)
        )
    broker.allow(PUBLISHER, ResourceType.TOPIC, progress_topic, read_write)
    prefixed = ResourcePatternType.PREFIXED
    group = publisher_progress_group(f"pytest-{pipeline.run}.")
    broker.allow(
        PUBLISHER,
        ResourceType.TRANSACTIONAL_ID,
        group,
        (AclOperation.WRITE, AclOperation.DESCRIBE),
        prefixed,
    )
    broker.allow(
        PUBLISHER, ResourceType.GROUP, group, (AclOperation.READ, AclOperation.DESCRIBE), prefixed
    )
    return topics


@contextmanager
def refused(
    broker: SecuredBroker, topic: str, operations: tuple[AclOperation, ...]
) -> Iterator[None]:
    """publisher-kafka refused ``operations`` on ``topic`` inside the block."""
    broker.revoke(PUBLISHER, ResourceType.TOPIC, topic, operations)
    try:
        yield
    finally:
        broker.allow(PUBLISHER, ResourceType.TOPIC, topic, operations)


def run_then_operate_through_the_cli(
    spark: SparkSession,
    secured_broker: SecuredBroker,
    secured_pipeline: Pipeline,
    report: ProduceReport,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``cdc run --once``, then ``cdc status`` and ``cdc verify``, each as its principal
    with only its rows of the ACL table (``acl_table``, deploy/kafka-acls): the run, as
    cdc-application with the ingestor's and publisher-kafka's rows, carries new records
    to the change topics exactly once; status, as cdc-operator, reads the source topics'
    watermarks and publisher-kafka's progress; verify, as cdc-operator, finds each change
    topic equal to silver; the operator cannot read a source topic's record (Describe
    only). No password in any output or log."""
    caplog.clear()
    capfd.readouterr()
    admin = secured_broker.kafka_config(ADMIN)
    config = secured_pipeline.config
    run = secured_pipeline.run
    secured_broker.grant(
        acl_table(
            source_prefix=f"pytest_{run}.inventory.",
            change_prefix=f"pytest-{run}.2026.",
            progress_topic=config.publisher_kafka.progress_topic,
            ingestor=APPLICATION,
            publisher=APPLICATION,
            operator=OPERATOR,
        )
    )
    report.add(produce(admin, iter(generate(secured_pipeline, events=30, keys=20, seed=7))))

    def as_user(user: str) -> None:
        document = yaml.safe_load(secured_pipeline.path.read_text())
        document["kafka"] = secured_broker.kafka_section(user, PASSWORD_ENV)
        document["application"] = {"metrics_port": 0}
        secured_pipeline.path.write_text(yaml.safe_dump(document))
        monkeypatch.setenv(PASSWORD_ENV, secured_broker.password(user))

    as_user(APPLICATION)
    path = str(secured_pipeline.path)
    services = ("--service", "ingestor", "--service", "merger", "--service", "publisher-kafka")
    ran = cdc("run", "--config", path, "--once", *services)
    assert ran.exit_code == 0, ran.output + caplog.text[-3000:]
    assert_bronze_exactly_once(spark, secured_pipeline, admin, report)
    published = assert_change_topics_exactly_once(spark, secured_pipeline, admin)
    assert all(n > 0 for n in published.values())

    as_user(OPERATOR)
    status = cdc_json("status", "--config", path)
    for entity in status["entities"]:
        lags = {s["service"]: s for s in entity["streams"]}
        assert lags["ingestor"]["lag"] == 0, lags  # from the source topic's watermarks
        # From its progress group's offset, not only the checkpoint (needs the operator's
        # Describe on the progress topic and on publisher-kafka's groups).
        assert lags["publisher_kafka"]["note"].startswith("published up to silver"), lags
        assert lags["publisher_kafka"]["lag"] == 0, lags
    verified = cdc("verify", "--config", path, "--target", "change_topic", "--json")
    assert verified.exit_code == 0, verified.output
    checked = json.loads(verified.stdout)
    assert len(checked["entities"]) == 2, checked
    # Least privilege: the operator who can run both cannot read a raw source record.
    source_topic = secured_pipeline.config.entities[0].source_topic
    refused = first_read_error(load_config(path).kafka, source_topic)
    assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, refused
    printed = ran.output + json.dumps(status) + verified.output
    logged = printed + caplog.text + "".join(capfd.readouterr())
    for user in (APPLICATION, OPERATOR, ADMIN):
        assert secured_broker.password(user) not in logged, user


def first_read_error(kafka: KafkaConfig, topic: str, timeout_s: float = 30.0) -> KafkaError | None:
    """The error of a first read of ``topic``'s partition 0 from its start; None when a
    record came back (the principal may read it). The consumer's group is one the CLI's
    own grants cover (``cdc-cli-``), so only the topic's grant decides."""
    consumer = make_consumer(kafka, "cdc-cli-probe")
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None:
                error: KafkaError | None = message.error()
                return error
        raise AssertionError(f"no record and no error from {topic} in {timeout_s:.0f} s")
    finally:
        consumer.close()


def test_wrong_password_stops_at_start_with_one_line(
    spark: SparkSession,
    secured_broker: SecuredBroker,
    secured_pipeline: Pipeline,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``cdc-ingestor`` as a user runs it: its whole stderr is JSON lines (but the Java
    launcher's own line), the one error its own line naming the broker, the mechanism and
    the user; no JVM error, no stack frame, no password."""
    wrong = "wrong-" + secured_broker.password(INGESTOR)
    stderr = tmp_path / "ingestor.stderr"
    started = time.monotonic()
    ingestor = launch_ingestor(secured_pipeline, stderr, "--once", env={PASSWORD_ENV: wrong})
    assert ingestor.wait(timeout=120) == 1
    assert time.monotonic() - started < 90
    text = stderr.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line != JAVA_LAUNCHER_LINE]
    errors = [line for line in lines if line["level"] in ("error", "critical", "fatal")]
    assert len(errors) == 1, errors
    line = errors[0]["msg"]
    assert errors[0].get("source") != "jvm" and "\n" not in line
    assert secured_broker.bootstrap_servers in line and "SCRAM-SHA-512" in line
    assert f"as {INGESTOR!r}" in line  # the user name; never the password (below)
    assert "refused the SASL credentials" in line
    assert "unreachable" not in text and "Traceback" not in text and "\tat " not in text
    warnings = [x for x in lines if x["level"] in ("warn", "warning")]
    assert not [x for x in warnings if "kafka" in x["logger"].lower()], warnings
    assert len(lines) <= 12, text  # start-up, the stream started, the stop
    assert wrong not in text and secured_broker.password(INGESTOR) not in text

    # The broker watch, probing while the ingestor runs, says what the broker refused too.
    caplog.clear()
    runner = StreamRunner(spark, SERVICE)
    try:
        kafka = secured_broker.kafka_config(INGESTOR, password=wrong)
        assert not KafkaWatch(kafka, ["customers"], runner, timeout_s=5).check()
    finally:
        runner.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"Kafka at {kafka.describe()} refused the SASL credentials")
    assert "unreachable" not in warnings[0]
    logged = caplog.text + "".join(capfd.readouterr())
    assert wrong not in logged and secured_broker.password(INGESTOR) not in logged


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("untrusted", "unable to get local issuer certificate"),
        ("expired", "certificate has expired"),
    ],
)
def test_a_broker_certificate_that_fails_verification_stops_at_start_with_one_line(
    secured_broker: SecuredBroker,
    secured_pipeline: Pipeline,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    case: str,
    reason: str,
) -> None:
    """The right password, but a broker certificate the client must refuse: signed by
    another CA than the bundle's (as after a renewal by another CA), or past its dates (the
    broker's second listener presents one that expired yesterday, signed by the right CA).
    One line naming the broker, the TLS handshake and OpenSSL's reason; not "unreachable",
    and no retrying until a timeout."""
    document = yaml.safe_load(secured_pipeline.path.read_text())
    if case == "untrusted":
        other_ca = tmp_path / "other-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(other_ca))
        document["kafka"]["tls"]["ca_file"] = str(other_ca)
        broker = secured_broker.bootstrap_servers
    else:
        broker = document["kafka"]["bootstrap_servers"] = secured_broker.expired_bootstrap_servers
    secured_pipeline.path.write_text(yaml.safe_dump(document))
    started = time.monotonic()
    assert run_ingestor(secured_pipeline) == 1
    assert time.monotonic() - started < 60
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert broker in errors[0], errors
    assert "refused the TLS handshake" in errors[0], errors
    assert reason in errors[0], errors
    assert "unreachable" not in caplog.text
    assert secured_broker.password(INGESTOR) not in caplog.text


def test_publisher_transactions_with_only_their_acls(secured_broker: SecuredBroker) -> None:
    """publisher-kafka's transactional producer, as its own principal with the grants of
    deploy/kafka-acls: a transaction commits events and progress; a restart reads the
    progress back, fencing the first instance."""
    run = uuid.uuid4().hex[:8]
    prefix = f"pytest-{run}."
    topic, progress_topic = f"{prefix}changes", f"pytest-{run}-progress"
    admin = secured_broker.kafka_config(ADMIN)
    ensure_topics(admin, [topic], partitions=1)
    ensure_topics(admin, [progress_topic], partitions=1)
    read_write = (AclOperation.WRITE, AclOperation.DESCRIBE, AclOperation.READ)
    prefixed = ResourcePatternType.PREFIXED
    grants = [
        (ResourceType.TOPIC, prefix, (*read_write, AclOperation.DESCRIBE_CONFIGS), prefixed),
        (ResourceType.TOPIC, progress_topic, read_write, ResourcePatternType.LITERAL),
        (
            ResourceType.TRANSACTIONAL_ID,
            publisher_progress_group(prefix),
            (AclOperation.WRITE, AclOperation.DESCRIBE),
            prefixed,
        ),
        (
            ResourceType.GROUP,
            publisher_progress_group(prefix),
            (AclOperation.READ, AclOperation.DESCRIBE),
            prefixed,
        ),
    ]
    for resource, name, operations, pattern in grants:
        secured_broker.allow(PUBLISHER, resource, name, operations, pattern)
    kafka = secured_broker.kafka_config(PUBLISHER)
    settings = PublisherKafkaConfig(progress_topic=progress_topic, retry_attempts=2)
    messages = [(b"k1", b"v1"), (b"k2", None), (b"k3", b"v3")]
    publisher = TransactionalPublisher(kafka, settings, topic)
    try:
        assert publisher.start() is None
        assert publisher.publish(messages, Progress(5, "q", 0)) == []
    finally:
        publisher.close()
    again = TransactionalPublisher(kafka, settings, topic)
    try:
        progress = again.start()
        assert progress is not None and progress.version == 5 and progress.offsets == {0: 2}
    finally:
        again.close()
    consumer = Consumer(
        {
            **secured_broker.server.client_settings(ADMIN),
            "group.id": f"pytest-{run}",
            "isolation.level": "read_committed",
        }
    )
    got: list[tuple[bytes | None, bytes | None]] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 30
        while len(got) < len(messages) and time.monotonic() < deadline:
            for m in consumer.consume(10, timeout=0.5):
                assert m.error() is None, m.error()
                got.append((m.key(), m.value()))
    finally:
        consumer.close()
    assert got == messages
