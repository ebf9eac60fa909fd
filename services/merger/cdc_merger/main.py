"""``cdc-merger``: bronze change log -> silver current state, order-safe and idempotent.

One streaming query per group of tables (:mod:`cdc_merger.stream`): a Delta stream over
bronze (source) -> per changed table, latest event per key and tombstone filter
(transform) -> one MERGE into ``silver/<entity>`` plus tombstones, truncates and history
(sink), written through the group's work queue.
"""

from __future__ import annotations

import sys

from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.runner import StreamRunner
from cdc_shared.streaming.runtime import StreamService, start_service
from cdc_shared.streaming.service import service_main
from pyspark.sql import SparkSession

from cdc_merger.merging import SERVICE
from cdc_merger.stream import GroupMerge


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
    group_names: list[str] | None = None,
) -> StreamRunner:
    """Start the bronze -> silver query of each group (each waits for bronze); ``run()`` it."""
    merger = StreamService(SERVICE, config.merger, GroupMerge, lag="numFilesOutstanding")
    return start_service(merger, config, entity_names, once, spark, group_names)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-merger``."""
    return service_main(SERVICE, "bronze Delta change log -> silver Delta tables.", start, argv)


if __name__ == "__main__":
    sys.exit(main())
