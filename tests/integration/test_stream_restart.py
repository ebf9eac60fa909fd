"""StreamRunner restarts a query that failed transiently from its checkpoint (real Spark)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cdc_shared.streaming.failures import Failure, StreamFailedError
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.streaming.runtime import with_trigger
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamWriter

pytestmark = pytest.mark.integration


def foreach_batch_writer(
    source: DataFrame, process: Callable[[DataFrame, int], None], checkpoint: str
) -> DataStreamWriter:
    """source -> foreachBatch(process), checkpointed, ``--once``: as a service's group query."""
    writer = source.writeStream.foreachBatch(process).option("checkpointLocation", checkpoint)
    return with_trigger(writer, once=True, interval="1 second")


def flaky_stream(
    spark: SparkSession, tmp_path: Path, failures: int
) -> tuple[StreamRunner, list[int], QueryIdentity, list[int]]:
    """A Delta table of 100 ids streamed into a list; the first ``failures`` batches fail."""
    source = str(tmp_path / "source")
    spark.range(100).write.format("delta").save(source)
    seen: list[int] = []
    attempts = [0]

    def process(batch: DataFrame, _batch_id: int) -> None:
        attempts[0] += 1
        if attempts[0] <= failures:
            raise RuntimeError("source flaky: try again")
        seen.extend(r.id for r in batch.collect())

    def on_failure(entity: str, error: str) -> Failure | None:
        return Failure(f"{entity}: flaky source", transient=True) if "flaky" in error else None

    runner = StreamRunner(spark, "test", on_failure=on_failure, max_restart_backoff_s=1)
    writer = foreach_batch_writer(
        spark.readStream.format("delta").load(source),
        process,
        str(tmp_path / "checkpoint"),
    )
    identity = QueryIdentity()
    runner.start("things", writer, identity)
    return runner, seen, identity, attempts


def test_an_entity_stopped_at_start_fails_the_run_after_the_others_ran(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A table held at start (EntityStoppedError, e.g. a publisher refused its topic): the
    group's query runs to its end, /health lists the held table as failing with its
    reason, run() raises it."""
    runner, seen, _, _ = flaky_stream(spark, tmp_path, failures=0)
    runner.stop_entity("others", "refused Describe on topic 'x'")
    health = runner.health()
    assert health["status"] == "failing"
    assert health["streams"]["others"]["problem"] == "stopped: refused Describe on topic 'x'"
    assert health["streams"]["others"]["active"] is False
    with pytest.raises(StreamFailedError, match=r"table 'others' refused Describe on topic"):
        runner.run()
    assert sorted(seen) == list(range(100))  # the group's query ran to its end


def test_a_transient_failure_restarts_from_the_checkpoint(
    spark: SparkSession, tmp_path: Path
) -> None:
    runner, seen, identity, attempts = flaky_stream(spark, tmp_path, failures=2)
    first_id = identity.get()
    runner.run()  # raises if the failure was not retried
    assert sorted(seen) == list(range(100))  # each row once: the failed batches wrote nothing
    assert attempts == [3]
    assert identity.get() == first_id  # same checkpoint, same query id (txnAppId)
    assert runner.health()["streams"]["things"]["problem"] is None  # recovered


def test_a_failure_it_does_not_recognise_stops_the_service(
    spark: SparkSession, tmp_path: Path
) -> None:
    runner = StreamRunner(spark, "test", on_failure=lambda entity, error: None)
    source = str(tmp_path / "source")
    spark.range(10).write.format("delta").save(source)

    def process(batch: DataFrame, batch_id: int) -> None:
        raise ValueError("a bug")

    writer = foreach_batch_writer(
        spark.readStream.format("delta").load(source),
        process,
        str(tmp_path / "checkpoint"),
    )
    runner.start("things", writer, QueryIdentity())
    with pytest.raises(StreamFailedError, match=r"(?s)'things' failed: .*ValueError: a bug"):
        runner.run()


def test_a_failure_between_batches_reads_as_the_same_failure_in_a_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A group's table fails where the table queue wrote it between batches: the service
    stops saying what its query failing in a batch with the same error says."""

    def on_failure(entity: str, error: BaseException | str) -> Failure | None:
        return Failure("stopped: the index is gone") if "index gone" in str(error) else None

    said = {}
    for between in (False, True):
        runner = StreamRunner(spark, "test", on_failure=on_failure)
        source = str(tmp_path / f"source-{between}")
        spark.range(10).write.format("delta").save(source)

        def process(batch: DataFrame, batch_id: int, between: bool = between) -> None:
            if not between:
                raise RuntimeError("index gone")

        writer = foreach_batch_writer(
            spark.readStream.format("delta").load(source),
            process,
            str(tmp_path / f"checkpoint-{between}"),
        )
        runner.start("things", writer, QueryIdentity())
        if between:
            runner.fail_group("things", RuntimeError("index gone"))
        with pytest.raises(StreamFailedError) as raised:
            runner.run()
        said[between] = str(raised.value)
    assert said[True] == said[False] == "test group 'things' stopped: the index is gone"


def test_runners_sharing_a_session_share_one_listener_and_log_only_their_batches(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cdc_shared.streaming.progress import BatchStats, _ProgressDispatch

    source = str(tmp_path / "source")
    spark.range(20).write.format("delta").save(source)

    def lag(progress: Any) -> float:  # read off the event's sources, as the services do
        return float(sum(read.numInputRows for read in progress.sources))

    runners = [StreamRunner(spark, service, lag=lag) for service in ("left", "right")]
    assert len(_ProgressDispatch._by_session[id(spark)]._loggers) == 2
    for runner in runners:

        def process(batch: DataFrame, batch_id: int, runner: StreamRunner = runner) -> None:
            runner.report("things", batch_id, BatchStats(counts={"seen": batch.count()}))

        writer = foreach_batch_writer(
            spark.readStream.format("delta").load(source),
            process,
            str(tmp_path / f"checkpoint-{runner.service}"),
        )
        runner.start("things", writer, QueryIdentity())
    with caplog.at_level("INFO", logger="cdc_shared.streaming"):
        for runner in runners:
            runner.run()
    batches = [vars(r) for r in caplog.records if r.getMessage() == "batch"]
    assert sorted((b["service"], b["seen"]) for b in batches) == [("left", 20), ("right", 20)]
    assert [b["lag"] for b in batches] == [20.0, 20.0]
    assert all(b["duration_ms"] > 0 and b["batch_id"] == 0 for b in batches), batches
    assert id(spark) not in _ProgressDispatch._by_session  # the last runner removed it


def test_a_kill_while_the_first_offset_was_written_does_not_block_the_restart(
    spark: SparkSession, tmp_path: Path
) -> None:
    # What a SIGKILL between creating and renaming `offsets/0` leaves behind (seen in a
    # chaos run): an empty hidden temp file and its checksum, and no batch at all.
    source = str(tmp_path / "source")
    spark.range(10).write.format("delta").save(source)
    offsets = tmp_path / "checkpoint" / "offsets"
    offsets.mkdir(parents=True)
    (offsets / ".0.55901991-a08d-405b-96d1-e593cc782270.tmp").touch()
    (offsets / "..0.55901991-a08d-405b-96d1-e593cc782270.tmp.crc").touch()
    seen: list[int] = []
    runner = StreamRunner(spark, "test", on_failure=lambda entity, error: None)
    writer = foreach_batch_writer(
        spark.readStream.format("delta").load(source),
        lambda batch, _batch_id: seen.extend(r.id for r in batch.collect()),
        str(tmp_path / "checkpoint"),
    )
    runner.start("things", writer, QueryIdentity())
    runner.run()  # raises if Spark refuses the checkpoint
    assert sorted(seen) == list(range(10))
