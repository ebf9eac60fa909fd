"""How far each alias is published: a document per alias in a progress index.

publisher-es writes idempotently (external versions: a change sent again is refused as
old), so its progress only has to be safe, never exact: after each table's writes are
all applied, the last silver version published is written to the alias's document in
``publisher_es.progress_index`` (default ``cdc-publisher-es-progress``); a crash before
it publishes those changes again, harmlessly. At start a table reads where to go on
from it. The first start after the releases that kept the position in a stream
checkpoint per entity takes it from there (``legacy_version``).
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import ALL_ENTITIES, PUBLISHER_ES
from cdc_shared.contracts.stream_checkpoint import entity_source, last_committed_batch
from cdc_shared.jvm.bridge import HadoopFiles
from elasticsearch import Elasticsearch, NotFoundError
from pyspark.sql import SparkSession

_MAPPINGS: dict[str, Any] = {
    "dynamic": "strict",
    "properties": {
        "entity": {"type": "keyword"},
        "silver_version": {"type": "long"},
        "updated_at": {"type": "date"},
    },
}


class IndexProgress:
    """The progress documents of one pipeline's aliases."""

    def __init__(self, es: Elasticsearch, index: str) -> None:
        self.es = es
        self.index = index
        self._made = False
        self._making = threading.Lock()  # the tables start side by side

    def _ensure(self) -> None:
        """The progress index, made unless it exists.

        Its creation waits for its shard; one made meanwhile by another publisher may not
        have it up yet, which the callers' wait for Elasticsearch rides out (HTTP 503).
        No cluster health call: the publisher's role has no cluster privilege.
        """
        with self._making:
            if self._made:
                return
            if not self.es.indices.exists(index=self.index):
                try:
                    self.es.indices.create(
                        index=self.index,
                        mappings=_MAPPINGS,
                        settings={"number_of_shards": 1, "auto_expand_replicas": "0-1"},
                    )
                except Exception as error:  # made meanwhile by another publisher: fine
                    if not self.es.indices.exists(index=self.index):
                        raise error from None
            self._made = True

    def read(self, alias: str) -> int | None:
        """The silver version published to ``alias`` (None: no progress recorded)."""
        self._ensure()
        try:
            found = self.es.get(index=self.index, id=alias)
        except NotFoundError:
            return None
        return int(found["_source"]["silver_version"])

    def write(self, alias: str, entity: str, version: int) -> None:
        """Record that ``alias`` holds every change of silver up to ``version``."""
        self._ensure()
        self.es.index(
            index=self.index,
            id=alias,
            document={
                "entity": entity,
                "silver_version": version,
                "updated_at": dt.datetime.now(dt.UTC).isoformat(),
            },
        )


def legacy_version(spark: SparkSession, config: PipelineConfig, entity: str) -> int | None:
    """The silver version the stream of the releases before groups had published up to.

    From the entity's own checkpoint, or their one query's (``_all``); None when neither
    committed a batch. The version itself is published again (harmless: refused as old).
    """
    files = HadoopFiles(spark)
    for name in (entity, ALL_ENTITIES):
        checkpoint = config.layout.legacy_checkpoint(PUBLISHER_ES, name)
        batch = last_committed_batch(files, checkpoint)
        if batch is None:
            continue
        offset = entity_source(batch, files, checkpoint, entity)
        if isinstance(offset, dict) and not offset.get("isStartingVersion", True):
            return int(offset["reservoirVersion"]) - 1
    return None
