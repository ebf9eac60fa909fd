"""The merger's history table against the history its bronze events make (the dev kit's oracle).

Bronze holds every event the ingestor took, re-deliveries included, whatever order the
merger met them in; ``history_versions`` replays them in sequence order, independently of
the merger's code.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from cdc_devkit.oracle import SourceEvent, history_versions
from cdc_shared.contracts.silver import END, START
from pyspark.sql import SparkSession

from support.ingestion import bronze
from support.pipelines import Pipeline


def bronze_events(spark: SparkSession, pipeline: Pipeline, entity: str) -> list[SourceEvent]:
    """The entity's bronze events as the oracle takes them (Kafka tombstones left out)."""
    config = pipeline.config
    key = config.entity(entity).key
    rows = bronze(spark, pipeline, entity).where("not is_tombstone and op is not null").collect()
    return [
        SourceEvent(
            None if r.op == "t" else tuple(r.key[k] for k in key),
            tuple(r.sequence),
            r.op,
            None if r.after is None else r.after.asDict(),
            r.source.ts_ms if r.source is not None else r.ts_ms,
        )
        for r in rows
    ]


def assert_history_equals_bronze(spark: SparkSession, pipeline: Pipeline, entity: str) -> int:
    """The history table holds exactly the versions the bronze events make, every column
    compared (a version holds its newest event's values); returns how many versions."""
    config = pipeline.config
    settings = config.entity(entity)
    events = bronze_events(spark, pipeline, entity)
    columns = sorted({c for e in events if e.row is not None for c in e.row})
    untracked = settings.history.untracked_columns(columns, settings.key)
    expected = history_versions(events, untracked)
    wanted = sorted(
        (
            (k, v.start, v.end, *(v.row.get(c) for c in columns))
            for k, vs in expected.items()
            for v in vs
        ),
        key=repr,
    )
    rows = spark.read.format("delta").load(config.layout.history(entity)).collect()

    def shape(r: Any) -> tuple[Any, ...]:
        end = None if r[END] is None else tuple(r[END])
        key = tuple(r[k] for k in settings.key)
        return (key, tuple(r[START]), end, *(r[c] for c in columns))

    got = sorted((shape(r) for r in rows), key=repr)
    missing, extra = set(wanted) - set(got), set(got) - set(wanted)
    repeated = [(v, n) for v, n in Counter(got).items() if n > 1]
    assert got == wanted, (
        f"{len(missing)} versions missing {sorted(missing, key=repr)[:3]}, "
        f"{len(extra)} extra {sorted(extra, key=repr)[:3]}, "
        f"{len(repeated)} repeated {repeated[:3]}"
    )
    return len(got)
