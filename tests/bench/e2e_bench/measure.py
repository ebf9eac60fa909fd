"""The results, and turning observations into them: delays, backlog, the verdict."""

from __future__ import annotations

import datetime as dt
import functools
import json
import math
import operator
import posixpath
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.tables import has_commits

from .baseline import baseline_bronze
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
    # Per table (entity name, every table) -> stage -> p50.. and n (its probe events that
    # reached the stage; a p99 needs 2): every table's delay, not only the whole's
    table_delays_ms: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
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

    def worst_tables(self) -> dict[str, dict[str, Any]]:
        """Per stage, the table whose delay p99 is the highest: its name, p50, p99 (ms) and
        samples; with the number of tables measured and of tables with too few samples
        (under 2) for a p99, whose delays it does not cover."""
        worst: dict[str, dict[str, Any]] = {}
        stages = sorted({stage for by_stage in self.table_delays_ms.values() for stage in by_stage})
        for stage in stages:
            measured = [
                (name, by_stage[stage])
                for name, by_stage in self.table_delays_ms.items()
                if "p99" in by_stage.get(stage, {})
            ]
            if not measured:
                continue
            name, cuts = max(measured, key=lambda item: item[1]["p99"])
            worst[stage] = {
                "table": name,
                "p50": cuts["p50"],
                "p99": cuts["p99"],
                "n": int(cuts["n"]),
                "tables": len(measured),
                "too_few": len(self.table_delays_ms) - len(measured),
            }
        return worst


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
    # From launch until every table's first change event was readable in its change topic
    # (each table held a snapshot when the pipeline was launched); None: not every table's
    first_start_s: float | None = None
    snapshot_s: float | None = None  # from launch until every table's snapshot was there
    # The most the pipeline's own processes held at one time (sampled every second)
    peak_pipeline_rss_mib: float = 0.0

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


def _at(timestamp: dt.datetime) -> float:
    """Seconds since the epoch of a timestamp Spark hands back (the session's time zone: UTC)."""
    return timestamp.replace(tzinfo=dt.UTC).timestamp()


def _bronze_times(
    spark: SparkSession, config: PipelineConfig, probes: set[tuple[str, Key]]
) -> tuple[dict[Mark, float], dict[Mark, float]]:
    """Kafka timestamps of the probes' bronze rows, and when the bronze commit that added
    each landed: ours, every table in one bronze (``cdc_shared.contracts.bronze``).

    Bronze only appends, so its Change Data Feed holds each row once, with the commit that
    added it (``_commit_timestamp``: that commit's time, as silver's feed gives silver's).
    One read of the feed for every table: a table's rows are picked by its ``entity``
    partition and the first column of its key (in the ``payload`` VARIANT), the key itself
    compared as JSON (the example's keys are integers).
    """
    from cdc_shared.contracts.bronze import ENTITY, PAYLOAD, read_payload_types
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    path = config.layout.bronze()
    types = read_payload_types(spark, path)
    entities = {e.name: e for e in config.entities}
    picked = []
    for entity in config.entities:
        firsts = sorted({k[0] for name, k in probes if name == entity.name})
        if not firsts or entity.name not in types:
            continue
        key_type = types[entity.name]["key"].dataType
        assert isinstance(key_type, T.StructType)
        first_type = key_type[entity.key[0]].dataType.simpleString()
        first = F.variant_get(F.col(PAYLOAD), f"$.key.{entity.key[0]}", first_type)
        picked.append((F.col(ENTITY) == F.lit(entity.name)) & first.isin(firsts))
    if not picked:
        return {}, {}
    rows = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 0)
        .load(path)
        .where(functools.reduce(operator.or_, picked))
        .groupBy(
            F.col(ENTITY),
            F.to_json(F.variant_get(F.col(PAYLOAD), "$.key", "variant")).alias("key"),
            F.col("sequence"),
        )
        .agg(F.min("kafka_timestamp").alias("produced"), F.min("_commit_timestamp").alias("added"))
        .collect()
    )
    produced: dict[Mark, float] = {}
    in_bronze: dict[Mark, float] = {}
    for r in rows:
        name = r[ENTITY]
        fields = json.loads(r["key"])
        key = tuple(fields.get(k) for k in entities[name].key)
        if (name, key) in probes:
            mark = (name, key, tuple(r["sequence"]))
            produced[mark] = _at(r["produced"])
            in_bronze[mark] = _at(r["added"])
    return produced, in_bronze


def _baseline_file_times(
    spark: SparkSession, table: str, key: list[str], firsts: list[Any]
) -> dict[tuple[Key, Seq], float]:
    """(key, sequence) of the probes' rows in one of the baseline's bronze tables -> when
    that table first had them (its log: ``_data_file_commit_times``)."""
    from pyspark.sql import functions as F

    landed = _data_file_commit_times(table)
    if not landed:
        return {}
    files = [f"{table}/{name}" for name in landed]  # the baseline's bronze: not partitioned
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


def _baseline_bronze_times(
    spark: SparkSession, config: PipelineConfig, probes: set[tuple[str, Key]]
) -> tuple[dict[Mark, float], dict[Mark, float]]:
    """As ``_bronze_times``, for the baseline's bronze tables (one per table, key a column).

    Their commit times come from their logs, so only on a local storage root.
    """
    from pyspark.sql import functions as F

    produced: dict[Mark, float] = {}
    in_bronze: dict[Mark, float] = {}
    for entity in config.entities:
        first = entity.key[0]
        firsts = sorted({k[0] for name, k in probes if name == entity.name})
        path = baseline_bronze(config, entity)
        rows = (
            spark.read.format("delta")
            .load(path)
            .where(F.col(f"key.{first}").isin(firsts))
            .groupBy("key", "sequence")
            .agg(F.min("kafka_timestamp").alias("at"))
            .collect()
        )
        for r in rows:
            key = tuple(r["key"][k] for k in entity.key)
            if (entity.name, key) in probes:
                produced[(entity.name, key, tuple(r["sequence"]))] = _at(r["at"])
        if "://" not in path:
            for (key, seq), at in _baseline_file_times(spark, path, entity.key, firsts).items():
                if (entity.name, key) in probes:
                    in_bronze[(entity.name, key, seq)] = at
    return produced, in_bronze


def _silver_times(
    config: PipelineConfig, probes: set[tuple[str, Key]], baseline: bool
) -> tuple[
    dict[Mark, float], dict[Mark, float], dict[Mark, float], dict[tuple[str, Key, int], Seq]
]:
    """Kafka timestamps and bronze commit times (ours: ``_bronze_times``; ``baseline``:
    ``_baseline_bronze_times``); silver commit times and commit versions from silver's CDF."""
    from cdc_shared.jvm.spark import build_spark_session
    from pyspark.sql import functions as F

    spark = build_spark_session(config.spark, "bench-e2e-measure")
    spark.sparkContext.setLogLevel("ERROR")
    committed: dict[Mark, float] = {}
    commit_seq: dict[tuple[str, Key, int], Seq] = {}
    try:
        read_bronze = _baseline_bronze_times if baseline else _bronze_times
        produced, in_bronze = read_bronze(spark, config, probes)
        for entity in config.entities:
            if not has_commits(spark, config.layout.silver(entity.name)):
                continue  # never written: none of its probes reached silver
            first = entity.key[0]
            firsts = sorted({k[0] for name, k in probes if name == entity.name})
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
                at = _at(r["_commit_timestamp"])
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
    baseline: bool = False,
) -> None:
    """Delays per step and stage, the growth rule, and the delay series for the plot.

    Each step's delays also per table (``StepResult.table_delays_ms``) and, with ``hot``
    tables (entity names), for the hot tables and for the others, apart. ``baseline``:
    the pipeline is the baseline (its bronze tables are its own).
    """
    probes = {(name, key) for name, key, _ in produced_at}
    kafka_ts, in_bronze, committed, commit_seq = _silver_times(config, probes, baseline)
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
            tables: dict[str, list[float]] = {e.name: [] for e in config.entities}
            for mark, (wrapper_at, at_step) in produced_at.items():
                if at_step != number or mark not in arrived[stage]:
                    continue
                at = kafka_ts.get(mark, wrapper_at)
                delay = arrived[stage][mark] - at
                all_.append(delay * 1000)
                tables[mark[0]].append(delay * 1000)
                offset = at - started - begun
                if quarter <= offset < 2 * quarter:
                    mid.append(delay)
                elif offset >= 3 * quarter:
                    end.append(delay)
                points.append((at - started, delay))
            step.delays_ms[stage] = _cuts(all_)
            _apart(step, stage, tables, hot or set())
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


def _apart(step: StepResult, stage: str, tables: dict[str, list[float]], hot: set[str]) -> None:
    """The step's delays (ms) to ``stage`` of each table, and of the ``hot`` tables and
    the others (when some are hot)."""
    for name, delays in tables.items():
        step.table_delays_ms.setdefault(name, {})[stage] = {
            **_cuts(delays),
            "n": float(len(delays)),
        }
    if not hot:
        return
    groups: dict[str, list[float]] = {"hot tables": [], "cold tables": []}
    for name, delays in tables.items():
        groups["hot tables" if name in hot else "cold tables"].extend(delays)
    for group, delays in groups.items():
        if delays:
            step.group_delays_ms.setdefault(group, {})[stage] = _cuts(delays)


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
