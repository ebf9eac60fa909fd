"""The README's first command, in a short mode, then the same pipeline as four processes.

`cdc demo` runs the pipeline as one Spark application (`cdc run`) and must end with every
output agreeing with the oracle and every service stopping cleanly (exit 0). The test then
goes on from the demo's storage root as four processes, with more load produced first:
every output again equals the oracle, the change topics hold no duplicate, and the four
stop cleanly on SIGTERM. So one application and four processes are two shapes of the same
deployment: nothing was lost or repeated at the switch, and nothing had to be migrated.
The other way, four processes to one application, is the chaos run's switch
(`tests/e2e/test_chaos.py`), where every process is SIGKILLed first.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from cdc_devkit import infra
from cdc_devkit.checks import change_topic_state
from cdc_devkit.local_run import check_outputs, oracle_rows, wait_until_healthy
from cdc_devkit.processes import RunMode, ServiceProcess, launch, stop_all, wait_a_little
from cdc_devkit.workload import WorkloadGenerator, WorkloadSpec, produce
from cdc_shared.config import load_config
from cdc_shared.layout import SERVICES
from cdc_shared.schemas import make_registry
from pyspark.sql import SparkSession
from support.servers import infra_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CDC = str(Path(sys.executable).with_name("cdc"))
CATCH_UP_S = 300.0


def _errors_and_services(processes: list[ServiceProcess]) -> tuple[list[str], set[str]]:
    """The error lines the processes logged, and the services that logged a batch."""
    for process in processes:
        process.poll()
    errors = [e for p in processes for e in p.errors]
    return errors, {str(b.get("service")) for p in processes for b in p.batches}


def test_demo_agrees_with_the_oracle_then_goes_on_as_four_processes(
    local_servers: infra.Endpoints, spark: SparkSession, tmp_path: Path
) -> None:
    # The demo brings up its servers with `cdc infra up`: point it at the session's own.
    workdir = tmp_path / "demo"
    run = subprocess.run(
        [
            CDC,
            "demo",
            *("--events", "1500", "--rate", "500", "--keys", "200"),
            *("--workdir", str(workdir), "--timeout", "420"),
        ],
        env=infra_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    summary = run.stdout[run.stdout.find("events produced") :]
    assert run.returncode == 0, (
        f"demo failed:\n{summary or run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    assert "everything agrees with the oracle" in summary
    for check in ("silver/customers", "silver/orders", "index ", "topic "):
        assert check in summary
    assert "DISAGREEMENT" not in summary
    assert (workdir / "report.html").stat().st_size > 1000
    config_path = workdir / "pipeline.yaml"
    errors, batches = _errors_and_services(
        launch(RunMode.APPLICATION, config_path, workdir / "logs")
    )
    assert errors == [], f"the demo's application logged errors: {errors[:5]}"
    assert batches == set(SERVICES)

    # The same storage root, topics and indexes, now as four processes.
    config = load_config(config_path)
    spec = WorkloadSpec(events=400, keys=150, seed=11, poison_share=0.003)
    produce(
        config.kafka, WorkloadGenerator(config.entities, make_registry(config), spec).messages()
    )
    processes = launch(RunMode.SERVICES, config_path, tmp_path / "logs")
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
    assert all(d.agrees for d in differences), f"four processes after the demo:\n{described}"
    assert exit_codes == dict.fromkeys(exit_codes, 0)
    errors, batches = _errors_and_services(processes)
    assert errors == [], f"the four processes logged errors: {errors[:5]}"
    assert batches == set(SERVICES)
    for entity in config.entities:
        duplicates = change_topic_state(config, entity).duplicates
        assert duplicates == [], f"{entity.change_topic_name} repeated {duplicates[:5]}"
