"""Tables a service's one query holds back: a failure of one table's own stops it alone.

With a query per table, a failure that concerns one table only (``Failure.entity_only``:
an incompatible writer schema, a registry past its retry budget, an ACL refusing that
table's topic) stops that table's query, and the others go on. A service's one query
(``<service>.one_query``) does the same through :class:`HeldTables`: when a table's write
fails in a batch and the service's ``on_failure`` reads the error as that table's alone,
the table is *held*. Where its rows of that batch start (its *position*: a Delta version,
or Kafka offsets by partition) and why are written to the checkpoint's :data:`HELD_FILE`
before the batch commits; ``/health`` lists the table as stopped; its rows in that batch
and later ones are left unwritten, while the other tables' are written. The service exits
1 when it stops, naming the table, as with a query per table.

A table whose stream cannot even start (``EntityStoppedError`` from its ``prepare``, as a
query per table would report it stopped at start) is stopped alone at once and held from
the start of the query's first batch: its position is only known then (the held
position of an earlier run, if it had one). Its rows are read and left unwritten like a
held table's; a run that reads no batch holds nothing, and the next start reads the
table from where the query stood.

The next start of the service takes each held table up again from its position (how
depends on the source: :func:`cdc_shared.streaming.delta_union.starting_versions` starts
a new checkpoint, :meth:`cdc_ingestor.one_query.AllTopicsIngestion.take_up_held` reads
the held records as a batch of their own); if it fails again, it is held again.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pyspark.sql import SparkSession

from cdc_shared.jvm_bridge import write_text
from cdc_shared.spark import TABLES_AT_ONCE, side_by_side_in_groups
from cdc_shared.stream_checkpoint import HELD_FILE, HadoopFiles, held_tables
from cdc_shared.streaming.failures import Failure, StreamFailedError
from cdc_shared.streaming.runner import StreamRunner

log = logging.getLogger("cdc_shared.streaming")


class HeldTables:
    """The tables a one query holds back, and those an earlier run held (to take up again)."""

    def __init__(self, spark: SparkSession, checkpoint: str, runner: StreamRunner) -> None:
        self.spark = spark
        self.runner = runner
        self.file = f"{checkpoint.rstrip('/')}/{HELD_FILE}"
        #: Held by an earlier run: taken up again at this start (then forgotten).
        self.resuming = held_tables(HadoopFiles(spark), checkpoint)
        #: Held in this run: their rows are left unwritten until the service starts again.
        self.held: dict[str, dict[str, Any]] = {}
        #: Could not start in this run (why): held from the query's first batch.
        self.refused_at_start: dict[str, str] = {}

    def __contains__(self, entity: str) -> bool:
        return entity in self.held or entity in self.refused_at_start

    def refuse_at_start(self, refused: Mapping[str, str], entities: int) -> None:
        """Stop each of the ``refused`` tables (name: why) alone; hold it from the first batch.

        ``entities``: how many the query reads. When none of them can start, the service
        cannot run at all: StreamFailedError, as with a query per table.
        """
        for entity, reason in refused.items():
            self.refused_at_start[entity] = reason
            self.runner.stop_entity(entity, reason)
        if refused and len(self.refused_at_start) >= entities:
            raise StreamFailedError(self.runner.stopped_message())

    def positions(self) -> dict[str, Any]:
        """Where each held table (of this run or an earlier one) starts again."""
        return {name: entry["position"] for name, entry in {**self.resuming, **self.held}.items()}

    def write_each(
        self,
        writes: Mapping[str, Callable[[], object]],
        batch_id: int,
        query_id: str,
        position: Callable[[str], Any],
    ) -> list[str]:
        """Run each table's write, a few side by side; the tables written.

        A write that fails for its table alone holds that table (at ``position(table)``,
        its rows' start in this batch); any other failure is raised, and the batch with
        it.
        """
        self._hold_refused_at_start(batch_id, query_id, position)
        failed: dict[str, Failure] = {}

        def guarded(name: str, write: Callable[[], object]) -> None:
            try:
                write()
            except Exception as error:
                failure = self.alone(name, error)
                if failure is None:
                    raise
                failed[name] = failure

        calls = [functools.partial(guarded, name, write) for name, write in writes.items()]
        side_by_side_in_groups(calls, TABLES_AT_ONCE)
        for name, failure in failed.items():
            self.hold(name, position(name), batch_id, query_id, failure.message)
        return [name for name in writes if name not in failed]

    def _hold_refused_at_start(
        self, batch_id: int, query_id: str, position: Callable[[str], Any]
    ) -> None:
        """Hold the tables that could not start, from this batch's start (the query's first).

        A table an earlier run held keeps that run's position, batch and query.
        """
        for entity, reason in self.refused_at_start.items():
            earlier = self.resuming.pop(entity, None)
            if earlier is None:
                self.hold(entity, position(entity), batch_id, query_id, reason, stop=False)
            else:
                at, batch, query = earlier["position"], earlier["batch_id"], earlier["query_id"]
                self.hold(entity, at, batch, query, reason, stop=False)
        self.refused_at_start.clear()

    def alone(self, entity: str, error: Exception) -> Failure | None:
        """How the service reads ``error`` of ``entity``, when it is that table's alone."""
        failure = self.runner.failure_of(entity, f"{type(error).__name__}: {error}")
        if failure is None or failure.transient or not failure.entity_only:
            return None
        return failure

    def hold(
        self,
        entity: str,
        position: Any,
        batch_id: int,
        query_id: str,
        reason: str,
        stop: bool = True,
    ) -> None:
        """Hold ``entity`` from ``position`` (saved before the batch commits); stop it alone.

        ``stop``: False for a table stopped already (it could not start).
        """
        entry = {"position": position, "batch_id": batch_id, "query_id": query_id}
        self.held[entity] = {**entry, "reason": reason}
        self.save()
        log.error(
            "a table of the one query failed alone: held back from its position",
            extra={"service": self.runner.service, "entity": entity, **entry},
        )
        if stop:
            self.runner.stop_entity(entity, reason)

    def taken_up(self, entity: str) -> None:
        """``entity``, held by an earlier run, is read again: forget its old position."""
        self.resuming.pop(entity, None)
        self.save()

    def save(self) -> None:
        """Write the tables still held or still to take up (the file names them all)."""
        write_text(self.spark, self.file, json.dumps({**self.resuming, **self.held}, indent=1))
