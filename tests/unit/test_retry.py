"""The shared retry policy: wait bounds and growth, jitter, logging, giving up."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from cdc_shared.clients.retry import backoff_s, log_retry, retrying

LOGGER = "cdc_test_retry"


class Transient(Exception):
    pass


class Permanent(Exception):
    pass


def failing(times: int, error: type[Exception] = Transient) -> tuple[list[int], Callable[[], str]]:
    """A call that raises ``error`` ``times`` times, then returns "done"."""
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error(f"failure {len(calls)}")
        return "done"

    return calls, call


def policy(
    attempts: int | None,
    waits: list[float],
    problems: list[str] | None = None,
    initial_s: float = 0.5,
    max_s: float = 4.0,
) -> Callable[..., object]:
    return retrying(
        lambda error: isinstance(error, Transient),
        initial_s=initial_s,
        max_s=max_s,
        attempts=attempts,
        log=logging.getLogger(LOGGER),
        describe=lambda error, attempt: f"{error}; retrying, attempt {attempt}",
        on_retry=None if problems is None else (lambda _error, message: problems.append(message)),
        fields={"topic": "changes"},
        sleep=waits.append,
    )


def test_the_wait_doubles_from_the_initial_one_up_to_the_maximum() -> None:
    nominal = [backoff_s(attempt, 0.5, 4.0, rand=lambda: 1.0) for attempt in range(1, 8)]
    assert nominal == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


@pytest.mark.parametrize("attempt", [1, 3, 10])
def test_jitter_keeps_the_wait_within_three_quarters_and_all_of_the_nominal_one(
    attempt: int,
) -> None:
    nominal = min(30.0, 0.5 * 2 ** (attempt - 1))
    assert backoff_s(attempt, 0.5, 30.0, rand=lambda: 0.0) == pytest.approx(0.75 * nominal)
    assert backoff_s(attempt, 0.5, 30.0, rand=lambda: 0.5) == pytest.approx(0.875 * nominal)
    draws = [backoff_s(attempt, 0.5, 30.0) for _ in range(2000)]
    assert all(0.75 * nominal <= d <= nominal for d in draws)
    assert max(draws) - min(draws) > 0.2 * nominal  # really random, spread over the range


def test_a_loop_that_retries_for_days_neither_overflows_nor_exceeds_the_maximum() -> None:
    assert backoff_s(5000, 0.5, 30.0, rand=lambda: 1.0) == 30.0


def test_log_retry_logs_a_warning_with_the_attempt_and_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log_retry(logging.getLogger(LOGGER), "broker away", 3, 1.23456, topic="changes")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage() == "broker away"
    assert vars(record)["attempt"] == 3
    assert vars(record)["retry_in_s"] == 1.23
    assert vars(record)["topic"] == "changes"


def test_transient_errors_are_retried_with_growing_waits_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    waits: list[float] = []
    problems: list[str] = []
    calls, call = failing(4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert policy(10, waits, problems)(call) == "done"
    assert len(calls) == 5
    for wait, nominal in zip(waits, [0.5, 1.0, 2.0, 4.0], strict=True):
        assert 0.75 * nominal <= wait <= nominal
    assert problems == [f"failure {n}; retrying, attempt {n}" for n in range(1, 5)]
    records = [vars(r) for r in caplog.records if r.name == LOGGER]
    assert [r["msg"] for r in records] == problems
    assert [r["attempt"] for r in records] == [1, 2, 3, 4]
    assert [r["retry_in_s"] for r in records] == [round(w, 2) for w in waits]
    assert all(r["topic"] == "changes" and r["levelno"] == logging.WARNING for r in records)


def test_the_last_error_is_raised_once_the_attempts_are_spent() -> None:
    waits: list[float] = []
    calls, call = failing(10)
    with pytest.raises(Transient, match="failure 3"):
        policy(3, waits)(call)
    assert len(calls) == 3
    assert len(waits) == 2  # no wait after the last attempt


def test_an_error_not_retried_is_raised_at_once() -> None:
    waits: list[float] = []
    problems: list[str] = []
    calls, call = failing(1, Permanent)
    with pytest.raises(Permanent):
        policy(10, waits, problems)(call)
    assert len(calls) == 1
    assert waits == [] and problems == []


def test_without_a_limit_it_retries_as_long_as_it_takes() -> None:
    waits: list[float] = []
    calls, call = failing(200)
    assert policy(None, waits, max_s=2.0)(call) == "done"
    assert len(calls) == 201
    assert all(1.5 <= wait <= 2.0 for wait in waits[3:])  # capped at the maximum


def test_a_failure_in_the_retry_hook_stops_the_retries() -> None:
    """E.g. publisher-kafka's abort before a retry finding the producer fenced."""
    waits: list[float] = []
    calls, call = failing(5)

    def fenced(_error: BaseException, _message: str) -> None:
        raise Permanent("fenced")

    with pytest.raises(Permanent, match="fenced"):
        retrying(
            lambda error: isinstance(error, Transient),
            initial_s=0.5,
            max_s=4.0,
            attempts=10,
            log=logging.getLogger(LOGGER),
            describe=lambda error, _attempt: str(error),
            on_retry=fenced,
            sleep=waits.append,
        )(call)
    assert len(calls) == 1 and waits == []
