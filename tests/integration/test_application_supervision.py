"""``cdc run``'s supervision on a real SparkSession: failure, stop and pools.

The runners here stand in for the services' ``StreamRunner`` (what runs inside them is
tested with each service); what is under test is how the application treats them.
"""

from __future__ import annotations

import threading
from typing import cast

import pytest
from cdc_cli.application import POOL_PROPERTY, Application
from cdc_shared.config.pipeline import PipelineConfig
from cdc_shared.streaming.failures import StreamFailedError
from cdc_shared.streaming.runner import StreamRunner
from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration


class StandInRunner:
    """Runs until asked to stop, or fails at once; records the pool its thread is in."""

    def __init__(self, spark: SparkSession, service: str, fails: bool = False) -> None:
        self.spark, self.service, self.fails = spark, service, fails
        self.stop_requested = threading.Event()
        self.pool: str | None = None

    def run(self) -> None:
        self.pool = self.spark.sparkContext.getLocalProperty(POOL_PROPERTY)
        if self.fails:
            raise StreamFailedError(f"{self.service} stream for entity 'orders' failed: boom")
        if not self.stop_requested.wait(60):
            raise AssertionError(f"{self.service} was never asked to stop")

    def request_stop(self) -> None:
        self.stop_requested.set()


def application(spark: SparkSession) -> Application:
    return Application(PipelineConfig(), ["ingestor", "merger"], spark=spark)


def test_a_service_that_fails_stops_the_others_and_the_application(spark: SparkSession) -> None:
    app = application(spark)
    ingestor = StandInRunner(spark, "ingestor")
    merger = StandInRunner(spark, "merger", fails=True)
    for runner in (ingestor, merger):
        app.adopt(runner.service, cast(StreamRunner, runner))
    with pytest.raises(StreamFailedError, match="merger stream for entity 'orders' failed"):
        app.supervise([ingestor, merger])
    assert ingestor.stop_requested.is_set()
    assert (ingestor.pool, merger.pool) == ("ingestor", "merger")  # restarts run in the pool


def test_a_stop_drains_every_service_and_ends_cleanly(spark: SparkSession) -> None:
    app = application(spark)
    runners = [StandInRunner(spark, "ingestor"), StandInRunner(spark, "merger")]
    for runner in runners:
        app.adopt(runner.service, cast(StreamRunner, runner))
    threading.Timer(0.5, app.request_stop).start()  # what SIGTERM does
    app.supervise(runners)
    assert all(r.stop_requested.is_set() for r in runners)


def test_a_service_whose_start_outlasted_a_stop_request_stops_too(spark: SparkSession) -> None:
    app = application(spark)
    app.request_stop()  # SIGTERM while the merger was still starting
    late = StandInRunner(spark, "merger")
    app.adopt("merger", cast(StreamRunner, late))
    assert late.stop_requested.is_set()
