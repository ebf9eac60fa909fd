"""One writer per table: a lease per (service, entity) under the storage root.

Two instances of a service on the same root would write the same tables, checkpoints and
topics side by side: Delta's optimistic commits keep each table readable, but two
streaming queries on one checkpoint, or two MERGE writers racing, break the exactly-once
and ordering guarantees. So a service (alone or in ``cdc run``) takes a lease on every
(service, entity) it runs before it starts a stream (``start_service``), renews it from a
daemon thread while it runs, and releases it when it stops. A second instance finds the
lease held and refuses to start, naming the holder (:class:`WriterRunningError`).

A lease is a small JSON document (``StorageLayout.writer_lease``): who holds it (host,
boot, pid and the pid's start time, the command, the service, since when, a random token)
and until when. It is taken over when it has expired or been released, or at once when
its holder ran on this host and that process is gone (a SIGKILLed service restarted on
the same machine or in the same container does not wait for the expiry). A holder on
another host is waited out: its lease must expire first. Every write is conditional on
the version read (compare-and-swap), so a holder whose lease was taken over notices at
its next renewal and its service stops loudly (``on_lost``) instead of writing on.

Where: local disk (a root without a scheme) through :class:`LocalLeaseStore`; S3
(``s3a://``) through :class:`S3LeaseStore`, Hadoop's S3A file system of the service's
SparkSession, whose conditional writes (``If-None-Match: *`` to create, ``If-Match`` with
the ETag read to replace) make each write a compare-and-swap. Those leases are taken once
the session is built. A store that accepts conditional writes without checking them
(S3Proxy before 4.x, some S3-compatible servers) would make a lease a false promise, so
the service first probes it (:meth:`S3LeaseStore.enforces_conditions`). On a root whose
store does not enforce them, or has no store (other schemes), no lease is taken and the
service says so at start (:func:`acquire_writer_leases`); the deployment must keep one
instance per service (Kubernetes: one replica, ``strategy: Recreate``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from py4j.protocol import Py4JError
from pyspark.errors.exceptions.captured import CapturedException

from cdc_shared.contracts.layout import StorageLayout, display_name
from cdc_shared.jvm import bridge as jvm_bridge

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("cdc_shared.streaming.writer_lease")

#: How long a lease lasts without renewal. Long enough that a holder survives a stalled
#: disk, a long GC pause or a slow renewal (two heartbeats may fail before it could be
#: taken), short enough that a service moved to another host (whose old holder cannot
#: be checked for life) waits at most a minute; a restart on the same host takes over at
#: once. Hosts' clocks must agree to well within it (NTP does).
LEASE_TTL_S = 60.0
#: How often the holder renews: three times per lease.
HEARTBEAT_S = LEASE_TTL_S / 3
#: How soon a failed renewal (an I/O error, not a lost lease) is tried again.
RENEW_RETRY_S = 2.0


class WriterRunningError(RuntimeError):
    """Another instance holds the lease of a (service, entity): this one must not start."""


class LeaseConflictError(Exception):
    """A conditional write found the lease changed since it was read."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: enough to name it to an operator and to tell whether it lives."""

    host: str
    boot: str  # the host's boot id: a pid means nothing across reboots
    pid: int
    pid_start: str  # the pid's start time (since boot): a reused pid differs
    command: str  # e.g. "cdc-merger", "cdc run"
    service: str
    token: str  # random, per acquisition
    since: str  # ISO time of the acquisition

    def describe(self) -> str:
        """The holder as an error names it."""
        return (
            f"{self.command} (service {self.service}, pid {self.pid} on host {self.host}, "
            f"since {self.since})"
        )


@dataclass(frozen=True)
class Lease:
    """A lease document: its holder, until when, and whether it was released."""

    holder: Holder
    expires_at: float  # epoch seconds
    released: bool = False

    def to_bytes(self) -> bytes:
        """The JSON document stored."""
        document = {
            "holder": asdict(self.holder),
            "expires_at": dt.datetime.fromtimestamp(self.expires_at, dt.UTC).isoformat(),
            "released": self.released,
        }
        return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Lease:
        """Parse a stored document (ValueError when it is not one)."""
        try:
            document = json.loads(data)
            return cls(
                holder=Holder(**document["holder"]),
                expires_at=dt.datetime.fromisoformat(document["expires_at"]).timestamp(),
                released=bool(document.get("released", False)),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a writer lease: {exc}") from None


class LeaseStore(Protocol):
    """Where leases live; every write is conditional on the version last read."""

    def read(self, path: str) -> tuple[bytes, str] | None:
        """The document and its version; None when there is none."""

    def create(self, path: str, data: bytes) -> str:
        """Write a new document; LeaseConflictError if one exists. Returns its version."""

    def replace(self, path: str, data: bytes, version: str) -> str:
        """Overwrite the document if still at ``version`` (else LeaseConflictError)."""


class LocalLeaseStore:
    """Leases on local disk: each change under an exclusive ``flock`` of a sibling file.

    The lock serialises every read-compare-write of one lease among the processes of
    this host, and the kernel drops it when its process dies, so a killed holder never
    leaves it stuck (an ``O_EXCL`` create alone cannot tell a stale file from a live
    one). The document is written to a temporary file and renamed into place, so a
    reader sees the old or the new one, never half. The version is the content's hash:
    every write holds a new expiry, so it changes with each.
    """

    @contextlib.contextmanager
    def _locked(self, path: str) -> Iterator[None]:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    @staticmethod
    def _current(path: str) -> tuple[bytes, str] | None:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    @staticmethod
    def _write(path: str, data: bytes) -> str:
        temporary = Path(f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        return hashlib.sha256(data).hexdigest()

    def read(self, path: str) -> tuple[bytes, str] | None:
        """The document and its version; None when there is none."""
        return self._current(path)

    def create(self, path: str, data: bytes) -> str:
        """Write a new document; LeaseConflictError if one exists."""
        with self._locked(path):
            if self._current(path) is not None:
                raise LeaseConflictError(path)
            return self._write(path, data)

    def replace(self, path: str, data: bytes, version: str) -> str:
        """Overwrite the document if still at ``version``."""
        with self._locked(path):
            current = self._current(path)
            if current is None or current[1] != version:
                raise LeaseConflictError(path)
            return self._write(path, data)


#: Hadoop's create options (``Options.CreateFileOptionKeys``) that S3A turns into
#: conditional PUTs: create only if absent, or replace only the object with this ETag.
CONDITIONAL_CREATE = "fs.option.create.conditional.overwrite"
CONDITIONAL_REPLACE_ETAG = "fs.option.create.conditional.overwrite.etag"
#: What S3A raises when the store refuses a conditional write (HTTP 412 or 409).
_REFUSED = frozenset(
    {
        "org.apache.hadoop.fs.s3a.RemoteFileChangedException",
        "org.apache.hadoop.fs.FileAlreadyExistsException",
    }
)
#: What a call into the JVM raises when Java throws: Py4J's error, or PySpark's wrapper
#: for the exceptions it knows (IllegalArgumentException among them).
_JVM_ERRORS: tuple[type[Exception], ...] = (Py4JError, CapturedException)
#: What a file system without conditional creates raises for the mandatory options.
_UNSUPPORTED = frozenset(
    {"java.lang.IllegalArgumentException", "java.lang.UnsupportedOperationException"}
)


class S3LeaseStore:
    """Leases on S3 through Hadoop's S3A: every write a conditional PUT.

    A create sends ``If-None-Match: *`` and a replace ``If-Match`` with the ETag read
    (``S3AFileStatus.getEtag``); the store refuses either, atomically, when the object
    is there or has changed (``LeaseConflictError``). The version is the ETag: every
    write holds a new expiry, so it changes with each. The status is read before the
    content, so a write between the two leaves a version older than the content and the
    replace that follows is refused, never applied to a document not read; each write
    reads its own version back the same way. Java I/O failures come out as OSError, as
    on local disk, so a renewal retries them.
    """

    def __init__(self, spark: SparkSession) -> None:
        self._spark = spark

    def _fs(self, path: str) -> tuple[Any, Any]:
        return jvm_bridge.hadoop_path(self._spark, path)

    @staticmethod
    def _java(exc: BaseException) -> Any:
        """The Java exception behind a failed call (PySpark wraps some it knows)."""
        return getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)

    def _java_class(self, exc: BaseException) -> str:
        java = self._java(exc)
        return str(java.getClass().getName()) if java is not None else ""

    def _failed(self, exc: BaseException, what: str, path: str) -> Exception:
        """The error to raise for a failed JVM call: a conflict, or an OSError."""
        if self._java_class(exc) in _REFUSED:
            return LeaseConflictError(path)
        java = self._java(exc)
        detail = str(java.toString()) if java is not None else str(exc)
        return OSError(f"could not {what} the writer lease {path}: {detail}")

    def read(self, path: str) -> tuple[bytes, str] | None:
        """The document and its ETag; None when there is none."""
        fs, file = self._fs(path)
        try:
            etag = fs.getFileStatus(file).getEtag()
            data = jvm_bridge.read_text(self._spark, path).encode()
        except _JVM_ERRORS as exc:
            if self._java_class(exc) == "java.io.FileNotFoundException":
                return None
            raise self._failed(exc, "read", path) from None
        if etag is None:
            raise OSError(f"the store of {path} gives no ETag: it cannot hold writer leases")
        return data, str(etag)

    def _put(self, path: str, data: bytes, option: str, value: object) -> str:
        fs, file = self._fs(path)
        try:
            builder = fs.createFile(file).overwrite(option != CONDITIONAL_CREATE)
            stream = builder.must(option, value).build()
            try:
                stream.write(bytearray(data))
            finally:
                stream.close()  # the PUT, and its refusal, happen here
        except _JVM_ERRORS as exc:
            raise self._failed(exc, "write", path) from None
        # The PUT's own ETag is not returned: read it back, with the content, which is
        # unique to this write (its token and expiry). Still ours, the ETag read before
        # it is ours; another's, the lease was taken in between.
        current = self.read(path)
        if current is None or current[0] != data:
            raise LeaseConflictError(path)
        return current[1]

    def create(self, path: str, data: bytes) -> str:
        """Write a new document; LeaseConflictError if one exists. Returns its ETag."""
        return self._put(path, data, CONDITIONAL_CREATE, True)

    def replace(self, path: str, data: bytes, version: str) -> str:
        """Overwrite the document if its ETag is still ``version``."""
        return self._put(path, data, CONDITIONAL_REPLACE_ETAG, version)

    def enforces_conditions(self, folder: str) -> bool:
        """Whether the store refuses a second create of one object (a probe under ``folder``).

        False when the file system has no conditional create or the store accepts the
        second write: its leases would not exclude anyone.
        """
        probe = f"{folder}/_probe-{secrets.token_hex(8)}"
        try:
            self.create(probe, b"probe\n")
        except OSError as exc:
            if any(name in str(exc) for name in _UNSUPPORTED):
                return False
            raise
        try:
            self.create(probe, b"probe again\n")
        except LeaseConflictError:
            return True
        else:
            return False
        finally:
            fs, file = self._fs(probe)
            with contextlib.suppress(*_JVM_ERRORS):
                fs.delete(file, False)


# --- who is this process, and does a holder still live ------------------------------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux); empty if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name may hold spaces


def _command() -> str:
    """How this process was started, e.g. ``cdc-merger`` or ``cdc run``."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    first = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""
    return f"{name} {first}".strip() if name == "cdc" else name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def holder_alive(holder: Holder) -> bool:
    """False when the holder ran on this host (this boot) and its process is gone.

    A holder on another host (or from before a reboot of this one) cannot be checked
    from here: it counts as alive until its lease expires.
    """
    if holder.host != socket.gethostname():
        return True
    if holder.boot != _boot_id():
        return not holder.boot  # a reboot ended it; unknown boots are not judged
    if not _pid_alive(holder.pid):
        return False
    started = _pid_start(holder.pid)
    return not (holder.pid_start and started and started != holder.pid_start)


def lease_is_live(lease: Lease, now: float | None = None) -> bool:
    """Whether the lease still binds: not released, not expired, its holder not gone."""
    now = dt.datetime.now(dt.UTC).timestamp() if now is None else now
    return not lease.released and lease.expires_at > now and holder_alive(lease.holder)


# --- one lease ---------------------------------------------------------------------


class WriterLease:
    """One (service, entity)'s lease, held by this process: acquire, renew, release."""

    def __init__(
        self,
        store: LeaseStore,
        path: str,
        service: str,
        ttl_s: float = LEASE_TTL_S,
        clock: Callable[[], float] = lambda: dt.datetime.now(dt.UTC).timestamp(),
    ) -> None:
        self.store = store
        self.path = path
        self.service = service
        self.ttl_s = ttl_s
        self._clock = clock
        self._version: str | None = None
        self._lease: Lease | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether this process holds the lease (as of its last write)."""
        return self._lease is not None and not self._lease.released

    def expired(self) -> bool:
        """Whether the lease held has run out (so another instance may have taken it)."""
        return self._lease is None or self._clock() >= self._lease.expires_at

    def acquire(self) -> None:
        """Take the lease: new, released, expired or its holder gone; else WriterRunningError."""
        now = self._clock()
        holder = Holder(
            host=socket.gethostname(),
            boot=_boot_id(),
            pid=os.getpid(),
            pid_start=_pid_start(os.getpid()),
            command=_command(),
            service=self.service,
            token=secrets.token_hex(16),
            since=dt.datetime.fromtimestamp(now, dt.UTC).isoformat(timespec="seconds"),
        )
        lease = Lease(holder, now + self.ttl_s)
        for _ in range(5):  # another starter may change it between our read and write
            current = self.store.read(self.path)
            try:
                if current is None:
                    version = self.store.create(self.path, lease.to_bytes())
                else:
                    self._refuse_if_live(current[0], now)
                    version = self.store.replace(self.path, lease.to_bytes(), current[1])
            except LeaseConflictError:
                continue
            with self._lock:
                self._lease, self._version = lease, version
            if current is not None:
                log.info("writer lease taken over", extra={"lease": self.path})
            return
        raise WriterRunningError(
            f"cannot take the writer lease {self.path}: it changed under every attempt; "
            "another instance is starting on the same storage root"
        )

    def check(self) -> None:
        """WriterRunningError if another instance holds the lease now (takes nothing)."""
        current = self.store.read(self.path)
        if current is not None:
            self._refuse_if_live(current[0], self._clock())

    def _refuse_if_live(self, data: bytes, now: float) -> None:
        try:
            lease = Lease.from_bytes(data)
        except ValueError:
            return  # not a lease (e.g. a torn copy by hand): take it
        if lease_is_live(lease, now):
            raise WriterRunningError(
                f"{display_name(self.service)} cannot start: {lease.holder.describe()} "
                f"already writes this storage root (writer lease {self.path}, valid until "
                f"{dt.datetime.fromtimestamp(lease.expires_at, dt.UTC):%Y-%m-%dT%H:%M:%SZ}). "
                "Stop that instance first (one instance per service and root; Kubernetes: "
                "replicas 1, strategy Recreate); a lease of a host that is gone lapses "
                f"{self.ttl_s:g} s after its last renewal"
            )

    def renew(self) -> None:
        """Extend the lease by its TTL; LeaseConflictError if another took it over."""
        with self._lock:
            if self._lease is None or self._version is None or self._lease.released:
                raise LeaseConflictError(self.path)
            lease = replace(self._lease, expires_at=self._clock() + self.ttl_s)
            self._version = self.store.replace(self.path, lease.to_bytes(), self._version)
            self._lease = lease

    def release(self) -> None:
        """Mark the lease released, if still ours, so the next start takes it at once."""
        with self._lock:
            if self._lease is None or self._version is None or self._lease.released:
                return
            lease = replace(self._lease, expires_at=self._clock(), released=True)
            try:
                self._version = self.store.replace(self.path, lease.to_bytes(), self._version)
            except LeaseConflictError:
                return  # taken over meanwhile: not ours to release
            except OSError:
                log.warning("could not release a writer lease", extra={"lease": self.path})
                return
            self._lease = lease


class LeaseKeeper:
    """A service's leases held by this process: renewed by a daemon thread, released on stop.

    When a renewal finds a lease taken over, or cannot renew it before it expires,
    ``on_lost`` is called once with what happened: the service must stop writing.
    """

    def __init__(
        self,
        leases: list[WriterLease],
        on_lost: Callable[[str], object],
        heartbeat_s: float = HEARTBEAT_S,
        retry_s: float = RENEW_RETRY_S,
    ) -> None:
        self.leases = leases
        self._on_lost = on_lost
        self._heartbeat_s = heartbeat_s
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        """Start renewing (a daemon thread)."""
        self._thread = threading.Thread(target=self._beat, name="writer-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        wait = self._heartbeat_s
        while not self._stop.wait(wait):
            wait = self._heartbeat_s
            for lease in self.leases:
                try:
                    lease.renew()
                except LeaseConflictError:
                    self._lost(f"its writer lease {lease.path} was taken over by another instance")
                    return
                except OSError as exc:
                    if lease.expired():
                        self._lost(f"could not renew its writer lease {lease.path}: {exc}")
                        return
                    log.warning(
                        "writer lease renewal failed; retrying",
                        extra={"lease": lease.path, "error": str(exc)},
                    )
                    wait = self._retry_s

    def _lost(self, reason: str) -> None:
        log.error("writer lease lost; stopping", extra={"reason": reason})
        self._on_lost(reason)

    def release(self) -> None:
        """Stop renewing and release every lease (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for lease in self.leases:
            lease.release()


def lease_store(root: str, spark: SparkSession | None = None) -> LeaseStore | None:
    """The lease store for a storage root; None where leases are not kept.

    Local disk always has one; an ``s3a://`` root has one through ``spark``'s S3A file
    system (none without a session); other schemes have none.
    """
    if "://" not in root:
        return LocalLeaseStore()
    if spark is not None and root.split("://", 1)[0] == "s3a":
        return S3LeaseStore(spark)
    return None


def _no_lease(service: str, root: str, why: str) -> None:
    log.warning(
        f"no writer lease on this storage root: {why}, so a second instance of the "
        "service would not be refused; run one instance per service (Kubernetes: "
        "replicas 1, strategy Recreate)",
        extra={"service": service, "storage_root": root},
    )


def acquire_writer_leases(
    root: str,
    service: str,
    entities: list[str],
    on_lost: Callable[[str], object],
    spark: SparkSession | None = None,
) -> LeaseKeeper | None:
    """Take ``service``'s lease on each entity's tables and keep them renewed.

    WriterRunningError (releasing any taken) when another instance holds one. On S3 the
    leases go through ``spark``'s file system, after a probe that the store enforces
    conditional writes. None, with a warning, on a root without a lease store or whose
    store does not enforce them: one writer is then not enforced.
    """
    store = lease_store(root, spark)
    layout = StorageLayout(root)
    if store is None:
        _no_lease(service, root, "this kind of storage has no lease store")
        return None
    if isinstance(store, S3LeaseStore):
        folder = layout.writer_lease(service, "probe").rsplit("/", 1)[0]
        if not store.enforces_conditions(folder):
            _no_lease(service, root, "the store does not enforce conditional writes")
            return None
    taken: list[WriterLease] = []
    try:
        for entity in entities:
            lease = WriterLease(store, layout.writer_lease(service, entity), service)
            lease.acquire()
            taken.append(lease)
    except BaseException:
        for lease in taken:
            lease.release()
        raise
    return LeaseKeeper(taken, on_lost).start()


def refuse_if_running(
    root: str, services: list[str], entities: list[str], spark: SparkSession | None = None
) -> None:
    """WriterRunningError naming a live lease of ``services`` on ``entities``, if any.

    A check before starting for ``cdc run --once``, which takes each service's leases
    only when it reaches that service: a conflict is reported before anything runs (on
    S3 only with ``spark``, through which its leases are read).
    """
    store = lease_store(root, spark)
    if store is None:
        return
    layout = StorageLayout(root)
    for service in services:
        for entity in entities:
            WriterLease(store, layout.writer_lease(service, entity), service).check()


def live_leases(
    root: str,
    services: tuple[str, ...],
    entities: list[str],
    read: Callable[[str], bytes | None] | None = None,
) -> list[str]:
    """Each live lease under ``root``, described for an operator (``cdc maintenance``).

    ``read`` returns a lease file's bytes (None when there is none), from wherever the
    root is: the operator's tools read object storage without a JVM. Without it the
    local disk is read, and a root on object storage shows no lease.
    """
    if read is None:
        store = lease_store(root)
        if store is None:
            return []

        def read(path: str) -> bytes | None:
            current = store.read(path)
            return None if current is None else current[0]

    layout = StorageLayout(root)
    found = []
    for service in services:
        for entity in entities:
            path = layout.writer_lease(service, entity)
            document = read(path)
            if document is None:
                continue
            try:
                lease = Lease.from_bytes(document)
            except ValueError:
                continue
            if lease_is_live(lease):
                found.append(f"writer lease {path}: held by {lease.holder.describe()}")
    return found
