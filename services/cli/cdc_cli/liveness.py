"""Whether a service of the pipeline may be running, seen from outside it.

What ``cdc maintenance`` checks before a VACUUM shorter than Delta's minimum (a live
writer lease, a ``/health`` that answers, a recent data commit or checkpoint progress),
and the ``/health`` endpoints ``cdc watch`` probes. Tables and checkpoints are read
through an :class:`ActivityReader`: without a JVM, or through Spark.
"""

from __future__ import annotations

import datetime as dt
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Protocol

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.services import StreamingServiceConfig
from cdc_shared.contracts.layout import SERVICES, display_name

from cdc_cli.checkpoints import (
    BRONZE,
    Commit,
    StateReader,
    data_commits_from,
    group_checkpoints,
    streams_folder,
)

#: Bronze's commits no service makes: retention's deletes (``cdc_cli.log_retention``).
RETENTION_OPERATIONS = frozenset({"DELETE"})
#: How long a commit or a checkpoint's progress counts as a sign of a running service.
DEFAULT_QUIET = dt.timedelta(minutes=10)
HEALTH_TIMEOUT_S = 2.0
#: How many of a table's newest commits are read at a time looking for its last data commit.
_HISTORY_WINDOW = 100
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class ActivityReader(StateReader, Protocol):
    """A :class:`StateReader` that also tells when a folder last changed."""

    def newest_modification(self, folder: str) -> dt.datetime | None:
        """The newest modification time of an entry of ``folder``; None when it has none."""
        ...


def health_endpoints(config: PipelineConfig) -> list[tuple[str, str]]:
    """(service, ``/health`` URL) of every service the configuration gives a metrics port.

    Each service's own port and the one of ``cdc run`` (the application), on the
    configured ``metrics_host``; a wildcard bind address is probed on this host.
    """
    sections: list[StreamingServiceConfig] = [getattr(config, s) for s in SERVICES]
    binds = [
        (display_name(service), section.metrics_host, section.metrics_port)
        for service, section in zip(SERVICES, sections, strict=True)
    ]
    application = config.application
    binds.append(("cdc run", application.metrics_host, application.metrics_port))
    endpoints = []
    for name, bind, port in binds:
        if not port:
            continue
        host = "127.0.0.1" if bind in _WILDCARD_HOSTS else bind
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        endpoints.append((name, f"http://{host}:{port}/health"))
    return endpoints


def health_answer(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """What ``url`` says about a service there; None when no service of ours answers.

    A service's ``/health`` answers 200 or 503 (running, or starting or failing): both
    are a running service. A refused connection, or another HTTP answer (some other
    server on that port), is none. Anything else (a timeout, an unknown host) cannot
    rule a service out, so it is reported too. Proxies from the environment are ignored.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as answer:
            status = int(answer.status)
    except urllib.error.HTTPError as exc:
        status = exc.code
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return None
        return f"no clear answer ({exc.reason})"
    except OSError as exc:  # a timeout or reset while reading the answer
        return f"no clear answer ({exc})"
    return f"answers {status}" if status in (200, 503) else None


def _recent_data_commit(
    state: StateReader, path: str, since: dt.datetime, also_not_data: frozenset[str]
) -> Commit | None:
    """The table's last data commit if it is after ``since``; None otherwise.

    The history is read from the newest commits back, a window at a time, only as far as
    ``since``: a table of many versions costs the few read. ``also_not_data``: operations
    of the table that no service commits (bronze's DELETE: retention's, maintenance's own).
    """
    newest = state.table_version(path)
    end = -1 if newest is None else newest
    while end >= 0:
        start = max(0, end - _HISTORY_WINDOW + 1)
        window = {v: c for v, c in state.history(path, start).items() if v <= end}
        written = [c for c in data_commits_from(window, start) if c.operation not in also_not_data]
        if written:
            return written[-1] if written[-1].timestamp > since else None
        if not window or min(c.timestamp for c in window.values()) <= since:
            return None
        end = start - 1
    return None


def signs_of_life(
    config: PipelineConfig,
    entities: list[EntityConfig],
    tables: Mapping[str, str],
    state: ActivityReader,
    quiet: dt.timedelta = DEFAULT_QUIET,
    now: dt.datetime | None = None,
) -> list[str]:
    """What suggests a service may be running; empty when nothing does.

    A live writer lease of ``entities`` (``cdc_shared.streaming.writer_lease``); a configured
    ``/health`` endpoint that answers; a data commit on one of ``tables`` (name -> path:
    bronze, written by the ingestor, and silver, by the merger) within ``quiet``; a group
    checkpoint of any service (``_streams/<service>/<group>``) that planned or committed
    a micro-batch within
    ``quiet`` (the publishers, which write no table). OPTIMIZE and VACUUM commits do not
    count: they add no data and are maintenance's own; nor do bronze's DELETEs (its
    retention's). A service idle for longer than
    ``quiet`` whose ``/health`` cannot be reached from here is not seen: that is what the
    operator's ``--force-short-retention`` vouches for. Leases are read the way ``state``
    reads files (without a JVM from object storage too).
    """
    # Here, not at the top: writer_lease imports PySpark's error types, and a dry run
    # imports no PySpark (tests/unit/test_delta_log.py).
    from cdc_shared.streaming.writer_lease import live_leases  # noqa: PLC0415

    def read_lease(path: str) -> bytes | None:
        text = state.read_text_if_exists(path)
        return None if text is None else text.encode()

    now = now or dt.datetime.now(dt.UTC)
    since = now - quiet
    signs = live_leases(config.storage_root, SERVICES, [e.name for e in entities], read_lease)
    for service, url in health_endpoints(config):
        answer = health_answer(url)
        if answer is not None:
            signs.append(f"{service}: {url} {answer}")
    minutes = f"{quiet.total_seconds() / 60:g} minutes"
    for table, path in tables.items():
        maintenance_only = RETENTION_OPERATIONS if table == BRONZE else frozenset()
        last = _recent_data_commit(state, path, since, maintenance_only)
        if last is not None:
            signs.append(
                f"{table}: {last.operation} committed version {last.version} at "
                f"{last.timestamp.isoformat(timespec='seconds')}, within {minutes}"
            )
    for service in SERVICES:
        for checkpoint in group_checkpoints(state, streams_folder(config, service)):
            progressed = [
                state.newest_modification(f"{checkpoint}/{d}") for d in ("offsets", "commits")
            ]
            latest = max((t for t in progressed if t is not None), default=None)
            if latest is not None and latest > since:
                group = checkpoint.rsplit("/", 1)[1]
                signs.append(
                    f"{display_name(service)}'s checkpoint of group {group} progressed at "
                    f"{latest.isoformat(timespec='seconds')}, within {minutes}"
                )
    return signs
