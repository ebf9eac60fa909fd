"""Running Structured Streaming queries as a service: one runtime for every service.

A service describes itself (:class:`StreamService`) and opens one :class:`GroupStream`
per group of its tables (``groups``); :func:`start_service` starts one query per group
and hands them to a :class:`StreamRunner`, which serves health and metrics, logs one JSON
line per micro-batch, stops after the batch in flight on SIGTERM (exit 0), and surfaces
a failed query as an error naming the group, or restarts it from its checkpoint when the
service's ``on_failure`` calls the error transient (e.g. its source is unreachable).
Each batch writes the tables it changed through a :class:`TableQueue`: a table is
written from its own progress, kept in its target, so it can wait for a later batch or
be held alone.

Read top to bottom: ``failures`` (how an error is read), ``progress`` (the batch log),
``groups`` (which tables a query runs), ``queue`` (how a batch writes its tables),
``runner`` (the queries' lifecycle), ``runtime`` (a service's groups, wired).
"""

from cdc_shared.streaming.failures import (
    NO_SPACE,
    EntityStoppedError,
    Failure,
    KnownFailureError,
    OnFailure,
    StreamFailedError,
    no_space_message,
    read_failure,
    rebuilding_on_schema_change,
    recognising_full_storage,
)
from cdc_shared.streaming.groups import TableGroup, table_groups
from cdc_shared.streaming.progress import BatchStats, LagReader, source_metric
from cdc_shared.streaming.queue import BatchWrites, TableQueue
from cdc_shared.streaming.runner import BuildQuery, QueryIdentity, StreamRunner
from cdc_shared.streaming.runtime import (
    SOURCE_WAIT_S,
    GroupStream,
    OpenGroup,
    StreamService,
    start_service,
    with_trigger,
)

__all__ = [
    "NO_SPACE",
    "SOURCE_WAIT_S",
    "BatchStats",
    "BatchWrites",
    "BuildQuery",
    "EntityStoppedError",
    "Failure",
    "GroupStream",
    "KnownFailureError",
    "LagReader",
    "OnFailure",
    "OpenGroup",
    "QueryIdentity",
    "StreamFailedError",
    "StreamRunner",
    "StreamService",
    "TableGroup",
    "TableQueue",
    "no_space_message",
    "read_failure",
    "rebuilding_on_schema_change",
    "recognising_full_storage",
    "source_metric",
    "start_service",
    "table_groups",
    "with_trigger",
]
