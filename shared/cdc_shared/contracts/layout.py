"""Where everything lives under the storage root, and the names the services share.

The services meet only in these tables and names, so each is made here, once: a
service, the ``cdc`` command and the tests cannot disagree on a path. docs/design.md
("Tables") says what each table holds.
"""

from __future__ import annotations

from dataclasses import dataclass

INGESTOR = "ingestor"
MERGER = "merger"
PUBLISHER_KAFKA = "publisher_kafka"
PUBLISHER_ES = "publisher_es"
#: The services, in pipeline order, by their configuration section (also their folder
#: name under ``_checkpoints/`` and ``quarantine/``).
SERVICES = (INGESTOR, MERGER, PUBLISHER_KAFKA, PUBLISHER_ES)
#: The services that quarantine what they cannot process (publisher-kafka: oversized events).
QUARANTINE_WRITERS = (INGESTOR, MERGER, PUBLISHER_KAFKA, PUBLISHER_ES)
#: The app id of the merger's progress in silver's (and the history's) log: Delta's
#: idempotent-write ``txnAppId``, its ``txnVersion`` the bronze version merged through.
MERGER_PROGRESS_APP = "cdc-merger"
#: The app id recording in silver's log that the entity's own bronze table of the
#: releases before one bronze was drained (``cdc_merger.legacy``).
MERGER_LEGACY_APP = "cdc-merger-legacy"
#: The key of the ingestor's record in each bronze commit's ``userMetadata``
#: (``cdc_ingestor.positions``: each topic's position, the tables held).
INGESTOR_COMMIT_KEY = "cdc_ingestor"
#: How many of bronze's latest commits are read for the topics' positions.
POSITIONS_COMMITS_READ = 1000
#: A name no entity can take (entity names start with a letter): the one bronze table's
#: folder, and the checkpoint of the one queries of earlier releases (``<service>.one_query``).
ALL_ENTITIES = "_all"
#: The one bronze table's partition column: the entity a change belongs to.
ENTITY_COLUMN = "entity"
#: Bronze's column of when the ingestor read a row (its retention goes by it).
INGESTED_AT = "ingested_at"
#: Bronze's table property recording before when retention may have deleted an entity's
#: rows (``cdc.retention.deletedBefore.<entity>``: ``cdc_shared.contracts.bronze``).
RETENTION_PROPERTY = "cdc.retention.deletedBefore."


def display_name(service: str) -> str:
    """The service as people and logs of processes name it: ``publisher-kafka``.

    Either spelling in, this one out.
    """
    return service.replace("_", "-")


def section_name(service: str) -> str:
    """The service as its configuration section and folders name it: ``publisher_kafka``.

    Either spelling in, this one out.
    """
    return service.replace("-", "_")


#: The services, in pipeline order, as people, logs and ``cdc run --service`` name them.
SERVICE_NAMES = tuple(display_name(service) for service in SERVICES)


def command_name(service: str) -> str:
    """The service's command: ``publisher_kafka`` -> ``cdc-publisher-kafka``."""
    return f"cdc-{display_name(service)}"


def publisher_progress_group(change_topic: str) -> str:
    """publisher-kafka's transactional id for ``change_topic``, and its progress group.

    The group's committed offset on the progress topic is the last published silver
    version + 1, committed in the same transaction as the events.
    """
    return f"cdc-publisher-kafka.{change_topic}"


@dataclass(frozen=True)
class StorageLayout:
    """The tables and checkpoints under one storage root (a local path or a URI)."""

    root: str

    def _under(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def bronze(self) -> str:
        """Every entity's append-only change log, one table (``cdc_shared.contracts.bronze``)."""
        return self._under("bronze", ALL_ENTITIES)

    def legacy_bronze(self, entity: str) -> str:
        """The change log of ``entity`` as releases before one bronze wrote it."""
        return self._under("bronze", entity)

    def silver(self, entity: str) -> str:
        """The current state of ``entity``, one row per key, written by the merger."""
        return self._under("silver", entity)

    def history(self, entity: str) -> str:
        """The SCD type 2 history of ``entity`` (one row per version), written by the merger."""
        return self._under("silver_history", entity)

    def tombstones(self, entity: str) -> str:
        """The merger's newest delete per key of ``entity``, so late events stay out."""
        return self._under("silver", "_tombstones", entity)

    def silver_versions(self) -> str:
        """The merger's record of each silver commit, read by the publishers."""
        return self._under("silver", "_versions")

    def truncates(self, entity: str) -> str:
        """The merger's record of truncates of ``entity``."""
        return self._under("silver", "_truncates", entity)

    def quarantine(self, service: str) -> str:
        """What ``service`` could not process, with the reason."""
        return self._under("quarantine", service)

    def replay_ledger(self) -> str:
        """``cdc quarantine replay``'s ledger of what it re-produced."""
        return self._under("quarantine", "_replayed")

    def checkpoint(self, service: str, group: str) -> str:
        """The streaming checkpoint of ``service``'s query for the table group ``group``."""
        return self._under("_streams", service, group)

    def legacy_checkpoint(self, service: str, entity: str) -> str:
        """A checkpoint of earlier releases: a query per entity, or their one query (``_all``)."""
        return self._under("_checkpoints", service, entity)

    def writer_lease(self, service: str, entity: str) -> str:
        """The lease of ``service``'s one writer for ``entity`` (``streaming.writer_lease``)."""
        return self._under("_leases", service, f"{entity}.json")

    def erasure_log(self) -> str:
        """``cdc erase``'s requests and steps (``cdc_shared.contracts.erasure``)."""
        return self._under("_erasure")

    def change_schemas(self) -> str:
        """Change-event schemas publisher-kafka derives when no registry is set."""
        return self._under("_schemas")
