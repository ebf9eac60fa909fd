"""How far each topic is written: a bronze commit's record, and where a batch ends."""

from __future__ import annotations

import json

from cdc_ingestor.positions import batch_ends, commit_metadata
from cdc_shared.contracts.layout import INGESTOR_COMMIT_KEY
from support.checkpoint_files import Files

CHECKPOINT = "/data/_streams/ingestor/default"


def test_a_bronze_commit_records_the_group_its_topics_positions_and_held_tables() -> None:
    positions = {"db.orders": {"0": 12, "1": 7}, "db.customers": {"0": 3}}
    held = {"customers": "stopped: its writer schema cannot be resolved"}
    recorded = json.loads(commit_metadata("default", positions, held))
    assert recorded == {
        INGESTOR_COMMIT_KEY: {"group": "default", "positions": positions, "held": held},
    }
    assert json.loads(commit_metadata("hot", {}, {}))[INGESTOR_COMMIT_KEY]["held"] == {}


def test_where_a_batch_ends_is_its_planned_offsets_by_topic_and_partition() -> None:
    offsets = {"db.orders": {"0": 12, "1": 7}, "db.customers": {"0": 3}}
    text = "v1\n" + json.dumps({"batchWatermarkMs": 0}) + "\n" + json.dumps(offsets)
    files = Files({f"{CHECKPOINT}/offsets/4": text})
    assert batch_ends(files, CHECKPOINT, 4) == offsets
    assert batch_ends(files, CHECKPOINT, 5) == {}  # not planned: no positions
