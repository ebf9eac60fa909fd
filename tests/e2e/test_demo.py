"""The README's first command, in a short mode.

`cdc demo` runs the pipeline as one Spark application (`cdc run`) and must end with every
output agreeing with the oracle, every service having written batches, no error logged,
and every service stopping cleanly (exit 0). The outputs include the example's history
table (customers has `history` on): every version, its end and its newest event's values,
against the versions the oracle's replay of the source topic makes. That one application
and four processes are two shapes of one deployment (nothing to migrate between them) is
the chaos run's switch (`tests/e2e/test_chaos.py`: four processes SIGKILLed, then one
application on their root).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cdc_devkit import infra
from cdc_devkit.processes import RunMode, launch
from cdc_shared.contracts.layout import SERVICES
from support.servers import infra_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CDC = str(Path(sys.executable).with_name("cdc"))


def test_demo_agrees_with_the_oracle(local_servers: infra.Endpoints, tmp_path: Path) -> None:
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
    # The one bronze table's rows, counted per entity: each entity's records landed, and
    # with the ingestor's quarantine (the poison records) every record produced, once.
    landed = {
        entity: _count(rf"bronze/_all, entity {entity}\s+([\d,]+) rows", summary)
        for entity in ("customers", "orders")
    }
    assert all(landed.values()), summary
    produced = _count(r"events produced\s+([\d,]+) \(", summary)
    quarantined = _count(r"quarantine/ingestor\s+([\d,]+) rows", summary)
    assert sum(landed.values()) + quarantined == produced, summary
    history = re.search(
        r"check\s+silver_history/customers by \(key, __start_at\): (\d+) keys agree", summary
    )
    assert history, f"no agreeing history check in:\n{summary}"
    assert int(history.group(1)) > 200, summary  # more versions than keys: changes tracked
    assert "DISAGREEMENT" not in summary
    assert (workdir / "report.html").stat().st_size > 1000
    # Its application's log, read back: no error line, a batch of every service.
    (application,) = launch(RunMode.APPLICATION, workdir / "pipeline.yaml", workdir / "logs")
    application.poll()
    assert application.errors == [], f"the demo's application logged: {application.errors[:5]}"
    assert {str(b.get("service")) for b in application.batches} == set(SERVICES)


def _count(pattern: str, summary: str) -> int:
    """The number (``12,116``) the summary line matching ``pattern`` shows."""
    found = re.search(pattern, summary)
    assert found, f"no line matching {pattern!r} in:\n{summary}"
    return int(found.group(1).replace(",", ""))
