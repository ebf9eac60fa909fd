"""Records of a writer schema the reader cannot resolve: the error that stops the entity.

docs/design.md: an incompatible change stops the affected entity with a clear error, or
with ``ingestor.on_incompatible_schema: quarantine`` its records go to quarantine, with
an error line per batch.
"""

from __future__ import annotations

import logging
from typing import Any

from cdc_shared.config.entities import EntityConfig
from cdc_shared.contracts.layout import INGESTOR

log = logging.getLogger("cdc_ingestor")


def _reasons(rejected: list[Any]) -> list[str]:
    """Why each incompatible writer schema among the rejected records cannot be read."""
    return sorted({r.error_message for r in rejected if r.error_kind == "incompatible_schema"})


def incompatible_stop(entity: EntityConfig, count: int, rejected: list[Any]) -> str:
    """The one line an operator reads when the entity stops for an incompatible schema."""
    reasons = _reasons(rejected)
    return (
        f"stopped: {count} record(s) of topic {entity.source_topic!r} were written "
        f"with a schema the reader cannot resolve ({'; '.join(reasons[:3])}). Nothing of "
        "the table's batch was written; the table is held from its first record of that "
        "batch while the others go on. Deploy a reader schema that resolves it (or fix the "
        "producer), or set ingestor.on_incompatible_schema: quarantine to set such "
        "records aside, then restart"
    )


def log_incompatible(entity: EntityConfig, batch_id: int, count: int, rejected: list[Any]) -> None:
    """One error line per batch that quarantined records of an incompatible schema."""
    log.error(
        "records written with a schema incompatible with the reader went to quarantine",
        extra={
            "service": INGESTOR,
            "entity": entity.name,
            "batch_id": batch_id,
            "incompatible_schema": count,
            "reasons": _reasons(rejected) or "see quarantine/ingestor",
        },
    )
