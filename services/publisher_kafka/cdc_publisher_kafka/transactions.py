"""Publishing a micro-batch to Kafka in one transaction, together with its progress.

The progress (the last silver commit version published, and the Spark batch that did
it) is committed as a consumer-group offset on a progress topic inside the same Kafka
transaction as the events: either both become visible or neither does. After a crash,
the new producer's ``init_transactions`` fences the old one and resolves its open
transaction, and the progress read back tells which batches and versions are already
out, so a replayed micro-batch publishes nothing twice.

The progress also records the last offset written to each partition of the change
topic: a topic whose end went back below it (deleted and created again) is found at
start, instead of publishing on after a gap. An event larger than the topic accepts
(``max.message.bytes``, read from the broker at start) is not sent but handed back to
the caller, to quarantine, so that one event cannot stop the topic. An operation the
broker's ACLs refuse is not retried: the transaction is aborted and
PermissionRefusedError names the missing permission.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cdc_shared.clients.connect import kafka_client_config, kafka_missing_permission, make_admin
from cdc_shared.clients.retry import retrying
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.config.services import PublisherKafkaConfig
from cdc_shared.contracts.layout import publisher_progress_group
from cdc_shared.streaming.failures import KnownFailureError
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka import Message as KafkaMessage
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
)
from tenacity import Retrying

from cdc_publisher_kafka.progress import Progress

log = logging.getLogger(__name__)

#: Errors librdkafka does not flag retriable on every call (e.g. reading the progress
#: right after a broker start answers NOT_COORDINATOR) but that pass with time.
_TRANSIENT_CODES = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
    }
)

#: The broker's ACLs refused the operation: they stay as they are until an administrator
#: changes them, so such an error is never retried (see PermissionRefusedError).
_AUTHORIZATION_CODES = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)

#: The first wait of a retry (the config sets the longest, ``max_backoff_s``).
INITIAL_BACKOFF_S = 0.5

#: How long ``send_offsets_to_transaction`` may take before its producer counts as stuck
#: and is replaced (see ``_within_deadline``), and the timeout librdkafka itself is given.
#: On a reachable broker the call takes milliseconds, a coordinator still loading after a
#: restart a few seconds; after some broker restarts it never returns, and every second
#: of this deadline is a second that no change of the entity is published.
SEND_OFFSETS_DEADLINE_S = 30.0
SEND_OFFSETS_TIMEOUT_S = 20.0

Message = tuple[bytes, bytes | None]  # (key, value); a None value is a tombstone

#: What a record batch holding one record adds to its key and value, at most: the batch
#: header (61 bytes) and the record's framing (its length, attributes, timestamp and
#: offset deltas, key and value lengths, header count; varints at their longest). The
#: broker compares the batch with the topic's ``max.message.bytes``.
RECORD_OVERHEAD_BYTES = 61 + 5 + 1 + 10 + 5 + 5 + 5 + 5

#: The producer's batches at most (smaller when the topic accepts less).
BATCH_BYTES = 1_000_000

#: librdkafka's default ``message.max.bytes``: the largest message it sends.
PRODUCER_MAX_MESSAGE_BYTES = 1_000_000

#: A message too large: refused by librdkafka itself (on produce), or by the broker.
_SIZE_CODES = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)


class StuckProducerError(RuntimeError):
    """A producer call blocked past its deadline; a fresh producer replaced the stuck one."""


class PublisherFatalError(RuntimeError):
    """The producer cannot go on (fenced by another instance, or a fatal Kafka error)."""


class PermissionRefusedError(KnownFailureError):
    """The broker's ACLs refused an operation; the message names the missing permission.

    On the change topic, the progress topic or the progress group: it stops that table
    alone, since the other tables' topics and groups have their own ACLs. Not transient:
    the transaction was aborted, nothing of it is visible, and the progress still says
    what was published, so a restart once the ACL is granted loses nothing.
    """

    entity_only = True


class TransactionalIdRefusedError(PermissionRefusedError):
    """The ACLs refused the publisher's transactional id: it cannot run a transaction.

    It stops the service.
    """

    entity_only = False


class ChangeTopicResetError(RuntimeError):
    """The change topic holds less than the progress says was written to it.

    It was deleted (and created again, e.g. by the publisher's start): the events
    published before are gone, and publishing on would leave them missing for good.
    """


class _RefusedBySize(Exception):
    """The broker refused messages of the open transaction as too large (by index)."""

    def __init__(self, indexes: dict[int, str]) -> None:
        super().__init__(f"{len(indexes)} messages too large")
        self.indexes = indexes  # message index -> the broker's error


@dataclass(frozen=True)
class Oversized:
    """An event not sent because the change topic does not accept one that large."""

    index: int  # its position in the messages given to ``publish``
    size_bytes: int  # key + value + record framing
    limit_bytes: int  # what the topic (or the producer) accepts
    reason: str

    def describe(self) -> str:
        """Its size against the limit, and why."""
        return (
            f"change event of {self.size_bytes} bytes (key, value and record framing) is "
            f"larger than the {self.limit_bytes} bytes the change topic accepts: {self.reason}"
        )


def event_size(key: bytes, value: bytes | None) -> int:
    """The bytes an event takes in a record batch of its own, at most."""
    return len(key) + len(value or b"") + RECORD_OVERHEAD_BYTES


def ensure_topics(admin: AdminClient, topics: Sequence[NewTopic]) -> None:
    """Create the topics that do not exist yet (existing ones are left as they are)."""
    existing = set(admin.list_topics(timeout=30).topics)
    missing = [t for t in topics if t.topic not in existing]
    if not missing:
        return
    for name, future in admin.create_topics(missing, operation_timeout=30).items():
        try:
            future.result(60)
            log.info("created topic", extra={"topic": name})
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


class TransactionalPublisher:
    """One transactional producer per change topic, with its progress on a progress topic."""

    def __init__(
        self,
        kafka: KafkaConfig,
        settings: PublisherKafkaConfig,
        change_topic: str,
        on_problem: Callable[[str | None], None] = lambda _: None,
    ) -> None:
        self.settings = settings
        self.change_topic = change_topic
        self.transactional_id = publisher_progress_group(change_topic)
        self._kafka = kafka
        self._progress_partition = TopicPartition(settings.progress_topic, 0)
        self._on_problem = on_problem
        self._producer_config = kafka_client_config(
            kafka,
            **{
                "transactional.id": self.transactional_id,
                "transaction.timeout.ms": settings.transaction_timeout_ms,
                "enable.idempotence": True,
                "linger.ms": 20,
                "batch.size": BATCH_BYTES,
                "queue.buffering.max.messages": 1_000_000,
                "queue.buffering.max.kbytes": 1_048_576,
            },
        )
        self._producer = Producer(self._producer_config)
        # Only a holder of the group metadata (and a reader of the change topic's
        # watermarks); it never subscribes or polls.
        self._group = Consumer(
            kafka_client_config(
                kafka,
                **{
                    "group.id": self.transactional_id,
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                },
            )
        )
        self.progress: Progress | None = None
        #: The largest event the change topic accepts (``event_size``); set by ``start``.
        self.max_event_bytes = PRODUCER_MAX_MESSAGE_BYTES
        self._limit_name = "the producer's message.max.bytes"  # what sets max_event_bytes

    def start(self) -> Progress | None:
        """Read the topic's size limit, fence any older instance, read what is published.

        Raises ChangeTopicResetError when the change topic holds less than the progress
        says was written to it, PermissionRefusedError when the broker's ACLs refuse one
        of these reads (or the transactional id).
        """
        self._fit_to(self._read_size_limit(), started=False)
        self._with_retries("init_transactions", lambda: self._producer.init_transactions(60))
        self.progress = self._read_progress()
        if self.progress is not None:
            self._check_not_reset(self.progress)
        log.info(
            "publisher ready",
            extra={
                "topic": self.change_topic,
                "published_up_to_version": self.progress.version if self.progress else None,
                "max_event_bytes": self.max_event_bytes,
            },
        )
        return self.progress

    def _read_size_limit(self) -> int:
        """The change topic's ``max.message.bytes``, as the broker applies it."""
        admin = make_admin(self._kafka)
        resource = ConfigResource("topic", self.change_topic)

        def describe() -> int:
            configs = admin.describe_configs([resource], request_timeout=30)[resource].result(60)
            return int(configs["max.message.bytes"].value)

        limit: int = self._with_retries("describe the change topic", describe)
        return limit

    def _fit_to(self, topic_limit: int, started: bool) -> None:
        """Size events and batches to what the topic accepts (see ``_sizes``).

        A new batch size needs a new producer (``started``: one that already ran
        ``init_transactions``, which the new one repeats, fencing it).
        """
        self.max_event_bytes, batch_bytes = self._sizes(topic_limit)
        self._limit_name = (
            "the topic's max.message.bytes"
            if topic_limit == self.max_event_bytes
            else "the producer's message.max.bytes"
        )
        if batch_bytes != self._producer_config["batch.size"]:
            self._producer_config["batch.size"] = batch_bytes
            self._replace_producer(started)

    def _sizes(self, topic_limit: int) -> tuple[int, int]:
        """The largest event, and the largest batch, for a topic limit.

        The broker refuses a whole batch larger than the topic's limit, so batches stay
        below it; the producer's own ``message.max.bytes`` caps events too.
        """
        producer_limit = int(
            self._producer_config.get("message.max.bytes", PRODUCER_MAX_MESSAGE_BYTES)
        )
        max_event = min(topic_limit, producer_limit)
        return max_event, max(1, min(BATCH_BYTES, max_event - RECORD_OVERHEAD_BYTES))

    def _replace_producer(self, started: bool) -> None:
        """A new producer of the same transactional id (the old one is abandoned)."""
        self._producer = Producer(self._producer_config)
        if started:
            self._with_retries("init_transactions", lambda: self._producer.init_transactions(60))

    def _read_progress(self) -> Progress | None:
        def read() -> list[TopicPartition]:
            result: list[TopicPartition] = self._group.committed(
                [self._progress_partition], timeout=30
            )
            return result

        (committed,) = self._with_retries("read progress", read)
        if committed.offset < 0 or not committed.metadata:
            return None
        return Progress.from_metadata(committed.metadata)

    def _end_offsets(self) -> dict[int, int]:
        """The change topic's end (high watermark) per partition."""

        def read() -> dict[int, int]:
            topic = self._group.list_topics(self.change_topic, timeout=30).topics[self.change_topic]
            if topic.error is not None:
                raise KafkaException(topic.error)
            return {
                p: int(
                    self._group.get_watermark_offsets(
                        TopicPartition(self.change_topic, p), timeout=30
                    )[1]
                )
                for p in topic.partitions
            }

        ends: dict[int, int] = self._with_retries("read the change topic's offsets", read)
        return ends

    def _check_not_reset(self, progress: Progress) -> None:
        """Raise ChangeTopicResetError if the change topic ends before what was written.

        A progress without offsets (an older publisher's) can only tell an empty topic.
        """
        ends = self._end_offsets()
        behind: dict[int, tuple[int | None, int | None]]
        if progress.offsets is None:
            behind = {p: (end, None) for p, end in ends.items()} if not any(ends.values()) else {}
        else:
            behind = {
                p: (ends.get(p), offset)
                for p, offset in progress.offsets.items()
                if ends.get(p, 0) <= offset
            }
        if not behind:
            return
        where = ", ".join(
            f"partition {p} ends at {'(none)' if end is None else end}"
            + ("" if offset is None else f", offset {offset} was written")
            for p, (end, offset) in sorted(behind.items())
        )
        raise ChangeTopicResetError(
            f"change topic {self.change_topic} holds less than this publisher wrote to it "
            f"({where}; up to silver version {progress.version}, as consumer group "
            f"{self.transactional_id!r} on {self.settings.progress_topic} records): it was "
            "deleted or recreated, and the events published before are gone"
        )

    def publish(
        self,
        messages: Sequence[Message],
        progress: Progress,
        set_aside: Callable[[list[Oversized]], None] = lambda _: None,
    ) -> list[Oversized]:
        """Send ``messages`` in order and record ``progress``, all in one transaction.

        Messages larger than the topic accepts are not sent: ``set_aside`` gets them
        (e.g. to quarantine them) inside the transaction, before it commits, and they are
        returned. Those the broker refuses as too large anyway abort the transaction,
        which runs again without them (or, when the topic's limit changed, with events
        and batches sized to the new one).

        Retries a transaction that must be aborted (e.g. the broker went away) with
        exponential backoff; raises PublisherFatalError when the producer is fenced or
        hit a fatal error, PermissionRefusedError (the transaction aborted, never retried)
        when the broker's ACLs refuse it, and KafkaException when the retries are exhausted.
        """

        def retriable(exc: BaseException) -> bool:
            if isinstance(exc, StuckProducerError):  # a new producer took over: no abort
                return True
            if not isinstance(exc, KafkaException):
                return False
            error: KafkaError = exc.args[0]
            if error.code() in _AUTHORIZATION_CODES:
                return False
            return error.txn_requires_abort() or error.retriable()

        def describe(exc: BaseException, _attempt: int) -> str:
            if isinstance(exc, KafkaException):
                return f"transaction failed, retrying: {exc.args[0].str()}"
            return str(exc)

        def before_retry(exc: BaseException, problem: str) -> None:
            if isinstance(exc, KafkaException):
                self._abort_quietly()
            self._on_problem(problem)

        oversized = self._over_limit(messages, {})
        while True:
            try:
                offsets: dict[int, int] = self._retrying(retriable, describe, before_retry)(
                    self._fatal_raised,
                    lambda: self._transaction(messages, oversized, progress, set_aside),
                )
                break
            except _RefusedBySize as refused:
                self._abort_quietly()
                self._after_size_refusal(messages, oversized, refused.indexes)
            except PermissionRefusedError:
                self._abort_after_refusal()
                raise
            except KafkaException as exc:
                if (refusal := self._refusal(exc.args[0], "transaction")) is not None:
                    self._abort_after_refusal()
                    raise refusal from None
                self._on_problem(f"Kafka transaction failing: {exc.args[0].str()}")
                raise
        self.progress = replace(progress, offsets=offsets)
        self._on_problem(None)
        return sorted(oversized.values(), key=lambda o: o.index)

    def _over_limit(
        self, messages: Sequence[Message], known: dict[int, Oversized]
    ) -> dict[int, Oversized]:
        """``known`` and the messages larger than ``max_event_bytes``, by index."""
        limit = self.max_event_bytes
        found = dict(known)
        for index, (key, value) in enumerate(messages):
            size = event_size(key, value)
            if size > limit and index not in found:
                found[index] = Oversized(index, size, limit, f"over {self._limit_name}")
        return found

    def _after_size_refusal(
        self, messages: Sequence[Message], oversized: dict[int, Oversized], refused: dict[int, str]
    ) -> None:
        """After the broker refused messages as too large: what the next attempt leaves out.

        If the topic's limit changed since it was read, events and batches are sized to
        the new one; else the messages the broker refused are left out.
        """
        limit = self._read_size_limit()
        log.warning(
            "the broker refused messages as too large",
            extra={
                "topic": self.change_topic,
                "count": len(refused),
                "max_message_bytes": limit,
                "error": next(iter(refused.values())),
            },
        )
        if self._sizes(limit) != (self.max_event_bytes, self._producer_config["batch.size"]):
            self._fit_to(limit, started=True)
            oversized.update(self._over_limit(messages, oversized))
            return
        for index, error in refused.items():
            key, value = messages[index]
            oversized[index] = Oversized(
                index, event_size(key, value), limit, f"the broker refused it: {error}"
            )

    def _transaction(
        self,
        messages: Sequence[Message],
        oversized: dict[int, Oversized],
        progress: Progress,
        set_aside: Callable[[list[Oversized]], None],
    ) -> dict[int, int]:
        """One transaction: the messages not ``oversized``, then the progress.

        Returns the last offset written to each partition, so far. Raises _RefusedBySize
        (the transaction then needs an abort) when the broker refused messages as too
        large; librdkafka's own refusal joins ``oversized`` at once.
        """
        producer = self._producer
        written = dict(self.progress.offsets or {}) if self.progress else {}
        refused: dict[int, str] = {}

        def delivered(index: int, error: KafkaError | None, message: KafkaMessage) -> None:
            if error is None:
                partition, offset = int(message.partition() or 0), int(message.offset() or 0)
                written[partition] = max(offset, written.get(partition, -1))
            elif error.code() in _SIZE_CODES:
                refused[index] = error.str()

        producer.begin_transaction()
        for index, (key, value) in enumerate(messages):
            if index in oversized:
                continue
            while True:
                try:
                    producer.produce(
                        self.change_topic,
                        value=value,
                        key=key,
                        on_delivery=functools.partial(delivered, index),
                    )
                    break
                except BufferError:
                    producer.poll(0.05)  # the local queue is full: let deliveries drain
                except KafkaException as exc:
                    if exc.args[0].code() not in _SIZE_CODES:
                        raise
                    oversized[index] = Oversized(
                        index,
                        event_size(key, value),
                        self.max_event_bytes,
                        f"the producer refused it: {exc.args[0].str()}",
                    )
                    break
            producer.poll(0)
        # Every delivery reported: the offsets for the progress, and any size refusal.
        # What is still out after the timeout (broker away) fails the commit below.
        producer.flush(self.settings.transaction_timeout_ms / 1000)
        if refused:
            raise _RefusedBySize(refused)
        if oversized:
            set_aside(sorted(oversized.values(), key=lambda o: o.index))
        recorded = replace(progress, offsets=written)
        marker = TopicPartition(
            self.settings.progress_topic, 0, progress.version + 1, metadata=recorded.metadata()
        )
        group = self._group.consumer_group_metadata()
        self._within_deadline(
            "send_offsets_to_transaction",
            lambda: producer.send_offsets_to_transaction([marker], group, SEND_OFFSETS_TIMEOUT_S),
            deadline_s=SEND_OFFSETS_DEADLINE_S,
        )
        # A commit that timed out (broker away) may be resumed as is; only an error that
        # requires an abort sends the whole transaction round again.
        self._with_retries(
            "commit",
            lambda: producer.commit_transaction(self.settings.transaction_timeout_ms / 1000),
        )
        return written

    def _within_deadline(self, what: str, call: Callable[[], object], deadline_s: float) -> None:
        """Run a producer call that librdkafka may block on past its own timeout.

        When the group coordinator went away (e.g. a broker restart),
        ``send_offsets_to_transaction`` can block forever (librdkafka issues #5456 and
        #5511). Past ``deadline_s`` the producer is replaced: the new one's
        ``init_transactions`` fences the stuck one, whose transaction can then never
        commit, and StuckProducerError asks for the transaction to be run again.
        """
        outcome: dict[str, BaseException] = {}

        def run() -> None:
            try:
                call()
            except BaseException as exc:
                outcome["error"] = exc

        worker = threading.Thread(target=run, name=f"kafka-{what}", daemon=True)
        worker.start()
        worker.join(deadline_s)
        if worker.is_alive():
            log.warning(
                "producer stuck: replacing it",
                extra={"topic": self.change_topic, "call": what, "after_s": deadline_s},
            )
            self._replace_producer(started=True)  # the stuck one is abandoned
            raise StuckProducerError(f"{what} blocked for {deadline_s} s; producer replaced")
        if "error" in outcome:
            raise outcome["error"]

    def _abort_quietly(self) -> None:
        try:
            self._producer.abort_transaction(60)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal():
                raise PublisherFatalError(self._fatal_message(error)) from None
            log.warning("abort failed", extra={"topic": self.change_topic, "error": error.str()})

    def _abort_after_refusal(self) -> None:
        """Abort the transaction the ACLs refused, so that nothing of it commits.

        A refused AddPartitionsToTxn leaves the broker no transaction to end, and
        librdkafka then calls its abort fatal (INVALID_TXN_STATE): the producer is
        replaced, and the new one's ``init_transactions`` aborts whatever the broker still
        holds open for the transactional id. If that is refused too, the broker's
        transaction timeout aborts it.
        """
        try:
            self._producer.abort_transaction(60)
            return
        except KafkaException as exc:
            log.info(
                "refused transaction: replacing the producer to abort it",
                extra={"topic": self.change_topic, "error": exc.args[0].str()},
            )
        try:
            self._replace_producer(started=True)
        except (KafkaException, PublisherFatalError, PermissionRefusedError) as exc:
            log.warning(
                "could not replace the refused producer; the broker's transaction timeout "
                "aborts its transaction",
                extra={"topic": self.change_topic, "error": str(exc)},
            )

    def _refusal(self, error: KafkaError, what: str) -> PermissionRefusedError | None:
        """The missing permission that ``error`` shows, for the call ``what``; else None.

        The operation is the one that call needs (``kafka-acls`` names): the events of a
        transaction need Write on the change topic, its progress Read on the progress
        group (and on the progress topic's offsets); reading the progress at start
        Describe on the group; the change topic's size limit DescribeConfigs, its last
        offsets Describe; the transactional id Write.
        """
        code = error.code()
        if code not in _AUTHORIZATION_CODES:
            return None
        kafka = self._kafka
        if code == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
            return TransactionalIdRefusedError(
                kafka_missing_permission(kafka, "Write", "transactional-id", self.transactional_id)
            )
        if code == KafkaError.GROUP_AUTHORIZATION_FAILED:
            operation = "Describe" if what == "read progress" else "Read"
            return PermissionRefusedError(
                kafka_missing_permission(kafka, operation, "group", self.transactional_id)
            )
        in_transaction = what in ("transaction", "commit")
        if in_transaction and "offsets" in error.str():  # committing the progress
            return PermissionRefusedError(
                kafka_missing_permission(kafka, "Read", "topic", self.settings.progress_topic)
            )
        operation = {
            "describe the change topic": "DescribeConfigs",
            "read the change topic's offsets": "Describe",
            "read progress": "Describe",
        }.get(what, "Write")
        topic = self.settings.progress_topic if what == "read progress" else self.change_topic
        return PermissionRefusedError(kafka_missing_permission(kafka, operation, "topic", topic))

    def _with_retries(self, what: str, call: Callable[[], Any]) -> Any:
        def retriable(exc: BaseException) -> bool:
            if not isinstance(exc, KafkaException):
                return False
            error: KafkaError = exc.args[0]
            if error.code() in _AUTHORIZATION_CODES:
                return False
            transient = error.retriable() or error.code() in _TRANSIENT_CODES
            return transient and not error.txn_requires_abort()

        retried = False

        def before_retry(_exc: BaseException, problem: str) -> None:
            nonlocal retried
            retried = True
            self._on_problem(problem)

        try:
            result = self._retrying(
                retriable,
                lambda exc, _attempt: f"{what} failed, retrying: {exc.args[0].str()}",
                before_retry,
            )(self._fatal_raised, call)
        except KafkaException as exc:
            if (refusal := self._refusal(exc.args[0], what)) is not None:
                raise refusal from None
            self._on_problem(f"Kafka {what} failing: {exc.args[0].str()}")
            raise
        if retried:  # recovered: /health must stop reporting the retries
            self._on_problem(None)
        return result

    def _retrying(
        self,
        retriable: Callable[[BaseException], bool],
        describe: Callable[[BaseException, int], str],
        before_retry: Callable[[BaseException, str], None],
    ) -> Retrying:
        """The retry policy of a producer call: ``retry_attempts`` calls at most."""
        return retrying(
            retriable,
            initial_s=INITIAL_BACKOFF_S,
            max_s=self.settings.max_backoff_s,
            attempts=self.settings.retry_attempts,
            log=log,
            describe=describe,
            on_retry=before_retry,
            fields={"topic": self.change_topic},
        )

    def _fatal_raised(self, call: Callable[[], Any]) -> Any:
        """Run ``call``; a fatal Kafka error (never retried) becomes PublisherFatalError.

        An authorization error stays a KafkaException (fatal or not: librdkafka calls a
        refused transactional id fatal), for the caller to name the missing permission.
        """
        try:
            return call()
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal() and error.code() not in _AUTHORIZATION_CODES:
                raise PublisherFatalError(self._fatal_message(error)) from None
            raise

    def _fatal_message(self, error: KafkaError) -> str:
        if error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED):
            return (
                f"publisher for {self.change_topic} was fenced: another instance with "
                f"transactional.id {self.transactional_id!r} started; this one stops"
            )
        return f"fatal Kafka producer error on {self.change_topic}: {error.str()}"

    def close(self) -> None:
        """Release the clients (an open transaction is aborted by the broker's timeout)."""
        self._producer.flush(10)
        self._group.close()
