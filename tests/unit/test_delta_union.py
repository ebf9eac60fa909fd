"""Where a one query over Delta tables (the merger's, the publishers') starts each table,
how its checkpoint is read back, and that it is never started for some entities only."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from cdc_cli.status import held_note
from cdc_ingestor.main import start as start_ingestor
from cdc_merger.main import start as start_merger
from cdc_publisher_es.main import start as start_publisher_es
from cdc_publisher_kafka.main import start as start_publisher_kafka
from cdc_shared.config import ConfigError, EntityConfig, PipelineConfig
from cdc_shared.layout import (
    ALL_ENTITIES,
    INGESTOR,
    MERGER,
    PUBLISHER_ES,
    PUBLISHER_KAFKA,
    SERVICES,
)
from cdc_shared.stream_checkpoint import (
    HELD_FILE,
    SOURCES_FILE,
    entity_source,
    last_committed_batch,
)
from cdc_shared.streaming.delta_union import carried_positions, position_version
from support.checkpoint_files import Files

CHECKPOINT = f"/data/_checkpoints/{MERGER}/{ALL_ENTITIES}"


def _offset(version: int, index: int = -1, starting: bool = False) -> dict[str, object]:
    return {
        "sourceVersion": 1,
        "reservoirId": "t",
        "reservoirVersion": version,
        "index": index,
        "isStartingVersion": starting,
    }


def _one_query_checkpoint(entities: list[str], offsets: list[object], committed: bool) -> Files:
    lines = "\n".join("-" if o is None else json.dumps(o) for o in offsets)
    files = {
        f"{CHECKPOINT}/{SOURCES_FILE}": json.dumps(
            {"entities": entities, "starting_versions": {e: 0 for e in entities}}
        ),
        f"{CHECKPOINT}/offsets/4": "v1\n{}\n" + lines,
    }
    if committed:
        files[f"{CHECKPOINT}/commits/4"] = "v1\n{}"
    return Files(files)


def test_a_table_carries_on_at_the_version_its_stream_had_reached() -> None:
    assert position_version(_offset(7)) == 7  # version 7 next: read again at worst
    assert position_version(_offset(7, index=3)) == 7  # inside version 7: from its start
    # Still inside its first snapshot (no version resumes it) or never read: the snapshot.
    assert position_version(_offset(7, starting=True)) is None
    assert position_version(None) is None


def test_each_table_of_a_committed_batch_is_carried_by_its_place_among_the_sources() -> None:
    files = _one_query_checkpoint(["a", "b"], [_offset(3), _offset(9, starting=True)], True)
    assert carried_positions(files, CHECKPOINT, ["a", "b"]) == {"a": 3, "b": None}
    # Planned but never committed: the starts recorded for that batch still hold.
    files = _one_query_checkpoint(["a", "b"], [_offset(3), _offset(9)], committed=False)
    assert carried_positions(files, CHECKPOINT, ["a", "b"]) == {"a": 0, "b": 0}


def test_status_reads_each_table_at_its_place_in_the_one_query() -> None:
    files = _one_query_checkpoint(["a", "b"], [_offset(3), _offset(9)], committed=True)
    batch = last_committed_batch(files, CHECKPOINT)
    assert batch is not None
    assert entity_source(batch, files, CHECKPOINT, "b") == _offset(9)
    assert entity_source(batch, files, CHECKPOINT, "c") is None  # not read by the query yet
    # A query over one table has no list: its only source.
    own = Files({"/x/offsets/0": "v1\n{}\n" + json.dumps(_offset(2)), "/x/commits/0": ""})
    batch = last_committed_batch(own, "/x")
    assert batch is not None
    assert entity_source(batch, own, "/x", "a") == _offset(2)


@pytest.mark.parametrize(
    ("service", "start"),
    [
        (INGESTOR, start_ingestor),
        (MERGER, start_merger),
        (PUBLISHER_KAFKA, start_publisher_kafka),
        (PUBLISHER_ES, start_publisher_es),
    ],
)
def test_every_table_resumes_from_the_one_query_checkpoint_and_no_entity_alone(
    service: str, start: Callable[[PipelineConfig, list[str]], object]
) -> None:
    config = PipelineConfig(
        storage_root="/data",
        entities=[EntityConfig(name="customers", source_topic="db.customers", key=["id"])],
        **{service: {"one_query": True}},
    )
    assert config.checkpoint_path(service, "customers") == f"/data/_checkpoints/{service}/_all"
    others = set(SERVICES) - {service}
    assert all(config.checkpoint_path(s, "customers").endswith("/customers") for s in others)
    # Refused before anything is made (no session, no topic, no registry).
    with pytest.raises(ConfigError, match=rf"{service}\.one_query .* leave out --entity"):
        start(config, ["customers"])


def test_cdc_status_says_a_held_table_is_held_rather_than_where_the_query_is() -> None:
    held = {"position": 3, "batch_id": 9, "query_id": "q", "reason": "stopped: refused Write"}
    files = Files({f"{CHECKPOINT}/{HELD_FILE}": json.dumps({"customers": held})})
    assert held_note(files, CHECKPOINT, "orders") is None
    assert held_note(files, CHECKPOINT, "customers") == (
        "held back since batch 9 (taken up at the next start): stopped: refused Write"
    )
