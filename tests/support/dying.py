"""A process dying at a chosen point of a step, in the test's own process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Killed(BaseException):
    """The process dying at a chosen point (not an Exception: nothing handles it)."""


def dying_before(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` that dies before it does anything."""

    def died(*args: Any, **kwargs: Any) -> Any:
        raise Killed(f"killed before {step.__name__}")

    return died


def dying_after(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` that dies just after it is done."""

    def died(*args: Any, **kwargs: Any) -> Any:
        step(*args, **kwargs)
        raise Killed(f"killed after {step.__name__}")

    return died
