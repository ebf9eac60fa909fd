"""``cdc status --watch``: the status report refreshed in place, with each service's pace.

Like ``kubectl get -w``: every ``interval`` seconds the report of :mod:`cdc_cli.status`
(read from what the services persist) is drawn again, under a block with what the running
services say about themselves on their ``/metrics`` endpoints (the ones the
configuration gives them, as ``cdc maintenance`` probes them): micro-batches per minute,
rows per second and the mean batch time since the previous refresh. A service whose
endpoint does not answer is shown as "not reachable": it may be stopped, starting, or
served on another host.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TextIO

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import display_name
from prometheus_client.parser import text_string_to_metric_families

from cdc_cli.liveness import health_endpoints

#: How long one ``/metrics`` request may take before the service counts as not reachable.
SCRAPE_TIMEOUT_S = 2.0
#: Clear the terminal and go home (ANSI), so each refresh replaces the last.
CLEAR = "\x1b[H\x1b[2J"
NOT_REACHABLE = "not reachable"


@dataclass(frozen=True)
class Totals:
    """A service's counters at one moment, summed over its entities."""

    at: float  # monotonic time of the scrape
    batches: float
    rows: float  # read from the sources
    batch_seconds: float  # the batch-duration histogram's sum


@dataclass(frozen=True)
class Pace:
    """What a service did between two scrapes."""

    batches_per_min: float
    rows_per_s: float
    mean_batch_s: float | None  # None: no batch finished in between


def parse_totals(text: str, at: float) -> dict[str, Totals]:
    """Per service (its ``service`` label), the counters of one ``/metrics`` answer.

    A service's own endpoint reports one service; ``cdc run``'s reports each it runs.
    """
    sums: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            service = sample.labels.get("service")
            if name in _COUNTED and service:
                of_service = sums.setdefault(service, dict.fromkeys(_COUNTED, 0.0))
                of_service[name] += sample.value
    return {
        service: Totals(at, *(counted[name] for name in _COUNTED))
        for service, counted in sums.items()
    }


#: The samples summed over a service's entities, in the order of Totals' fields.
_COUNTED = ("cdc_batches", "cdc_input_rows", "cdc_batch_duration_seconds_sum")


def pace(before: Totals, after: Totals) -> Pace:
    """The rates between two scrapes of one service (a restart resets its counters)."""
    elapsed = max(after.at - before.at, 1e-9)
    if after.batches < before.batches:  # restarted in between: counters began again at 0
        before = Totals(before.at, 0.0, 0.0, 0.0)
    batches = after.batches - before.batches
    rows = after.rows - before.rows
    mean = (after.batch_seconds - before.batch_seconds) / batches if batches else None
    return Pace(batches * 60 / elapsed, rows / elapsed, mean)


Scrape = dict[str, Totals] | None  # per service; None: the endpoint did not answer


def scrape(health_url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Scrape:
    """The counters behind a service's ``/health`` URL; None when it does not answer."""
    url = health_url.removesuffix("/health") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            text = answer.read().decode()
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return parse_totals(text, time.monotonic())


def render_paces(
    endpoints: list[tuple[str, str]],
    now: Mapping[str, Scrape],
    before: Mapping[str, Scrape],
) -> str:
    """The services block: per endpoint, each service's pace since the previous refresh."""
    lines = ["services"]
    if not endpoints:
        lines.append("  (every metrics_port is 0: nothing to ask)")
    for name, url in endpoints:
        where = url.removesuffix("/health")
        current, previous = now.get(name), before.get(name) or {}
        if current is None:
            lines.append(f"  {name:<16} {NOT_REACHABLE:<50} {where}")
            continue
        if not current:
            lines.append(f"  {name:<16} {'reachable, no batch yet':<50} {where}")
        for service, totals in sorted(current.items()):
            label = display_name(service)
            if service not in previous:
                lines.append(f"  {label:<16} {'reachable, measuring...':<50} {where}")
                continue
            rate = pace(previous[service], totals)
            batch = "-" if rate.mean_batch_s is None else f"{rate.mean_batch_s:.1f} s"
            figures = (
                f"{rate.batches_per_min:.1f} batches/min  {rate.rows_per_s:,.0f} rows/s  "
                f"batch {batch}"
            )
            lines.append(f"  {label:<16} {figures:<50} {where}")
    return "\n".join(lines)


def refreshes(
    config: PipelineConfig,
    report: Callable[[], str],
    interval_s: float,
    count: int | None = None,
) -> Iterator[str]:
    """Each refresh's screen: the report, then the services' paces; ``count`` bounds them."""
    endpoints = health_endpoints(config)
    previous: dict[str, Scrape] = {}
    shown = 0
    while count is None or shown < count:
        started = time.monotonic()
        current = {name: scrape(url) for name, url in endpoints}
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        header = f"every {interval_s:g} s, {stamp} (Ctrl-C to stop)"
        yield f"{header}\n\n{report()}\n\n{render_paces(endpoints, current, previous)}"
        previous = current
        shown += 1
        if count is None or shown < count:
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def watch(
    config: PipelineConfig,
    report: Callable[[], str],
    interval_s: float,
    out: TextIO = sys.stdout,
    count: int | None = None,
) -> None:
    """Draw each refresh over the last until Ctrl-C (or ``count`` refreshes)."""
    try:
        for screen in refreshes(config, report, interval_s, count):
            out.write(CLEAR + screen + "\n")
            out.flush()
    except KeyboardInterrupt:
        out.write("\n")
