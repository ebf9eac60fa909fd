"""spark_conf's bounds on what the driver keeps per query, the Spark UI off by default,
and the user's conf winning."""

from __future__ import annotations

import threading

from cdc_shared.config.services import SparkConfig
from cdc_shared.jvm.spark import PYTHON_GC_INTERVAL, collect_python_garbage, spark_conf

BOUNDED = (
    "spark.sql.streaming.numRecentProgressUpdates",
    "spark.sql.streaming.ui.retainedProgressUpdates",
)


def test_the_driver_keeps_few_progress_reports_per_query_and_collects_python_garbage() -> None:
    conf = spark_conf(SparkConfig(master="local[2]"), "t")
    for key in BOUNDED:
        assert 0 < int(conf[key]) < 100, key  # Spark's default keeps 100 per query
    assert float(conf[PYTHON_GC_INTERVAL]) > 0


def test_the_users_values_win() -> None:
    users = {key: "100" for key in BOUNDED} | {PYTHON_GC_INTERVAL: "0"}
    conf = spark_conf(SparkConfig(master="local[2]", conf=users), "t")
    assert {key: conf[key] for key in users} == users


def _collector_threads() -> int:
    return sum(thread.name == "cdc-python-gc" for thread in threading.enumerate())


def test_an_interval_of_zero_starts_no_collector() -> None:
    # A session built earlier in this process may have started the one collector already.
    before = _collector_threads()
    collect_python_garbage(0)
    assert _collector_threads() == before


def test_the_spark_ui_is_off_unless_the_pipeline_turns_it_on() -> None:
    """Spark's UI would listen on every interface: off by default, on by spark.conf."""
    assert spark_conf(SparkConfig(master="local[2]"), "t")["spark.ui.enabled"] == "false"
    on = SparkConfig(master="local[2]", conf={"spark.ui.enabled": "true"})
    assert spark_conf(on, "t")["spark.ui.enabled"] == "true"
