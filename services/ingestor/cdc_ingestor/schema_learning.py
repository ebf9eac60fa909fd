"""An entity's decode plan, kept up to date with the writer schemas its records use.

Producers may register new writer schemas while the ingestor runs: before each batch the
plan learns them from the registry, and the reader becomes the newest version that can
read the older ones (unless pinned), so a compatible new column reaches bronze.
"""

from __future__ import annotations

import logging
from typing import Any

from cdc_shared.avro import (
    AvroSerdeError,
    KnownSchema,
    SchemaRegistry,
    UnknownSchemaError,
    read_header,
)
from cdc_shared.clients.schemas import entity_schemas
from cdc_shared.config.entities import EntityConfig
from cdc_shared.contracts.layout import INGESTOR
from pyspark.sql import DataFrame, SparkSession

from cdc_ingestor.compatibility import incompatibility, readable_reader
from cdc_ingestor.decode import DecodePlan
from cdc_ingestor.framing_headers import BatchHeaders, batch_headers

log = logging.getLogger("cdc_ingestor")


class SchemaTracker:
    """The decode plan of one entity: its writer schemas and the reader to resolve them to."""

    def __init__(self, spark: SparkSession, entity: EntityConfig, registry: SchemaRegistry) -> None:
        self.spark = spark
        self.entity = entity
        self.registry = registry
        self.plan = self._newest_plan()

    def _newest_plan(self) -> DecodePlan:
        """Every version the registry knows, and the reader to resolve them to.

        The reader is the pinned value schema, else the newest version that can read the
        versions before it; an error line names each version it cannot read.
        """
        schemas = entity_schemas(self.entity, self.registry)
        pinned = self.entity.value_schema is not None
        reader = schemas.value if pinned else readable_reader(self.spark, schemas.values)
        for version in schemas.values:
            reason = incompatibility(self.spark, reader, version)
            if reason is not None:
                log.error(
                    "a value schema version is incompatible with the reader: records written "
                    "with it go to quarantine as incompatible_schema",
                    extra={
                        "service": INGESTOR,
                        "entity": self.entity.name,
                        "subject": version.subject,
                        "version": version.version,
                        "fingerprint": version.fingerprint.hex(),
                        "reader_version": reader.version,
                        "reason": reason,
                    },
                )
        return DecodePlan.from_schemas(schemas, self.registry, reader, self.entity)

    def update(self, batch: DataFrame, headers: BatchHeaders | None = None) -> DecodePlan:
        """Give the decode plan every writer schema the batch may need; the plan to decode it.

        A registry that lists its schemas (files) is read again, and the plan gets all of
        them: a header outside the plan then resolves nowhere, no look at the batch needed.
        A registry that resolves ids it does not list (HTTP) is asked about the headers
        the batch uses that the plan lacks (``headers``, else one cheap pass over the
        framing headers). With the batch's ``headers`` known, the plan returned holds only
        the writers they name (:meth:`DecodePlan.narrowed`).
        """
        self.registry.refresh()
        listing = self.registry.listing()
        if listing is None:
            if self.plan.uses_avro:  # JSON records carry no header to look up
                headers = headers or batch_headers(batch)
                self._learn_writers(*headers)
        else:
            planned = {s.fingerprint for s in self.plan.value_writers.values()}
            new = [s for s in listing if s.fingerprint not in planned]
            if new:
                self._replan(listing, listing, [s.fingerprint.hex() for s in new])
        return self.plan if headers is None else self.plan.narrowed(headers)

    def _learn_writers(self, values: set[bytes], keys: set[bytes]) -> None:
        """Ask the registry about headers the plan does not know, and add what it knows.

        The reader becomes the subject's newest schema (unless pinned), so a compatible new
        column reaches bronze (the bronze write merges the schema). A header the registry
        says it does not know is left out (its records go to quarantine as unknown_schema);
        a registry that cannot answer (``SchemaRegistryUnavailableError``, after its
        retries) fails the batch, so no valid record is quarantined for want of its schema.
        """
        headers = {("value", h) for h in values - self.plan.value_writers.keys()} | {
            ("key", h) for h in keys - self.plan.key_writers.keys()
        }
        if not headers:
            return
        known = {"value": self.plan.value_writers, "key": self.plan.key_writers}
        learned: dict[str, list[Any]] = {"value": [], "key": []}
        for part, data in headers:
            try:
                head = read_header(data)
            except AvroSerdeError:
                continue
            if data[: head.size] in known[part]:
                continue
            try:
                schema = self.registry.resolve(head)
            except UnknownSchemaError:
                continue
            if schema not in learned[part]:
                learned[part].append(schema)
        if not learned["value"] and not learned["key"]:
            return
        self._replan(
            [*self.plan.value_writers.values(), *learned["value"]],
            [*self.plan.key_writers.values(), *learned["key"]],
            [s.fingerprint.hex() for s in learned["value"] + learned["key"]],
        )

    def _replan(self, values: list[KnownSchema], keys: list[KnownSchema], new: list[str]) -> None:
        """The newest plan with these writer schemas; log the ``new`` ones and the reader."""
        context = {"service": INGESTOR, "entity": self.entity.name}
        log.info("new writer schemas", extra={**context, "schemas": new})
        self.plan = self._newest_plan().with_writers(values, keys)
        reader = self.plan.value_reader.fingerprint.hex()
        log.info("reader schema", extra={**context, "value_reader": reader})
