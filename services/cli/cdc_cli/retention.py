"""Delta's retention rules as ``cdc maintenance`` applies them.

A table's ``delta.deletedFileRetentionDuration`` is the shortest VACUUM that cannot
corrupt a commit or fail a read (:func:`retention_minimum`, :func:`check_vacuum_minimum`);
``delta.logRetentionDuration`` is how long its log keeps a version's commit. Both are
read in Delta's interval syntax (:func:`interval_hours`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cdc_cli.table_state import TableState

DEFAULT_RETENTION_HOURS = 168.0  # Delta's default deletedFileRetentionDuration: 7 days
DEFAULT_LOG_RETENTION_HOURS = 720.0  # Delta's default logRetentionDuration: 30 days
RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
LOG_RETENTION_PROPERTY = "delta.logRetentionDuration"
# Spark's interval units as Delta's table properties use them ("interval 7 days").
_INTERVAL_UNITS = {
    "week": 7 * 24.0,
    "day": 24.0,
    "hour": 1.0,
    "minute": 1 / 60,
    "second": 1 / 3600,
    "millisecond": 1 / 3_600_000,
    "microsecond": 1 / 3_600_000_000,
}


class RetentionTooShortError(RuntimeError):
    """A requested retention would delete files (or tombstones) a table or stream still needs."""


class ProgressUnknownError(RetentionTooShortError):
    """A service's progress cannot be read: what VACUUM may delete cannot be told."""


def log_retention_hours(state: TableState, path: str) -> float:
    """How long the table at ``path`` keeps a version's commit in its log, in hours."""
    value = state.table_properties(path).get(LOG_RETENTION_PROPERTY)
    return DEFAULT_LOG_RETENTION_HOURS if value is None else interval_hours(str(value))


def interval_hours(text: str) -> float:
    """Hours in a Delta interval property such as ``interval 7 days`` or ``1 week 12 hours``.

    Delta reads these with Spark's interval syntax and refuses months and years for
    retentions; every other unit of that syntax is read here. Raises ValueError otherwise.
    """
    words = text.strip().lower().split()
    if words[:1] == ["interval"]:
        words = words[1:]
    if not words or len(words) % 2:
        raise ValueError(f"not an interval of <number> <unit> pairs: {text!r}")
    hours = 0.0
    for number, unit in zip(words[::2], words[1::2], strict=True):
        per_unit = _INTERVAL_UNITS.get(unit.removesuffix("s"))
        if per_unit is None or not re.fullmatch(r"[+-]?\d+(\.\d+)?", number):
            raise ValueError(f"not an interval Delta accepts for a retention: {text!r}")
        hours += float(number) * per_unit
    return hours


@dataclass(frozen=True)
class RetentionMinimum:
    """Delta's minimum VACUUM retention of one table, and where it comes from."""

    table: str  # e.g. "bronze/customers"
    hours: float
    source: str  # the property's value, or that it is Delta's default

    def __str__(self) -> str:
        return f"{self.table}: {self.hours:g} hours ({RETENTION_PROPERTY} {self.source})"


def retention_minimum(state: TableState, table: str, path: str) -> RetentionMinimum:
    """The table's ``delta.deletedFileRetentionDuration`` (unset: Delta's default).

    Raises RetentionTooShortError when the property cannot be read as an interval: VACUUM
    would not know how short is too short.
    """
    value = state.table_properties(path).get(RETENTION_PROPERTY)
    if value is None:
        return RetentionMinimum(table, DEFAULT_RETENTION_HOURS, "not set: Delta's default")
    try:
        return RetentionMinimum(table, interval_hours(str(value)), f"= {value!r}")
    except ValueError as exc:
        raise RetentionTooShortError(
            f"cannot tell Delta's minimum VACUUM retention of {table} ({path}): {exc}; set "
            f"the table's {RETENTION_PROPERTY} to e.g. 'interval 7 days'"
        ) from None


def check_vacuum_minimum(minimums: list[RetentionMinimum], hours: float) -> None:
    """Raise RetentionTooShortError naming every table ``hours`` is below Delta's minimum of."""
    short = [m for m in minimums if hours < m.hours]
    if short:
        raise RetentionTooShortError(
            f"refusing VACUUM with a retention of {hours:g} hours: below Delta's minimum of\n"
            + "\n".join(f"  {m}" for m in short)
            + "\nfiles younger than that may belong to a commit a running ingestor or merger "
            "has not finished, or to a version a stream is still reading: deleting them "
            "corrupts the table or fails the stream. Use --vacuum-hours "
            f"{math.ceil(max(m.hours for m in short))} or more; only with every service "
            "stopped, --force-short-retention"
        )
