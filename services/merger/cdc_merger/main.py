"""``cdc-merger``: bronze change log -> silver current state, order-safe and idempotent.

Per entity (:mod:`cdc_merger.merging`), or all entities in one query (``merger.one_query``,
:mod:`cdc_merger.one_query`): a Delta stream over ``bronze/<entity>`` (source) -> latest
event per key, tombstone filter (transform) -> one MERGE into ``silver/<entity>`` plus
tombstones (sink).
"""

from __future__ import annotations

import sys

from cdc_shared.config import PipelineConfig
from cdc_shared.layout import MERGER
from cdc_shared.service import service_main
from cdc_shared.streaming import (
    StreamRunner,
    StreamService,
    rebuilding_on_schema_change,
    start_service,
)
from pyspark.sql import SparkSession

from cdc_merger.merging import EntityMerge
from cdc_merger.one_query import open_all_tables

SERVICE = MERGER


def start(
    config: PipelineConfig,
    entity_names: list[str] | None = None,
    once: bool = False,
    spark: SparkSession | None = None,
) -> StreamRunner:
    """Start the bronze -> silver streams (each waits for its bronze); ``run()`` it.

    One stream per entity, or one query for all of them (``merger.one_query``).
    """
    merger = StreamService(
        SERVICE,
        config.merger,
        EntityMerge,
        lag="numFilesOutstanding",  # bronze files not yet merged
        on_failure=rebuilding_on_schema_change("bronze"),
        open_group=open_all_tables if config.merger.one_query else None,
    )
    return start_service(merger, config, entity_names, once, spark)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cdc-merger``."""
    return service_main(SERVICE, "bronze Delta change logs -> silver Delta tables.", start, argv)


if __name__ == "__main__":
    sys.exit(main())
