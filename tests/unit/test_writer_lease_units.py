"""Writer leases on local disk: one holder, takeover of expired and dead holders, loss.

Each test plays two instances with two ``WriterLease`` objects on the same file; a
holder of another host, or one whose process is gone, is written into the file as the
real holder would have written it.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cdc_shared.contracts.layout import MERGER, SERVICES, StorageLayout
from cdc_shared.streaming.writer_lease import (
    Lease,
    LeaseConflictError,
    LeaseKeeper,
    LocalLeaseStore,
    WriterLease,
    WriterRunningError,
    acquire_writer_leases,
    live_leases,
    refuse_if_running,
)


class Clock:
    """A clock the test moves by hand (epoch seconds)."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _lease(tmp_path: Path, clock: Clock, ttl_s: float = 60.0) -> WriterLease:
    path = StorageLayout(str(tmp_path)).writer_lease(MERGER, "customers")
    return WriterLease(LocalLeaseStore(), path, MERGER, ttl_s=ttl_s, clock=clock)


def _stored(lease: WriterLease) -> Lease:
    return Lease.from_bytes(Path(lease.path).read_bytes())


def _rewrite_holder(lease: WriterLease, **changes: object) -> None:
    """Make the stored lease look as if another process (or host) had written it."""
    stored = _stored(lease)
    holder = dataclasses.replace(stored.holder, **changes)  # type: ignore[arg-type]
    Path(lease.path).write_bytes(dataclasses.replace(stored, holder=holder).to_bytes())


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_instance_is_refused_naming_the_holder(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    _rewrite_holder(first, host="node-a")  # another host: cannot be checked for life
    with pytest.raises(WriterRunningError) as refused:
        second.acquire()
    message = str(refused.value)
    assert "\n" not in message
    for part in ("merger cannot start", "node-a", f"pid {_stored(first).holder.pid}", "since"):
        assert part in message
    assert first.path in message and "Stop that instance first" in message
    assert first.path.endswith("/_leases/merger/customers.json")


def test_an_expired_lease_is_taken_over_and_its_old_holder_notices(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    _rewrite_holder(first, host="node-a")
    clock.now += 59.0
    with pytest.raises(WriterRunningError):
        second.acquire()
    clock.now += 1.0  # now exactly expired
    second.acquire()
    assert _stored(second).holder.token == second._lease.holder.token  # type: ignore[union-attr]
    with pytest.raises(LeaseConflictError):
        first.renew()  # its next heartbeat finds the lease gone
    first.release()  # and a release does not free the new holder's lease
    assert not _stored(second).released


def test_renewal_keeps_the_lease(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    for _ in range(3):  # without renewals it would have expired after 60 s
        clock.now += 40.0
        first.renew()
    with pytest.raises(WriterRunningError):
        second.acquire()
    assert _stored(first).expires_at == clock.now + 60.0


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    _rewrite_holder(first, pid=_dead_pid())
    second.acquire()  # well before the expiry
    assert _stored(second).holder.host == socket.gethostname()


def test_a_reused_pid_does_not_keep_a_lease(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    _rewrite_holder(first, pid_start="1")  # this pid, but a process started at tick 1
    second.acquire()


def test_a_live_holder_in_this_process_is_refused(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    with pytest.raises(WriterRunningError):
        second.acquire()


def test_a_released_lease_is_taken_at_once_and_not_live(tmp_path: Path) -> None:
    clock = Clock()
    first, second = _lease(tmp_path, clock), _lease(tmp_path, clock)
    first.acquire()
    _rewrite_holder(first, host="node-a")
    first._version = LocalLeaseStore().read(first.path)[1]  # type: ignore[index]
    first.release()
    assert _stored(first).released
    assert live_leases(str(tmp_path), SERVICES, ["customers"]) == []
    second.acquire()


def test_only_one_of_racing_starters_wins(tmp_path: Path) -> None:
    clock = Clock()
    racers = [_lease(tmp_path, clock) for _ in range(8)]
    outcomes: list[str] = []

    def start(lease: WriterLease) -> None:
        try:
            lease.acquire()
            outcomes.append("won")
        except WriterRunningError:
            outcomes.append("refused")

    threads = [threading.Thread(target=start, args=(r,)) for r in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["won"]


def test_a_lost_lease_calls_on_lost_once(tmp_path: Path) -> None:
    lease = _lease(tmp_path, Clock())
    lease.acquire()
    _rewrite_holder(lease, host="node-a")  # another instance took it over
    lost: list[str] = []
    keeper = LeaseKeeper([lease], lost.append, heartbeat_s=0.01).start()
    keeper._thread.join(5.0)  # type: ignore[union-attr]
    assert len(lost) == 1 and "taken over" in lost[0] and lease.path in lost[0]
    keeper.release()
    assert _stored(lease).holder.host == "node-a"  # not released: not ours


def test_an_unrenewable_lease_is_lost_once_it_expires(tmp_path: Path) -> None:
    clock = Clock()
    lease = _lease(tmp_path, clock)
    lease.acquire()
    lock = Path(f"{lease.path}.lock")
    lock.unlink()
    lock.mkdir()  # a directory where the lock file was: every renewal fails to open it
    lost: list[str] = []
    keeper = LeaseKeeper([lease], lost.append, heartbeat_s=0.01, retry_s=0.01).start()
    threading.Event().wait(0.2)
    assert lost == []  # failing renewals are retried while the lease lasts
    clock.now += 60.0
    keeper._thread.join(5.0)  # type: ignore[union-attr]
    assert len(lost) == 1 and "could not renew" in lost[0]


def test_leases_of_a_service_and_cdc_run_meet(tmp_path: Path) -> None:
    keeper = acquire_writer_leases(str(tmp_path), MERGER, ["customers", "orders"], print)
    assert keeper is not None
    try:
        assert len(live_leases(str(tmp_path), SERVICES, ["customers", "orders"])) == 2
        with pytest.raises(WriterRunningError):
            refuse_if_running(str(tmp_path), ["ingestor", "merger"], ["orders"])
        with pytest.raises(WriterRunningError):
            acquire_writer_leases(str(tmp_path), MERGER, ["addresses", "orders"], print)
        # the refused start released what it had taken
        assert json.loads(Path(tmp_path, "_leases/merger/addresses.json").read_text())["released"]
    finally:
        keeper.release()
    assert live_leases(str(tmp_path), SERVICES, ["customers", "orders"]) == []
    refuse_if_running(str(tmp_path), ["merger"], ["customers", "orders"])


def test_object_storage_roots_say_no_lease_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    assert acquire_writer_leases("s3a://bucket/root", MERGER, ["customers"], print) is None
    assert "no writer lease on this storage root" in caplog.text
