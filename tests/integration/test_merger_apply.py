"""The merger's core on real Spark + Delta: hand-built bronze batches for every tricky case."""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from cdc_ingestor.decode import KAFKA_SCHEMA, DecodePlan, decode
from cdc_merger.apply import (
    DEFAULT_PLACEHOLDER,
    ERROR_KIND,
    ERROR_MESSAGE,
    ApplyResult,
    MergeState,
    apply_batch,
    apply_history,
)
from cdc_merger.history import HistoryTable
from cdc_merger.silver_tables import SilverLayout, ensure_tables
from cdc_shared.avro import FileSchemaRegistry
from cdc_shared.clients.schemas import entity_schemas
from cdc_shared.config.entities import EntityConfig, HistoryConfig
from cdc_shared.contracts import bronze
from cdc_shared.contracts.bronze import read_payload_types
from cdc_shared.contracts.unavailable import DEBEZIUM_PLACEHOLDER, Placeholder
from cdc_shared.jvm.bridge import delta_transaction_version, delta_version
from cdc_shared.streaming.tables import ensure_table, expire_tombstones, table_properties
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from support.entities import CUSTOMERS, ORDERS, SCHEMAS
from support.ingestion import typed_bronze_rows

pytestmark = pytest.mark.integration


class Silver:
    """One entity's silver table fed hand-made bronze batches (bronze's real schema)."""

    def __init__(
        self,
        spark: SparkSession,
        root: Path,
        entity: EntityConfig,
        schema_dir: Path = SCHEMAS,
        silver_bronze_schema: T.StructType | None = None,
        history: HistoryConfig | None = None,
        layout: SilverLayout | None = None,  # the tables' paths (default: under root)
    ) -> None:
        self.spark = spark
        self.entity = entity
        registry = FileSchemaRegistry([schema_dir])
        plan = DecodePlan.from_schemas(entity_schemas(entity, registry), registry)
        empty = spark.createDataFrame([], KAFKA_SCHEMA)
        self.bronze_schema: T.StructType = typed_bronze_rows(
            decode(spark, empty, plan, entity.sequence_by)
        ).schema
        self.layout = layout or SilverLayout(
            str(root / "silver"),
            str(root / "tombstones"),
            str(root / "truncates"),
            entity.key,
            None if history is None else HistoryTable(str(root / "history"), history),
        )
        ensure_tables(spark, silver_bronze_schema or self.bronze_schema, self.layout)
        self.state = MergeState(spark, self.layout)  # kept, as the merger
        self.offset = 0
        self.rejected: list[Row] = []

    def event(
        self,
        op: str,
        key: dict[str, Any] | None,
        sequence: list[int],
        row: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.offset += 1
        image = None if row is None else {**row, **(key or {})}
        return {
            "kafka_topic": self.entity.source_topic,
            "kafka_partition": 0,
            "kafka_offset": self.offset,
            "kafka_timestamp": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            "key": key,
            "before": None,
            "after": None if op in ("d", "t") else image,
            "source": {
                "version": "v",
                "connector": "postgresql",
                "name": "db",
                "ts_ms": 1_767_225_600_000 + sequence[-1],
                "db": "inventory",
                "schema": "inventory",
                "table": self.entity.name,
                "lsn": sequence[-1],
            },
            "transaction": None,
            "op": op,
            "ts_ms": None,
            "ts_us": None,
            "ts_ns": None,
            "is_tombstone": False,
            "sequence": sequence,
            "writer_schema": "test",
            "ingested_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        }

    def apply(
        self,
        *events: dict[str, Any],
        null_updates: tuple[str, ...] = (),
        dropped: tuple[str, ...] = (),
    ) -> ApplyResult:
        frame = self.spark.createDataFrame(list(events), self.bronze_schema).persist()
        try:
            return self.apply_frame(frame, dropped=dropped, null_updates=null_updates)
        finally:
            frame.unpersist()

    def apply_frame(
        self,
        events: DataFrame,
        placeholder: Placeholder | None = DEFAULT_PLACEHOLDER,
        dropped: tuple[str, ...] = (),
        null_updates: tuple[str, ...] = (),
    ) -> ApplyResult:
        """Silver's step, then (the entity keeping one) the history's, as the merger."""
        result = apply_batch(
            self.spark,
            events,
            self.layout,
            self.quarantine,
            self.state,
            placeholder,
            dropped=dropped,
            null_updates=null_updates,
        )
        if self.layout.history is not None:
            apply_history(
                self.spark,
                events,
                self.layout,
                self.state,
                placeholder,
                dropped=dropped,
                null_updates=null_updates,
            )
        return result

    def restart(self) -> None:
        """Forget what the process kept in memory, as a restarted merger would."""
        self.state = MergeState(self.spark, self.layout)

    def quarantine(self, rejected: DataFrame) -> None:
        self.rejected += rejected.collect()

    def rows(self) -> DataFrame:
        return self.spark.read.format("delta").load(self.layout.silver_path)

    def changes(self) -> list[tuple[Any, ...]]:
        feed = (
            self.spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load(self.layout.silver_path)
        )
        return sorted(
            (r._commit_version, r._change_type, *(r[k] for k in self.entity.key))
            for r in feed.collect()
        )


def customer(name: str) -> dict[str, Any]:
    return {
        "first_name": name,
        "last_name": "x",
        "email": "e",
        "phone": None,
        "created_at": dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    }


@pytest.fixture
def customers(spark: SparkSession, tmp_path: Path) -> Silver:
    return Silver(spark, tmp_path, CUSTOMERS)


def names(silver: Silver) -> dict[int, str]:
    return {r.id: r.first_name for r in silver.rows().collect()}


def test_duplicates_in_one_batch_become_one_row(customers: Silver) -> None:
    first = customers.event("c", {"id": 1}, [10], customer("a"))
    customers.apply(first, dict(first), dict(first))
    assert names(customers) == {1: "a"}
    assert [c[1] for c in customers.changes()] == ["insert"]


def test_sequence_not_kafka_order_decides(customers: Silver) -> None:
    customers.apply(
        customers.event("u", {"id": 1}, [30], customer("newest")),
        customers.event("c", {"id": 1}, [10], customer("oldest")),
    )
    assert names(customers) == {1: "newest"}
    row = customers.rows().collect()[0]
    assert row._cdc_seq == [30] and row._cdc_op == "u"


def test_delete_then_late_update_stays_deleted(customers: Silver) -> None:
    customers.apply(customers.event("c", {"id": 1}, [10], customer("a")))
    customers.apply(customers.event("d", {"id": 1}, [30]))
    customers.apply(customers.event("u", {"id": 1}, [20], customer("late")))
    assert names(customers) == {}
    assert [c[1] for c in customers.changes()] == ["insert", "delete"]


def test_delete_before_insert_blocks_the_older_insert(customers: Silver) -> None:
    customers.apply(customers.event("d", {"id": 2}, [50]))
    customers.apply(customers.event("c", {"id": 2}, [40], customer("older")))
    assert names(customers) == {}


def test_delete_then_newer_insert(customers: Silver) -> None:
    customers.apply(customers.event("c", {"id": 1}, [10], customer("a")))
    customers.apply(customers.event("d", {"id": 1}, [20]))
    customers.apply(customers.event("c", {"id": 1}, [30], customer("reborn")))
    assert names(customers) == {1: "reborn"}
    assert [c[1] for c in customers.changes()] == ["insert", "delete", "insert"]


def test_tombstones_outlive_a_restart(customers: Silver) -> None:
    customers.apply(customers.event("c", {"id": 1}, [10], customer("a")))
    customers.apply(customers.event("d", {"id": 1}, [30]))
    customers.restart()  # the index is loaded again from the tombstones table
    assert len(customers.state.tombstones) == 1
    customers.apply(customers.event("u", {"id": 1}, [20], customer("late")))
    assert names(customers) == {}


def test_a_newer_insert_retires_the_tombstone_it_overtakes(customers: Silver) -> None:
    """Silver's row guards the key once it is newer than the delete: memory is freed."""
    customers.apply(customers.event("d", {"id": 1}, [20]))
    customers.apply(customers.event("d", {"id": 2}, [21]))
    assert len(customers.state.tombstones) == 2
    customers.apply(customers.event("c", {"id": 1}, [30], customer("reborn")))
    assert len(customers.state.tombstones) == 1
    customers.restart()  # the table still holds key 1's tombstone; the load leaves it out
    assert len(customers.state.tombstones) == 1
    customers.apply(
        customers.event("u", {"id": 1}, [25], customer("late")),
        customers.event("c", {"id": 2}, [15], customer("late")),
    )
    assert names(customers) == {1: "reborn"}


def test_a_delete_whose_tombstone_committed_before_its_merge_still_applies(
    customers: Silver,
) -> None:
    """The tombstones' append runs beside the MERGE: a crash may keep only the tombstone."""
    customers.apply(customers.event("c", {"id": 1}, [10], customer("a")))
    delete = customers.event("d", {"id": 1}, [30])
    tombstone = customers.spark.createDataFrame(
        [(1, [30], dt.datetime.now(dt.UTC))], "id int, _cdc_seq array<bigint>, deleted_at timestamp"
    )
    tombstone.write.format("delta").mode("append").save(customers.layout.tombstone_path)
    customers.restart()  # the crash: the batch is replayed by a new process
    customers.apply(delete)
    assert names(customers) == {}
    assert [c[1] for c in customers.changes()] == ["insert", "delete"]


def test_replayed_batch_changes_nothing(customers: Silver) -> None:
    batch = [
        customers.event("c", {"id": 1}, [10], customer("a")),
        customers.event("c", {"id": 2}, [11], customer("b")),
        customers.event("u", {"id": 1}, [12], customer("a2")),
    ]
    customers.apply(*batch)
    customers.apply(customers.event("d", {"id": 2}, [13]))
    before, changes = names(customers), customers.changes()
    customers.apply(*batch)  # a crash between the MERGE commit and the checkpoint commit
    customers.apply(customers.event("d", {"id": 2}, [13]))
    assert names(customers) == before == {1: "a2"}
    assert customers.changes() == changes


def test_the_first_write_into_an_empty_silver_appends_with_its_progress(
    customers: Silver,
) -> None:
    """Into an empty silver the MERGE would only insert: an append writes the same rows.

    It records the batch's progress with it, so the batch run again writes nothing
    twice; its delete keeps its key out of silver and a late older insert out after.
    """
    batch = [
        customers.event("c", {"id": 1}, [10], customer("a")),
        customers.event("u", {"id": 1}, [12], customer("a2")),
        customers.event("c", {"id": 2}, [11], customer("b")),
        customers.event("d", {"id": 2}, [13]),
    ]
    frame = customers.spark.createDataFrame(batch, customers.bronze_schema)
    silver_path = customers.layout.silver_path
    for _ in range(2):  # the second: a crash before the checkpoint committed the batch
        apply_batch(
            customers.spark,
            frame,
            customers.layout,
            customers.quarantine,
            customers.state,
            progress=("merger-test", 7),
        )
    history = DeltaTable.forPath(customers.spark, silver_path).history()
    operations = [r.operation for r in history.orderBy("version").collect()]
    assert operations[-1] == "WRITE" and "MERGE" not in operations
    assert delta_transaction_version(customers.spark, silver_path, "merger-test") == 7
    assert names(customers) == {1: "a2"}
    assert [c[1:] for c in customers.changes()] == [("insert", 1)]
    customers.apply(customers.event("c", {"id": 2}, [5], customer("late")))
    assert names(customers) == {1: "a2"}


def test_update_changes_show_pre_and_post_images(customers: Silver) -> None:
    customers.apply(customers.event("r", {"id": 1}, [10], customer("snap")))
    customers.apply(customers.event("u", {"id": 1}, [20], customer("new")))
    kinds = [c[1] for c in customers.changes()]
    assert kinds == ["insert", "update_postimage", "update_preimage"]


def test_composite_key_and_two_column_sequence(spark: SparkSession, tmp_path: Path) -> None:
    orders = Silver(spark, tmp_path, ORDERS)

    def line(quantity: int) -> dict[str, Any]:
        return {
            "customer_id": 1,
            "product": None,
            "quantity": quantity,
            "amount": Decimal("9.99"),
            "order_date": dt.date(2024, 1, 1),
            "status": "paid",
        }

    orders.apply(
        orders.event("c", {"order_id": 7, "line_no": 1}, [100, 5], line(1)),
        orders.event("c", {"order_id": 7, "line_no": 2}, [100, 6], line(2)),
        orders.event("u", {"order_id": 7, "line_no": 1}, [100, 9], line(3)),
        orders.event("u", {"order_id": 7, "line_no": 1}, [99, 50], line(4)),  # older ts wins
    )
    got = {(r.order_id, r.line_no): (r.quantity, r.amount) for r in orders.rows().collect()}
    assert got == {(7, 1): (3, Decimal("9.99")), (7, 2): (2, Decimal("9.99"))}


def test_generated_workload_in_random_batches_equals_the_oracle(
    spark: SparkSession, kafka_config: Any, make_pipeline: Any, tmp_path: Path
) -> None:
    """Ingest the generated load, merge bronze in random slices: silver == the oracle."""

    from cdc_devkit.oracle import EntityOracle, load_fingerprints, read_topic
    from cdc_devkit.workload import produce
    from pyspark.sql import functions as F
    from support.ingestion import bronze, generate, ingest_once

    pipeline = make_pipeline(entities=("customers",))
    produce(
        kafka_config,
        iter(generate(pipeline, events=4000, keys=150, delete_share=0.25, redelivery_share=0.1)),
    )
    ingest_once(pipeline, spark)
    entity = pipeline.config.entity("customers")
    table = bronze(spark, pipeline, "customers").withColumn(
        "slice", (F.col("kafka_offset") * 7 + F.col("kafka_partition")) % 5
    )
    silver = Silver(spark, tmp_path / "merge", entity, pipeline.schema_dir)
    slices = list(range(5))
    random.Random(3).shuffle(slices)  # batches out of Kafka order: sequences must decide
    for number in slices:
        silver.apply_frame(table.where(F.col("slice") == number).drop("slice"))
    assert silver.rejected == []

    oracle = read_topic(
        kafka_config, EntityOracle(entity, ["id"], load_fingerprints([pipeline.schema_dir]))
    )
    assert oracle.deleted_keys and oracle.ignored  # the load had deletes and late events
    columns = [f.name for f in silver.bronze_schema["after"].dataType.fields]  # type: ignore[attr-defined]

    def normal(value: Any) -> Any:
        if isinstance(value, dt.datetime) and value.tzinfo is not None:
            return value.astimezone(dt.UTC).replace(tzinfo=None)
        return value

    expected = {k[0]: tuple(normal(row.get(c)) for c in columns) for k, row in oracle.rows.items()}
    got = {r.id: tuple(normal(r[c]) for c in columns) for r in silver.rows().collect()}
    assert got == expected


def test_truncate_deletes_older_rows_and_keeps_late_events_out(customers: Silver) -> None:
    customers.apply(
        customers.event("c", {"id": 1}, [10], customer("a")),
        customers.event("c", {"id": 2}, [11], customer("b")),
    )
    truncate = customers.event("t", None, [20])
    result = customers.apply(
        customers.event("c", {"id": 3}, [15], customer("before the truncate")),
        truncate,
        customers.event("c", {"id": 4}, [25], customer("after the truncate")),
    )
    assert result.truncated and customers.rejected == []
    assert names(customers) == {4: "after the truncate"}
    customers.apply(customers.event("u", {"id": 1}, [19], customer("late, older")))
    customers.apply(customers.event("c", {"id": 5}, [30], customer("newer")))
    assert names(customers) == {4: "after the truncate", 5: "newer"}
    changes = customers.changes()
    assert sorted(c[1:] for c in changes if c[1] == "delete") == [("delete", 1), ("delete", 2)]

    customers.apply(truncate)  # replayed: nothing newer than it is touched
    assert names(customers) == {4: "after the truncate", 5: "newer"}
    assert customers.changes() == changes

    customers.restart()  # the truncate is read back from its table
    customers.apply(customers.event("c", {"id": 6}, [18], customer("late, after a restart")))
    assert names(customers) == {4: "after the truncate", 5: "newer"}
    assert customers.changes() == changes


def test_unappliable_events_are_rejected_and_the_rest_applied(customers: Silver) -> None:
    good = customers.event("c", {"id": 1}, [10], customer("good"))
    null_key = customers.event("c", {"id": None}, [11], customer("no key"))
    unknown_op = customers.event("x", {"id": 2}, [12], customer("what"))
    no_after = customers.event("u", {"id": 3}, [13], None)
    result = customers.apply(good, null_key, unknown_op, no_after)
    assert names(customers) == {1: "good"}
    assert (result.events, result.rejected, result.keys) == (4, 3, 1)
    rejected = {r.kafka_offset: (r[ERROR_KIND], r[ERROR_MESSAGE]) for r in customers.rejected}
    assert rejected == {
        null_key["kafka_offset"]: ("null_key", "key column id is null"),
        unknown_op["kafka_offset"]: ("unknown_op", "op x is not c, u, r, d or t"),
        no_after["kafka_offset"]: ("missing_after", "op u without an 'after' row image"),
    }


def test_values_that_do_not_cast_to_silver_types_are_rejected(
    spark: SparkSession, tmp_path: Path
) -> None:
    plain = Silver(spark, tmp_path / "plain", CUSTOMERS)
    after = plain.bronze_schema["after"].dataType
    assert isinstance(after, T.StructType)
    numeric_phone = T.StructType(
        [
            T.StructField(f.name, T.LongType() if f.name == "phone" else f.dataType, f.nullable)
            for f in after.fields
        ]
    )
    silver_bronze = T.StructType(
        [
            T.StructField(f.name, numeric_phone if f.name == "after" else f.dataType, f.nullable)
            for f in plain.bronze_schema.fields
        ]
    )
    silver = Silver(spark, tmp_path / "typed", CUSTOMERS, silver_bronze_schema=silver_bronze)
    result = silver.apply(
        silver.event("c", {"id": 1}, [10], {**customer("digits"), "phone": "5551234"}),
        silver.event("c", {"id": 2}, [11], {**customer("letters"), "phone": "call me"}),
    )
    assert result.rejected == 1
    assert {r.id: r.phone for r in silver.rows().collect()} == {1: 5551234}
    assert [(r.key.id, r[ERROR_KIND]) for r in silver.rejected] == [(2, "type_mismatch")]


def test_expired_tombstones_no_longer_block_older_events(customers: Silver) -> None:
    customers.apply(customers.event("d", {"id": 1}, [50]))
    now = dt.datetime.now(dt.UTC)
    assert (
        expire_tombstones(
            customers.spark, customers.layout.tombstone_path, now - dt.timedelta(hours=1)
        )
        == 0
    )
    customers.apply(customers.event("c", {"id": 1}, [40], customer("blocked")))
    assert names(customers) == {}
    assert (
        expire_tombstones(
            customers.spark, customers.layout.tombstone_path, now + dt.timedelta(minutes=1)
        )
        == 1
    )
    customers.restart()  # the merger reloads its tombstones after an expiry
    customers.apply(customers.event("c", {"id": 1}, [40], customer("after expiry")))
    assert names(customers) == {1: "after expiry"}


def test_key_deleted_twice_is_guarded_by_its_newest_tombstone(customers: Silver) -> None:
    customers.apply(customers.event("c", {"id": 1}, [10], customer("a")))
    customers.apply(customers.event("d", {"id": 1}, [20]))
    customers.apply(customers.event("c", {"id": 1}, [30], customer("again")))
    customers.apply(customers.event("d", {"id": 1}, [40]))
    customers.apply(customers.event("u", {"id": 1}, [35], customer("late")))
    assert names(customers) == {}
    customers.apply(customers.event("u", {"id": 1}, [45], customer("newer")))
    assert names(customers) == {1: "newer"}


def test_service_expiry_counts_retention_in_bronze_ingest_time(
    spark: SparkSession, make_pipeline: Any, customers: Silver
) -> None:
    """A merger behind on old bronze events keeps the tombstones those events still need."""
    from cdc_merger.merging import TableMerge

    pipeline = make_pipeline(entities=("customers",), merger={"tombstone_retention_hours": 1})
    entity = pipeline.config.entity("customers")
    merge = TableMerge(spark, pipeline.config, entity, announce=lambda _entity: None)
    ensure_tables(spark, customers.bronze_schema, merge.layout)
    now = dt.datetime.now(dt.UTC)
    tombstone = spark.createDataFrame(
        [(1, [50], now - dt.timedelta(hours=2))],
        "id int, _cdc_seq array<bigint>, deleted_at timestamp",
    )
    tombstone.write.format("delta").mode("append").save(merge.layout.tombstone_path)

    # Merging events ingested 90 minutes ago: the tombstone is only 30 minutes older.
    assert merge.expire_tombstones(now - dt.timedelta(minutes=90)) == 0
    assert merge.expire_tombstones(now) is None  # checked at most once per interval
    merge.next_expiry = 0.0
    assert merge.expire_tombstones(now) == 1  # bronze has moved on by more than the retention


def random_changes(
    silver: Silver, rng: random.Random, expected: dict[int, str], count: int, keys: int
) -> list[dict[str, Any]]:
    """``count`` customer events on ``keys`` keys, newer than any before, shuffled.

    ``expected`` (key -> first name) is updated as if they were applied in sequence order.
    """
    events = []
    for _ in range(count):
        key = rng.randrange(keys)
        sequence = silver.offset + 1  # offsets grow by one per event: unique and increasing
        if key in expected and rng.random() < 0.2:
            events.append(silver.event("d", {"id": key}, [sequence]))
            expected.pop(key)
        else:
            name = f"k{key}s{sequence}"
            op = "u" if key in expected else "c"
            events.append(silver.event(op, {"id": key}, [sequence], customer(name)))
            expected[key] = name
    rng.shuffle(events)  # Kafka order is not sequence order
    return events


def test_merges_beside_a_compaction_retry_the_commit_races_they_lose(
    customers: Silver, caplog: pytest.LogCaptureFixture
) -> None:
    """``cdc maintenance``'s OPTIMIZE runs over silver while batches merge into it.

    One compaction per batch, started at a random moment of the batch (scaled to how long
    the last batch took, so the moments cover the MERGE however loaded the machine is):
    whichever of the two commits second lost the race on files both read, and retries.
    Silver ends equal to the events applied (an oracle kept here), every change once in the
    feed. The MERGE loses in a third to half of the batches, OPTIMIZE in about one in 40 (it
    often survives a MERGE commit): the MERGE's retry must have happened; an OPTIMIZE that
    lost without retrying would surface in ``failures``.
    """
    from cdc_cli.spark_state import compact

    caplog.set_level(logging.WARNING)
    path = customers.layout.silver_path
    rng, moments = random.Random(11), random.Random(12)  # one per thread
    batch_started, stop = threading.Event(), threading.Event()
    failures: list[Exception] = []
    last_batch_s = [3.0]  # written by the test thread, read by the compactor

    def compact_once_per_batch() -> None:
        while not stop.is_set():
            if not batch_started.wait(timeout=0.5):
                continue
            batch_started.clear()
            stop.wait(moments.uniform(0.0, last_batch_s[0]))  # before, in or after MERGE
            try:
                compact(customers.spark, path)
            except Exception as error:
                failures.append(error)
                return

    def retries(write: str) -> int:
        return sum(f"write conflict on {write} " in r.getMessage() for r in caplog.records)

    batches = 15
    expected: dict[int, str] = {}
    compactor = threading.Thread(target=compact_once_per_batch, daemon=True)
    compactor.start()
    try:
        for _ in range(batches):
            events = random_changes(customers, rng, expected, count=60, keys=120)
            started = time.monotonic()
            batch_started.set()
            customers.apply(*events)
            last_batch_s[0] = time.monotonic() - started
            if failures:
                break
    finally:
        stop.set()
        compactor.join(timeout=300)
    assert not failures, failures
    merge_retries, compact_retries = retries("_merge_silver"), retries("compact")
    assert merge_retries >= 1, (
        f"in {batches} batches, {merge_retries} MERGE and {compact_retries} OPTIMIZE retries: "
        "no MERGE lost a race, so its retry was not exercised"
    )
    assert names(customers) == expected
    assert customers.rejected == []
    feed = customers.spark.read.format("delta").option("readChangeFeed", "true")
    changes = feed.option("startingVersion", 0).load(path)
    once = changes.where("_change_type IN ('insert', 'update_postimage', 'delete')")
    assert once.groupBy("id", "_cdc_seq", "_change_type").count().where("count > 1").count() == 0


def test_tables_made_before_get_auto_compaction_at_the_next_start(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Tuning properties reach existing tables; protocol-changing ones are left alone."""
    from cdc_shared.streaming.tables import ensure_table

    path = str(tmp_path / "old")
    spark.range(3).write.format("delta").save(path)  # made without our properties
    wanted = {"delta.autoOptimize.autoCompact": "true", "delta.enableChangeDataFeed": "true"}
    ensure_table(spark, path, T.StructType([T.StructField("id", T.LongType())]), wanted)
    properties = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()["properties"]
    assert properties.get("delta.autoOptimize.autoCompact") == "true"
    assert "delta.enableChangeDataFeed" not in properties
    layout = Silver(spark, tmp_path / "new", CUSTOMERS).layout
    for table in (layout.silver_path, layout.tombstone_path):
        detail = spark.sql(f"DESCRIBE DETAIL delta.`{table}`").first()
        assert detail["properties"].get("delta.autoOptimize.autoCompact") == "true"


# --- values the source did not send (Debezium's unavailable-value placeholder) ----------

PLACEHOLDER = DEBEZIUM_PLACEHOLDER
#: Columns a TOASTed PostgreSQL value can arrive in, with Debezium's rendering of the
#: placeholder in each (see cdc_shared.contracts.unavailable).
TOASTABLE = T.StructType(
    [
        T.StructField("bio", T.StringType()),
        T.StructField("doc", T.StringType()),  # jsonb: io.debezium.data.Json, a string
        T.StructField("blob", T.BinaryType()),
        T.StructField("tags", T.ArrayType(T.StringType())),
        T.StructField("scores", T.ArrayType(T.IntegerType())),
        T.StructField("attrs", T.MapType(T.StringType(), T.StringType())),
    ]
)
UNSENT = {
    "bio": PLACEHOLDER,
    "doc": PLACEHOLDER,
    "blob": bytearray(PLACEHOLDER.encode()),
    "tags": [PLACEHOLDER],
    "scores": list(PLACEHOLDER.encode()),
    "attrs": {PLACEHOLDER: PLACEHOLDER},
}


def sent(n: int) -> dict[str, Any]:
    """Real values of the large columns, different for each ``n``."""
    return {
        "bio": f"bio {n} " + "x" * 50,
        "doc": f'{{"n": {n}}}',
        "blob": bytearray(f"blob {n}".encode()),
        "tags": [f"tag{n}", "t"],
        "scores": [n, n + 1],
        "attrs": {"n": str(n)},
    }


def _with_large_columns(bronze: T.StructType) -> T.StructType:
    """Bronze's schema with the large columns added to ``before`` and ``after``."""

    def widened(field: T.StructField) -> T.StructField:
        if field.name not in ("before", "after"):
            return field
        row = field.dataType
        assert isinstance(row, T.StructType)
        return T.StructField(field.name, T.StructType(row.fields + TOASTABLE.fields), True)

    return T.StructType([widened(f) for f in bronze.fields])


@pytest.fixture
def documents(spark: SparkSession, tmp_path: Path) -> Silver:
    plain = Silver(spark, tmp_path / "probe", CUSTOMERS)
    wide = _with_large_columns(plain.bronze_schema)
    silver = Silver(
        spark,
        tmp_path / "docs",
        CUSTOMERS,
        silver_bronze_schema=wide,
        history=HistoryConfig(enabled=True),
    )
    silver.bronze_schema = wide
    return silver


def history_large_columns(silver: Silver) -> dict[int, list[tuple[Any, ...]]]:
    """Each key's versions in order: (start, end, first name, the large columns)."""
    assert silver.layout.history is not None
    versions: dict[int, list[tuple[Any, ...]]] = {}
    rows = silver.spark.read.format("delta").load(silver.layout.history.path).collect()
    for r in sorted(rows, key=lambda r: (r.id, r["__start_at"])):
        values = tuple(
            bytearray(r[f.name]) if isinstance(r[f.name], bytes | bytearray) else r[f.name]
            for f in TOASTABLE.fields
        )
        versions.setdefault(r.id, []).append(
            (r["__start_at"], r["__end_at"], r.first_name, *values)
        )
    return versions


def large_columns(silver: Silver) -> dict[int, dict[str, Any]]:
    def plain(value: Any) -> Any:
        return bytearray(value) if isinstance(value, bytes | bytearray) else value

    return {
        r.id: {f.name: plain(r[f.name]) for f in TOASTABLE.fields} | {"name": r.first_name}
        for r in silver.rows().collect()
    }


def test_unavailable_values_keep_the_value_silver_or_the_batch_holds(documents: Silver) -> None:
    """Debezium's placeholder never reaches silver (nor its change feed): the prior value
    stays, from an earlier event of the batch, else from silver; with none, null."""
    first = documents.apply(
        *[documents.event("c", {"id": n}, [n], customer(f"c{n}") | sent(n)) for n in (1, 2, 3)]
    )
    assert first.unavailable == {}
    second = documents.apply(
        # an update that leaves every large column alone: silver's values stay
        documents.event("u", {"id": 1}, [10], customer("c1-renamed") | UNSENT),
        # a real new value, and a real null, are stored as sent
        documents.event("u", {"id": 2}, [11], customer("c2") | sent(22)),
        documents.event("u", {"id": 3}, [12], customer("c3") | sent(3) | {"bio": None}),
        # insert and update of one key in one batch: the insert's values stay
        documents.event("c", {"id": 4}, [13], customer("c4") | sent(4)),
        documents.event("u", {"id": 4}, [14], customer("c4-renamed") | UNSENT),
        # nothing anywhere holds key 5's values: null, and counted
        documents.event("u", {"id": 5}, [15], customer("c5") | UNSENT),
        # an older update than silver's row changes nothing
        documents.event("u", {"id": 2}, [5], customer("stale") | UNSENT),
    )
    rows = large_columns(documents)
    assert rows[1] == sent(1) | {"name": "c1-renamed"}
    assert rows[2] == sent(22) | {"name": "c2"}
    assert rows[3] == sent(3) | {"bio": None, "name": "c3"}
    assert rows[4] == sent(4) | {"name": "c4-renamed"}
    assert rows[5] == dict.fromkeys(UNSENT, None) | {"name": "c5"}
    assert second.unavailable == dict.fromkeys(UNSENT, 1)

    # The change feed (what both publishers read) never shows the placeholder.
    feed = (
        documents.spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 0)
        .load(documents.layout.silver_path)
    )
    assert feed.where(F.col("bio") == PLACEHOLDER).count() == 0
    post = {r.id: r.bio for r in feed.where("_change_type = 'update_postimage'").collect()}
    assert post[1] == sent(1)["bio"]

    # Replayed, the batch changes nothing, and key 5 is no longer unheld.
    changes = documents.changes()
    again = documents.apply(
        documents.event("u", {"id": 1}, [10], customer("c1-renamed") | UNSENT),
        documents.event("u", {"id": 5}, [15], customer("c5") | UNSENT),
    )
    assert large_columns(documents) == rows
    assert documents.changes() == changes
    assert again.unavailable == {}

    # The history (on here) takes the prior value the same way: every version holds the
    # values silver held then, never the placeholder.
    def version(start: int, end: int | None, name: str, n: int | None) -> tuple[Any, ...]:
        values = dict.fromkeys(UNSENT, None) if n is None else sent(n)
        ends = None if end is None else [end]
        return ([start], ends, name, *(values[f.name] for f in TOASTABLE.fields))

    expected = {
        1: [version(1, 10, "c1", 1), version(10, None, "c1-renamed", 1)],
        # the stale update (older than silver's row) is a version of its own in history
        2: [version(2, 5, "c2", 2), version(5, 11, "stale", 2), version(11, None, "c2", 22)],
        3: [version(3, 12, "c3", 3), version(12, None, "c3", 3)],
        4: [version(13, 14, "c4", 4), version(14, None, "c4-renamed", 4)],
        5: [version(15, None, "c5", None)],
    }
    expected[3][1] = (*expected[3][1][:3], None, *expected[3][1][4:])  # bio: a real null
    assert history_large_columns(documents) == expected
    # An update that changed nothing but brought the placeholder makes no version.
    documents.apply(documents.event("u", {"id": 2}, [16], customer("c2") | UNSENT))
    assert history_large_columns(documents) == expected

    # After a delete the key holds nothing to keep: an update that does not send its
    # values (with no insert between, e.g. an event lost upstream) stores null, in
    # silver and in the history's current version alike.
    documents.apply(documents.event("d", {"id": 4}, [17]))
    documents.apply(documents.event("u", {"id": 4}, [18], customer("c4-back") | UNSENT))
    assert large_columns(documents)[4] == dict.fromkeys(UNSENT, None) | {"name": "c4-back"}
    expected[4] = [expected[4][0], version(14, 17, "c4-renamed", 4)]
    expected[4].append(version(18, None, "c4-back", None))
    assert history_large_columns(documents) == expected


def test_unavailable_values_stored_as_sent_when_the_placeholder_is_off(
    documents: Silver,
) -> None:
    documents.apply(documents.event("c", {"id": 1}, [1], customer("a") | sent(1)))
    batch = documents.spark.createDataFrame(
        [documents.event("u", {"id": 1}, [2], customer("a") | UNSENT)], documents.bronze_schema
    )
    documents.apply_frame(batch, placeholder=None)
    assert large_columns(documents)[1]["bio"] == PLACEHOLDER


def test_a_null_in_an_update_keeps_the_value_when_told_to(customers: Silver) -> None:
    """``ignore_null_updates``: a null in an update keeps the value the batch or silver
    holds, only for the columns named; a null in an insert, and any null with the option
    off, is stored as sent."""

    def person(email: str | None, phone: str | None) -> dict[str, Any]:
        return customer("p") | {"email": email, "phone": phone}

    customers.apply(
        customers.event("c", {"id": 1}, [1], person("a@x", "111")),
        customers.event("c", {"id": 2}, [2], person("b@x", "222")),
    )
    result = customers.apply(
        # silver holds email: kept; phone is not named: its null is stored
        customers.event("u", {"id": 1}, [10], person(None, None)),
        # insert, then an update with a null, in one batch: the insert's email stays
        customers.event("c", {"id": 3}, [11], person("c@x", "333")),
        customers.event("u", {"id": 3}, [12], person(None, "334")),
        # nothing holds key 4's email: null, counted
        customers.event("u", {"id": 4}, [13], person(None, "444")),
        # an insert's null is a real null
        customers.event("c", {"id": 5}, [14], person(None, "555")),
        null_updates=("email",),
    )
    rows = {r.id: (r.email, r.phone) for r in customers.rows().collect()}
    assert rows == {
        1: ("a@x", None),
        2: ("b@x", "222"),
        3: ("c@x", "334"),
        4: (None, "444"),
        5: (None, "555"),
    }
    assert result.unavailable == {"email": 1}

    customers.apply(customers.event("u", {"id": 2}, [20], person(None, "222")))  # option off
    assert {r.id: r.email for r in customers.rows().collect()}[2] is None


def _last_merge(silver: Silver) -> dict[str, str]:
    """The ``operationMetrics`` of silver's newest MERGE."""
    history = DeltaTable.forPath(silver.spark, silver.layout.silver_path).history(5)
    merges = history.where(F.col("operation") == "MERGE").orderBy(F.col("version").desc())
    newest = merges.first()
    assert newest is not None, "no MERGE in silver's history"
    return dict(newest["operationMetrics"])


def test_silver_switches_to_deletion_vectors_as_it_grows(customers: Silver) -> None:
    """Below ``deletion_vectors_from_mib`` silver's MERGEs rewrite the files they change;
    at it, they mark the changed rows in deletion vectors; back to rewriting only below
    half of it. Silver holds the same rows either way."""
    from cdc_merger.write_mode import DELETION_VECTORS, WriteMode

    path = customers.layout.silver_path
    customers.apply(*[customers.event("c", {"id": i}, [i], customer(f"n{i}")) for i in range(50)])
    mode = WriteMode(customers.spark, path, from_mib=1.0)  # silver: a few KiB
    mode.open()
    assert table_properties(customers.spark, path)[DELETION_VECTORS] == "false"
    customers.apply(customers.event("u", {"id": 3}, [103], customer("rewritten")))
    rewrite = _last_merge(customers)
    assert rewrite["numTargetDeletionVectorsAdded"] == "0", rewrite
    assert int(rewrite["numTargetFilesRemoved"]) >= 1, rewrite

    def size() -> int:
        detail = customers.spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
        assert detail is not None
        return int(detail["sizeInBytes"])

    mode.from_bytes = size()  # silver has reached the size
    mode.check()
    assert table_properties(customers.spark, path)[DELETION_VECTORS] == "true"
    customers.apply(customers.event("u", {"id": 4}, [104], customer("marked")))
    marked = _last_merge(customers)
    assert int(marked["numTargetDeletionVectorsAdded"]) >= 1, marked
    assert marked["numTargetFilesRemoved"] == "0", marked

    mode.from_bytes = size() * 3 // 2  # above silver, not twice it: deletion vectors stay
    mode.check()
    assert table_properties(customers.spark, path)[DELETION_VECTORS] == "true"
    mode.from_bytes = 2 * size() + 2  # silver is under half of it: rewriting again
    mode.check()
    assert table_properties(customers.spark, path)[DELETION_VECTORS] == "false"
    expected = {i: f"n{i}" for i in range(50)} | {3: "rewritten", 4: "marked"}
    assert names(customers) == expected


@pytest.mark.parametrize("history", [False, True])
def test_an_empty_batch_applies_nothing(spark: SparkSession, tmp_path: Path, history: bool) -> None:
    """A micro-batch without rows (a stream's first, over a bronze made but not written
    yet): adaptive execution proves its input empty and runs none of its plan, so Spark
    collects none of the batch's observed metrics. The batch applies nothing and fails
    nothing, with the history's every-delete grouping too."""
    kept = HistoryConfig(enabled=True) if history else None
    silver = Silver(spark, tmp_path, CUSTOMERS, history=kept)
    result = silver.apply_frame(spark.createDataFrame([], silver.bronze_schema))
    assert (result.events, result.keys, result.rejected, result.deletes) == (0, 0, 0, 0)
    assert silver.rows().count() == 0


def test_events_rejected_again_after_a_crash_before_the_merge_are_quarantined_once(
    spark: SparkSession,
    make_pipeline: Any,
    customers: Silver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table's write quarantines its rejected events, then dies before silver's MERGE
    (which records how far the table is merged): the next write reads those events
    again, with more, up to a later bronze version (a new ``txnVersion`` of the
    quarantine's append). The quarantine still holds each rejected event once, and silver
    the rest."""
    from cdc_merger import apply as apply_module
    from cdc_merger.merging import TableMerge, ensure_quarantine
    from support.dying import Killed, dying_before

    pipeline = make_pipeline(entities=("customers",))
    config = pipeline.config
    entity = config.entity("customers")
    first = [
        customers.event("x", {"id": 1}, [10], customer("unknown op")),
        customers.event("c", {"id": 2}, [10], customer("kept")),
        customers.event("c", None, [11], customer("no key")),
    ]
    then = [
        customers.event("c", {"id": 3}, [12], customer("kept too")),
        customers.event("x", {"id": 4}, [13], customer("unknown op too")),
    ]
    reached = write_bronze(spark, config.layout.bronze(), "customers", customers, first)
    ensure_quarantine(spark, config)  # as the merger's start
    merge = TableMerge(spark, config, entity, announce=lambda _entity: None)
    merge.typed_as(read_payload_types(spark, config.layout.bronze())["customers"])
    monkeypatch.setattr(apply_module, "_write_silver", dying_before(apply_module._write_silver))
    with pytest.raises(Killed):
        merge.write(spark, reached)
    monkeypatch.undo()
    quarantine = config.layout.quarantine("merger")
    assert spark.read.format("delta").load(quarantine).count() == 2  # then the crash

    later = write_bronze(spark, config.layout.bronze(), "customers", customers, then)
    restarted = TableMerge(spark, config, entity, announce=lambda _entity: None)  # progress -1
    restarted.typed_as(read_payload_types(spark, config.layout.bronze())["customers"])
    restarted.write(spark, later)
    quarantined = spark.read.format("delta").load(quarantine).collect()
    assert sorted(r.kafka_offset for r in quarantined) == [
        first[0]["kafka_offset"],
        first[2]["kafka_offset"],
        then[1]["kafka_offset"],
    ]
    assert {r.batch_id for r in quarantined} == {reached, later}  # the version reached
    assert {r.source_table for r in quarantined} == {"bronze"}
    silver = spark.read.format("delta").load(config.layout.silver("customers")).collect()
    assert sorted((r.id, r.first_name) for r in silver) == [(2, "kept"), (3, "kept too")]


def write_bronze(
    spark: SparkSession, path: str, entity: str, silver: Silver, events: list[dict[str, Any]]
) -> int:
    """``events`` (typed as ``silver``'s bronze rows) appended to the one bronze as the
    ingestor writes them: its shared columns, the rest in the VARIANT payload, the
    payload's type a table property. The version the append made."""
    typed_rows = spark.createDataFrame(events, silver.bronze_schema)
    payload = [f for f in silver.bronze_schema.fields if f.name not in bronze.SHARED_COLUMNS]
    rows = typed_rows.select(
        F.lit(entity).alias(bronze.ENTITY),
        *bronze.SHARED_COLUMNS,
        F.to_variant_object(F.struct(*[f.name for f in payload])).alias(bronze.PAYLOAD),
    ).select(*bronze.SCHEMA.fieldNames())
    ensure_table(spark, path, bronze.SCHEMA, bronze.PROPERTIES, [bronze.ENTITY])
    kind = json.dumps(T.StructType(payload).jsonValue())
    setting = f"'{bronze.TYPE_PROPERTY}{entity}' = '{kind}'"
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({setting})")
    rows.write.format("delta").mode("append").save(path)
    return delta_version(spark, path)
