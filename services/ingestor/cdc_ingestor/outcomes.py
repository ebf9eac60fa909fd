"""Counting a decoded batch's outcomes: records per outcome, and the records to quarantine.

The counts come as observed metrics of the bronze write (no pass of their own), or from
an aggregation of their own when that write did not run (a replayed batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdc_shared.config.entities import EntityConfig
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

from cdc_ingestor.decode import ERROR_KINDS
from cdc_ingestor.projection import quarantine_columns

#: Quarantined records of one batch collected to the driver and written from there;
#: a batch with more is quarantined by a third pass over it instead.
MAX_COLLECTED_QUARANTINE = 20_000
#: Records per outcome (only those that occurred), and the collected quarantine records.
Outcomes = tuple[dict[str, int], list[Any]]


def outcome_metrics(entity: EntityConfig) -> list[Column]:
    """Aggregates of a decoded batch: records per outcome, and the records to quarantine.

    The records come as quarantine rows without their batch id and time (``stamped``
    adds them), up to ``MAX_COLLECTED_QUARANTINE`` of them.
    """
    kind = F.col("error_kind")
    record = F.struct(*quarantine_columns(entity, None))
    return [
        F.count_if(kind.isNull()).alias("ok"),
        *[F.count_if(kind == name).alias(name) for name in ERROR_KINDS],
        F.count(kind).alias("rejected"),
        F.slice(
            F.collect_list(F.when(kind.isNotNull(), record)), 1, MAX_COLLECTED_QUARANTINE
        ).alias("rows"),
    ]


def outcomes(row: Mapping[str, Any] | Row | None) -> Outcomes:
    """Counts per outcome (only those that occurred) and the collected records."""
    assert row is not None
    counts = {"ok": int(row["ok"]), **{kind: int(row[kind]) for kind in ERROR_KINDS}}
    unclassified = int(row["rejected"]) - sum(counts[kind] for kind in ERROR_KINDS)
    if unclassified:
        counts["unclassified"] = unclassified
    counts = {name: n for name, n in counts.items() if n}
    collected = list(row["rows"])
    if int(row["rejected"]) > MAX_COLLECTED_QUARANTINE:
        collected = []  # written by a pass of their own
    return counts, collected


def count_outcomes(decoded: DataFrame, entity: EntityConfig) -> Outcomes:
    """A pass of its own over the batch: what ``outcome_metrics`` observes on a write."""
    return outcomes(decoded.agg(*outcome_metrics(entity)).first())
