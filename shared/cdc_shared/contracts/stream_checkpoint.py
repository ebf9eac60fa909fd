"""Reading a Structured Streaming checkpoint: which batch it committed, at which offsets.

A checkpoint records, per micro-batch ``n``, the end offsets of its sources in
``offsets/<n>`` and marks the batch done with ``commits/<n>``; the offsets of the last
committed batch are where the stream resumes. ``cdc status`` and ``cdc maintenance``
read them to tell how far a stream got; the services read them to start a new query
where an older one (of a group, or of a release's per-entity streams) ended. Files are read
through a :class:`CheckpointFiles` (``cdc_shared.jvm.bridge.HadoopFiles``: Spark's Hadoop file
systems, so local paths and object storage alike; the CLI's own without a JVM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class CommittedBatch:
    """The last micro-batch a stream committed, and its sources' end offsets (parsed JSON)."""

    batch_id: int
    sources: tuple[Any, ...]


class CheckpointFiles(Protocol):
    """Read access to the files of a checkpoint (paths as configured)."""

    def list_names(self, path: str) -> list[str] | None:
        """Names of the entries in the folder ``path``; None when it does not exist."""
        ...

    def read_text_if_exists(self, path: str) -> str | None:
        """The file ``path`` as UTF-8 text; None when there is no such file."""
        ...


def last_committed_batch(files: CheckpointFiles, checkpoint: str) -> CommittedBatch | None:
    """The last committed batch of the stream checkpointed at ``checkpoint``; None if none.

    A batch planned but not committed (``offsets/<n>`` without ``commits/<n>``) is run again
    from the previous batch's end on restart, so it is ignored here.
    """
    folder = checkpoint.rstrip("/")
    commits = files.list_names(f"{folder}/commits")
    done = [int(name) for name in commits or [] if name.isdigit()]
    if not done:
        return None
    batch_id = max(done)
    text = files.read_text_if_exists(f"{folder}/offsets/{batch_id}")
    if text is None:
        raise FileNotFoundError(
            f"the stream checkpoint {checkpoint} committed batch {batch_id} but has no "
            f"offsets/{batch_id}: the checkpoint is damaged; restore it or rebuild the stream"
        )
    return CommittedBatch(batch_id, parse_offsets(text))


def start_file(checkpoint: str) -> str:
    """Where a one query's new checkpoint starts each table, beside it.

    ``<checkpoint>.start.json``: written before the old checkpoint is moved aside
    (``jvm_bridge.move_aside``), read while the new one has not recorded its start, then
    deleted; a kill between the move and the new query's start loses no table's place.
    """
    return f"{checkpoint.rstrip('/')}.start.json"


def kafka_initial_offsets(files: CheckpointFiles, checkpoint: str) -> dict[str, Any] | None:
    """Where the Kafka source of the query at ``checkpoint`` started (``sources/0/0``).

    Spark's Kafka source writes its first offsets, resolved, there before it plans its
    first batch: a zero byte, a version line, then the offsets' JSON. None when absent.
    """
    text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/sources/0/0")
    lines = [line for line in (text or "").replace("\x00", "").splitlines() if line.strip()]
    return dict(json.loads(lines[-1])) if len(lines) > 1 else None


def planned_batches(files: CheckpointFiles, checkpoint: str) -> list[int]:
    """The batch ids the stream at ``checkpoint`` planned (``offsets/<n>``), in order."""
    names = files.list_names(f"{checkpoint.rstrip('/')}/offsets")
    return sorted(int(name) for name in names or [] if name.isdigit())


def parse_offsets(text: str) -> tuple[Any, ...]:
    """The sources' end offsets in an ``offsets/<n>`` file (None for a source without one).

    Line 1 is the format version, line 2 the batch metadata, then one line per source.
    """
    lines = text.splitlines()
    return tuple(None if line.strip() == "-" else json.loads(line) for line in lines[2:])


#: The file in the checkpoint of a query over many Delta tables
#: (``cdc_shared.streaming.delta_union``) listing its tables in the order of its sources,
#: and where each one's stream started:
#: ``{"entities": [...], "starting_versions": {entity: version | null}}``.
SOURCES_FILE = "cdc_sources.json"


def recorded_sources(files: CheckpointFiles, checkpoint: str) -> dict[str, Any] | None:
    """The :data:`SOURCES_FILE` of ``checkpoint``; None when it has none."""
    text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/{SOURCES_FILE}")
    return None if text is None else dict(json.loads(text))


def entity_source(
    batch: CommittedBatch, files: CheckpointFiles, checkpoint: str, entity: str
) -> Any:
    """``entity``'s source offset in ``batch`` of the stream at ``checkpoint`` (None: not read).

    A query over one entity has one source; a query over many lists them in
    :data:`SOURCES_FILE`.
    """
    recorded = recorded_sources(files, checkpoint)
    if recorded is None:
        return batch.sources[0] if batch.sources else None
    entities = list(recorded["entities"])
    if entity not in entities or entities.index(entity) >= len(batch.sources):
        return None
    return batch.sources[entities.index(entity)]


#: The file in a one query's checkpoint naming the tables it holds back
#: (``cdc_shared.streaming.held``):
#: ``{entity: {"position": ..., "batch_id": n, "query_id": id, "reason": text}}``.
HELD_FILE = "cdc_held.json"


def held_tables(files: CheckpointFiles, checkpoint: str) -> dict[str, dict[str, Any]]:
    """The tables the one query at ``checkpoint`` holds back (:data:`HELD_FILE`), by entity."""
    text = files.read_text_if_exists(f"{checkpoint.rstrip('/')}/{HELD_FILE}")
    return dict(json.loads(text)) if text else {}
