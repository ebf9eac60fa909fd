"""The figures as Markdown tables and an SVG plot."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import statistics

from .measure import HOPS, PipelineResult, StepResult


def _ms(cuts: dict[str, float]) -> str:
    """p50 / p95 / p99 in seconds."""
    if "p50" not in cuts:
        return "n/a"
    return f"{cuts['p50'] / 1000:.1f} / {cuts['p95'] / 1000:.1f} / {cuts['p99'] / 1000:.1f}"


def _p50_p99(cuts: dict[str, float]) -> str:
    """p50 / p99 in seconds."""
    if "p50" not in cuts:
        return "n/a"
    return f"{cuts['p50'] / 1000:.1f} / {cuts['p99'] / 1000:.1f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _cpu_per_1k(r: PipelineResult, s: StepResult) -> float:
    """CPU seconds of the pipeline's own processes over the step and its drain, per 1,000
    events produced in the step."""
    own = sum(cpu for name, cpu in s.cpu_s.items() if name in r.processes)
    return own / max(s.produced, 1) * 1000


def _worst(s: StepResult, stage: str) -> str:
    """The table with the highest p99 of ``stage``: p99 s (table, its samples; tables
    with too few samples for a p99)."""
    worst = s.worst_tables().get(stage)
    if worst is None:
        return "n/a"
    few = f"; {worst['too_few']} with < 2" if worst["too_few"] else ""
    return f"{worst['p99'] / 1000:.1f} ({worst['table']}, n={worst['n']}{few})"


def summary(results: list[PipelineResult], args: argparse.Namespace) -> list[str]:
    """One row per pipeline and rate: the delay to the change topic (all tables, the hot
    and the cold ones, the worst table's p99), start, first start, memory and CPU."""
    skewed = args.hot > 0
    lines = [
        "To the change topic, p50 / p99 s"
        + (
            f" (the first {args.hot} tables took {args.hot_share:.0%} of the changes)"
            if skewed
            else ""
        )
        + "; the worst table's p99 beside (its name and samples); start: launch to healthy; "
        "first start: launch to every table's first change event (each held a snapshot); "
        "peak RSS of the pipeline's processes together; CPU s of the pipeline's processes "
        "per 1,000 events:",
        "",
        "| pipeline | offered/s | all tables | hot tables | cold tables | worst table p99 "
        "| start s | first start s | peak RSS MiB | CPU s / 1k events |",
        "|---|---:|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for s in r.steps:
            groups = s.group_delays_ms
            hot = _p50_p99(groups.get("hot tables", {}).get("topic", {})) if skewed else "-"
            cold = _p50_p99(groups.get("cold tables", {}).get("topic", {})) if skewed else "-"
            lines.append(
                f"| {r.name} | {s.rate:,.0f} | {_p50_p99(s.delays_ms.get('topic', {}))} "
                f"| {hot} | {cold} | {_worst(s, 'topic')} | {r.start_s:.1f} "
                f"| {_seconds(r.first_start_s)} | {r.peak_pipeline_rss_mib:,.0f} "
                f"| {_cpu_per_1k(r, s):.2f} |"
            )
    return lines


def _stages(results: list[PipelineResult]) -> list[str]:
    """Every stage's delay, the backlog, the growth rule and the verdict."""
    lines = [
        "Every stage, p50 / p95 / p99 s:",
        "",
        "| pipeline | offered/s | produced/s | to silver commit | to change topic "
        "| to searchable | samples | backlog before silver, mid -> end "
        "| delay growth s (allowed) | verdict |",
        "|---|---:|---:|---|---|---|---:|---|---|---|",
    ]
    for r in results:
        for s in r.steps:
            growth = ", ".join(
                f"{stage} {s.growth_s[stage]:+.1f} ({s.allowed_s[stage]:.1f})"
                for stage in r.stages
                if stage in s.growth_s
            )
            mid, end = s.backlog_events.get("silver", (math.nan, math.nan))
            backlog = f"{mid:,.0f} -> {end:,.0f}"
            lines.append(
                f"| {r.name} | {s.rate:,.0f} | {s.achieved:,.0f} "
                f"| {_ms(s.delays_ms.get('silver', {}))} | {_ms(s.delays_ms.get('topic', {}))} "
                f"| {_ms(s.delays_ms.get('index', {})) if 'index' in r.stages else '-'} "
                f"| {min(s.samples.values(), default=0):,} | {backlog} | {growth or 'n/a'} "
                f"| {s.verdict} |"
            )
    return lines


def _hops(results: list[PipelineResult]) -> list[str]:
    """Each hop's delay on its own."""
    lines = [
        "Each hop on its own (p50 / p95 / p99 s over the probe events that reached both ends; "
        "bronze and silver at their commits):",
        "",
        "| pipeline | offered/s | " + " | ".join(name for name, _, _ in HOPS) + " |",
        "|---|---:|" + "---|" * len(HOPS),
    ]
    for r in results:
        for s in r.steps:
            cells = " | ".join(_ms(s.hops_ms.get(name, {})) for name, _, _ in HOPS)
            lines.append(f"| {r.name} | {s.rate:,.0f} | {cells} |")
    return lines


def _groups(results: list[PipelineResult], args: argparse.Namespace) -> list[str]:
    """The hot and the cold tables' delays apart (none when the load was even)."""
    grouped = [(r, s) for r in results for s in r.steps if s.group_delays_ms]
    if not grouped:
        return []
    lines = [
        f"The first {args.hot} of {args.tables or 'the'} tables took "
        f"{args.hot_share:.0%} of the changes; delays of each group apart:",
        "",
        "| pipeline | offered/s | tables | to silver commit | to change topic | to searchable |",
        "|---|---:|---|---|---|---|",
    ]
    for r, s in grouped:
        for group, stages in sorted(s.group_delays_ms.items()):
            index = _ms(stages.get("index", {})) if "index" in r.stages else "-"
            lines.append(
                f"| {r.name} | {s.rate:,.0f} | {group} | {_ms(stages.get('silver', {}))} "
                f"| {_ms(stages.get('topic', {}))} | {index} |"
            )
    return lines


def _tables(results: list[PipelineResult]) -> list[str]:
    """Each table's delay: the worst table's p99 and the median of the tables' p99s."""
    lines = [
        "Each table's delay to the change topic: the worst table's p99 (table, samples; "
        "tables with fewer than 2 samples have no p99) and the median of the tables' p99s:",
        "",
        "| pipeline | offered/s | tables measured | worst p99 s | median table p99 s "
        "| to silver commit, worst p99 s |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in results:
        for s in r.steps:
            p99s = [
                by_stage["topic"]["p99"]
                for by_stage in s.table_delays_ms.values()
                if "p99" in by_stage.get("topic", {})
            ]
            middle = f"{statistics.median(p99s) / 1000:.1f}" if p99s else "n/a"
            lines.append(
                f"| {r.name} | {s.rate:,.0f} | {len(p99s)} of {len(s.table_delays_ms)} "
                f"| {_worst(s, 'topic')} | {middle} | {_worst(s, 'silver')} |"
            )
    return lines


def _starts(results: list[PipelineResult]) -> list[str]:
    """The highest sustainable load, the start, the first start and the peak memory."""
    lines = [
        "| pipeline | highest sustainable load | ready after s (launch to healthy) "
        "| first start s (launch to every table's first change event) "
        "| snapshot everywhere after s | peak RSS MiB, pipeline together |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        best = r.highest_sustainable
        sustained = "none of the rates" if best is None else f"{best:,.0f}/s"
        lines.append(
            f"| {r.name} | {sustained} | {r.start_s:.1f} | {_seconds(r.first_start_s)} "
            f"| {_seconds(r.snapshot_s)} | {r.peak_pipeline_rss_mib:,.0f} |"
        )
    return lines


def _resources(results: list[PipelineResult]) -> list[str]:
    """CPU per step and peak RSS, per process group."""
    lines = [
        "CPU seconds over each step and its drain (per 1,000 events produced), and peak RSS "
        "per process group:",
        "",
    ]
    for r in results:
        names = sorted({n for s in r.steps for n in s.cpu_s})
        header = " | ".join(f"{s.rate:,.0f}/s" for s in r.steps)
        lines += [
            f"| {r.name} | {header} | peak RSS MiB |",
            "|---|" + "---:|" * (len(r.steps) + 1),
        ]
        for n in names:
            cells = " | ".join(
                f"{s.cpu_s.get(n, 0):,.0f} ({s.cpu_s.get(n, 0) / max(s.produced, 1) * 1000:.2f})"
                for s in r.steps
            )
            lines.append(f"| {n} | {cells} | {r.peak_rss_mib.get(n, 0):,.0f} |")
        own = [n for n in names if n in r.processes]
        cells = " | ".join(f"{_cpu_per_1k(r, s):.2f}" for s in r.steps)
        rss = f"{r.peak_pipeline_rss_mib:,.0f} (together)"
        lines.append(f"| **pipeline** ({', '.join(own)}) per 1k | {cells} | {rss} |")
        lines.append("")
    return lines


def markdown(results: list[PipelineResult], args: argparse.Namespace) -> str:
    """The figures as Markdown tables."""
    lines = [
        f"# End-to-end benchmark, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"{os.cpu_count()} cores; {args.tables or 'the example'} tables (KIND@N: N tables); "
        f"{args.keys:,} keys per entity; {args.producers} producer "
        f"process(es); {args.seconds_per_rate:.0f} s per rate. Delays in seconds "
        "from the source record's Kafka timestamp.",
    ]
    for section in (
        summary(results, args),
        _stages(results),
        _hops(results),
        _groups(results, args),
        _tables(results),
        _starts(results),
        _resources(results),
    ):
        if section:
            lines += ["", *section]
    notes = [f"{r.name}: {n}" for r in results for n in r.notes]
    if notes:
        lines += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def svg(results: list[PipelineResult]) -> str:
    """Delay p50/p99 per stage over time, then each service's reported lag, per pipeline."""
    width, height, pad = 760, 230, 50
    panels: list[tuple[str, dict[str, list[tuple[float, float]]], list[tuple[float, float]]]] = []
    for r in results:
        delay: dict[str, list[tuple[float, float]]] = {}
        for stage, bins in r.series.items():
            delay[f"{stage} p50"] = [(t, p50) for t, p50, _ in bins]
            delay[f"{stage} p99"] = [(t, p99) for t, _, p99 in bins]
        panels.append((f"{r.name}: delay from produce (s), by produce time", delay, r.step_bounds))
        panels.append(
            (f"{r.name}: lag per micro-batch (Kafka records; silver versions)", r.lags, [])
        )
    parts = []
    for number, (title, series, bounds) in enumerate(panels):
        top = number * (height + 30)
        points = [p for values in series.values() for p in values]
        max_x = max((x for x, _ in points), default=1.0) or 1.0
        max_y = max((y for _, y in points), default=1.0) or 1.0
        x0 = min((x for x, _ in points), default=0.0)

        def xy(
            x: float,
            y: float,
            x0: float = x0,
            max_x: float = max_x,
            m: float = max_y,
            top: int = top,
        ) -> str:
            px = pad + (x - x0) / max(max_x - x0, 1e-9) * (width - 2 * pad)
            py = top + height - pad - y / m * (height - 2 * pad)
            return f"{px:.1f},{py:.1f}"

        parts.append(
            f'<text x="{pad}" y="{top + 18}" font-size="13" font-weight="bold">{title}</text>'
            f'<line x1="{pad}" y1="{top + height - pad}" x2="{width - pad}" '
            f'y2="{top + height - pad}" stroke="#888"/>'
            f'<line x1="{pad}" y1="{top + pad}" x2="{pad}" y2="{top + height - pad}" '
            'stroke="#888"/>'
            f'<text x="{pad - 4}" y="{top + pad}" font-size="11" text-anchor="end">{max_y:,.0f}'
            f"</text>"
            f'<text x="{width - pad}" y="{top + height - pad + 14}" font-size="11" '
            f'text-anchor="end">{max_x:,.0f} s since start</text>'
        )
        for begun, ended in bounds:
            for at in (begun, ended):
                if x0 <= at <= max_x:
                    a, b = xy(at, 0).split(",")[0], xy(at, max_y).split(",")[1]
                    parts.append(
                        f'<line x1="{a}" y1="{b}" x2="{a}" y2="{top + height - pad}" '
                        'stroke="#ccc" stroke-dasharray="4"/>'
                    )
        for i, (name, values) in enumerate(sorted(series.items())):
            colour = _COLOURS[i % len(_COLOURS)]
            path = " ".join(xy(x, y) for x, y in sorted(values))
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>'
                f'<text x="{width - pad + 4}" y="{top + pad + 12 * i}" font-size="10" '
                f'fill="{colour}">{name}</text>'
            )
    total = len(panels) * (height + 30)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 120}" height="{total}" '
        f'font-family="sans-serif">{"".join(parts)}</svg>\n'
    )
