"""Running Structured Streaming queries as a service: one runtime for every service.

A service describes itself (:class:`StreamService`) and builds one :class:`EntityStream`
per entity (or one :class:`GroupStream` over all of them, a service run as one query);
:func:`start_service` opens them all and hands the queries to a
:class:`StreamRunner`, which serves health and metrics, logs one JSON line per
micro-batch, stops after the batch in flight on SIGTERM (exit 0), and surfaces a failed
query as an error naming the entity, or restarts it from its checkpoint when the
service's ``on_failure`` calls the error transient (e.g. its source is unreachable).

Read top to bottom: ``failures`` (how an error is read), ``progress`` (the batch log),
``runner`` (the queries' lifecycle), ``runtime`` (a service's streams, wired).
"""

from cdc_shared.streaming.failures import (
    NO_SPACE,
    EntityStoppedError,
    Failure,
    OnFailure,
    StreamFailedError,
    no_space_message,
    rebuilding_on_schema_change,
    recognising_full_storage,
)
from cdc_shared.streaming.progress import BatchStats, LagReader, source_metric
from cdc_shared.streaming.runner import BuildQuery, QueryIdentity, StreamRunner
from cdc_shared.streaming.runtime import (
    SOURCE_WAIT_S,
    EntityStream,
    EntityStreamBase,
    GroupStream,
    OpenEntity,
    OpenGroup,
    StreamService,
    foreach_batch_writer,
    refuse_some_entities_in_one_query,
    start_service,
    with_trigger,
)

__all__ = [
    "NO_SPACE",
    "SOURCE_WAIT_S",
    "BatchStats",
    "BuildQuery",
    "EntityStoppedError",
    "EntityStream",
    "EntityStreamBase",
    "Failure",
    "GroupStream",
    "LagReader",
    "OnFailure",
    "OpenEntity",
    "OpenGroup",
    "QueryIdentity",
    "StreamFailedError",
    "StreamRunner",
    "StreamService",
    "foreach_batch_writer",
    "no_space_message",
    "rebuilding_on_schema_change",
    "recognising_full_storage",
    "refuse_some_entities_in_one_query",
    "source_metric",
    "start_service",
    "with_trigger",
]
