"""What a failure calls for: our own errors by their type, the JVM's by the text it sends.

Each JVM text reader is shown the message Spark or Delta actually sends (Delta's
``DELTA_SCHEMA_CHANGED`` from its error classes, the JVM's ``IOException`` of ENOSPC).
"""

from __future__ import annotations

from cdc_shared.streaming.failures import (
    Failure,
    KnownFailureError,
    read_failure,
    rebuilding_on_schema_change,
    recognising_full_storage,
)

#: Delta 4.x, a streaming source whose table gained a column (error class
#: DELTA_SCHEMA_CHANGED), as the failed query's error text starts.
DELTA_SCHEMA_CHANGED = (
    "[DELTA_SCHEMA_CHANGED] Detected schema change:\nstreaming source schema: "
    "struct<id:bigint>\n\ndata file schema: struct<id:bigint,email:string>\n\n"
    "Please try restarting the query. If this issue repeats across query restarts "
    "without\nmaking progress, you have made an incompatible schema change"
)
#: The JVM's error for a write on a full disk, inside Spark's task failure.
NO_SPACE = (
    "Job aborted due to stage failure: Task 0 in stage 12.0 failed 1 times, most recent "
    "failure: Lost task 0.0 (TID 40): java.io.IOException: No space left on device\n"
    "\tat java.base/java.io.FileOutputStream.writeBytes(Native Method)"
)


class TableAlone(KnownFailureError):
    entity_only = True


def test_our_errors_are_read_by_type_not_by_text() -> None:
    def text_reader(_entity: str, text: str) -> Failure | None:
        return Failure(f"read as text: {text}")

    assert read_failure("t", TableAlone("stopped: x"), text_reader) == Failure(
        "stopped: x", entity_only=True
    )
    assert read_failure("t", KnownFailureError("stopped: y"), None) == Failure("stopped: y")
    # Any other exception, and the JVM's text, go to the service's text readers.
    assert read_failure("t", ValueError("v"), text_reader) == Failure("read as text: ValueError: v")
    assert read_failure("t", "TableAlone: stopped: x", None) is None


def test_a_source_schema_change_rebuilds_the_stream() -> None:
    read = rebuilding_on_schema_change("bronze")
    failure = read("customers", DELTA_SCHEMA_CHANGED)
    assert failure is not None and failure.transient and failure.rebuild
    assert read("customers", NO_SPACE) is None


def test_a_full_disk_stops_with_the_storage_root_named() -> None:
    read = recognising_full_storage("/data/cdc", None)
    failure = read("customers", NO_SPACE)
    assert failure is not None and not failure.transient
    assert "no space left on device under the storage root /data/cdc" in failure.message
    assert read("customers", DELTA_SCHEMA_CHANGED) is None
