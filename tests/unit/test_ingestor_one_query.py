"""Where the ingestor's one query starts: carried on from the per-entity streams' checkpoints."""

from __future__ import annotations

import json

import pytest
from cdc_ingestor.failures import kafka_failures
from cdc_ingestor.ingestion import refuse_per_entity_after_one_query
from cdc_ingestor.one_query import (
    EARLIEST,
    LATEST,
    IngestedEnds,
    new_checkpoint_start,
    refuse_unfinished_per_entity_batches,
    start_file,
    starting_offsets,
)
from cdc_shared.config import ConfigError, EntityConfig, PipelineConfig
from cdc_shared.layout import ALL_ENTITIES, INGESTOR
from cdc_shared.stream_checkpoint import HELD_FILE
from support.checkpoint_files import Files

ROOT = "/data"


def _config(one_query: bool = True, starting: str = "earliest") -> PipelineConfig:
    return PipelineConfig(
        storage_root=ROOT,
        entities=[
            EntityConfig(name="customers", source_topic="db.customers", key=["id"]),
            EntityConfig(name="orders", source_topic="db.orders", key=["id"]),
        ],
        ingestor={"one_query": one_query, "starting_offsets": starting},
    )


def _batch(checkpoint: str, batch_id: int, offsets: dict[str, object], committed: bool) -> dict:
    text = "v1\n{}\n" + json.dumps(offsets)
    files = {f"{checkpoint}/offsets/{batch_id}": text}
    if committed:
        files[f"{checkpoint}/commits/{batch_id}"] = "v1\n{}"
    return files


def _partitions(_config: PipelineConfig, topics: list[str]) -> dict[str, list[int]]:
    return {topic: [0, 1, 2] for topic in topics}


def test_the_one_query_starts_where_each_entity_stream_committed() -> None:
    config = _config()
    customers = config.layout.checkpoint(INGESTOR, "customers")
    files = Files(
        {
            **_batch(customers, 3, {"db.customers": {"0": 10, "1": 20}}, committed=True),
            **_batch(customers, 4, {"db.customers": {"0": 15, "1": 25}}, committed=True),
        }
    )
    start = json.loads(starting_offsets(config, ["db.customers", "db.orders"], files, _partitions))
    # customers from its last committed batch (a partition it never saw: from the start);
    # orders, without a checkpoint, where ingestor.starting_offsets says.
    assert start == {
        "db.customers": {"0": 15, "1": 25, "2": EARLIEST},
        "db.orders": {"0": EARLIEST, "1": EARLIEST, "2": EARLIEST},
    }
    latest = _config(starting="latest")
    start = json.loads(starting_offsets(latest, ["db.customers", "db.orders"], files, _partitions))
    assert start["db.orders"] == {"0": LATEST, "1": LATEST, "2": LATEST}
    assert start["db.customers"]["2"] == EARLIEST


def test_without_per_entity_checkpoints_the_setting_is_used_as_it_is() -> None:
    config = _config(starting="latest")
    assert starting_offsets(config, ["db.customers"], Files({}), _partitions) == "latest"


def test_per_entity_streams_after_the_one_query_are_refused() -> None:
    config = _config(one_query=False)
    group = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    refuse_per_entity_after_one_query(config, Files({}))  # never ran as one query: fine
    files = Files(_batch(group, 0, {"db.customers": {"0": 1}}, committed=False))
    with pytest.raises(ConfigError, match=r"ingestor\.one_query is off"):
        refuse_per_entity_after_one_query(config, files)


def test_the_checkpoint_of_every_entity_is_the_one_query_s() -> None:
    config = _config()
    assert config.checkpoint_path(INGESTOR, "orders") == f"{ROOT}/_checkpoints/ingestor/_all"
    assert config.checkpoint_path("merger", "orders") == f"{ROOT}/_checkpoints/merger/orders"
    per_entity = _config(one_query=False)
    assert per_entity.checkpoint_path(INGESTOR, "orders").endswith("/ingestor/orders")


def test_a_per_entity_batch_planned_but_not_committed_must_finish_first() -> None:
    config = _config()
    orders = config.layout.checkpoint(INGESTOR, "orders")
    files = Files(
        {
            **_batch(orders, 0, {"db.orders": {"0": 5}}, committed=True),
            **_batch(orders, 1, {"db.orders": {"0": 9}}, committed=False),
        }
    )
    with pytest.raises(ConfigError, match="'orders' planned batch 1 but did not commit it"):
        refuse_unfinished_per_entity_batches(config, files)
    del files.files[f"{orders}/offsets/1"]
    refuse_unfinished_per_entity_batches(config, files)  # every planned batch committed
    group = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    files.files.update(_batch(group, 0, {"db.orders": {"0": 9}}, committed=True))
    files.files.update(_batch(orders, 1, {"db.orders": {"0": 9}}, committed=False))
    refuse_unfinished_per_entity_batches(config, files)  # the one query has its own start


def _entities(*topics: str) -> list[EntityConfig]:
    return [EntityConfig(name=t.split(".")[1], source_topic=t, key=["id"]) for t in topics]


def _nothing_ingested(_entity: EntityConfig) -> dict[str, int] | None:
    return None


def test_a_topic_no_longer_read_starts_a_new_checkpoint_where_the_old_stood() -> None:
    config = _config()
    group = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    read = {"db.customers": {"0": 7, "1": 8}, "db.orders": {"0": 3}}
    files = Files(_batch(group, 4, read, committed=True))

    def carry(*topics: str, ingested: IngestedEnds = _nothing_ingested) -> object:
        return new_checkpoint_start(config, _entities(*topics), files, ingested, _partitions)

    assert carry("db.customers", "db.orders") is None  # the checkpoint goes on
    assert carry("db.customers", "db.orders", "db.new") is None  # Spark reads a new topic
    # customers taken out, a new table added: the others from where the query committed
    # (every partition named: Spark requires it), the new one from its start.
    assert carry("db.orders", "db.new") == {
        "db.orders": {"0": 3, "1": EARLIEST, "2": EARLIEST},
        "db.new": {"0": EARLIEST, "1": EARLIEST, "2": EARLIEST},
    }
    # A table the query holds back: from where it was held (its records since unwritten).
    held = {"orders": {"position": {"0": 1}, "batch_id": 3, "query_id": "q", "reason": "r"}}
    files.files[f"{group}/{HELD_FILE}"] = json.dumps(held)
    assert carry("db.orders") == {"db.orders": {"0": 1, "1": EARLIEST, "2": EARLIEST}}
    # The batch after the last committed one failed. Read whole before any write, it was
    # written by none when a topic was refused: the others from where the query committed.
    del files.files[f"{group}/{HELD_FILE}"]
    files.files.update(_batch(group, 5, {**read, "db.orders": {"0": 9}}, committed=False))
    assert carry("db.orders") == {"db.orders": {"0": 3, "1": EARLIEST, "2": EARLIEST}}

    def wrote_batch_5(entity: EntityConfig) -> dict[str, int] | None:
        return {"0": 6} if entity.name == "orders" else {"0": 2}

    # Written by a table (it failed later): its quarantine may lack it, so finish it first.
    with pytest.raises(ConfigError, match=r"is in bronze for table\(s\) \['orders'\] already"):
        carry("db.orders", ingested=wrote_batch_5)
    # Its first batch uncommitted: from where Spark's Kafka source started.
    first = Files(_batch(group, 0, read, committed=False))
    with pytest.raises(ConfigError, match="does not say where it started"):
        new_checkpoint_start(config, _entities("db.orders"), first, _nothing_ingested, _partitions)
    first.files[f"{group}/sources/0/0"] = '\x00v1\n{"db.customers":{"0":2},"db.orders":{"0":1}}'
    start = new_checkpoint_start(
        config, _entities("db.orders"), first, _nothing_ingested, _partitions
    )
    assert start == {"db.orders": {"0": 1, "1": EARLIEST, "2": EARLIEST}}


def test_a_table_put_back_starts_where_its_records_end_or_where_it_was_held() -> None:
    config = _config()
    group = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    files = Files(_batch(group, 2, {"db.orders": {"0": 3}}, committed=True))

    def ingested(entity: EntityConfig) -> dict[str, int] | None:
        return {"0": 40, "2": 12} if entity.name == "customers" else None

    both = _entities("db.customers", "db.orders")
    # customers where its records end (a partition without any: from its start).
    assert new_checkpoint_start(config, both, files, ingested, _partitions) == {
        "db.customers": {"0": 40, "1": EARLIEST, "2": 12},
        "db.orders": {"0": 3, "1": EARLIEST, "2": EARLIEST},
    }
    # Held while its topic was not read (the broker refused it): where it was held.
    held = {"customers": {"position": {"0": 41, "1": 0, "2": 12}, "batch_id": 1, "query_id": "q"}}
    files.files[f"{group}/{HELD_FILE}"] = json.dumps({**held, "orders": {"position": {"0": 2}}})
    assert new_checkpoint_start(config, both, files, ingested, _partitions) == {
        "db.customers": {"0": 41, "1": 0, "2": 12},
        "db.orders": {"0": 2, "1": EARLIEST, "2": EARLIEST},
    }


def test_a_new_checkpoint_carried_over_starts_where_its_start_file_says() -> None:
    config = _config(starting="latest")
    group = config.layout.checkpoint(INGESTOR, ALL_ENTITIES)
    customers = config.layout.checkpoint(INGESTOR, "customers")
    files = Files(_batch(customers, 3, {"db.customers": {"0": 10}}, committed=True))
    files.files[start_file(group)] = json.dumps({"db.customers": {"0": 4, "1": 5}})
    start = json.loads(starting_offsets(config, ["db.customers", "db.orders"], files, _partitions))
    # It outranks the per-entity checkpoints and the setting; what it does not name, from
    # the start.
    assert start == {
        "db.customers": {"0": 4, "1": 5, "2": EARLIEST},
        "db.orders": {"0": EARLIEST, "1": EARLIEST, "2": EARLIEST},
    }
    files.files.update(_batch(group, 0, {"db.customers": {"0": 6}}, committed=False))
    # Once the new checkpoint planned a batch, Spark keeps its start: the file is not read.
    after = json.loads(starting_offsets(config, ["db.customers"], files, _partitions))
    assert after == {"db.customers": {"0": 10, "1": EARLIEST, "2": EARLIEST}}


def test_a_failure_of_the_one_query_names_the_topic_it_is_about() -> None:
    read = kafka_failures(_config())
    lost = (
        "org.apache.spark.SparkException: [KAFKA_DATA_LOSS] Some data may have been lost "
        "because they are not available in Kafka any more; partitions db.orders-2 ..."
    )
    failure = read(ALL_ENTITIES, lost)
    assert failure is not None
    assert "topic 'db.orders' partition(s) 2" in failure.message
    assert "restarts every table" in failure.message  # and how to start where it stood
    refused = (
        "org.apache.kafka.common.errors.TopicAuthorizationException: "
        "Not authorized to access topics: [db.customers]"
    )
    failure = read(ALL_ENTITIES, refused)
    assert failure is not None
    assert "db.customers" in failure.message and "db.orders" not in failure.message
    assert failure.entity_only and failure.table == "customers"  # held, the others go on
    per_entity = kafka_failures(_config(one_query=False))(  # a table's own stream
        "orders", lost
    )
    assert per_entity is not None and "restarts every table" not in per_entity.message
