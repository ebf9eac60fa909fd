"""publisher-kafka: which Kafka errors are waited out, which stop it; what its progress records."""

from __future__ import annotations

import pytest
from cdc_publisher_kafka.progress import Progress
from cdc_publisher_kafka.transactions import (
    PermissionRefusedError,
    TransactionalIdRefusedError,
    TransactionalPublisher,
)
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.services import PublisherKafkaConfig
from cdc_shared.streaming.failures import read_failure
from confluent_kafka import KafkaError, KafkaException


def _publisher(problems: list[str | None]) -> TransactionalPublisher:
    # Nothing listens on port 9: the clients are built, never used.
    return TransactionalPublisher(
        KafkaConfig(bootstrap_servers="127.0.0.1:9"),
        PublisherKafkaConfig(retry_attempts=3, max_backoff_s=0.01),
        "changes",
        on_problem=problems.append,
    )


def _failing(times: int, code: int, fatal: bool = False) -> tuple[list[int], object]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise KafkaException(KafkaError(code, fatal=fatal))
        return "done"

    return calls, call


@pytest.mark.parametrize(
    "code", [KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS]
)
def test_coordinator_errors_after_a_broker_start_are_retried(code: int) -> None:
    problems: list[str | None] = []
    publisher = _publisher(problems)
    try:
        calls, call = _failing(2, code)
        assert publisher._with_retries("read progress", call) == "done"  # type: ignore[arg-type]
        assert len(calls) == 3
        # Reported while retrying, cleared once the call went through: a publisher that
        # retried at start-up and has nothing to publish yet must still turn healthy.
        assert len(problems) == 3 and "retrying" in str(problems[0]) and problems[-1] is None
    finally:
        publisher.close()


def test_a_permanent_error_is_not_retried() -> None:
    problems: list[str | None] = []
    publisher = _publisher(problems)
    try:
        calls, call = _failing(5, KafkaError.INVALID_CONFIG)
        with pytest.raises(KafkaException):
            publisher._with_retries("read progress", call)  # type: ignore[arg-type]
        assert len(calls) == 1
        assert problems and "failing" in str(problems[0])
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("what", "code", "fatal", "refused"),
    [
        ("read progress", KafkaError.GROUP_AUTHORIZATION_FAILED, False, "Describe on group"),
        (
            "describe the change topic",
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
            False,
            "DescribeConfigs",
        ),
        ("commit", KafkaError.TOPIC_AUTHORIZATION_FAILED, False, "Write on topic 'changes'"),
        ("commit", KafkaError.GROUP_AUTHORIZATION_FAILED, False, "Read on group"),
        # librdkafka calls a refused transactional id fatal: still named, not "fatal".
        ("init_transactions", KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, True, "Write"),
    ],
)
def test_a_refused_permission_is_named_and_not_retried(
    what: str, code: int, fatal: bool, refused: str
) -> None:
    publisher = _publisher([])
    try:
        calls, call = _failing(5, code, fatal)
        with pytest.raises(PermissionRefusedError) as raised:
            publisher._with_retries(what, call)  # type: ignore[arg-type]
        assert len(calls) == 1
        line = str(raised.value)
        assert f"refused {refused}" in line and "to the client's principal" in line
        assert "\n" not in line and "kafka-acls" in line and "loses nothing" in line
        service_wide = code == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
        assert isinstance(raised.value, TransactionalIdRefusedError) == service_wide
        if code != KafkaError.TOPIC_AUTHORIZATION_FAILED:
            assert "'cdc-publisher-kafka.changes'" in line  # the group / transactional id
    finally:
        publisher.close()


def test_a_refused_batch_stops_its_entity_and_a_refused_transactional_id_the_service() -> None:
    line = "stopped: Kafka at b:9092 refused Write on topic 'cdc.customers' to User:p: ..."
    failure = read_failure("customers", PermissionRefusedError(line), None)
    assert failure is not None and failure.entity_only and not failure.transient
    assert failure.message == line
    whole = read_failure("customers", TransactionalIdRefusedError(line), None)
    assert whole is not None and not whole.entity_only and whole.message == line
    # Text alone is the JVM's: a refusal's name in it is not read as ours.
    assert read_failure("customers", f"PermissionRefusedError: {line}", None) is None


def test_progress_records_the_change_topics_offsets() -> None:
    progress = Progress(12, "query", 3, {2: 40, 0: 17})
    assert Progress.from_metadata(progress.metadata()) == progress
    # An older publisher's progress says nothing about the topic: no offsets to check.
    older = '{"version": 12, "query_id": "query", "batch_id": 3}'
    assert Progress.from_metadata(older).offsets is None
    # Too many partitions for the broker's offset metadata: recorded without offsets.
    wide = Progress(12, "query", 3, {p: 10**12 for p in range(1000)})
    assert Progress.from_metadata(wide.metadata()) == wide.without_offsets()
