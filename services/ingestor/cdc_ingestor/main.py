"""``cdc-ingestor``: Kafka CDC topics -> bronze Delta, exactly-once, with quarantine.

Per entity: Spark's Kafka source (source) -> JVM Avro or JSON decoding and contract
checks (transform) -> one foreachBatch writing bronze and quarantine idempotently (sink).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from cdc_shared.avro import (
    AvroSerdeError,
    KnownSchema,
    SchemaRegistry,
    UnknownSchemaError,
    read_header,
)
from cdc_shared.clients import make_admin, spark_kafka_options
from cdc_shared.config import EntityConfig, KafkaConfig, PipelineConfig
from cdc_shared.layout import INGESTOR
from cdc_shared.observability import Stopwatch
from cdc_shared.schemas import entity_schemas, make_registry
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    BatchStats,
    Failure,
    OnFailure,
    QueryIdentity,
    StreamRunner,
    foreach_batch_writer,
    start_streams,
)
from cdc_shared.tables import (
    QUARANTINE_PROPERTIES,
    QUARANTINE_SCHEMA,
    app_id,
    ensure_table,
    idempotent_append,
)
from confluent_kafka import KafkaError, KafkaException
from pyspark.sql import Column, DataFrame, Observation, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.readwriter import DataStreamWriter

from cdc_ingestor.decode import (
    BRONZE_PROPERTIES,
    ERROR_KINDS,
    KAFKA_SCHEMA,
    REFUSED_INCOMPATIBLE,
    DecodePlan,
    batch_headers,
    bronze_rows,
    check_sequence_paths,
    decode,
    incompatibility,
    quarantine_columns,
    quarantine_rows,
    readable_reader,
    refusing_incompatible,
    stamped,
)

SERVICE = INGESTOR
#: Quarantined records of one batch collected to the driver and written from there;
#: a batch with more is quarantined by a third pass over it instead.
MAX_COLLECTED_QUARANTINE = 20_000
#: Spark's failure when the Kafka brokers are out of reach (a query restarted with backoff).
KAFKA_UNAVAILABLE = re.compile(
    r"org\.apache\.kafka\.common\.errors\.(TimeoutException|DisconnectException|NetworkException)"
    r"|Timed out waiting for a node assignment|Cannot fetch record.* in \d+ milliseconds"
)
#: Spark's failure when offsets the checkpoint needs are gone (failOnDataLoss is on).
KAFKA_DATA_LOSS = re.compile(r"KAFKA_DATA_LOSS|Some data may have been lost|OffsetOutOfRange")
log = logging.getLogger("cdc_ingestor")
#: How a batch stopped for an incompatible writer schema reads in the query's error.
INCOMPATIBLE = re.compile(r"IncompatibleSchemaError: ([^\n]*)")


def observation_ready(observation: Observation) -> bool:
    """Whether the action an observation watched has run (``get`` would wait forever)."""
    return bool(observation._jo is not None and observation._jo.future().isCompleted())


class IncompatibleSchemaError(RuntimeError):
    """A batch holds records whose writer schema the reader cannot resolve.

    docs/design.md: an incompatible change stops the affected entity with a clear error.
    """


class EntityIngestion:
    """One entity's stream: its source topic into ``bronze/<entity>``."""

    def __init__(
        self,
        spark: SparkSession,
        config: PipelineConfig,
        entity: EntityConfig,
        registry: SchemaRegistry,
        runner: StreamRunner,
    ) -> None:
        self.spark = spark
        self.config = config
        self.entity = entity
        self.registry = registry
        self.runner = runner
        self.identity = QueryIdentity()
        self.plan = self._newest_plan()
        self.bronze_path = config.layout.bronze(entity.name)
        self.quarantine_path = config.layout.quarantine(SERVICE)
        check_sequence_paths(spark, entity, self.plan)

    def _newest_plan(self) -> DecodePlan:
        """Every version the registry knows, and the reader to resolve them to.

        The reader is the pinned value schema, else the newest version that can read the
        versions before it; an error line names each version it cannot read.
        """
        schemas = entity_schemas(self.entity, self.registry)
        pinned = self.entity.value_schema is not None
        reader = schemas.value if pinned else readable_reader(self.spark, schemas.values)
        for version in schemas.values:
            reason = incompatibility(self.spark, reader, version)
            if reason is not None:
                log.error(
                    "a value schema version is incompatible with the reader: records written "
                    "with it go to quarantine as incompatible_schema",
                    extra={
                        "service": SERVICE,
                        "entity": self.entity.name,
                        "subject": version.subject,
                        "version": version.version,
                        "fingerprint": version.fingerprint.hex(),
                        "reader_version": reader.version,
                        "reason": reason,
                    },
                )
        return DecodePlan.from_schemas(schemas, self.registry, reader, self.entity)

    def create_tables(self) -> None:
        """Bronze and quarantine, with explicit schemas, unless they exist."""
        empty = self.spark.createDataFrame([], KAFKA_SCHEMA)
        bronze_schema = bronze_rows(
            decode(self.spark, empty, self.plan, self.entity.sequence_by)
        ).schema
        ensure_table(self.spark, self.bronze_path, bronze_schema, BRONZE_PROPERTIES)
        ensure_table(self.spark, self.quarantine_path, QUARANTINE_SCHEMA, QUARANTINE_PROPERTIES)

    def source(self) -> DataFrame:
        """The entity's source topic through Spark's Kafka source (failOnDataLoss on)."""
        settings = self.config.ingestor
        reader = (
            self.spark.readStream.format("kafka")
            .options(**spark_kafka_options(self.config.kafka))
            .option("subscribe", self.entity.source_topic)
            .option("startingOffsets", settings.starting_offsets)
            .option("failOnDataLoss", "true")
            .option("includeHeaders", "false")
        )
        if settings.max_offsets_per_trigger:
            reader = reader.option("maxOffsetsPerTrigger", settings.max_offsets_per_trigger)
        return reader.load()

    def writer(self, once: bool) -> DataStreamWriter:
        """source -> foreachBatch(decode, write bronze + quarantine)."""
        return foreach_batch_writer(
            self.source(),
            self.process_batch,
            self.config.checkpoint_path(SERVICE, self.entity.name),
            once,
            self.config.ingestor.trigger_interval,
        )

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Decode, then append bronze and quarantine idempotently (txnAppId + batch id).

        The decode plan is brought up to date with the registry first (``_update_plan``).
        Then one decoding pass writes bronze while counting the outcomes and collecting
        the (rare) records to quarantine (observed metrics); when so configured, a record
        of an incompatible writer schema fails that write before its commit, and the
        batch is refused. A replayed batch, whose bronze write Delta skips without running
        it, is counted by a pass of its own. Each pass reads the batch's offsets from
        Kafka again: caching the raw records instead cost ~650 MiB more peak RSS at
        500k-record batches for no throughput (``tests/bench/bench_ingestor.py``).
        """
        app = app_id(SERVICE, self.entity.name, self.identity.get())
        lap = Stopwatch()
        self._update_plan(batch)
        lap("plan")
        decoded = decode(self.spark, batch, self.plan, self.entity.sequence_by)
        refuse = self.config.ingestor.on_incompatible_schema == "stop"
        written = refusing_incompatible(decoded) if refuse else decoded
        observation = Observation(f"ingest-{self.entity.name}-{batch_id}")
        observed = written.observe(observation, *self._outcome_metrics())
        try:
            idempotent_append(
                bronze_rows(observed), self.bronze_path, app, batch_id, merge_schema=True
            )
        except Exception as error:
            if REFUSED_INCOMPATIBLE not in str(error):
                raise
            counts, rejected = self._count(decoded)
            count = counts.get("incompatible_schema", 0)
            raise IncompatibleSchemaError(self._incompatible_stop(count, rejected)) from None
        lap("bronze")
        counts, rejected = (
            self._outcomes(observation.get)
            if observation_ready(observation)
            else self._count(decoded)  # a replay: Delta skipped the write
        )
        errors = {kind: n for kind, n in counts.items() if kind != "ok"}
        if errors.get("incompatible_schema"):
            self._log_incompatible(batch_id, errors["incompatible_schema"], rejected)
        if errors:
            collected = len(rejected) == sum(errors.values())
            quarantined = (
                self.spark.createDataFrame(stamped(rejected, batch_id), QUARANTINE_SCHEMA)
                if collected
                else quarantine_rows(decoded, self.entity, batch_id)  # many: another pass
            )
            idempotent_append(quarantined, self.quarantine_path, app, batch_id)
            lap("quarantine")
        self.runner.report(
            self.entity.name,
            batch_id,
            BatchStats(
                counts={
                    "input_rows": sum(counts.values()),
                    "bronze_rows": counts.get("ok", 0),
                    "quarantined_rows": sum(errors.values()),
                },
                extra={"errors": errors, **lap.laps},
            ),
        )

    def _update_plan(self, batch: DataFrame) -> None:
        """Give the decode plan every writer schema the batch may need, before decoding it.

        A registry that lists its schemas (files) is read again, and the plan gets all of
        them: a header outside the plan then resolves nowhere, no look at the batch needed.
        A registry that resolves ids it does not list (HTTP) is asked about the headers
        the batch uses that the plan lacks: one cheap pass over the framing headers.
        """
        self.registry.refresh()
        listing = self.registry.listing()
        if listing is None:
            if self.plan.uses_avro:  # JSON records carry no header to look up
                self._learn_writers(*batch_headers(batch))
            return
        planned = {s.fingerprint for s in self.plan.value_writers.values()}
        new = [s for s in listing if s.fingerprint not in planned]
        if new:
            self._replan(listing, listing, [s.fingerprint.hex() for s in new])

    def _count(self, decoded: DataFrame) -> tuple[dict[str, int], list[Any]]:
        """A pass of its own over the batch: what ``_outcome_metrics`` observes on a write."""
        return self._outcomes(decoded.agg(*self._outcome_metrics()).first())

    def _outcome_metrics(self) -> list[Column]:
        """Aggregates of a decoded batch: records per outcome, and the records to quarantine.

        The records come as quarantine rows without their batch id and time (``stamped``
        adds them), up to ``MAX_COLLECTED_QUARANTINE`` of them.
        """
        kind = F.col("error_kind")
        record = F.struct(*quarantine_columns(self.entity, None))
        return [
            F.count_if(kind.isNull()).alias("ok"),
            *[F.count_if(kind == name).alias(name) for name in ERROR_KINDS],
            F.count(kind).alias("rejected"),
            F.slice(
                F.collect_list(F.when(kind.isNotNull(), record)), 1, MAX_COLLECTED_QUARANTINE
            ).alias("rows"),
        ]

    @staticmethod
    def _outcomes(row: Mapping[str, Any] | Row | None) -> tuple[dict[str, int], list[Any]]:
        """Counts per outcome (only those that occurred) and the collected records."""
        assert row is not None
        counts = {"ok": int(row["ok"]), **{kind: int(row[kind]) for kind in ERROR_KINDS}}
        unclassified = int(row["rejected"]) - sum(counts[kind] for kind in ERROR_KINDS)
        if unclassified:
            counts["unclassified"] = unclassified
        counts = {name: n for name, n in counts.items() if n}
        collected = list(row["rows"])
        if int(row["rejected"]) > MAX_COLLECTED_QUARANTINE:
            collected = []  # written by a pass of their own
        return counts, collected

    def _incompatible_stop(self, count: int, rejected: list[Any]) -> str:
        """The one line an operator reads when the entity stops for an incompatible schema."""
        reasons = sorted(
            {r.error_message for r in rejected if r.error_kind == "incompatible_schema"}
        )
        return (
            f"stopped: {count} record(s) of topic {self.entity.source_topic!r} were written "
            f"with a schema the reader cannot resolve ({'; '.join(reasons[:3])}). Nothing of "
            "the batch was written; the stream stops before the first such record's batch. "
            "Deploy a reader schema that resolves it (or fix the producer), or set "
            "ingestor.on_incompatible_schema: quarantine to set such records aside, then "
            "restart"
        )

    def _log_incompatible(self, batch_id: int, count: int, rejected: list[Any]) -> None:
        """One error line per batch that quarantined records of an incompatible schema."""
        reasons = sorted(
            {r.error_message for r in rejected if r.error_kind == "incompatible_schema"}
        )
        log.error(
            "records written with a schema incompatible with the reader went to quarantine",
            extra={
                "service": SERVICE,
                "entity": self.entity.name,
                "batch_id": batch_id,
                "incompatible_schema": count,
                "reasons": reasons or "see quarantine/ingestor",
            },
        )

    def _learn_writers(self, values: set[bytes], keys: set[bytes]) -> None:
        """Ask the registry about headers the plan does not know, and add what it knows.

        The reader becomes the subject's newest schema (unless pinned), so a compatible new
        column reaches bronze (the bronze write merges the schema).
        """
        headers = {("value", h) for h in values - self.plan.value_writers.keys()} | {
            ("key", h) for h in keys - self.plan.key_writers.keys()
        }
        if not headers:
            return
        known = {"value": self.plan.value_writers, "key": self.plan.key_writers}
        learned: dict[str, list[Any]] = {"value": [], "key": []}
        for part, data in headers:
            try:
                head = read_header(data)
            except AvroSerdeError:
                continue
            if data[: head.size] in known[part]:
                continue
            try:
                schema = self.registry.resolve(head)
            except UnknownSchemaError:
                continue
            if schema not in learned[part]:
                learned[part].append(schema)
        if not learned["value"] and not learned["key"]:
            return
        self._replan(
            [*self.plan.value_writers.values(), *learned["value"]],
            [*self.plan.key_writers.values(), *learned["key"]],
            [s.fingerprint.hex() for s in learned["value"] + learned["key"]],
        )

    def _replan(self, values: list[KnownSchema], keys: list[KnownSchema], new: list[str]) -> None:
        """The newest plan with these writer schemas; log the ``new`` ones and the reader."""
        context = {"service": SERVICE, "entity": self.entity.name}
        log.info("new writer schemas", extra={**context, "schemas": new})
        self.plan = self._newest_plan().with_writers(values, keys)
        reader = self.plan.value_reader.fingerprint.hex()
        log.info("reader schema", extra={**context, "value_reader": reader})


def kafka_failures(config: PipelineConfig) -> OnFailure:
    """Read a failed ingestion: Kafka unreachable -> restart; offsets lost -> a clear stop."""

    def read(entity: str, error: str) -> Failure | None:
        if incompatible := INCOMPATIBLE.search(error):
            return Failure(incompatible.group(1), entity_only=True)
        if KAFKA_DATA_LOSS.search(error):
            topic = config.entity(entity).source_topic
            partitions = sorted({int(p) for p in re.findall(rf"{re.escape(topic)}-(\d+)", error)})
            where = ", ".join(map(str, partitions)) or "unknown (see Spark's reason)"
            spark_reason = re.search(r"Reason: (.*)", error)  # Spark's KAFKA_DATA_LOSS line
            return Failure(
                f"stopped: Kafka no longer has records it must ingest from topic {topic!r} "
                f"partition(s) {where} (deleted by retention or delete-records, or the topic "
                "was recreated). The stream stopped at the gap: nothing was skipped and bronze is "
                "as it was. To go on, "
                "accept the gap and restart with a new checkpoint (move "
                f"{config.checkpoint_path(SERVICE, entity)} aside), then re-snapshot the "
                "source table if its rows are needed; raise the topic's retention.ms so it "
                "does not happen again. Spark: "
                + (spark_reason.group(1) if spark_reason else error.partition("\n")[0])[:600]
            )
        if KAFKA_UNAVAILABLE.search(error):
            return Failure(
                f"Kafka unavailable ({config.kafka.bootstrap_servers}): "
                "the stream failed and restarts from its checkpoint",
                transient=True,
            )
        return None

    return read


class KafkaWatch:
    """Probes the brokers while the ingestor runs; unreachable -> ``/health`` 503 and a warning.

    Spark's Kafka source mostly waits when the brokers go away: the executors' consumers
    retry until they are back, and the driver's offset lookup retries for about three
    minutes (3 attempts of ``default.api.timeout.ms``) before the query fails and is
    restarted (:func:`kafka_failures`). The probe makes the wait visible: ``set_problem``
    on every entity, a warning when Kafka goes away and once a minute while it stays
    away, and a note when it is back.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        entities: list[str],
        runner: StreamRunner,
        interval_s: float = 5.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.kafka = kafka
        self.entities = entities
        self.runner = runner
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._admin = make_admin(kafka, log_level=0)  # our warning says it; librdkafka is noisy
        self._stop = threading.Event()
        self._down_since: float | None = None
        self._warned_at = 0.0

    def start(self) -> KafkaWatch:
        """Probe in a daemon thread until the runner closes."""
        threading.Thread(target=self._run, name="kafka-watch", daemon=True).start()
        self.runner.on_close(self._stop.set)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def check(self) -> bool:
        """One probe (a metadata request); True if a broker answered."""
        try:
            self._admin.list_topics(timeout=self.timeout_s)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            self._unreachable(error.str() if isinstance(error, KafkaError) else type(exc).__name__)
            return False
        if self._down_since is not None:
            log.info(
                "Kafka reachable again",
                extra={"service": SERVICE, "down_s": round(time.monotonic() - self._down_since)},
            )
            self._down_since = None
            for entity in self.entities:
                self.runner.set_problem(entity, None)
        return True

    def _unreachable(self, reason: str) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        problem = f"Kafka unreachable ({self.kafka.bootstrap_servers}): {reason}; retrying"
        for entity in self.entities:
            self.runner.set_problem(entity, problem)
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning(
                "Kafka unreachable; ingestion waits and retries, nothing is skipped",
                extra={
                    "service": SERVICE,
                    "bootstrap_servers": self.kafka.bootstrap_servers,
                    "error": reason,
                    "down_s": round(now - self._down_since),
                },
            )


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Create the tables and start one stream per entity; ``run()`` the result."""
    registry = make_registry(config)

    def open_stream(
        spark: SparkSession, entity: EntityConfig, runner: StreamRunner
    ) -> tuple[DataStreamWriter, QueryIdentity]:
        ingestion = EntityIngestion(spark, config, entity, registry, runner)
        ingestion.create_tables()
        return ingestion.writer(once), ingestion.identity

    runner = start_streams(
        SERVICE,
        config,
        config.ingestor,
        entity_names,
        spark,
        "maxOffsetsBehindLatest",
        open_stream,
        kafka_failures(config),
    )
    KafkaWatch(config.kafka, list(runner.queries), runner).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-ingestor``."""
    return service_main(
        SERVICE, "Kafka CDC topics -> bronze Delta tables, exactly-once.", start, argv
    )


if __name__ == "__main__":
    sys.exit(main())
