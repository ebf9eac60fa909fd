"""The demo's HTML report: throughput and lag of every service over the run, as SVG charts.

Drawn from the services' own per-batch log lines, so it shows what an operator would see
in their logs; no plotting library needed.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
_WIDTH, _HEIGHT, _PAD = 640, 220, 40


def _seconds(entry: dict[str, Any], start: dt.datetime) -> float:
    when = dt.datetime.fromisoformat(str(entry["ts"]).replace("Z", "+00:00"))
    return (when - start).total_seconds()


def _chart(title: str, series: dict[str, list[tuple[float, float]]], unit: str) -> str:
    points = [p for values in series.values() for p in values]
    if not points:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    max_x = max(x for x, _ in points) or 1.0
    max_y = max(y for _, y in points) or 1.0

    def xy(x: float, y: float) -> str:
        px = _PAD + x / max_x * (_WIDTH - 2 * _PAD)
        py = _HEIGHT - _PAD - y / max_y * (_HEIGHT - 2 * _PAD)
        return f"{px:.1f},{py:.1f}"

    lines = []
    for (name, values), colour in zip(sorted(series.items()), _COLOURS * 4, strict=False):
        path = " ".join(xy(x, y) for x, y in sorted(values))
        lines.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}">'
            f"<title>{html.escape(name)}</title></polyline>"
        )
    legend = " ".join(
        f'<span style="color:{c}">&#9632; {html.escape(n)}</span>'
        for n, c in zip(sorted(series), _COLOURS * 4, strict=False)
    )
    axes = (
        f'<line x1="{_PAD}" y1="{_HEIGHT - _PAD}" x2="{_WIDTH - _PAD}" y2="{_HEIGHT - _PAD}" '
        'stroke="#888"/>'
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_HEIGHT - _PAD}" stroke="#888"/>'
        f'<text x="{_PAD}" y="{_PAD - 8}" font-size="11">{max_y:,.0f} {html.escape(unit)}</text>'
        f'<text x="{_WIDTH - _PAD}" y="{_HEIGHT - 12}" font-size="11" text-anchor="end">'
        f"{max_x:,.0f} s</text>"
    )
    return (
        f"<h3>{html.escape(title)}</h3><div>{legend}</div>"
        f'<svg width="{_WIDTH}" height="{_HEIGHT}">{axes}{"".join(lines)}</svg>'
    )


def write_report(
    path: Path,
    batches: Mapping[str, Sequence[dict[str, Any]]],
    summary: Sequence[tuple[str, str]],
    started: dt.datetime,
) -> Path:
    """Write the HTML report: the summary table, then throughput and lag per service."""
    throughput: dict[str, list[tuple[float, float]]] = {}
    lag: dict[str, list[tuple[float, float]]] = {}
    for service, entries in batches.items():
        for entry in entries:
            name = f"{service}/{entry.get('entity')}"
            at = _seconds(entry, started)
            throughput.setdefault(name, []).append((at, float(entry.get("input_rows_per_s") or 0)))
            if entry.get("lag") is not None:
                lag.setdefault(name, []).append((at, float(entry["lag"])))
    rows = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in summary
    )
    body = (
        "<html><head><meta charset='utf-8'><title>cdc demo</title></head>"
        "<body style='font-family:sans-serif'><h1>cdc demo</h1>"
        f"<table>{rows}</table>"
        + _chart("Throughput per micro-batch", throughput, "rows/s")
        + _chart("Lag after each micro-batch (Kafka offsets; table versions or files)", lag, "")
        + "</body></html>"
    )
    path.write_text(body, encoding="utf-8")
    return path
