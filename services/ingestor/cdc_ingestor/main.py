"""``cdc-ingestor``: Kafka CDC topics -> bronze Delta, exactly-once, with quarantine.

Per entity (:mod:`cdc_ingestor.ingestion`), or all entities in one query
(``ingestor.one_query``, :mod:`cdc_ingestor.one_query`): Spark's Kafka source (source)
-> JVM Avro or JSON decoding and contract checks (transform) -> one foreachBatch writing
bronze and quarantine idempotently (sink).
"""

from __future__ import annotations

import functools
import sys

from cdc_shared.config import PipelineConfig
from cdc_shared.schemas import make_registry
from cdc_shared.service import service_main
from cdc_shared.streaming import StreamRunner, StreamService, start_service
from pyspark.sql import SparkSession

from cdc_ingestor.failures import kafka_failures
from cdc_ingestor.ingestion import SERVICE, EntityIngestion
from cdc_ingestor.kafka_watch import KafkaWatch
from cdc_ingestor.one_query import open_all_topics


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Start the Kafka -> bronze streams and the broker watch; ``run()`` it.

    One stream per entity, or one query for all of them (``ingestor.one_query``).
    """
    registry = make_registry(config)
    ingestor = StreamService(
        SERVICE,
        config.ingestor,
        functools.partial(EntityIngestion, registry=registry),
        lag="maxOffsetsBehindLatest",
        on_failure=kafka_failures(config),
        open_group=(
            functools.partial(open_all_topics, registry=registry)
            if config.ingestor.one_query
            else None
        ),
    )
    runner = start_service(ingestor, config, entity_names, once, spark)
    KafkaWatch(config.kafka, None, runner).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-ingestor``."""
    return service_main(
        SERVICE, "Kafka CDC topics -> bronze Delta tables, exactly-once.", start, argv
    )


if __name__ == "__main__":
    sys.exit(main())
