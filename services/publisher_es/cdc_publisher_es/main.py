"""``cdc-publisher-es``: silver Change Data Feed -> one Elasticsearch index per entity.

One query per group of tables (``cdc_shared.streaming.publishing``): each table's silver change
feed since its progress (source) -> one action per change, id = primary key,
``version_type=external`` with a version that grows per key (transform) -> bulk writes
with retries, permanent failures to ``quarantine/publisher_es`` (sink). A table's write
ends, and its progress is recorded (``cdc_publisher_es.progress``), only once each of
its documents is applied or quarantined; a write run again is harmless, since
Elasticsearch refuses versions it already holds (409, counted as applied).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import PUBLISHER_ES
from cdc_shared.contracts.quarantine import QuarantineRecord, quarantine_frame
from cdc_shared.streaming.changefeed import change_feed_range, shape_changes
from cdc_shared.streaming.groups import TableGroup
from cdc_shared.streaming.progress import BatchStats
from cdc_shared.streaming.publishing import ChangeFeedGroup
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.runtime import StreamService, start_service
from cdc_shared.streaming.service import service_main
from cdc_shared.streaming.tables import idempotent_append
from delta.tables import DeltaTable
from prometheus_client import Histogram
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_publisher_es.bulk import AliasMissingError, BulkOutcome, BulkWriter, Failure, Scrubber
from cdc_publisher_es.documents import Action, arrow_actions, document_frame
from cdc_publisher_es.index_lifecycle import IndexLifecycle, Rebuilt
from cdc_publisher_es.progress import IndexProgress, legacy_version

SERVICE = PUBLISHER_ES
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


@dataclass(eq=False)
class IndexPublication:
    """One table's publication: ``silver/<entity>``'s changes into its Elasticsearch alias."""

    spark: SparkSession
    config: PipelineConfig
    entity: EntityConfig
    progress_index: IndexProgress
    set_problem: Callable[[str, str | None], None]

    def __post_init__(self) -> None:
        self.settings = self.config.publisher_es
        self.alias = self.entity.es_index_name
        self.silver_path = self.config.layout.silver(self.entity.name)
        self.quarantine_path = self.config.layout.quarantine(SERVICE)
        es_config = self.config.elasticsearch
        self.scrub = Scrubber(
            s.get_secret_value() for s in (es_config.api_key, es_config.password) if s is not None
        )
        es = self.progress_index.es  # one client (and its connection pool) for every table
        self.index = IndexLifecycle(
            self.spark, self.config, self.entity, es, self._problem, self.scrub
        )
        self.bulk = BulkWriter(
            es, self.alias, self.settings, on_problem=self._problem, scrub=self.scrub
        )
        self.published = -1
        self._ready = False

    def _problem(self, problem: str | None) -> None:
        self.set_problem(self.entity.name, problem)

    # --- start-up ------------------------------------------------------------------

    def start(self) -> int:
        """The quarantine, the alias's progress, and the index (once silver exists).

        A lost index is rebuilt from silver (or refused); see ``index_lifecycle``.
        """
        recorded = self.index.until_available(lambda: self.progress_index.read(self.alias))
        if recorded is None:
            recorded = legacy_version(self.spark, self.config, self.entity.name)
        self.published = -1 if recorded is None else recorded
        if DeltaTable.isDeltaTable(self.spark, self.silver_path):
            self._prepare_index()
        return self.published

    def _prepare_index(self) -> None:
        """The index behind the alias, made or adopted (rebuilt when lost)."""
        schema = self.spark.read.format("delta").load(self.silver_path).schema
        rebuilt = self.index.prepare(schema, published=self.published >= 0)
        self._ready = True
        if rebuilt is None:
            return
        self._rebuilt(rebuilt)

    def _rebuilt(self, rebuilt: Rebuilt) -> None:
        """After a rebuild from silver: its refusals quarantined, the progress at its version."""
        if rebuilt.failures:
            # Written once per silver version rebuilt from.
            rebuild_app = f"cdc-{SERVICE}-{self.entity.name}-rebuild-{self.alias}"
            self._quarantine(
                rebuilt.failures, REBUILD_BATCH_ID, (rebuild_app, rebuilt.silver_version)
            )
        self.published = max(self.published, rebuilt.silver_version)
        self._record_progress()

    def _record_progress(self) -> None:
        """The alias's progress document at ``published`` (waits while Elasticsearch is away)."""
        self.index.until_available(
            lambda: self.progress_index.write(self.alias, self.entity.name, self.published)
        )

    def close(self) -> None:
        """Nothing to release (the clients close with the process)."""

    # --- publishing ----------------------------------------------------------------

    def publish(self, spark: SparkSession, since: int, until: int) -> BatchStats:
        """Index silver's changes after ``since`` up to ``until``; then record the progress.

        Returns only when each document is applied or quarantined.
        """
        started = time.monotonic()
        if not self._ready:
            self._prepare_index()
        since = max(since, self.published)
        feed = change_feed_range(spark, self.silver_path, self.settings, since, until)
        outcome, failures = BulkOutcome(), list[Failure]()
        if feed is not None:
            key = list(self.entity.key)
            documents = document_frame(shape_changes(feed, key), key, self.settings).toArrow()
            outcome, failures = self._index(feed.schema, documents)
        if failures:
            self._quarantine(failures, until)
        self.published = max(self.published, until)
        self._record_progress()
        return self._stats(outcome, len(failures), until, started)

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
                if rebuilt is not None:
                    refused_by_rebuild += rebuilt.failures
                    self.published = max(self.published, rebuilt.silver_version)
                continue
            return outcome, refused_by_rebuild + unaddressable + outcome.failures

    def _stats(
        self, outcome: BulkOutcome, quarantined: int, until: int, started: float
    ) -> BatchStats:
        if outcome.total:
            PUBLISH_DELAY.labels(SERVICE, self.entity.name).observe(outcome.oldest_commit_delay_s)
        return BatchStats(
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
                "published_up_to_version": until,
            },
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

        By default ``txn`` is the table's app id and ``batch_id``, the silver version its
        write reached: a write run again writes its rows once.
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
        app, version = txn or (f"cdc-{SERVICE}-{self.entity.name}", batch_id)
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
    group_names: list[str] | None = None,
) -> StreamRunner:
    """Start each group's query (each table's index made as it starts); ``run()`` it."""
    settings = config.publisher_es
    progress = IndexProgress(make_elasticsearch(config.elasticsearch), settings.progress_index)

    def open_group(
        spark: SparkSession, pipeline: PipelineConfig, group: TableGroup, runner: StreamRunner
    ) -> ChangeFeedGroup:
        def open_table(entity: EntityConfig) -> IndexPublication:
            return IndexPublication(spark, pipeline, entity, progress, runner.set_problem)

        return ChangeFeedGroup(spark, pipeline, group, runner, SERVICE, settings, open_table)

    publisher_es = StreamService(
        SERVICE,
        settings,
        open_group,
        lag=None,  # silver versions not yet published: each batch reports it
    )
    return start_service(publisher_es, config, entity_names, once, spark, group_names)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-publisher-es``."""
    return service_main(SERVICE, "silver Delta change feeds -> Elasticsearch indexes.", start, argv)


if __name__ == "__main__":
    sys.exit(main())
