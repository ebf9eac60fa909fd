"""Where a Spark application's job time went, by streaming query, from its event log.

Run a benchmark with Spark's event log on, uncompressed (``--conf
spark.eventLog.enabled=true --conf spark.eventLog.dir=file:///tmp/evlog --conf
spark.eventLog.compress=false`` through ``PYSPARK_SUBMIT_ARGS``), then, with the
application's event files joined in order (``cat $(ls -v events_*)``)::

    .venv/bin/python tests/bench/eventlog_jobs.py events.json [--skip-s 600 --span-s 180]

For each query (the job description's first line, e.g. ``ingestor-default``) it prints the
jobs run, their wall time (submission to end: what a batch waits for), the time their
tasks ran, and how long their first task waited for a core after submission; plus the
share of each query's job wall time during which tasks of other queries ran. A job
whose wall time grows while its tasks' time does not waited for cores or for the
driver; the wait column tells the two apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    query: str
    submitted_ms: int
    ended_ms: int = 0
    stages: list[int] = field(default_factory=list)


@dataclass
class Task:
    stage: int
    launched_ms: int
    finished_ms: int


def query_of(properties: dict[str, str]) -> str:
    """The streaming query a job ran for (its name: the description's first line, without
    Delta's ``Delta: `` prefixes), else "outside a query" (e.g. a service's start)."""
    description = properties.get("spark.job.description") or ""
    if "sql.streaming.queryId" not in properties or not description:
        return "outside a query"
    name = description.splitlines()[0]
    while name.startswith("Delta: "):
        name = name.removeprefix("Delta: ")
    return name


def read(path: Path) -> tuple[dict[int, Job], list[Task]]:
    jobs: dict[int, Job] = {}
    tasks: list[Task] = []
    with path.open() as events:
        for line in events:
            event = json.loads(line)
            kind = event["Event"]
            if kind == "SparkListenerJobStart":
                jobs[event["Job ID"]] = Job(
                    query_of(event.get("Properties") or {}),
                    event["Submission Time"],
                    stages=list(event["Stage IDs"]),
                )
            elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
                jobs[event["Job ID"]].ended_ms = event["Completion Time"]
            elif kind == "SparkListenerTaskEnd":
                info = event["Task Info"]
                tasks.append(Task(event["Stage ID"], info["Launch Time"], info["Finish Time"]))
    return {i: j for i, j in jobs.items() if j.ended_ms}, tasks


def overlap_ms(start: int, end: int, spans: list[tuple[int, int]]) -> int:
    """Milliseconds of [start, end) covered by at least one of ``spans`` (sorted)."""
    covered, cursor = 0, start
    for span_start, span_end in spans:
        left, right = max(span_start, cursor), min(span_end, end)
        if right > left:
            covered += right - left
            cursor = right
    return covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eventlog", type=Path)
    parser.add_argument("--skip-s", type=float, default=0, help="leave out the first seconds")
    parser.add_argument("--span-s", type=float, default=0, help="then only so many (0: all)")
    args = parser.parse_args()
    jobs, tasks = read(args.eventlog)
    if not jobs:
        raise SystemExit("no completed jobs in the event log")
    begin = min(j.submitted_ms for j in jobs.values()) + int(args.skip_s * 1000)
    end = begin + int(args.span_s * 1000) if args.span_s else None
    jobs = {
        i: j
        for i, j in jobs.items()
        if j.submitted_ms >= begin and (end is None or j.submitted_ms < end)
    }
    query_of_stage = {s: j.query for j in jobs.values() for s in j.stages}
    tasks_of_stage: dict[int, list[Task]] = defaultdict(list)
    for task in tasks:
        tasks_of_stage[task.stage].append(task)
    busy_by_query: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for task in tasks:
        if task.stage in query_of_stage:
            busy_by_query[query_of_stage[task.stage]].append((task.launched_ms, task.finished_ms))
    by_query: dict[str, list[Job]] = defaultdict(list)
    for job in jobs.values():
        by_query[job.query].append(job)
    print(
        f"{'query':<28} {'jobs':>6} {'wall p50 ms':>11} {'wall sum s':>10} "
        f"{'task sum s':>10} {'wait p50 ms':>11} {'others busy':>11}"
    )
    for query, its_jobs in sorted(by_query.items(), key=lambda kv: kv[0]):
        walls = [j.ended_ms - j.submitted_ms for j in its_jobs]
        its_tasks = [t for j in its_jobs for s in j.stages for t in tasks_of_stage[s]]
        waits = [
            min(t.launched_ms for s in j.stages for t in tasks_of_stage[s]) - j.submitted_ms
            for j in its_jobs
            if any(tasks_of_stage[s] for s in j.stages)
        ]
        others = sorted(
            span for name, spans in busy_by_query.items() if name != query for span in spans
        )
        shared = sum(overlap_ms(j.submitted_ms, j.ended_ms, others) for j in its_jobs)
        print(
            f"{query[:28]:<28} {len(its_jobs):>6} {statistics.median(walls):>11.0f} "
            f"{sum(walls) / 1000:>10.1f} "
            f"{sum(t.finished_ms - t.launched_ms for t in its_tasks) / 1000:>10.1f} "
            f"{(statistics.median(waits) if waits else 0):>11.0f} "
            f"{shared / max(1, sum(walls)):>10.0%}"
        )


if __name__ == "__main__":
    main()
