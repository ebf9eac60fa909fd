"""The README's first command, in a short mode: `cdc demo` must end with every output
agreeing with the oracle and every service stopping cleanly (exit 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cdc_devkit import infra
from support.servers import infra_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CDC = str(Path(sys.executable).with_name("cdc"))


def test_short_demo_agrees_with_the_oracle(local_servers: infra.Endpoints, tmp_path: Path) -> None:
    # The demo brings up its servers with `cdc infra up`: point it at the session's own.
    env = infra_env()
    workdir = tmp_path / "demo"
    run = subprocess.run(
        [
            CDC,
            "demo",
            "--events",
            "1500",
            "--rate",
            "500",
            "--keys",
            "200",
            "--workdir",
            str(workdir),
            "--timeout",
            "420",
        ],
        env=env,
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
