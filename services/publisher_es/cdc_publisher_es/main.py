"""``cdc-publisher-es``: silver Change Data Feed -> one Elasticsearch index per entity.

Per entity: silver's CDF as a stream (source) -> one action per change, id = primary key,
``version_type=external`` with a version that grows per key (transform) -> bulk writes
with retries, permanent failures to ``quarantine/publisher_es`` (sink). A micro-batch
returns, and so is committed to the checkpoint, only once each of its documents is
applied or quarantined; a replayed batch is harmless, since Elasticsearch refuses
versions it already holds (409, counted as applied).
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cdc_shared.avro import UnknownSchemaError
from cdc_shared.changefeed import LatestVersion, change_feed, row_columns, shape_changes
from cdc_shared.clients import make_elasticsearch
from cdc_shared.config import EntityConfig, PipelineConfig
from cdc_shared.driver_frames import frame_from_rows
from cdc_shared.layout import PUBLISHER_ES
from cdc_shared.retry import retrying
from cdc_shared.schemas import entity_schemas, make_registry
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    EntityStreamBase,
    StreamRunner,
    StreamService,
    rebuilding_on_schema_change,
    start_service,
)
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    app_id,
    ensure_table,
    idempotent_append,
    wait_for_table,
)
from elastic_transport import TransportError
from elasticsearch import ApiError
from prometheus_client import Histogram
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from cdc_publisher_es.bulk import BulkWriter, Failure, Scrubber
from cdc_publisher_es.documents import Action, arrow_actions, document_frame
from cdc_publisher_es.mapping import (
    MappingError,
    add_properties,
    ensure_index,
    entity_properties,
    index_mappings,
)

SERVICE = PUBLISHER_ES
#: Silver file bytes per micro-batch when ``max_bytes_per_trigger`` is not set.
DEFAULT_MAX_BYTES_PER_TRIGGER = "64m"
log = logging.getLogger("cdc_publisher_es")

PUBLISH_DELAY = Histogram(
    "cdc_publish_delay_seconds",
    "From a silver commit to Elasticsearch acknowledging its changes (oldest change of a "
    "bulk window; searchable after the next refresh)",
    ["service", "entity"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
)


def _worth_waiting(error: BaseException) -> bool:
    """Whether an index admin call's error passes with time: no answer, 429 or 5xx."""
    if isinstance(error, TransportError):
        return True
    if isinstance(error, ApiError):
        status = getattr(error, "status_code", None)
        return status is None or status >= 500 or status == 429
    return False


def version_source(entity: EntityConfig) -> str:
    """How the external version is derived for ``entity`` (see ``external_version``)."""
    if len(entity.sequence_by) == 1:
        return f"2 * {entity.sequence_by[0]} (+1 for a delete)"
    return "silver commit version (the sequence has several columns)"


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
        self.es = make_elasticsearch(es_config)
        self.mapped: set[str] = set()
        self.latest_version = LatestVersion(self.spark, self.silver_path)
        self.bulk = BulkWriter(
            self.es, self.alias, self.settings, on_problem=self.set_problem, scrub=self.scrub
        )

    # --- start-up ------------------------------------------------------------------

    def prepare(self, wait_s: float) -> None:
        """Wait for silver, create quarantine, and the index behind the alias."""
        hint = f"start the merger for entity {self.entity.name!r} first"
        wait_for_table(self.spark, self.silver_path, wait_s, hint, log)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)
        schema = self.spark.read.format("delta").load(self.silver_path).schema
        self._until_available(lambda: self._ensure_index(schema))

    def _row_schema(self) -> dict[str, Any] | None:
        try:
            return entity_schemas(self.entity, make_registry(self.config)).row_schema()
        except UnknownSchemaError as exc:
            log.warning(
                "no Avro schema for the mapping; using silver's column types",
                extra={"entity": self.entity.name, "reason": str(exc)},
            )
            return None

    def _properties(self, silver_schema: T.StructType) -> dict[str, Any]:
        columns = T.StructType([silver_schema[c] for c in row_columns(silver_schema)])
        return entity_properties(self._row_schema(), columns, self.settings)

    def _ensure_index(self, silver_schema: T.StructType) -> None:
        properties = self._properties(silver_schema)
        mappings = index_mappings(self.entity, properties, version_source(self.entity))
        index = ensure_index(
            self.es, self.alias, self.settings, mappings, on_conflict=self._mapping_conflict
        )
        self.mapped = set(properties)
        log.info(
            "index ready",
            extra={"entity": self.entity.name, "alias": self.alias, "index": index},
        )

    def _mapping_conflict(self, reason: str) -> None:
        log.warning(
            "the index maps a field differently from the schema; documents that do not fit "
            "it go to quarantine",
            extra={"entity": self.entity.name, "alias": self.alias, "reason": reason},
        )

    def _until_available(self, step: Any) -> None:
        """Run ``step`` (an index admin call), waiting while Elasticsearch is unreachable."""
        retried = False

        def report(_error: BaseException, problem: str) -> None:
            nonlocal retried
            retried = True
            self.set_problem(problem)

        policy = retrying(
            _worth_waiting,
            initial_s=self.settings.initial_backoff_s,
            max_s=self.settings.max_backoff_s,
            attempts=None,
            log=log,
            describe=lambda exc, _attempt: self.scrub(
                f"Elasticsearch unavailable ({type(exc).__name__}); retrying"
            ),
            on_retry=report,
            fields={"entity": self.entity.name},
        )
        try:
            policy(step)
        except ApiError as exc:  # refused for good: _worth_waiting said no
            hint = ""
            if "[scaled_float]" in str(exc):
                hint = (
                    " (this cluster lacks the mapper-extras module: set "
                    "publisher_es.decimal_as: string)"
                )
            raise MappingError(
                self.scrub(f"Elasticsearch refused to set up {self.alias!r}: {exc}{hint}")
            ) from None
        if retried:
            self.set_problem(None)

    # --- the stream ----------------------------------------------------------------

    def source(self) -> DataFrame:
        """Silver's Change Data Feed as a stream, from the configured start.

        A micro-batch is collected in the driver (as Arrow), so unless
        ``max_bytes_per_trigger`` is set it is bounded by ``DEFAULT_MAX_BYTES_PER_TRIGGER``.
        """
        settings = self.settings
        if settings.max_bytes_per_trigger is None:
            settings = settings.model_copy(
                update={"max_bytes_per_trigger": DEFAULT_MAX_BYTES_PER_TRIGGER}
            )
        return change_feed(self.spark, self.silver_path, settings)

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Index the batch; return only when each document is applied or quarantined."""
        started = time.monotonic()
        columns = row_columns(batch.schema)
        if set(columns) - self.mapped:  # schema evolution: map new columns before writing
            self._until_available(lambda: self._add_columns(batch.schema))
        changes = shape_changes(batch, list(self.entity.key))
        documents = document_frame(changes, list(self.entity.key), self.settings)
        unaddressable: list[Failure] = []
        actions = self._actions(documents, unaddressable)
        with ThreadPoolExecutor(1, thread_name_prefix=f"publish-{self.entity.name}") as pool:
            writing = pool.submit(self.bulk.write, actions)
            # For the lag; a Spark job at most every 10 s, run while the documents are sent.
            latest_version = self.latest_version.get()
            outcome = writing.result()
        failures = unaddressable + outcome.failures
        if failures:
            self._quarantine(failures, batch_id)
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
                    "quarantined": len(failures),
                    "retried": outcome.retried,
                },
                extra={
                    "bulk_ms": int((time.monotonic() - started) * 1000),
                    "publish_delay_ms": int(outcome.oldest_commit_delay_s * 1000),
                    **extra,
                },
            ),
        )

    def _add_columns(self, silver_schema: T.StructType) -> None:
        properties = self._properties(silver_schema)
        new = {k: v for k, v in properties.items() if k not in self.mapped}
        add_properties(self.es, self.alias, new, on_conflict=self._mapping_conflict)
        self.mapped |= set(new)
        log.info("mapping extended", extra={"entity": self.entity.name, "fields": sorted(new)})

    @staticmethod
    def _actions(documents: DataFrame, unaddressable: list[Failure]) -> Iterator[Action]:
        """The batch's actions, collected as Arrow (one Spark job, no row pickling)."""

        def no_id(action: Action) -> None:
            unaddressable.append(Failure(action, 0, "null_key", "a primary key column is null"))

        return arrow_actions(documents.toArrow(), no_id)

    def _quarantine(self, failures: list[Failure], batch_id: int) -> None:
        now = dt.datetime.now(dt.UTC)
        rows = [
            (
                SERVICE,
                self.entity.name,
                f.kind,
                f"document {f.action.doc_id!r} (version {f.action.version}): {f.reason}",
                None,
                None,
                None,
                None,
                f.action.doc_id.encode(),
                f.action.source.encode() if f.action.source is not None else None,
                self.silver_path,
                f.action.commit_version,
                batch_id,
                now,
            )
            for f in failures
        ]
        frame = frame_from_rows(self.spark, rows, QUARANTINE_SCHEMA)
        idempotent_append(
            frame,
            self.quarantine_path,
            app_id(SERVICE, self.entity.name, self.identity.get()),
            batch_id,
        )
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
    """Create the indexes and quarantine, start one stream per entity; ``run()`` the result."""
    publisher_es = StreamService(
        SERVICE,
        config.publisher_es,
        EntityPublisher,
        lag=None,  # silver versions not yet published: each batch reports it
        on_failure=rebuilding_on_schema_change("silver"),
    )
    return start_service(publisher_es, config, entity_names, once, spark)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-publisher-es``."""
    return service_main(SERVICE, "silver Delta change feeds -> Elasticsearch indexes.", start, argv)


if __name__ == "__main__":
    sys.exit(main())
