"""Bulk writing with an outcome for every document: applied, retried, or failed for good.

:class:`BulkWriter` sends actions with ``elasticsearch.helpers.streaming_bulk`` (its own
retries off, errors returned instead of raised) and sorts each answer:

- applied: 2xx; 409 (the index already holds this or a newer version: a replay); a 404
  on delete (nothing to delete; the delete's version is still recorded);
- retried: 429, 5xx, 408, and every failure of a whole request (connection refused,
  timeout, 401/403, ...), since those say nothing about the document. Retries use
  exponential backoff (``cdc_shared.clients.retry``) and never give up: after ``max_retries``
  rounds the entity is reported unhealthy, and it keeps waiting, so nothing is lost or
  skipped while Elasticsearch is down;
- failed: any other per-document 4xx (mapping or parse errors, an id too long, a
  request too large for a single document): returned to the caller for quarantine.

Writes name the alias with ``require_alias``, so Elasticsearch never auto-creates a plain
index (dynamic mapping, no settings) in place of a lost one, whatever
``action.auto_create_index`` says: a lost alias answers ``index_not_found_exception``, and
the writer raises :class:`AliasMissingError` for its caller to restore the index
(``cdc_publisher_es.index_lifecycle``) and write again.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cdc_shared.clients.retry import backoff_s, log_retry
from cdc_shared.config.services import PublisherEsConfig
from elastic_transport import TransportError
from elasticsearch import Elasticsearch
from elasticsearch.helpers import streaming_bulk

from cdc_publisher_es.documents import Action, latest_per_document, windows

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429})
#: How a bulk item says the alias it named (``require_alias``) does not exist.
ALIAS_MISSING = "index_not_found_exception"
#: All of a bulk answer that is read: a fraction of the JSON to parse.
RESPONSE_FIELDS = "items.*.status,items.*.error"
_USERINFO = re.compile(r"(//)[^/@\s]+@")


class AliasMissingError(RuntimeError):
    """The alias the writer writes through no longer exists (its index was deleted)."""

    def __init__(self, alias: str) -> None:
        super().__init__(f"the Elasticsearch alias {alias!r} no longer exists")
        self.alias = alias


@dataclass(frozen=True)
class Failure:
    """A document Elasticsearch refused for good, and why."""

    action: Action
    status: int
    kind: str
    reason: str


@dataclass
class BulkOutcome:
    """What happened to every action handed to :meth:`BulkWriter.write`."""

    indexed: int = 0
    deleted: int = 0
    already_applied: int = 0  # 409 conflicts and deletes of missing documents
    superseded: int = 0  # a newer change of the same id in the same window
    retried: int = 0  # document attempts repeated after a retryable answer
    failures: list[Failure] = field(default_factory=list)
    oldest_commit_delay_s: float = 0.0  # from the silver commit to its acknowledgement
    newest_commit_version: int | None = None  # the latest silver version written

    @property
    def total(self) -> int:
        """Actions accounted for."""
        return (
            self.indexed
            + self.deleted
            + self.already_applied
            + self.superseded
            + len(self.failures)
        )


class Scrubber:
    """Removes secrets (API key, password, URL user info) from text bound for logs."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = [s for s in secrets if s]

    def __call__(self, text: str) -> str:
        """``text`` without secrets."""
        text = _USERINFO.sub(r"\1***@", text)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


@dataclass
class _Round:
    retry: list[Action] = field(default_factory=list)
    solo: list[Action] = field(default_factory=list)  # a whole request was too large
    problem: str | None = None  # why Elasticsearch as a whole did not answer
    alias_missing: bool = False  # an item answered that the alias does not exist


class BulkWriter:
    """Writes actions to one index (or alias) until every one is applied or failed."""

    def __init__(
        self,
        es: Elasticsearch,
        index: str,
        settings: PublisherEsConfig,
        *,
        on_problem: Callable[[str | None], None] = lambda _p: None,
        scrub: Callable[[str], str] = lambda s: s,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,  # draws in [0, 1) for the backoff
        window: int | None = None,
        require_alias: bool = True,
    ) -> None:
        self.es = es
        self.index = index
        self.settings = settings
        self.on_problem = on_problem
        self.scrub = scrub
        self.sleep = sleep
        self.jitter = jitter
        self.window = window or settings.chunk_size * 4
        self.require_alias = require_alias
        self._reported_problem = False

    def write(self, actions: Iterable[Action]) -> BulkOutcome:
        """Send ``actions`` in windows; return once each is applied or failed for good.

        Raises AliasMissingError, as soon as a window finds the alias gone: the actions
        written until then went into the lost index, so the caller restores it and
        writes them all again (external versions make that harmless).

        Windows are written one after another, in order, by one sender thread, while the
        calling thread reads the next window from ``actions`` (Spark): reading and
        indexing overlap, and at most one window waits while another is in flight.
        """
        outcome = BulkOutcome()
        with ThreadPoolExecutor(1, thread_name_prefix=f"bulk-{self.index}") as sender:
            in_flight: Future[None] | None = None
            for window in windows(actions, self.window):
                if in_flight is not None:
                    in_flight.result()
                in_flight = sender.submit(self._write_window, window, outcome)
            if in_flight is not None:
                in_flight.result()
        return outcome

    def _write_window(self, window: list[Action], outcome: BulkOutcome) -> None:
        latest, dropped = latest_per_document(window)
        outcome.superseded += dropped
        self._resolve(latest, outcome)
        oldest = min(a.commit_timestamp for a in window)
        newest = max(a.commit_version for a in window)
        outcome.newest_commit_version = max(outcome.newest_commit_version or 0, newest)
        delay = time.time() - oldest.timestamp()
        outcome.oldest_commit_delay_s = max(outcome.oldest_commit_delay_s, delay)

    def _resolve(self, actions: list[Action], outcome: BulkOutcome) -> None:
        pending, attempt = actions, 0
        solo: list[Action] = []
        while pending or solo:
            result = _Round()
            if pending:
                self._round(pending, self.settings.chunk_size, outcome, result)
            if solo:
                self._round(solo, 1, outcome, result, solo_round=True)
            if result.alias_missing:
                raise AliasMissingError(self.index)
            pending, solo = result.retry, result.solo
            if not pending and not solo:
                break
            if not result.retry:  # only splitting an oversized request: no wait needed
                continue
            attempt += 1
            outcome.retried += len(result.retry)
            self._backoff(attempt, len(result.retry), result.problem)
        if self._reported_problem:
            self._reported_problem = False
            self.on_problem(None)
            log.info("Elasticsearch accepts writes again", extra={"index": self.index})

    def _backoff(self, attempt: int, waiting: int, problem: str | None) -> None:
        settings = self.settings
        delay = backoff_s(attempt, settings.initial_backoff_s, settings.max_backoff_s, self.jitter)
        text = problem or f"Elasticsearch asked to retry {waiting} document(s) (429/5xx)"
        text = f"{text}; retrying (attempt {attempt})"
        if problem is not None or attempt > settings.max_retries:
            self._reported_problem = True
            self.on_problem(text)
            log_retry(
                log,
                "bulk write waiting for Elasticsearch",
                attempt,
                delay,
                index=self.index,
                problem=text,
                documents=waiting,
            )
        self.sleep(delay)

    def _round(
        self,
        actions: list[Action],
        chunk_size: int,
        outcome: BulkOutcome,
        result: _Round,
        *,
        solo_round: bool = False,
    ) -> None:
        """One pass of ``streaming_bulk`` over ``actions``; sorts every answer."""
        answered = 0
        try:
            for ok, item in streaming_bulk(
                self.es,
                (a.bulk(self.index) for a in actions),
                chunk_size=chunk_size,
                max_chunk_bytes=self.settings.max_chunk_bytes,
                max_retries=0,
                raise_on_error=False,
                raise_on_exception=False,
                yield_ok=True,
                require_alias=self.require_alias,
                filter_path=RESPONSE_FIELDS,
            ):
                action = actions[answered]
                answered += 1
                self._sort(action, ok, item, outcome, result, solo_round)
        except TransportError as exc:  # connection refused, timeout: no answer at all
            result.problem = self.scrub(f"Elasticsearch unavailable: {type(exc).__name__}: {exc}")
            result.retry.extend(actions[answered:])

    def _sort(
        self,
        action: Action,
        ok: bool,
        item: dict[str, Any],
        outcome: BulkOutcome,
        result: _Round,
        solo_round: bool,
    ) -> None:
        info = next(iter(item.values()))
        status = info.get("status")
        if ok:
            if action.op == "delete":
                outcome.deleted += 1
            else:
                outcome.indexed += 1
            return
        error = info.get("error")
        kind = error.get("type", "") if isinstance(error, dict) else ""
        whole_request = "exception" in info  # the bulk request itself failed
        if not isinstance(status, int):
            status = 0
        if status == 409 or (status == 404 and action.op == "delete" and not error):
            outcome.already_applied += 1
        elif whole_request:
            if status == 413 and not solo_round:
                result.solo.append(action)  # split: find the document that is too large
            elif status == 413:
                outcome.failures.append(
                    Failure(action, status, "request_too_large", self._describe(info, status))
                )
            else:
                result.retry.append(action)
                result.problem = result.problem or self.scrub(
                    f"Elasticsearch refused the bulk request: {self._describe(info, status)}"
                )
        elif kind == ALIAS_MISSING:
            result.alias_missing = True
        elif status in RETRY_STATUS or status >= 500:
            result.retry.append(action)
        else:
            outcome.failures.append(
                Failure(action, status, kind or "rejected", self._describe(info, status))
            )

    def _describe(self, info: dict[str, Any], status: int) -> str:
        error = info.get("error")
        if isinstance(error, dict):
            text = f"{status} {error.get('type', '')}: {error.get('reason', '')}"
            cause = error.get("caused_by")
            if isinstance(cause, dict):
                text += f" (caused by {cause.get('type', '')}: {cause.get('reason', '')})"
        else:
            text = f"{status} {error}"
        return self.scrub(text)[:2000]
