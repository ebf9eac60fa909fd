"""The one retry policy of every service: exponential backoff, jitter, one log line a retry.

The wait before retry ``n`` (1 = the first) is ``initial_s * 2**(n - 1)``, at most
``max_s``, times a jitter factor drawn uniformly from [0.75, 1]. Not "full jitter"
(a factor in [0, 1]), which suits thousands of clients contending for one server: here
a handful of writers (one per entity or topic) only need to fall out of step, and a
wait of at least 3/4 of the nominal one keeps the policy predictable where it matters:
loops that give up after a number of attempts keep most of their time budget (a Kafka
transaction rides out a broker restart), and a failed stream is not restarted at once.

Loops that retry a call use :func:`retrying` (tenacity); loops that only need the wait
(a stream restart scheduled for later, bulk rounds that retry part of their documents)
use :func:`backoff_s` and log with :func:`log_retry`, so every retry logs the same way.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_never

#: The jitter factor's range: a wait is this fraction of the nominal one.
JITTER = (0.75, 1.0)


def backoff_s(
    attempt: int, initial_s: float, max_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before retry ``attempt`` (1-based); ``rand`` draws from [0, 1).

    Doubling from ``initial_s`` up to ``max_s``, with jitter, so that writers failing
    together (e.g. when a broker restarts) do not retry in step.
    """
    # The exponent is capped: a loop that retries forever would reach 2.0**1024, which
    # overflows, and 2**64 times any initial wait is past any maximum.
    nominal = min(max_s, initial_s * 2.0 ** min(attempt - 1, 64))
    low, high = JITTER
    return nominal * (low + (high - low) * rand())


def log_retry(
    log: logging.Logger, message: str, attempt: int, delay_s: float, **fields: object
) -> None:
    """Log a retry as a warning: ``message``, ``fields``, the attempt and the wait ahead."""
    log.warning(message, extra={**fields, "attempt": attempt, "retry_in_s": round(delay_s, 2)})


def retrying(
    retry_if: Callable[[BaseException], bool],
    *,
    initial_s: float,
    max_s: float,
    attempts: int | None,
    log: logging.Logger,
    describe: Callable[[BaseException, int], str],
    on_retry: Callable[[BaseException, str], None] | None = None,
    fields: Mapping[str, object] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Retrying:
    """A tenacity policy: retry errors ``retry_if`` accepts, ``attempts`` calls at most.

    ``attempts=None`` retries forever. Before each wait, ``describe(error, attempt)``
    makes the message, ``on_retry(error, message)`` runs (e.g. to report the problem on
    ``/health``), and the retry is logged by :func:`log_retry`. An error not retried, or
    the last one, is raised as it is.
    """

    def before_sleep(state: RetryCallState) -> None:
        assert state.outcome is not None  # tenacity waits only after a failed call
        error = state.outcome.exception()
        assert error is not None
        message = describe(error, state.attempt_number)
        if on_retry is not None:
            on_retry(error, message)
        log_retry(log, message, state.attempt_number, state.upcoming_sleep, **(fields or {}))

    return Retrying(
        retry=retry_if_exception(retry_if),
        stop=stop_never if attempts is None else stop_after_attempt(attempts),
        wait=lambda state: backoff_s(state.attempt_number, initial_s, max_s),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )
