"""Failure policy: what a failed batch or query calls for.

A :class:`Failure` says it: restart the query, rebuild it, stop only its entity, or stop
the service. Our own code raises a :class:`KnownFailureError`, whose type says which;
the runner reads it from the exception object (:meth:`StreamRunner.failure_of`). Errors
that reach us as the JVM's text (Spark, Delta, Kafka's Java client) are read by a
service's ``on_failure``: each pattern in one function, tested on the message it matches.
The readers here are the ones several services share: a full disk (every service) and
a Delta source whose schema changed (the services reading bronze or silver).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


class StreamFailedError(RuntimeError):
    """A stream stopped with an error; the message names the service and entity."""


class EntityStoppedError(StreamFailedError):
    """One entity's stream cannot start, and the service's other entities can.

    Raised by a table's writer when it cannot start (e.g. the broker's ACLs refuse a
    permission of that entity's own topic or group): the table is held
    (``cdc_shared.streaming.queue``) and the others go on, as for a table whose write
    fails while running (``Failure.entity_only``). The message says why, without the
    entity's name.
    """


@dataclass(frozen=True)
class Failure:
    """A service's reading of a failed query's error (see ``StreamRunner(on_failure=)``).

    ``transient``: restart the query from its checkpoint after a backoff (forever, while
    the error stays transient); else stop the service with ``message``. ``rebuild``: build
    the query again before restarting it (its source's schema changed, and a query keeps
    the schema it was built with). ``entity_only``: stop this entity's stream but keep the
    others running (``/health`` says so; the service exits 1 when it stops). ``table``:
    the one table of a service's one query the failure is about (with ``entity_only``):
    the query holds that table back if it can, and goes on without it
    (``StreamRunner.hold_tables_with``).
    """

    message: str
    transient: bool = False
    rebuild: bool = False
    entity_only: bool = False
    table: str | None = None


class KnownFailureError(StreamFailedError):
    """An error our own code raises knowing what it calls for: :meth:`failure` says it.

    Its message is the operator's one line (without the service's name: the runner adds
    it). Subclasses stop only their table (``entity_only``) or restart the query
    (``transient``); by default the service stops.
    """

    entity_only: ClassVar[bool] = False
    transient: ClassVar[bool] = False

    def failure(self) -> Failure:
        """The policy this error calls for, with its message."""
        return Failure(str(self), transient=self.transient, entity_only=self.entity_only)


#: Reads the JVM's text of a failed query or write: (entity, error text) -> Failure, or
#: None (not recognised).
OnFailure = Callable[[str, str], Failure | None]


def read_failure(
    entity: str, error: BaseException | str, on_failure: OnFailure | None
) -> Failure | None:
    """What ``entity``'s ``error`` calls for; None: unknown (the service stops).

    Our own errors say it by their type (KnownFailureError); any other is read as the
    JVM's text by ``on_failure`` (the service's readers).
    """
    if isinstance(error, KnownFailureError):
        return error.failure()
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return on_failure(entity, text) if on_failure else None


#: How the JVM and the OS say a write failed for want of space (ENOSPC, EDQUOT).
NO_SPACE = re.compile(r"No space left on device|ENOSPC|Disk quota exceeded")


def no_space_message(storage_root: str, error: str = "") -> str:
    """What to tell the operator when a write under ``storage_root`` found the disk full.

    Names the path being written when the JVM's ``error`` shows it.
    """
    written = re.search(rf"{re.escape(storage_root.rstrip('/'))}[^\s'\",;]*", error)
    return (
        f"stopped: no space left on device under the storage root {storage_root}"
        + (f" (writing {written.group(0).rstrip('.')})" if written else "")
        + ". Delta commits and the stream's checkpoint are atomic, so the failed micro-batch "
        "committed nothing (at most unreferenced files remain); free space or grow the "
        "volume, then restart: the stream resumes from its checkpoint and writes nothing twice"
    )


def recognising_full_storage(storage_root: str, on_failure: OnFailure | None) -> OnFailure:
    """``on_failure``, after recognising a full disk.

    A full disk stops the service with a one-line message naming the storage root, not
    the JVM's stack trace.
    """

    def read(entity: str, error: str) -> Failure | None:
        if NO_SPACE.search(error):
            return Failure(no_space_message(storage_root, error))
        return on_failure(entity, error) if on_failure else None

    return read


def rebuilding_on_schema_change(layer: str) -> OnFailure:
    """Reads a Delta source's schema change as "build the stream again".

    Delta ends a stream whose source table gained a column (``DELTA_SCHEMA_CHANGED*``,
    "try restarting the query"), and a query keeps the schema it was built with; rebuilt,
    it reads the new schema. ``layer`` names the source in the log (bronze, silver).
    """

    def read(entity: str, error: str) -> Failure | None:
        if "DELTA_SCHEMA_CHANGED" in error:
            return Failure(
                f"{layer}/{entity} changed its schema; rebuilding the stream to read it",
                transient=True,
                rebuild=True,
            )
        return None

    return read
