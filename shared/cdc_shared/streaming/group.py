"""The entity streams inside a service's one query, each taken up and prepared once.

A service run as one query for all its tables (``<service>.one_query``) still writes
each table through that table's own stream; this holds those streams, gives each the one
query's identity (their idempotent writes name the one query), and prepares them a few
at a time. A stream that cannot start for its table alone (``EntityStoppedError``, e.g.
an ACL refusing that table's change topic) does not stop the others' start: its table is
handed back to the caller, which holds it (:mod:`cdc_shared.streaming.held`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from cdc_shared.config import EntityConfig
from cdc_shared.spark import TABLES_AT_ONCE, side_by_side, side_by_side_in_groups
from cdc_shared.streaming.failures import EntityStoppedError
from cdc_shared.streaming.runner import QueryIdentity


class MemberStream(Protocol):
    """An entity's stream as a one query uses it."""

    entity: EntityConfig
    identity: QueryIdentity

    def prepare(self, wait_s: float) -> None:
        """Create the tables it writes; wait up to ``wait_s`` for its source."""


Member = TypeVar("Member", bound=MemberStream)


class MemberStreams(Generic[Member]):
    """The one query's entity streams by ``key`` (e.g. entity name, topic)."""

    def __init__(
        self,
        open_member: Callable[[EntityConfig], Member],
        key: Callable[[EntityConfig], str],
        identity: QueryIdentity,
    ) -> None:
        self.by_key: dict[str, Member] = {}
        self._open = open_member
        self._key = key
        self._identity = identity
        self._prepared: set[str] = set()

    def add(self, entity: EntityConfig, wait_s: float | None = None) -> None:
        """Take ``entity``'s stream up; with ``wait_s``, prepared first (raising: not taken up)."""
        stream = self._open(entity)
        stream.identity = self._identity
        if wait_s is not None:
            stream.prepare(wait_s)
            self._prepared.add(self._key(entity))
        self.by_key[self._key(entity)] = stream

    def prepare(self, wait_s: float) -> dict[str, str]:
        """Every stream not prepared yet, the first alone (it makes the shared quarantine).

        The entities whose stream cannot start alone (``EntityStoppedError``), each with
        why; the others are prepared all the same. Any other error is raised.
        """
        waiting = [s for key, s in self.by_key.items() if key not in self._prepared]
        refused: dict[str, str] = {}

        def prepare_one(stream: Member) -> None:
            try:
                stream.prepare(wait_s)
            except EntityStoppedError as stopped:
                refused[stream.entity.name] = str(stopped)

        prepares = [functools.partial(prepare_one, stream) for stream in waiting]
        side_by_side(prepares[:1])
        side_by_side_in_groups(prepares[1:], TABLES_AT_ONCE)
        self._prepared.update(self._key(s.entity) for s in waiting)
        return refused
