"""A probe of the Kafka brokers while the ingestor runs, so that waiting for them shows.

Spark's Kafka source mostly waits, silently, when the brokers go away; the probe turns
that wait into ``/health`` 503 and warning lines.
"""

from __future__ import annotations

import logging
import threading
import time

from cdc_shared.clients.connect import FIX_CREDENTIALS, kafka_refusal, make_admin
from cdc_shared.config.connections import KafkaConfig
from cdc_shared.contracts.layout import INGESTOR
from cdc_shared.streaming.runner import StreamRunner
from confluent_kafka import KafkaError, KafkaException

log = logging.getLogger("cdc_ingestor")


class KafkaWatch:
    """Probes the brokers while the ingestor runs; unreachable -> ``/health`` 503 and a warning.

    Spark's Kafka source mostly waits when the brokers go away: the executors' consumers
    retry until they are back, and the driver's offset lookup retries for about three
    minutes (3 attempts of ``default.api.timeout.ms``) before the query fails and is
    restarted (:func:`cdc_ingestor.failures.kafka_failures`). The probe makes the wait
    visible: ``set_problem`` on every entity, a warning when Kafka goes away and once a
    minute while it stays away, and a note when it is back. A broker that answers but
    refuses the credentials (a wrong password, an untrusted certificate) is not
    unreachable: the warning says what it refused, and that waiting will not help.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        entities: list[str] | None,
        runner: StreamRunner,
        interval_s: float = 5.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.kafka = kafka
        self._entities = entities  # None: every stream the runner runs, tables taken up too
        self.runner = runner
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Our warning says it; librdkafka is noisy. Its error callback is where it reports
        # a refused authentication (the metadata request itself just times out).
        self._admin = make_admin(kafka, log_level=0, error_cb=self._on_client_error)
        self._client_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.current_thread()  # the probing thread, once started
        self._down_since: float | None = None
        self._warned_at = 0.0

    @property
    def entities(self) -> list[str]:
        """The entities whose ``/health`` a broker outage marks."""
        return list(self.runner.queries) if self._entities is None else self._entities

    def start(self) -> KafkaWatch:
        """Probe in a daemon thread until the runner closes."""
        self._thread = threading.Thread(target=self._run, name="kafka-watch", daemon=True)
        self._thread.start()
        self.runner.on_close(self.stop)
        return self

    def stop(self) -> None:
        """Stop probing, and wait for a probe under way to end.

        A probe waits in librdkafka (up to ``timeout_s``) with its client; a process that
        exited meanwhile would free the client under that wait, and librdkafka's broker
        thread then crashes the process (SIGSEGV) instead of letting it exit as it chose.
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def check(self) -> bool:
        """One probe (a metadata request); True if a broker answered."""
        try:
            self._admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            reason = error.str() if isinstance(error, KafkaError) else type(exc).__name__
            self._admin.poll(0)  # serve the error callback: why the brokers did not answer
            refused = next(
                (r for e in [reason, *self._client_errors] if (r := kafka_refusal(self.kafka, e))),
                None,
            )
            self._client_errors.clear()
            if refused is not None:
                self._refused(refused)
            else:
                self._unreachable(reason)
            return False
        if self._down_since is not None:
            log.info(
                "Kafka reachable again",
                extra={"service": INGESTOR, "down_s": round(time.monotonic() - self._down_since)},
            )
            self._down_since = None
            for entity in self.entities:
                self.runner.set_problem(entity, None)
        return True

    def _on_client_error(self, error: KafkaError) -> None:
        self._client_errors.append(error.str())

    def _refused(self, refused: str) -> None:
        """The brokers answered but refused the credentials: say so, not "unreachable"."""
        self._down(
            f"{refused}; {FIX_CREDENTIALS}",
            f"{refused}: new connections fail until the credentials are fixed; {FIX_CREDENTIALS}",
            {},
        )

    def _unreachable(self, reason: str) -> None:
        self._down(
            f"Kafka unreachable ({self.kafka.bootstrap_servers}): {reason}; retrying",
            "Kafka unreachable; ingestion waits and retries, nothing is skipped",
            {"bootstrap_servers": self.kafka.bootstrap_servers, "error": reason},
        )

    def _down(self, problem: str, warning: str, fields: dict[str, object]) -> None:
        """Report ``problem`` on every entity; log ``warning`` at most once a minute."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        for entity in self.entities:
            self.runner.set_problem(entity, problem)
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning(
                warning,
                extra={"service": INGESTOR, **fields, "down_s": round(now - self._down_since)},
            )
