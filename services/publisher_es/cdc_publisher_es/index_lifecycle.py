"""The index behind an entity's alias over the publisher's life: ready, extended, restored.

- **Start** (:meth:`IndexLifecycle.prepare`): the index the alias names is adopted, or
  ``<alias>-000001`` created with the mapping (``cdc_publisher_es.mapping``).
- **Schema evolution** (:meth:`IndexLifecycle.cover`): silver columns not mapped yet are
  added to the mapping before a batch carrying them is written.
- **A lost index**: the publisher goes on from its progress, past every change it
  published before, so an index created anew while the progress records published
  changes would hold only what comes next, silently. Such an index is created marked
  (``_meta.cdc_rebuild_pending``) and rebuilt from silver's current state: a full load of
  silver at one version, with the ids and external versions the changes give
  (``documents.snapshot_document_frame``), then the publisher goes on from that version
  (changes older than the snapshot are refused, later ones apply). With
  ``publisher_es.on_missing_index: stop`` the publisher stops instead (exit 1), saying
  how to rebuild. Under a running publisher the loss shows at the next bulk write (the
  writer names the alias with ``require_alias``, so nothing auto-creates a plain index):
  :meth:`IndexLifecycle.restore` does the same, and the batch is written again. The mark
  is removed only once the rebuild is complete, so a crash during one makes the next
  start rebuild again rather than adopt a partial index.
- **Elasticsearch unavailable**: every index admin call waits with the one retry policy
  (``cdc_shared.clients.retry``), reporting the problem on ``/health``. A refusal for good stops
  the publisher: credentials, permissions or a certificate that fails verification with
  an ElasticsearchRefusedError (waiting would not help), anything else Elasticsearch
  refuses of the index with a MappingError naming the alias.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cdc_shared.avro import UnknownSchemaError
from cdc_shared.clients.retry import retrying
from cdc_shared.clients.schemas import entity_schemas, make_registry
from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.contracts.layout import PUBLISHER_ES
from cdc_shared.streaming.changefeed import row_columns
from cdc_shared.streaming.failures import Failure as StreamFailure
from cdc_shared.streaming.failures import KnownFailureError
from delta.tables import DeltaTable
from elastic_transport import TlsError, TransportError
from elasticsearch import ApiError, Elasticsearch
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_publisher_es.bulk import AliasMissingError, BulkWriter, Failure
from cdc_publisher_es.documents import Action, snapshot_document_frame
from cdc_publisher_es.mapping import (
    EnsuredIndex,
    MappingError,
    add_properties,
    ensure_index,
    entity_properties,
    finish_rebuild,
    index_mappings,
)

log = logging.getLogger("cdc_publisher_es")
Result = TypeVar("Result")
#: Where an IndexLostError's reason begins, after the service and entity it names.
STOPPED = "stopped: "


class IndexLostError(KnownFailureError):
    """The index behind the alias is gone and ``on_missing_index`` is ``stop``.

    The message (one line) says what was lost and how to rebuild; it stops the service.
    """

    def failure(self) -> StreamFailure:
        """The stop, from "stopped: " on (the runner names the service and entity itself)."""
        message = str(self)
        return StreamFailure(message[max(0, message.find(STOPPED)) :])


class ElasticsearchRefusedError(RuntimeError):
    """Elasticsearch refused the publisher for good; waiting would not help.

    Its credentials (401), its role's privileges (403) or the cluster's TLS certificate.
    The message is one line naming the hosts and what to fix, never a secret.
    """


#: How the TLS stack says a certificate failed verification, and OpenSSL's reason.
CERTIFICATE_VERIFY_FAILED = re.compile(r"certificate verify failed: (?P<reason>[^(]*?)\s*\(")


def certificate_refused(error: BaseException) -> str | None:
    """OpenSSL's reason if ``error`` is a TLS handshake whose certificate check failed.

    A certificate that does not verify (signed by a CA not in ``ca_certs``, expired, for
    another host) fails the same way at every attempt: not a fault to wait out.
    """
    if not isinstance(error, TlsError):
        return None
    found = CERTIFICATE_VERIFY_FAILED.search(str(error))
    return None if found is None else found.group("reason")


def _worth_waiting(error: BaseException) -> bool:
    """Whether an index admin call's error passes with time: no answer, 429 or 5xx."""
    if certificate_refused(error) is not None:
        return False
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


@dataclass(frozen=True)
class Rebuilt:
    """A rebuild from silver: the silver version loaded, documents sent, and refusals."""

    silver_version: int
    documents: int
    failures: list[Failure] = field(default_factory=list)


@dataclass(eq=False)
class IndexLifecycle:
    """One entity's index behind its alias: prepared, extended, and restored when lost."""

    spark: SparkSession
    config: PipelineConfig
    entity: EntityConfig
    es: Elasticsearch
    set_problem: Callable[[str | None], None]
    scrub: Callable[[str], str]

    def __post_init__(self) -> None:
        self.settings = self.config.publisher_es
        self.alias = self.entity.es_index_name
        self.silver_path = self.config.layout.silver(self.entity.name)
        self.mapped: set[str] = set()
        self._mappings: dict[str, Any] = {}

    # --- start and schema evolution ----------------------------------------------------

    def prepare(self, silver_schema: T.StructType, published: bool) -> Rebuilt | None:
        """Adopt or create the index; rebuild it if it was lost (see the module docstring).

        ``published``: whether the alias's progress records published changes. Returns
        the rebuild, if one ran (its refusals are the caller's to quarantine). Raises
        IndexLostError when the index is lost and ``on_missing_index`` is ``stop``.
        """

        def ensure() -> EnsuredIndex:
            if published and not self.es.indices.exists_alias(name=self.alias):
                self._refuse_if_told(
                    f"is missing while its progress ({self.settings.progress_index}) records "
                    "published changes: the documents published before are gone"
                )
            return self._ensure(silver_schema, to_rebuild=published)

        ensured = self.until_available(ensure)
        log.info(
            "index ready",
            extra={"entity": self.entity.name, "alias": self.alias, "index": ensured.index},
        )
        if not ensured.rebuild_pending:
            return None
        self._refuse_if_told(
            f"({ensured.index}) is incomplete: its rebuild from silver did not finish"
        )
        return self._rebuild()

    def cover(self, silver_schema: T.StructType) -> None:
        """Map the silver columns the index does not map yet (schema evolution)."""
        if not set(row_columns(silver_schema)) - self.mapped:
            return
        self.until_available(lambda: self._add_columns(silver_schema))

    def _add_columns(self, silver_schema: T.StructType) -> None:
        properties = self._properties(silver_schema)
        new = {k: v for k, v in properties.items() if k not in self.mapped}
        try:
            add_properties(self.es, self.alias, new, on_conflict=self._mapping_conflict)
        except ApiError as exc:
            if exc.status_code == 404:  # the index is gone: restore() maps every column
                raise AliasMissingError(self.alias) from None
            raise
        self.mapped |= set(new)
        self._mappings = index_mappings(self.entity, properties, version_source(self.entity))
        log.info("mapping extended", extra={"entity": self.entity.name, "fields": sorted(new)})

    # --- a lost index --------------------------------------------------------------------

    def restore(self) -> Rebuilt | None:
        """The alias vanished under the running stream: create the index and rebuild it.

        Returns the rebuild (None if someone restored the alias meanwhile, e.g. from a
        snapshot); raises IndexLostError when ``on_missing_index`` is ``stop``.
        """
        log.warning(
            "the index behind the alias is gone",
            extra={"entity": self.entity.name, "alias": self.alias},
        )
        self._refuse_if_told(
            "vanished under the running publisher: the documents published before are gone"
        )
        schema = self.spark.read.format("delta").load(self.silver_path).schema
        ensured = self.until_available(lambda: self._ensure(schema, to_rebuild=True))
        return self._rebuild() if ensured.rebuild_pending else None

    def _refuse_if_told(self, what: str) -> None:
        """Raise IndexLostError saying ``what`` happened, if told to stop rather than rebuild."""
        if self.settings.on_missing_index != "stop":
            return
        raise IndexLostError(
            f"{PUBLISHER_ES} stream for entity {self.entity.name!r} {STOPPED}the Elasticsearch "
            f"index behind the alias {self.alias!r} {what} "
            "(publisher_es.on_missing_index: stop). To rebuild it from "
            "silver's current state, restart with publisher_es.on_missing_index: rebuild "
            "(CDC_PUBLISHER_ES__ON_MISSING_INDEX=rebuild); or restore the index under the "
            "alias from a snapshot and restart"
        )

    def _rebuild(self) -> Rebuilt:
        """Load silver's current rows into the (marked) index, then remove the mark.

        The rows reach the driver one partition at a time (``toLocalIterator``), so a
        table of any size fits; a rebuild is rare, so speed matters less than memory here.
        If the alias vanishes again meanwhile, the rebuild starts over.
        """
        while True:  # once, unless the alias vanishes again during the rebuild
            history = DeltaTable.forPath(self.spark, self.silver_path).history(1).collect()[0]
            version = int(history["version"])
            silver = (
                self.spark.read.format("delta")
                .option("versionAsOf", version)
                .load(self.silver_path)
            )
            log.warning(
                "rebuilding the lost index from silver",
                extra={"entity": self.entity.name, "alias": self.alias, "silver_version": version},
            )
            documents = snapshot_document_frame(
                silver, list(self.entity.key), self.settings, version, history["timestamp"]
            )
            failures: list[Failure] = []
            writer = BulkWriter(
                self.es, self.alias, self.settings, on_problem=self.set_problem, scrub=self.scrub
            )
            try:
                outcome = writer.write(_row_actions(documents.toLocalIterator(True), failures))
            except AliasMissingError:
                log.warning(
                    "the index vanished during its rebuild; starting over",
                    extra={"entity": self.entity.name, "alias": self.alias},
                )
                self.until_available(
                    functools.partial(self._ensure, silver.schema, to_rebuild=True)
                )
                continue
            self.until_available(lambda: finish_rebuild(self.es, self.alias, self._mappings))
            rebuilt = Rebuilt(
                version, outcome.indexed + outcome.already_applied, failures + outcome.failures
            )
            log.warning(
                "index rebuilt from silver",
                extra={
                    "entity": self.entity.name,
                    "alias": self.alias,
                    "silver_version": version,
                    "documents": rebuilt.documents,
                    "refused": len(rebuilt.failures),
                },
            )
            return rebuilt

    # --- the mapping ---------------------------------------------------------------------

    def _ensure(self, silver_schema: T.StructType, *, to_rebuild: bool) -> EnsuredIndex:
        properties = self._properties(silver_schema)
        mappings = index_mappings(self.entity, properties, version_source(self.entity))
        ensured = ensure_index(
            self.es,
            self.alias,
            self.settings,
            mappings,
            on_conflict=self._mapping_conflict,
            to_rebuild=to_rebuild,
        )
        self.mapped = set(properties)
        self._mappings = mappings
        return ensured

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

    def _mapping_conflict(self, reason: str) -> None:
        log.warning(
            "the index maps a field differently from the schema; documents that do not fit "
            "it go to quarantine",
            extra={"entity": self.entity.name, "alias": self.alias, "reason": reason},
        )

    # --- Elasticsearch availability ------------------------------------------------------

    def until_available(self, step: Callable[[], Result]) -> Result:
        """Run ``step`` (index admin calls), waiting while Elasticsearch is unreachable."""
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
        hosts = ", ".join(self.config.elasticsearch.hosts)
        try:
            result = policy(step)
        except TlsError as exc:  # _worth_waiting said no: a certificate that fails
            reason = certificate_refused(exc)
            raise ElasticsearchRefusedError(
                f"Elasticsearch at {hosts}: its TLS certificate fails verification ({reason}); "
                "set elasticsearch.ca_certs to the CA bundle that signed it (PEM) and restart"
            ) from None
        except ApiError as exc:  # refused for good: _worth_waiting said no
            if exc.status_code in (401, 403):
                what = "the credentials" if exc.status_code == 401 else "a privilege"
                raise ElasticsearchRefusedError(
                    self.scrub(
                        f"Elasticsearch at {hosts} refused {what} (HTTP {exc.status_code}) while "
                        f"setting up {self.alias!r}: {exc}; fix elasticsearch.username "
                        "/ password / api_key (or the user's role) and restart"
                    )
                ) from None
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
        return result


def _row_actions(rows: Iterator[Any], unaddressable: list[Failure]) -> Iterator[Action]:
    """Rows of ``DOCUMENT_COLUMNS`` as actions; one with a null key part is refused."""
    for row in rows:
        if row[1] is None:
            action = Action(row[0], "", *row[2:])
            unaddressable.append(Failure(action, 0, "null_key", "a key column is null"))
        else:
            yield Action(*row)
