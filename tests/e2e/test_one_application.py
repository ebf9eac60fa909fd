"""One application and four processes are two shapes of the same deployment.

The pipeline runs as one Spark application (`cdc run`), stops, and goes on as four
processes on the same storage root, half of the load produced before each start. Every
output then equals the oracle, the change topics hold no duplicate, and both runs stopped
cleanly on SIGTERM: nothing was lost or repeated at the switch, and nothing had to be
migrated. The other way, four processes to one application, is the chaos run's switch
(`tests/e2e/test_chaos.py`), where every process is SIGKILLed first.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cdc_devkit import infra
from cdc_devkit.checks import change_topic_state
from cdc_devkit.local_run import (
    check_outputs,
    oracle_rows,
    wait_until_healthy,
    write_pipeline_config,
)
from cdc_devkit.processes import RunMode, launch, stop_all, wait_a_little
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, ensure_topics, produce
from cdc_shared.config import load_config
from cdc_shared.schemas import make_registry
from pyspark.sql import SparkSession

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PHASES = (RunMode.APPLICATION, RunMode.SERVICES)
CATCH_UP_S = 300.0


def test_services_switch_between_one_application_and_four_processes(
    local_servers: infra.Endpoints, spark: SparkSession, tmp_path: Path
) -> None:
    config_path = write_pipeline_config(tmp_path, local_servers, prefix="switch")
    config = load_config(config_path)
    ensure_topics(config.kafka, [e.source_topic for e in config.entities])
    spec = WorkloadSpec(events=600, keys=150, seed=11, poison_share=0.003)
    messages = list(WorkloadGenerator(config.entities, make_registry(config), spec).messages())
    share = len(messages) // len(PHASES) + 1

    for number, mode in enumerate(PHASES):
        produce(config.kafka, iter(messages[number * share : (number + 1) * share]), rate=None)
        processes = launch(mode, config_path, tmp_path / "logs" / f"{number}-{mode}")
        for process in processes:
            process.start()
        try:
            wait_until_healthy(processes, config, CATCH_UP_S)
            expected = oracle_rows(config)
            deadline = time.monotonic() + CATCH_UP_S
            while True:
                differences = check_outputs(spark, config, expected)
                if all(d.agrees for d in differences) or time.monotonic() > deadline:
                    break
                wait_a_little(processes, 5)
        finally:
            exit_codes = stop_all(processes)
        described = "\n".join(d.describe() for d in differences)
        assert all(d.agrees for d in differences), f"phase {number} ({mode}):\n{described}"
        assert exit_codes == dict.fromkeys(exit_codes, 0), f"phase {number} ({mode})"
        errors = [e for p in processes for e in p.errors]
        assert errors == [], f"phase {number} ({mode}) logged errors: {errors[:5]}"
        batches = {str(b.get("service")) for p in processes for b in p.batches}
        assert batches == {"ingestor", "merger", "publisher_kafka", "publisher_es"}, mode

    for entity in config.entities:
        duplicates = change_topic_state(config, entity).duplicates
        assert duplicates == [], f"{entity.change_topic_name} repeated {duplicates[:5]}"
