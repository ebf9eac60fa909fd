"""The value types every section of the configuration shares: errors, secrets, intervals, ports.

Values of the form ``${env:NAME}`` or ``${file:PATH}`` are read from the environment or
a file (``Resolved``, ``Secret``), so secrets need not be written in the YAML.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
)

_REFERENCE = re.compile(r"^\$\{(env|file):([^}]+)\}$")


#: Seconds per unit of a processing-time interval (``interval_seconds``).
_UNIT_S = {
    **dict.fromkeys(("ms", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("s", "second", "seconds"), 1.0),
    **dict.fromkeys(("min", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hour", "hours"), 3600.0),
}


_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)


_SECRET_WORDS = (
    "password",
    "secret",
    "api_key",
    "apikey",
    "token",
    "credential",
    "user.info",
    "access.key",
)


class ConfigError(ValueError):
    """The pipeline configuration is missing, unreadable or invalid."""


def interval_seconds(text: str) -> float | None:
    """A processing-time interval such as ``5 seconds`` or ``500 ms``, in seconds.

    None when ``text`` is not a number and a unit (milliseconds, seconds, minutes,
    hours): Spark may still take it, but it cannot be compared.
    """
    match = _INTERVAL.match(text)
    unit = _UNIT_S.get(match.group(2).lower()) if match else None
    return None if match is None or unit is None else float(match.group(1)) * unit


def _an_interval(text: str) -> str:
    """``text`` if ``interval_seconds`` reads it; ValueError if not."""
    if interval_seconds(text) is None:
        raise ValueError(
            f"not an interval: a number and a unit (ms, seconds, minutes, hours), got {text!r}"
        )
    return text


#: A processing-time interval such as ``5 seconds`` or ``500 ms`` (``interval_seconds``).
Interval = Annotated[str, AfterValidator(_an_interval)]


#: A TCP port; 0 where the field says so means "none".
Port = Annotated[int, Field(ge=0, lt=65536)]


def _unique_names(names: list[str]) -> list[str]:
    """``names`` if no name repeats; ValueError if one does."""
    if len(set(names)) != len(names):
        raise ValueError(f"column names must be unique, got {names}")
    return names


#: A selection of columns: at least one name, none twice.
ColumnNames = Annotated[list[str], Field(min_length=1), AfterValidator(_unique_names)]


def is_secret_option(name: str) -> bool:
    """Whether a pass-through option (e.g. ``sasl.password``) holds a secret."""
    lowered = name.lower()
    return (
        any(word in lowered for word in _SECRET_WORDS)
        or lowered.endswith(".jaas.config")
        or lowered.endswith("keystore.key")
    )


def redact(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` fit for logs: secret-looking values replaced by ``***``."""
    return {k: ("***" if is_secret_option(k) else v) for k, v in options.items()}


def resolve_reference(value: str) -> str:
    """``value``, or what its ``${env:NAME}`` / ``${file:PATH}`` reference reads."""
    match = _REFERENCE.match(value)
    if match is None:
        return value
    kind, target = match.groups()
    if kind == "env":
        if target not in os.environ:
            raise ValueError(f"environment variable {target!r} is not set")
        return os.environ[target]
    try:
        return Path(target).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read secret file {target!r}: {exc.strerror}") from None


def _resolved(value: object) -> object:
    return resolve_reference(value) if isinstance(value, str) else value


#: A value that may be a reference resolved at load: ``${env:NAME}`` or ``${file:PATH}``.
Resolved = Annotated[str, BeforeValidator(_resolved)]


#: A secret (never printed), given or referenced as ``Resolved`` is.
Secret = Annotated[SecretStr, BeforeValidator(_resolved)]


class Section(BaseModel):
    """A section of the configuration: unknown keys refused, immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
