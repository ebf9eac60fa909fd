"""Tables that appear while a service runs: the streams of an entity set's new topics.

A Debezium connector capturing a whole database starts a table's topic when the table is
created (or added to its publication). A service whose pipeline has ``entity_sets`` asks
the broker for its topics every ``entity_discovery_interval_s`` and opens the streams of
the tables its sets now select, exactly as it opens those found at start: the same writer
lease, its own checkpoint and query, every guarantee of a configured table. Each service
looks for itself, so the ingestor makes bronze first, and the merger (and then the
publishers) take the table up at the first look after their source table exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cdc_shared.config.entities import EntityConfig
from cdc_shared.config.entity_sets import TopicLister, broker_topics, newly_selected
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.config.values import ConfigError
from cdc_shared.streaming.tables import SourceTableMissingError

log = logging.getLogger("cdc_shared.streaming")

#: Starts a newly selected table's stream: True once running (or stopped alone for a
#: reason of its own), False when the service stops taking new streams.
#: SourceTableMissingError: its upstream table is not there yet (looked at again later).
StartEntity = Callable[[EntityConfig], bool]


class EntityDiscovery:
    """Looks for newly selected tables at an interval and starts their streams."""

    def __init__(
        self,
        config: PipelineConfig,
        service: str,
        start_entity: StartEntity,
        topics: TopicLister = broker_topics,
    ) -> None:
        self.config = config
        self.service = service
        self.known = list(config.entities)  # the tables this service ran from its start
        self.started: list[EntityConfig] = []  # tables it took up since
        self._start_entity = start_entity
        self._topics = topics
        self._warned: set[str] = set()  # a persisting problem is logged once
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{service}-entity-discovery", daemon=True
        )

    def start(self) -> EntityDiscovery:
        """Look at every interval until ``stop``."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop looking (idempotent); a look under way finishes first."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(60.0)

    def look(self) -> list[str]:
        """One look: start every table newly selected whose source is ready; their names."""
        known = self.config.model_copy(update={"entities": [*self.known, *self.started]})
        try:
            found = newly_selected(known, self._topics)
        except ConfigError as problem:  # the broker unreachable, two topics one name, ...
            self._warn_once(f"entity sets: {problem}")
            return []
        taken = []
        for entity in found:
            if self._stop.is_set():
                break
            self.config.learn_entity(entity)  # lookups by name (e.g. reading a failure)
            try:
                if not self._start_entity(entity):
                    break  # the service is stopping
            except SourceTableMissingError:
                continue  # the upstream service has not made it yet: the next look
            except ConfigError as problem:
                self._warn_once(f"table {entity.name!r} not taken up: {problem}")
                continue
            self.started.append(entity)
            taken.append(entity.name)
            log.info(
                "new table taken up",
                extra={
                    "service": self.service,
                    "entity": entity.name,
                    "topic": entity.source_topic,
                },
            )
        return taken

    def _run(self) -> None:
        while not self._stop.wait(self.config.entity_discovery_interval_s):
            try:
                self.look()
            except Exception as error:  # a look must not end the looking: the next one retries
                self._warn_once(f"looking for new tables failed: {error}")

    def _warn_once(self, problem: str) -> None:
        if problem not in self._warned:
            self._warned.add(problem)
            log.warning(problem, extra={"service": self.service})
