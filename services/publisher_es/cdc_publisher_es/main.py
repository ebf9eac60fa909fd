"""``cdc-publisher-es``: silver Change Data Feed -> one Elasticsearch index per entity.

Per entity (or all entities in one query, ``publisher_es.one_query``): silver's CDF
as a stream (source) -> one action per change, id = primary key,
``version_type=external`` with a version that grows per key (transform) -> bulk writes
with retries, permanent failures to ``quarantine/publisher_es`` (sink). A micro-batch
returns, and so is committed to the checkpoint, only once each of its documents is
applied or quarantined; a replayed batch is harmless, since Elasticsearch refuses
versions it already holds (409, counted as applied).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
from cdc_shared.changefeed import LatestVersion, change_feed, shape_changes
from cdc_shared.clients import make_elasticsearch
from cdc_shared.config import PipelineConfig
from cdc_shared.layout import PUBLISHER_ES, StorageLayout
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    EntityStreamBase,
    StreamRunner,
    StreamService,
    rebuilding_on_schema_change,
    start_service,
)
from cdc_shared.streaming.delta_union import delta_tables_group
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    QuarantineRecord,
    app_id,
    ensure_table,
    idempotent_append,
    quarantine_frame,
    wait_for_table,
)
from prometheus_client import Histogram
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from cdc_publisher_es.bulk import AliasMissingError, BulkOutcome, BulkWriter, Failure, Scrubber
from cdc_publisher_es.documents import Action, arrow_actions, document_frame
from cdc_publisher_es.index_lifecycle import IndexLifecycle, recognising_lost_index

SERVICE = PUBLISHER_ES
#: Silver file bytes per micro-batch when ``max_bytes_per_trigger`` is not set.
DEFAULT_MAX_BYTES_PER_TRIGGER = "64m"
#: ``batch_id`` of quarantine rows refused while rebuilding a lost index at start.
REBUILD_BATCH_ID = -1
log = logging.getLogger("cdc_publisher_es")

PUBLISH_DELAY = Histogram(
    "cdc_publish_delay_seconds",
    "From a silver commit to Elasticsearch acknowledging its changes (oldest change of a "
    "bulk window; searchable after the next refresh)",
    ["service", "entity"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
)


class EntityPublisher(EntityStreamBase):
    """One entity's stream: ``silver/<entity>`` CDF into its Elasticsearch alias."""

    def __post_init__(self) -> None:
        self.settings = self.config.publisher_es
        self.alias = self.entity.es_index_name
        self.silver_path = self.config.layout.silver(self.entity.name)
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        es_config = self.config.elasticsearch
        self.scrub = Scrubber(
            s.get_secret_value() for s in (es_config.api_key, es_config.password) if s is not None
        )
        es = make_elasticsearch(es_config)
        self.index = IndexLifecycle(
            self.spark, self.config, self.entity, es, self.set_problem, self.scrub
        )
        self.latest_version = LatestVersion(self.spark, self.silver_path)
        self.bulk = BulkWriter(
            es, self.alias, self.settings, on_problem=self.set_problem, scrub=self.scrub
        )

    # --- start-up ------------------------------------------------------------------

    def prepare(self, wait_s: float) -> None:
        """Wait for silver, create quarantine, and the index behind the alias.

        A lost index is rebuilt from silver (or refused); see ``index_lifecycle``.
        """
        hint = f"start the merger for entity {self.entity.name!r} first"
        wait_for_table(self.spark, self.silver_path, wait_s, hint, log)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)
        schema = self.spark.read.format("delta").load(self.silver_path).schema
        rebuilt = self.index.prepare(schema)
        if rebuilt is not None and rebuilt.failures:
            # Written once per silver version rebuilt from, whatever the checkpoint.
            rebuild_app = app_id(SERVICE, self.entity.name, f"rebuild-{self.alias}")
            self._quarantine(
                rebuilt.failures, REBUILD_BATCH_ID, (rebuild_app, rebuilt.silver_version)
            )

    # --- the stream ----------------------------------------------------------------

    def source(self) -> DataFrame:
        """Silver's Change Data Feed as a stream, from the configured start."""
        return self.stream_from(None)

    def stream_from(self, version: int | None) -> DataFrame:
        """Silver's Change Data Feed from ``version`` (None: the configured start).

        A micro-batch is collected in the driver (as Arrow), so unless
        ``max_bytes_per_trigger`` is set it is bounded by ``DEFAULT_MAX_BYTES_PER_TRIGGER``.
        """
        settings = self.settings
        if settings.max_bytes_per_trigger is None:
            settings = settings.model_copy(
                update={"max_bytes_per_trigger": DEFAULT_MAX_BYTES_PER_TRIGGER}
            )
        return change_feed(self.spark, self.silver_path, settings, version)

    def first_start(self) -> int | None:
        """A new stream starts where configured (``publisher_es.starting_version``, ...)."""
        return None

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Index the batch; return only when each document is applied or quarantined."""
        started = time.monotonic()
        key = list(self.entity.key)
        documents = document_frame(shape_changes(batch, key), key, self.settings).toArrow()
        with ThreadPoolExecutor(1, thread_name_prefix=f"publish-{self.entity.name}") as pool:
            indexing = pool.submit(self._index, batch.schema, documents)
            # For the lag; a Spark job at most every 10 s, run while the documents are sent.
            latest_version = self.latest_version.get()
            outcome, failures = indexing.result()
        if failures:
            self._quarantine(failures, batch_id)
        self._report_batch(batch_id, outcome, len(failures), latest_version, started)

    def _index(
        self, silver_schema: T.StructType, documents: pa.Table
    ) -> tuple[BulkOutcome, list[Failure]]:
        """Write the batch's documents: the outcome, and every document refused for good.

        If the index is lost meanwhile, it is restored (rebuilt from silver) and the whole
        batch written again: what went into the lost index went with it.
        """
        refused_by_rebuild: list[Failure] = []
        while True:
            unaddressable: list[Failure] = []
            try:
                self.index.cover(silver_schema)  # schema evolution: map new columns first
                outcome = self.bulk.write(self._actions(documents, unaddressable))
            except AliasMissingError:
                rebuilt = self.index.restore()
                refused_by_rebuild += rebuilt.failures if rebuilt is not None else []
                continue
            return outcome, refused_by_rebuild + unaddressable + outcome.failures

    def _report_batch(
        self,
        batch_id: int,
        outcome: BulkOutcome,
        quarantined: int,
        latest_version: int,
        started: float,
    ) -> None:
        extra: dict[str, Any] = {}
        if outcome.total:
            PUBLISH_DELAY.labels(SERVICE, self.entity.name).observe(outcome.oldest_commit_delay_s)
        if outcome.newest_commit_version is not None:
            # The Delta source reports no latest offset: lag = silver versions not yet read.
            extra["lag"] = max(0, latest_version - outcome.newest_commit_version)
        self.report(
            batch_id,
            BatchStats(
                counts={
                    "indexed": outcome.indexed,
                    "deleted": outcome.deleted,
                    "already_applied": outcome.already_applied,
                    "superseded": outcome.superseded,
                    "quarantined": quarantined,
                    "retried": outcome.retried,
                },
                extra={
                    "bulk_ms": int((time.monotonic() - started) * 1000),
                    "publish_delay_ms": int(outcome.oldest_commit_delay_s * 1000),
                    **extra,
                },
            ),
        )

    @staticmethod
    def _actions(documents: pa.Table, unaddressable: list[Failure]) -> Iterator[Action]:
        """The batch's actions, from its documents collected as Arrow.

        One Spark job, no row pickling.
        """

        def no_id(action: Action) -> None:
            unaddressable.append(Failure(action, 0, "null_key", "a primary key column is null"))

        return arrow_actions(documents, no_id)

    def _quarantine(
        self, failures: list[Failure], batch_id: int, txn: tuple[str, int] | None = None
    ) -> None:
        """Append the refused documents to quarantine, once per ``txn`` (app id, version).

        By default ``txn`` is the stream's (query id, batch id): a replayed batch writes its
        rows once.
        """
        records = [
            QuarantineRecord(
                SERVICE,
                self.entity.name,
                f.kind,
                f"document {f.action.doc_id!r} (version {f.action.version}): {f.reason}",
                batch_id,
                raw_key=f.action.doc_id.encode(),
                raw_value=f.action.source.encode() if f.action.source is not None else None,
                source_table=self.silver_path,
                source_version=f.action.commit_version,
            )
            for f in failures
        ]
        frame = quarantine_frame(self.spark, records)
        app, version = txn or (app_id(SERVICE, self.entity.name, self.identity.get()), batch_id)
        idempotent_append(frame, self.quarantine_path, app, version)
        log.warning(
            "documents quarantined",
            extra={
                "entity": self.entity.name,
                "batch_id": batch_id,
                "count": len(failures),
                "first_reason": failures[0].reason,
            },
        )


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Create the indexes and quarantine, start the streams; ``run()`` the result.

    One stream per entity, or one query for all of them (``publisher_es.one_query``).
    """
    publisher_es = StreamService(
        SERVICE,
        config.publisher_es,
        EntityPublisher,
        lag=None,  # silver versions not yet published: each batch reports it
        on_failure=recognising_lost_index(rebuilding_on_schema_change("silver")),
        open_group=open_all_tables if config.publisher_es.one_query else None,
    )
    return start_service(publisher_es, config, entity_names, once, spark)


#: publisher-es's one stream over every entity's change feed (an ``OpenGroup``). Replays
#: are harmless (Elasticsearch refuses a version it holds), so each table starts at the
#: silver version its previous stream had reached.
open_all_tables = delta_tables_group(SERVICE, EntityPublisher, StorageLayout.silver)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-publisher-es``."""
    return service_main(SERVICE, "silver Delta change feeds -> Elasticsearch indexes.", start, argv)


if __name__ == "__main__":
    sys.exit(main())
