"""One writer per table, between real processes: a second instance is refused.

A continuous ``cdc-merger`` takes its writer lease and waits for bronze; a second
``cdc-merger`` and a ``cdc run`` on the same root exit 1 naming it. SIGKILLed, it leaves
its lease behind, and its restart takes the lease over at once, not after the expiry.
A service whose lease another instance took over stops at its next heartbeat. On an
``s3a://`` root the same leases go through S3A's conditional writes to the S3 server.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from cdc_devkit import infra
from cdc_shared.config.connections import ObjectStorageConfig
from cdc_shared.contracts.layout import MERGER, StorageLayout
from cdc_shared.jvm import bridge as jvm_bridge
from cdc_shared.streaming.failures import StreamFailedError
from cdc_shared.streaming.runner import QueryIdentity, StreamRunner
from cdc_shared.streaming.writer_lease import (
    LEASE_TTL_S,
    LeaseConflictError,
    LeaseKeeper,
    LocalLeaseStore,
    S3LeaseStore,
    WriterLease,
    WriterRunningError,
    acquire_writer_leases,
    refuse_if_running,
)
from pyspark.sql import SparkSession
from support.cluster import command_path, launch_service, log_tail, service_env, sigkill_group
from support.pipelines import PipelineFactory

pytestmark = pytest.mark.integration


def _holder_pid(lease: Path, timeout_s: float, not_pid: int | None = None) -> int:
    """The pid holding ``lease`` once there is one (other than ``not_pid``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lease.exists():
            document = json.loads(lease.read_text())
            if not document["released"] and document["holder"]["pid"] != not_pid:
                return int(document["holder"]["pid"])
        time.sleep(0.1)
    raise AssertionError(f"no new holder of {lease} within {timeout_s:.0f} s")


def _refused(command: list[str], log: Path) -> str:
    """Run ``command`` to its end: it must exit 1 at once; its log."""
    with log.open("ab") as out:
        code = subprocess.run(
            command,
            check=False,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=service_env(),
            timeout=120,
        ).returncode
    assert code == 1, f"{command[0]} exited {code}, not 1:\n{log_tail(log)}"
    return log.read_text()


def test_a_second_writer_is_refused_and_a_killed_one_is_taken_over(
    make_pipeline: PipelineFactory, tmp_path: Path
) -> None:
    pipeline = make_pipeline(entities=("customers",), merger={"metrics_port": 0})
    lease = Path(pipeline.config.layout.writer_lease(MERGER, "customers"))
    first = launch_service("cdc-merger", pipeline, tmp_path / "first.log")
    try:
        pid = _holder_pid(lease, 60)
        assert pid == first.pid
        assert first.poll() is None, log_tail(tmp_path / "first.log")

        second = _refused(
            [command_path("cdc-merger"), "--config", str(pipeline.path)], tmp_path / "second.log"
        )
        refusal = next(line for line in second.splitlines() if "cannot start" in line)
        for part in ("merger cannot start", f"pid {pid}", "cdc-merger", str(lease), "since"):
            assert part in refusal, refusal
        application = _refused(
            [command_path("cdc"), "run", "--config", str(pipeline.path)], tmp_path / "run.log"
        )
        assert f"pid {pid}" in application and str(lease) in application
        assert first.poll() is None  # the holder runs on, untouched
    finally:
        sigkill_group(first)

    started = time.monotonic()
    restart = launch_service("cdc-merger", pipeline, tmp_path / "restart.log")
    try:
        _holder_pid(lease, LEASE_TTL_S / 2, not_pid=pid)  # its lease is still unexpired
        assert time.monotonic() - started < LEASE_TTL_S / 2
        assert restart.poll() is None, log_tail(tmp_path / "restart.log")
    finally:
        sigkill_group(restart)


def test_a_lease_taken_over_stops_the_running_service_at_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The holder's heartbeat finds its lease taken: its runner stops, ``run()`` raises."""
    runner = StreamRunner(spark, MERGER)
    store = LocalLeaseStore()
    lease = WriterLease(
        store, StorageLayout(str(tmp_path)).writer_lease(MERGER, "customers"), MERGER
    )
    lease.acquire()
    keeper = LeaseKeeper([lease], runner.fail, heartbeat_s=0.2).start()
    runner.on_close(keeper.release)
    writer = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 5)
        .load()
        .writeStream.foreachBatch(lambda batch, batch_id: None)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="200 milliseconds")
    )
    runner.start("default", writer, QueryIdentity())  # the group query writing customers
    document = json.loads(Path(lease.path).read_text())
    document["holder"] |= {"host": "node-b", "token": "another instance"}
    Path(lease.path).write_text(json.dumps(document))  # what a takeover writes
    with pytest.raises(StreamFailedError, match=r"writer lease .* was taken over"):
        runner.run()
    assert not runner.queries["default"].isActive
    assert json.loads(Path(lease.path).read_text())["holder"]["host"] == "node-b"


def _s3_root(spark: SparkSession, endpoint: str) -> str:
    """A fresh prefix of the local S3 bucket, its S3A settings on the session."""
    storage = ObjectStorageConfig(
        endpoint=endpoint,
        region=infra.S3_REGION,
        path_style_access=True,
        access_key=infra.S3_ACCESS_KEY,
        secret_key=infra.S3_SECRET_KEY,
    )
    jvm_bridge.set_hadoop_options(spark, storage.hadoop_options(infra.S3_BUCKET))
    return f"s3a://{infra.S3_BUCKET}/pytest-lease-{uuid.uuid4().hex[:8]}"


@pytest.mark.s3
def test_on_s3_a_second_writer_is_refused_and_an_expired_lease_taken_over(
    spark: SparkSession, s3_endpoint: str, tmp_path: Path
) -> None:
    """Leases on an ``s3a://`` root, through S3A's conditional writes on the real server.

    The store is probed as enforcing (a local file system, which has no conditional
    create, is not); a second instance is refused naming the first; an expired lease
    is taken over, and its former holder's renewal is refused.
    """
    root = _s3_root(spark, s3_endpoint)
    path = StorageLayout(root).writer_lease(MERGER, "customers")
    store = S3LeaseStore(spark)
    assert store.enforces_conditions(path.rsplit("/", 1)[0])
    # A file system without conditional creates is found out: no lease would bind there.
    assert not store.enforces_conditions(f"file://{tmp_path}")

    lost: list[str] = []
    keeper = acquire_writer_leases(root, MERGER, ["customers"], lost.append, spark)
    assert keeper is not None, "no lease taken on S3"
    try:
        with pytest.raises(WriterRunningError) as refused:
            acquire_writer_leases(root, MERGER, ["customers"], lost.append, spark)
        for part in ("merger cannot start", f"pid {os.getpid()}", path, "since"):
            assert part in str(refused.value), str(refused.value)
        with pytest.raises(WriterRunningError, match="cannot start"):
            refuse_if_running(root, [MERGER], ["customers"], spark)
    finally:
        keeper.release()
    refuse_if_running(root, [MERGER], ["customers"], spark)  # released: free to take
    assert not lost

    # A holder whose lease ran out (its clock a TTL and more behind) is taken over.
    stale = WriterLease(store, path, MERGER, clock=lambda: time.time() - 2 * LEASE_TTL_S)
    stale.acquire()
    successor = WriterLease(store, path, MERGER)
    successor.acquire()
    with pytest.raises(LeaseConflictError):
        stale.renew()
    stale.release()  # not its own any more: leaves the successor's lease alone
    document = json.loads(jvm_bridge.read_text(spark, path))
    assert document["holder"]["token"] == successor._lease.holder.token  # type: ignore[union-attr]
    assert not document["released"]
    successor.renew()
    successor.release()
