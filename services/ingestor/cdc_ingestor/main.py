"""``cdc-ingestor``: Kafka CDC topics -> bronze Delta, exactly-once, with quarantine.

One streaming query per group of tables (:mod:`cdc_ingestor.ingestion`): Spark's Kafka
source over the group's topics (source) -> JVM Avro or JSON decoding and contract checks
(transform) -> one bronze append and one quarantine append per batch, idempotent (sink).
"""

from __future__ import annotations

import functools
import sys

from cdc_shared.clients.schemas import make_registry
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.runtime import StreamService, start_service
from cdc_shared.streaming.service import service_main
from pyspark.sql import SparkSession

from cdc_ingestor.failures import kafka_failures
from cdc_ingestor.ingestion import SERVICE, GroupIngestion
from cdc_ingestor.kafka_watch import KafkaWatch


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
    group_names: list[str] | None = None,
) -> StreamRunner:
    """Start the Kafka -> bronze query of each group and the broker watch; ``run()`` it."""
    ingestor = StreamService(
        SERVICE,
        config.ingestor,
        functools.partial(GroupIngestion, registry=make_registry(config)),
        lag="maxOffsetsBehindLatest",
        on_failure=kafka_failures(config),
    )
    runner = start_service(ingestor, config, entity_names, once, spark, group_names)
    KafkaWatch(config.kafka, None, runner).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-ingestor``."""
    return service_main(
        SERVICE, "Kafka CDC topics -> bronze Delta table, exactly-once.", start, argv
    )


if __name__ == "__main__":
    sys.exit(main())
