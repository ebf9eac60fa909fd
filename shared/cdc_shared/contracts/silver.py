"""The silver tables' contract: the metadata columns, and the record of silver commits.

This module imports no PySpark (the CLI's JVM-free commands read these names); the
Spark schemas of the merger's side tables are in ``cdc_shared.streaming.tables``.

A silver row is the entity's columns (the source row) followed by these columns, written
by the merger only. After writing silver tables the merger records each one's new
version in ``silver/_versions`` (``VERSIONS_COLUMNS``): the publishers read that one
table to learn which silver tables changed, then each table's Change Data Feed.
"""

from __future__ import annotations

SEQUENCE = "_cdc_seq"  # array<long>: the entity's sequence_by values of the applied event
OP = "_cdc_op"  # the source op applied last: c, u or r (deleted rows leave silver)
SOURCE_TS = "_cdc_source_ts"  # the source database's commit time of that event
COMMIT_TS = "_cdc_commit_ts"  # when the merger applied it
METADATA = (SEQUENCE, OP, SOURCE_TS, COMMIT_TS)

#: An entity's SCD type 2 history (``silver_history/<entity>``, written by the merger):
#: silver's columns, each row one version of a key over the period ``[START, END)`` of
#: the entity's sequence; ``END`` is null for the current version.
START = "__start_at"  # array<long>: the sequence of the event that began the version
END = "__end_at"  # array<long>: the sequence of the event that ended it; null: current
START_TS = "__start_ts"  # the source's commit time of the event that began the version
END_TS = "__end_ts"  # the source's commit time of the event that ended it (when known)
PERIOD = (START, END, START_TS, END_TS)

#: A tombstone's time (silver's tombstones table: key, ``SEQUENCE``, this): when the
#: merger recorded the delete; tombstones expire by it (the merger, ``cdc maintenance``).
DELETED_AT = "deleted_at"

#: ``silver/_versions``: one row per silver commit the merger made (or found made, when a
#: write is run again): the entity, the version silver reached, and when it was noted.
VERSIONS_COLUMNS = ("entity", "version", "noted_at")
