"""The merger's SCD type 2 history on real Spark + Delta, against the dev kit's history oracle.

Batches are hand-made bronze events driven through ``apply_batch`` in this process, as in
``test_merger_apply.py``, with the entity's history on. Every Spark batch costs seconds,
so the guarantees are proven by one random, shuffled, re-delivered load compared with the
oracle and replayed (idempotence), on a table whose column selection leaves a column out
and to which the load brings a new column, rather than one test per case.
"""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import pytest
from cdc_cli.verify import TargetComparison, verify
from cdc_devkit.oracle import SourceEvent, history_versions
from cdc_merger.merging import silver_layout
from cdc_shared.config.entities import HistoryConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.silver import END, END_TS, START, START_TS
from cdc_shared.contracts.unavailable import DEBEZIUM_PLACEHOLDER
from delta.tables import DeltaTable
from pyspark.sql import Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from support.entities import CUSTOMERS
from test_merger_apply import Silver, customer

pytestmark = pytest.mark.integration

#: Names make versions; email and phone changes update the current version in place.
TRACKED = HistoryConfig(enabled=True, track_columns=["first_name", "last_name"])
UNTRACKED = ("email", "phone", "created_at")
DROPPED = ("email",)  # the entity's column selection leaves email out
BASE_MS = 1_767_225_600_000  # the source time ``Silver.event`` gives sequence 0


def narrow_customers(spark: SparkSession, root: Path) -> tuple[Silver, PipelineConfig]:
    """Customers' silver and history made as the merger makes them with a column selection
    leaving email out, before phone existed: phone is a new source column in the batches;
    where a pipeline configuration (returned) has them."""
    plain = Silver(spark, root / "plain", CUSTOMERS)
    after = plain.bronze_schema["after"].dataType
    assert isinstance(after, T.StructType)
    narrow = T.StructType([f for f in after.fields if f.name not in ("phone", "email")])
    bronze = T.StructType(
        [
            T.StructField(f.name, narrow if f.name == "after" else f.dataType, f.nullable)
            for f in plain.bronze_schema.fields
        ]
    )
    entity = CUSTOMERS.model_copy(update={"history": TRACKED})
    config = PipelineConfig(storage_root=str(root / "h"), entities=[entity])
    layout = silver_layout(config, entity)
    return Silver(spark, root / "h", entity, silver_bronze_schema=bronze, layout=layout), config


def history_rows(silver: Silver) -> list[Row]:
    assert silver.layout.history is not None
    rows = silver.spark.read.format("delta").load(silver.layout.history.path).collect()
    return sorted(rows, key=lambda r: (r.id, r[START]))


def history_changes(silver: Silver) -> int:
    assert silver.layout.history is not None
    feed = (
        silver.spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 0)
        .load(silver.layout.history.path)
    )
    return feed.count()


def at(sequence: int) -> dt.datetime:
    return dt.datetime.fromtimestamp((BASE_MS + sequence) / 1000, dt.UTC).replace(tzinfo=None)


def random_events(
    silver: Silver, rng: random.Random
) -> tuple[list[dict[str, Any]], list[SourceEvent]]:
    """Bronze events in sequence order on ten keys, and the same as the oracle's events."""
    alive: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    truth: list[SourceEvent] = []
    for sequence in range(10, 10 + 140):
        if sequence in (60, 115):
            events.append(silver.event("t", None, [sequence]))
            truth.append(SourceEvent(None, (sequence,), "t", None, BASE_MS + sequence))
            alive.clear()
            continue
        key = rng.randint(1, 10)
        roll = rng.random()
        if key not in alive:
            op, row = "c", customer(rng.choice("abc"))
        elif roll < 0.2:
            op, row = "d", None
        elif roll < 0.5:
            op, row = "u", {**alive[key], "first_name": rng.choice("abcd")}
        elif roll < 0.9:
            op, row = "u", {**alive[key], "phone": str(rng.randint(0, 99))}
        else:
            op, row = "u", dict(alive[key])  # nothing changed
        if row is None:
            alive.pop(key)
        else:
            alive[key] = row
        events.append(silver.event(op, {"id": key}, [sequence], row))
        image = None if row is None else {**row, "id": key}
        truth.append(SourceEvent((key,), (sequence,), op, image, BASE_MS + sequence))
    return events, truth


def test_history_equals_the_oracle_after_shuffled_redelivered_batches(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Random inserts, tracked and untracked-only updates (in place), deletes, re-inserts,
    truncates (closing every open version); re-delivered and shuffled into batches: the
    table holds the ordered events' history, and whole batches replayed change nothing.
    With the column selection (email left out) and a new source column (phone)."""
    customers, config = narrow_customers(spark, tmp_path)
    assert customers.layout.history is not None
    path = customers.layout.history.path
    assert "phone" not in spark.read.format("delta").load(path).columns
    rng = random.Random(7)
    events, truth = random_events(customers, rng)
    mixed, tail = events[:-10], events[-10:]
    delivered = mixed + [dict(e) for e in rng.sample(mixed, 25)]  # re-deliveries
    rng.shuffle(delivered)
    batches = [delivered[start : start + 83] for start in range(0, len(delivered), 83)]
    for batch in batches:  # two batches
        customers.apply(*batch, dropped=DROPPED)
    apply_in_order(customers, tail)
    assert customers.rejected == []
    rows, changes = history_rows(customers), history_changes(customers)
    version = DeltaTable.forPath(spark, path).history(1).collect()[0].version
    # Whole batches replayed, newest first and across a restart: nothing changes.
    customers.apply(*batches[1], dropped=DROPPED)
    customers.restart()
    customers.apply(*batches[0], dropped=DROPPED)
    replayed = history_rows(customers)
    assert replayed == rows, [(a, b) for a, b in zip(rows, replayed, strict=False) if a != b]
    assert history_changes(customers) == changes
    # Not even an empty commit: a replay writes nothing to the history.
    assert DeltaTable.forPath(spark, path).history(1).collect()[0].version == version

    columns = spark.read.format("delta").load(path).columns
    assert "phone" in columns and "email" not in columns  # narrowed as silver; phone came
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
    assert detail is not None and detail["properties"]["delta.enableChangeDataFeed"] == "true"
    expected = history_versions(truth, UNTRACKED)
    got = history_rows(customers)
    tracked = ("first_name", "last_name")

    def shape(key: int, start: int, end: int | None, row: dict[str, Any]) -> tuple[Any, ...]:
        return (key, start, end, *(row[c] for c in tracked))

    shapes = [shape(r.id, r[START][0], r[END] and r[END][0], r.asDict()) for r in got]
    wanted = sorted(
        shape(k[0], v.start[0], v.end and v.end[0], v.row)
        for k, versions in expected.items()
        for v in versions
    )
    assert shapes == wanted, (sorted(set(wanted) - set(shapes)), sorted(set(shapes) - set(wanted)))
    by_start = {(k[0], v.start[0]): v for k, versions in expected.items() for v in versions}
    for row in got:
        version = by_start[(row.id, row[START][0])]
        assert row[START_TS] == at(version.start[0])
        # The end's source time is known unless only a tombstone or a truncate the
        # history had not seen then remembers the delete.
        assert row[END_TS] is None or (
            version.end is not None and row[END_TS] == at(version.end[0])
        )
        # Every version holds its newest event's values, a closed one split by a late
        # event too (not those of the version's newest event before the split).
        assert (row.phone, row._cdc_seq) == (version.row["phone"], list(version.last))
    assert sum(r[END_TS] is not None for r in got if r[END] is not None) > len(got) // 2

    # The current versions are silver.
    current = {(r.id, r.first_name, r.phone, tuple(r._cdc_seq)) for r in got if r[END] is None}
    assert current == {
        (r.id, r.first_name, r.phone, tuple(r._cdc_seq)) for r in customers.rows().collect()
    }
    in_place = [v for versions in expected.values() for v in versions if v.last != v.start]
    assert in_place and any(v.end is not None for v in in_place)  # the load had both kinds
    assert_verify_checks_the_history(spark, customers, config, got)


def apply_in_order(customers: Silver, tail: list[dict[str, Any]]) -> None:
    """``tail``, newer than every tombstone and truncate, applied in order: its rebuild
    reads neither table (``history.Reach``), and it replaces only the versions it can
    change (each key's open one, and those it begins), not its keys' whole past."""
    assert customers.layout.history is not None
    state = customers.state
    oldest = min(event["sequence"] for event in tail)
    assert max(state.newest_delete.get() or [0], state.truncates.get() or [0]) < oldest
    customers.apply(*tail, dropped=DROPPED)
    history = DeltaTable.forPath(customers.spark, customers.layout.history.path)
    (tail_write,) = history.history(1).collect()
    written = {k: int(v) for k, v in tail_write.operationMetrics.items()}
    # Rows left in the files deletion vectors marked count as output and as copied.
    assert written["numOutputRows"] - written["numCopiedRows"] <= 2 * len(tail), written
    assert written["numDeletedRows"] <= len(tail), written


def assert_verify_checks_the_history(
    spark: SparkSession, customers: Silver, config: PipelineConfig, got: list[Row]
) -> None:
    """`cdc verify`'s history target agrees with silver, reports seeded differences by
    key, and agrees again once the history is restored."""
    assert customers.layout.history is not None
    path = customers.layout.history.path
    alive = sorted(r.id for r in customers.rows().collect())
    agreeing = TargetComparison("history", path, len(alive), buckets=1)
    (entity,) = verify(config, targets=("history",), spark=spark).entities
    assert entity.targets == (agreeing,)

    history = DeltaTable.forPath(spark, path)
    restore_to = int(history.history(1).head()["version"])  # type: ignore[index]
    gone = next(r for r in got if r.id not in alive)  # a version of a key silver deleted
    older = next(r for r in got if r.id in alive and r[END] is not None)  # a closed one
    dropped, altered, unsent = [k for k in alive if k != older.id][:3]
    # In one commit: dropped's current version closed, altered's and unsent's changed (the
    # placeholder: a value the source did not send, not compared), and two closed ones
    # current again: a version of a deleted key, and a second one of a key.
    key, current = F.col("id"), F.col(END).isNull()
    reopened = [
        (key == r.id) & (F.col(START) == F.array(*map(F.lit, r[START]))) for r in (gone, older)
    ]
    placeholder = F.lit(DEBEZIUM_PLACEHOLDER)
    history.update(
        (current & key.isin(dropped, altered, unsent)) | reopened[0] | reopened[1],
        {
            END: F.when(key == dropped, F.col(START)),  # the others current (null)
            "first_name": F.when(key == altered, "zz")
            .when(key == unsent, placeholder)
            .otherwise(F.col("first_name")),
            "phone": F.when(key == unsent, placeholder).otherwise(F.col("phone")),
        },
    )
    # Silver has a column the history lacks (silver narrowed after it had it): verify
    # compares on the history's columns, spilling silver again on those.
    silver = customers.layout.silver_path
    spark.sql(f"ALTER TABLE delta.`{silver}` ADD COLUMNS (nickname STRING)")
    DeltaTable.forPath(spark, silver).update(set={"nickname": F.lit("nick")})

    report = verify(config, targets=("history",), spark=spark)
    assert not report.ok
    (entity,) = report.entities
    (seeded,) = entity.targets
    assert (seeded.missing, seeded.extra, seeded.different) == (1, 1, 2), seeded
    assert seeded.examples == {
        "missing": [f"id={dropped}"],
        "extra": [f"id={gone.id}"],
        "different": [f"id={k}" for k in sorted((altered, older.id), key=lambda k: repr((k,)))],
    }
    assert seeded.rows == len(alive)  # one dropped, one of a deleted key come back

    history.restoreToVersion(restore_to)
    (entity,) = verify(config, targets=("history",), spark=spark).entities
    assert entity.targets == (agreeing,)
