"""The silver table's contract: metadata columns every service reading silver relies on.

A silver row is the entity's columns (the source row) followed by these columns, written
by the merger only.
"""

from __future__ import annotations

SEQUENCE = "_cdc_seq"  # array<long>: the entity's sequence_by values of the applied event
OP = "_cdc_op"  # the source op applied last: c, u or r (deleted rows leave silver)
SOURCE_TS = "_cdc_source_ts"  # the source database's commit time of that event
COMMIT_TS = "_cdc_commit_ts"  # when the merger applied it
METADATA = (SEQUENCE, OP, SOURCE_TS, COMMIT_TS)

#: A tombstone's time (silver's tombstones table: key, ``SEQUENCE``, this): when the
#: merger recorded the delete; tombstones expire by it (the merger, ``cdc maintenance``).
DELETED_AT = "deleted_at"
