"""publisher-kafka's progress: what a change topic's last transaction published.

Committed as the progress group's offset metadata (JSON) inside the same Kafka
transaction as the events (``cdc_publisher_kafka.transactions``): the last silver
version published, the query and batch that published it, and the last offset written
to each partition of the change topic (which finds a topic deleted and made again).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

#: The consumer offset metadata a broker keeps by default (``offset.metadata.max.bytes``),
#: less a margin: a progress longer than this is recorded without its offsets.
_METADATA_MAX_CHARS = 3500


@dataclass(frozen=True)
class Progress:
    """What the last committed transaction published: up to ``version``, by which batch.

    ``offsets``: the last offset written to each partition of the change topic, so far
    (None when a publisher that did not record them wrote the progress).
    """

    version: int
    query_id: str
    batch_id: int
    offsets: Mapping[int, int] | None = None

    def covers(self, query_id: str, batch_id: int) -> bool:
        """Whether batch ``batch_id`` of query ``query_id`` was already published in full."""
        return query_id == self.query_id and batch_id <= self.batch_id

    def metadata(self) -> str:
        """The progress as the committed offset's metadata (JSON)."""
        state: dict[str, object] = {
            "version": self.version,
            "query_id": self.query_id,
            "batch_id": self.batch_id,
        }
        if self.offsets is not None:
            state["offsets"] = {str(p): o for p, o in sorted(self.offsets.items())}
        text = json.dumps(state, separators=(",", ":"))
        if len(text) > _METADATA_MAX_CHARS:  # too many partitions: only the reset check loses
            return self.without_offsets().metadata()
        return text

    def without_offsets(self) -> Progress:
        """The same progress, not saying what the change topic holds."""
        return replace(self, offsets=None)

    @staticmethod
    def from_metadata(text: str) -> Progress:
        """The progress that ``metadata`` wrote."""
        state = json.loads(text)
        offsets = state.get("offsets")
        return Progress(
            int(state["version"]),
            str(state["query_id"]),
            int(state["batch_id"]),
            None if offsets is None else {int(p): int(o) for p, o in offsets.items()},
        )
