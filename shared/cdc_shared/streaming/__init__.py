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
