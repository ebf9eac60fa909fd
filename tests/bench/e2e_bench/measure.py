"""The results, and turning observations into them: delays, backlog, the verdict."""

from __future__ import annotations

import datetime as dt
import json
import math
import posixpath
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from cdc_shared.config import PipelineConfig

from .probes import Key, Mark, Seq
from .watch import IndexWatcher, TopicWatcher, index_sequence

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass
class StepResult:
    """One rate step of one pipeline."""

    rate: float
    seconds: float
    produced: int = 0
    produce_seconds: float = 0.0
    drained: bool = False
    drain_seconds: float = 0.0
    delays_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> p50..
    # With hot tables: "hot tables" / "cold tables" -> stage -> p50..
    group_delays_ms: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # hop (ingest, merge, publish ...) -> p50..: each event's time between two outputs
    hops_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    growth_s: dict[str, float] = field(default_factory=dict)
    allowed_s: dict[str, float] = field(default_factory=dict)
    backlog_events: dict[str, tuple[float, float]] = field(default_factory=dict)  # mid, end
    cpu_s: dict[str, float] = field(default_factory=dict)
    verdict: str = ""

    @property
    def achieved(self) -> float:
        """Messages per second the producers reached."""
        return self.produced / self.produce_seconds if self.produce_seconds else 0.0

    @property
    def sustainable(self) -> bool:
        """The rule of the package docstring."""
        return self.verdict == "sustainable"


@dataclass
class PipelineResult:
    """Everything measured for one pipeline."""

    name: str
    stages: list[str]
    steps: list[StepResult] = field(default_factory=list)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    lags: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    step_bounds: list[tuple[float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)  # the pipeline's own, not servers
    start_s: float = 0.0  # from launch until healthy (the baseline: its queries started)

    @property
    def highest_sustainable(self) -> float | None:
        """The highest sustainable offered rate, if any."""
        rates = [s.rate for s in self.steps if s.sustainable]
        return max(rates) if rates else None


#: Each hop of the pipeline: (name, from output, to output); "produce" is the Kafka time.
HOPS = (
    ("ingest", "produce", "bronze"),
    ("merge", "bronze", "silver"),
    ("publish to topic", "silver", "topic"),
    ("publish to index", "silver", "index"),
)


def _data_file_commit_times(table: str) -> dict[str, float]:
    """Each data file a commit added to a local Delta table -> when that commit landed.

    The commit's time is its log file's modification time, as for a Change Data Feed's
    ``_commit_timestamp``. Files a compaction rewrote (``dataChange`` false) are left out:
    their rows arrived earlier, in the files they replaced.
    """
    landed: dict[str, float] = {}
    for commit in sorted((Path(table) / "_delta_log").glob("*.json")):
        at = commit.stat().st_mtime
        for line in commit.read_text().splitlines():
            add = json.loads(line).get("add")
            if add is not None and add.get("dataChange", True):
                landed[posixpath.basename(unquote(add["path"]))] = at
    return landed


def _bronze_times(
    spark: SparkSession, table: str, key: list[str], firsts: list[Any]
) -> dict[tuple[Key, Seq], float]:
    """(key, sequence) of the probes' bronze rows -> when bronze first had them."""
    from pyspark.sql import functions as F

    landed = _data_file_commit_times(table)
    if not landed:
        return {}
    files = [f"{table}/{name}" for name in landed]  # bronze is not partitioned
    rows = (
        spark.read.option("mergeSchema", "true")
        .parquet(*files)
        .where(F.col(f"key.{key[0]}").isin(firsts))
        .select("key", "sequence", F.col("_metadata.file_name").alias("file"))
        .collect()
    )
    out: dict[tuple[Key, Seq], float] = {}
    for r in rows:
        at = landed.get(unquote(r["file"]))
        if at is not None:
            mark = (tuple(r["key"][k] for k in key), tuple(r["sequence"]))
            out[mark] = min(at, out.get(mark, at))
    return out


def _silver_times(
    config: PipelineConfig, probes: set[tuple[str, Key]]
) -> tuple[
    dict[Mark, float], dict[Mark, float], dict[Mark, float], dict[tuple[str, Key, int], Seq]
]:
    """Kafka timestamps and bronze commit times from bronze; silver commit times and commit
    versions from its CDF. Bronze commit times need a local storage root (else none)."""
    from cdc_shared.spark import build_spark_session
    from pyspark.sql import functions as F

    spark = build_spark_session(config.spark, "bench-e2e-measure")
    spark.sparkContext.setLogLevel("ERROR")
    produced: dict[Mark, float] = {}
    in_bronze: dict[Mark, float] = {}
    committed: dict[Mark, float] = {}
    commit_seq: dict[tuple[str, Key, int], Seq] = {}
    try:
        for entity in config.entities:
            first = entity.key[0]
            firsts = sorted({k[0] for name, k in probes if name == entity.name})
            bronze = spark.read.format("delta").load(config.layout.bronze(entity.name))
            rows = (
                bronze.where(F.col(f"key.{first}").isin(firsts))
                .groupBy("key", "sequence")
                .agg(F.min("kafka_timestamp").alias("at"))
                .collect()
            )
            for r in rows:
                key = tuple(r["key"][k] for k in entity.key)
                if (entity.name, key) in probes:
                    at = r["at"].replace(tzinfo=dt.UTC).timestamp()
                    produced[(entity.name, key, tuple(r["sequence"]))] = at
            bronze_path = config.layout.bronze(entity.name)
            if "://" not in bronze_path:
                for (key, seq), at in _bronze_times(spark, bronze_path, entity.key, firsts).items():
                    if (entity.name, key) in probes:
                        in_bronze[(entity.name, key, seq)] = at
            feed = (
                spark.read.format("delta")
                .option("readChangeFeed", "true")
                .option("startingVersion", 0)
                .load(config.layout.silver(entity.name))
                .where(F.col("_change_type").isin("insert", "update_postimage"))
                .where(F.col(first).isin(firsts))
                .select(*entity.key, "_cdc_seq", "_commit_version", "_commit_timestamp")
                .collect()
            )
            for r in feed:
                key = tuple(r[k] for k in entity.key)
                seq = tuple(r["_cdc_seq"])
                at = r["_commit_timestamp"].replace(tzinfo=dt.UTC).timestamp()
                mark = (entity.name, key, seq)
                committed[mark] = min(at, committed.get(mark, at))
                commit_seq[(entity.name, key, int(r["_commit_version"]))] = seq
    finally:
        spark.stop()
    return produced, in_bronze, committed, commit_seq


def _cuts(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "max": max(values)}


def _index_arrivals(
    config: PipelineConfig, index: IndexWatcher, commit_seq: dict[tuple[str, Key, int], Seq]
) -> dict[Mark, float]:
    """When each probe event first showed in the index, by the sequence its version holds."""
    entities = {e.name: e for e in config.entities}
    in_index: dict[Mark, float] = {}
    for (name, key, version), at in index.seen.items():
        seq = index_sequence(entities[name], key, version, commit_seq)
        if seq is not None:
            in_index[(name, key, seq)] = min(at, in_index.get((name, key, seq), at))
    return in_index


def measure_delays(
    config: PipelineConfig,
    result: PipelineResult,
    produced_at: dict[Mark, tuple[float, int]],
    topic: TopicWatcher,
    index: IndexWatcher | None,
    started: float,
    hot: set[str] | None = None,
) -> None:
    """Delays per step and stage, the growth rule, and the delay series for the plot.

    With ``hot`` tables (entity names), each step's delays also for the hot tables and
    for the others, apart.
    """
    probes = {(name, key) for name, key, _ in produced_at}
    kafka_ts, in_bronze, committed, commit_seq = _silver_times(config, probes)
    arrived: dict[str, dict[Mark, float]] = {"silver": committed, "topic": topic.seen}
    if index is not None:
        arrived["index"] = _index_arrivals(config, index, commit_seq)
    missing_ts = sum(1 for m in produced_at if m not in kafka_ts)
    if missing_ts:
        result.notes.append(f"{missing_ts} probe events not found in bronze (producer time used)")
    if not in_bronze:
        result.notes.append("no bronze commit times (storage root not local): no ingest hop")
    outputs = {**arrived, "bronze": in_bronze}
    for number, step in enumerate(result.steps):
        begun, ended = result.step_bounds[number]
        quarter = (ended - begun) / 4
        for stage in result.stages:
            all_, mid, end = [], [], []
            points = []
            groups: dict[str, list[float]] = {}
            for mark, (wrapper_at, at_step) in produced_at.items():
                if at_step != number or mark not in arrived[stage]:
                    continue
                at = kafka_ts.get(mark, wrapper_at)
                delay = arrived[stage][mark] - at
                all_.append(delay * 1000)
                if hot:
                    group = "hot tables" if mark[0] in hot else "cold tables"
                    groups.setdefault(group, []).append(delay * 1000)
                offset = at - started - begun
                if quarter <= offset < 2 * quarter:
                    mid.append(delay)
                elif offset >= 3 * quarter:
                    end.append(delay)
                points.append((at - started, delay))
            step.delays_ms[stage] = _cuts(all_)
            for group, delays in groups.items():
                step.group_delays_ms.setdefault(group, {})[stage] = _cuts(delays)
            step.samples[stage] = len(all_)
            result.series.setdefault(stage, []).extend(_bins(points, 10.0))
            if mid and end:
                m, e = statistics.median(mid), statistics.median(end)
                step.growth_s[stage] = e - m
                step.allowed_s[stage] = max(2.0, 0.25 * m, 0.05 * step.seconds)
                scale = step.produced / len(points)  # events per sampled event
                step.backlog_events[stage] = (
                    scale * _in_flight(points, (begun + ended) / 2),
                    scale * _in_flight(points, ended),
                )
        step.hops_ms = _hops(produced_at, number, kafka_ts, outputs)
        step.verdict = _verdict(step, result.stages)


def _hops(
    produced_at: dict[Mark, tuple[float, int]],
    step: int,
    kafka_ts: dict[Mark, float],
    outputs: dict[str, dict[Mark, float]],
) -> dict[str, dict[str, float]]:
    """Each hop's delay (``HOPS``) over the step's probe events that reached both ends."""
    hops: dict[str, dict[str, float]] = {}
    for name, start, end in HOPS:
        if end not in outputs:
            continue
        spans = []
        for mark, (wrapper_at, at_step) in produced_at.items():
            began = (
                kafka_ts.get(mark, wrapper_at) if start == "produce" else outputs[start].get(mark)
            )
            reached = outputs[end].get(mark)
            if at_step == step and began is not None and reached is not None:
                spans.append((reached - began) * 1000)
        if spans:
            hops[name] = _cuts(spans)
    return hops


def _in_flight(points: list[tuple[float, float]], t: float) -> int:
    """Sampled events produced by ``t`` that reached the output after ``t``."""
    return sum(1 for at, delay in points if at <= t < at + delay)


def _bins(points: list[tuple[float, float]], width: float) -> list[tuple[float, float, float]]:
    """(bin start, p50, p99) of the delays, by produce time."""
    bins: dict[int, list[float]] = {}
    for at, delay in points:
        bins.setdefault(int(at // width), []).append(delay)
    out = []
    for b, values in sorted(bins.items()):
        values.sort()
        p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
        out.append((b * width, statistics.median(values), p99))
    return out


def _verdict(step: StepResult, stages: list[str]) -> str:
    if step.achieved < 0.95 * step.rate:
        return "producer-bound"
    if not step.drained:
        return "did not drain"
    if any(s not in step.growth_s for s in stages):
        return "too few samples"
    if any(step.delays_ms[s]["p50"] / 1000 > step.seconds / 2 for s in stages):
        return "step too short"  # events wait longer than half the step: no trend to see
    if any(step.growth_s[s] > step.allowed_s[s] for s in stages):
        return "backlog grows"
    return "sustainable"
