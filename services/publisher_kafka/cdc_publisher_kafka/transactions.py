"""Publishing a micro-batch to Kafka in one transaction, together with its progress.

The progress (the last silver commit version published, and the Spark batch that did
it) is committed as a consumer-group offset on a progress topic inside the same Kafka
transaction as the events: either both become visible or neither does. After a crash,
the new producer's ``init_transactions`` fences the old one and resolves its open
transaction, and the progress read back tells which batches and versions are already
out, so a replayed micro-batch publishes nothing twice.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cdc_shared.clients import kafka_client_config
from cdc_shared.config import KafkaConfig, PublisherKafkaConfig
from cdc_shared.layout import publisher_progress_group
from cdc_shared.retry import retrying
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from tenacity import Retrying

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

#: The first wait of a retry (the config sets the longest, ``max_backoff_s``).
INITIAL_BACKOFF_S = 0.5

Message = tuple[bytes, bytes | None]  # (key, value); a None value is a tombstone


class StuckProducerError(RuntimeError):
    """A producer call blocked past its deadline; a fresh producer replaced the stuck one."""


class PublisherFatalError(RuntimeError):
    """The producer cannot go on (fenced by another instance, or a fatal Kafka error)."""


@dataclass(frozen=True)
class Progress:
    """What the last committed transaction published: up to ``version``, by which batch."""

    version: int
    query_id: str
    batch_id: int

    def covers(self, query_id: str, batch_id: int) -> bool:
        """Whether batch ``batch_id`` of query ``query_id`` was already published in full."""
        return query_id == self.query_id and batch_id <= self.batch_id


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
        self._progress_partition = TopicPartition(settings.progress_topic, 0)
        self._on_problem = on_problem
        self._producer_config = kafka_client_config(
            kafka,
            **{
                "transactional.id": self.transactional_id,
                "transaction.timeout.ms": settings.transaction_timeout_ms,
                "enable.idempotence": True,
                "linger.ms": 20,
                "batch.size": 1_000_000,
                "queue.buffering.max.messages": 1_000_000,
                "queue.buffering.max.kbytes": 1_048_576,
            },
        )
        self._producer = Producer(self._producer_config)
        # Only a holder of the group metadata; it never subscribes or polls.
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

    def start(self) -> Progress | None:
        """Fence any older instance, then read what is already published."""
        self._with_retries("init_transactions", lambda: self._producer.init_transactions(60))
        self.progress = self._read_progress()
        log.info(
            "publisher ready",
            extra={
                "topic": self.change_topic,
                "published_up_to_version": self.progress.version if self.progress else None,
            },
        )
        return self.progress

    def _read_progress(self) -> Progress | None:
        def read() -> list[TopicPartition]:
            result: list[TopicPartition] = self._group.committed(
                [self._progress_partition], timeout=30
            )
            return result

        (committed,) = self._with_retries("read progress", read)
        if committed.offset < 0 or not committed.metadata:
            return None
        state = json.loads(committed.metadata)
        return Progress(int(state["version"]), str(state["query_id"]), int(state["batch_id"]))

    def publish(self, messages: Sequence[Message], progress: Progress) -> None:
        """Send ``messages`` in order and record ``progress``, all in one transaction.

        Retries a transaction that must be aborted (e.g. the broker went away) with
        exponential backoff; raises PublisherFatalError when the producer is fenced or
        hit a fatal error, and KafkaException when the retries are exhausted.
        """

        def retriable(exc: BaseException) -> bool:
            if isinstance(exc, StuckProducerError):  # a new producer took over: no abort
                return True
            if not isinstance(exc, KafkaException):
                return False
            error: KafkaError = exc.args[0]
            return error.txn_requires_abort() or error.retriable()

        def describe(exc: BaseException, _attempt: int) -> str:
            if isinstance(exc, KafkaException):
                return f"transaction failed, retrying: {exc.args[0].str()}"
            return str(exc)

        def before_retry(exc: BaseException, problem: str) -> None:
            if isinstance(exc, KafkaException):
                self._abort_quietly()
            self._on_problem(problem)

        try:
            self._retrying(retriable, describe, before_retry)(
                self._fatal_raised, lambda: self._transaction(messages, progress)
            )
        except KafkaException as exc:
            self._on_problem(f"Kafka transaction failing: {exc.args[0].str()}")
            raise
        self.progress = progress
        self._on_problem(None)

    def _transaction(self, messages: Sequence[Message], progress: Progress) -> None:
        producer = self._producer
        producer.begin_transaction()
        for key, value in messages:
            while True:
                try:
                    producer.produce(self.change_topic, value=value, key=key)
                    break
                except BufferError:
                    producer.poll(0.05)  # the local queue is full: let deliveries drain
            producer.poll(0)
        marker = TopicPartition(
            self.settings.progress_topic,
            0,
            progress.version + 1,
            metadata=json.dumps(
                {
                    "version": progress.version,
                    "query_id": progress.query_id,
                    "batch_id": progress.batch_id,
                }
            ),
        )
        group = self._group.consumer_group_metadata()
        self._within_deadline(
            "send_offsets_to_transaction",
            lambda: producer.send_offsets_to_transaction([marker], group, 60),
            deadline_s=90,
        )
        # A commit that timed out (broker away) may be resumed as is; only an error that
        # requires an abort sends the whole transaction round again.
        self._with_retries(
            "commit",
            lambda: producer.commit_transaction(self.settings.transaction_timeout_ms / 1000),
        )

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
            self._producer = Producer(self._producer_config)  # the stuck one is abandoned
            self._with_retries("init_transactions", lambda: self._producer.init_transactions(60))
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

    def _with_retries(self, what: str, call: Callable[[], Any]) -> Any:
        def retriable(exc: BaseException) -> bool:
            if not isinstance(exc, KafkaException):
                return False
            error: KafkaError = exc.args[0]
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
        """Run ``call``; a fatal Kafka error (never retried) becomes PublisherFatalError."""
        try:
            return call()
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal():
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
