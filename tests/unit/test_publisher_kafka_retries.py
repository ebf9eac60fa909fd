"""publisher-kafka: which Kafka errors are waited out, which stop it; what its progress records."""

from __future__ import annotations

import pytest
from cdc_publisher_kafka.transactions import Progress, TransactionalPublisher
from cdc_shared.config import KafkaConfig, PublisherKafkaConfig
from confluent_kafka import KafkaError, KafkaException


def _publisher(problems: list[str | None]) -> TransactionalPublisher:
    # Nothing listens on port 9: the clients are built, never used.
    return TransactionalPublisher(
        KafkaConfig(bootstrap_servers="127.0.0.1:9"),
        PublisherKafkaConfig(retry_attempts=3, max_backoff_s=0.01),
        "changes",
        on_problem=problems.append,
    )


def _failing(times: int, code: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise KafkaException(KafkaError(code))
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
        calls, call = _failing(5, KafkaError.TOPIC_AUTHORIZATION_FAILED)
        with pytest.raises(KafkaException):
            publisher._with_retries("read progress", call)  # type: ignore[arg-type]
        assert len(calls) == 1
        assert problems and "failing" in str(problems[0])
    finally:
        publisher.close()


def test_progress_records_the_change_topics_offsets() -> None:
    progress = Progress(12, "query", 3, {2: 40, 0: 17})
    assert Progress.from_metadata(progress.metadata()) == progress
    # An older publisher's progress says nothing about the topic: no offsets to check.
    older = '{"version": 12, "query_id": "query", "batch_id": 3}'
    assert Progress.from_metadata(older).offsets is None
    # Too many partitions for the broker's offset metadata: recorded without offsets.
    wide = Progress(12, "query", 3, {p: 10**12 for p in range(1000)})
    assert Progress.from_metadata(wide.metadata()) == wide.without_offsets()
