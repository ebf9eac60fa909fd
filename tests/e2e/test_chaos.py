"""`cdc chaos` in a short mode: SIGKILLs, a broker restart, an Elasticsearch outage and
slowdown, a schema-registry outage (HTTP 503 while a service restarts and must ask the
registry for its schemas) under load, then zero divergences in every output and log, and
no valid record quarantined. One run covers both deployments on the same tables and both
ways between them: the services as four processes (one killed alone), then, after every
process is killed at once, as one application (a kill takes all four down), then, killed
at once again, as four processes. Every service's own process test kills it alone three
times more (``tests/integration/test_*_process.py``)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cdc_devkit import infra
from support.servers import infra_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CDC = str(Path(sys.executable).with_name("cdc"))
# One kill in each of the first two deployments; the third is killed only by the switch
# into it (a kill of the application restarts all four services).
KILLS = 2
MODES = ("services", "application", "services")
# Below the test's own timeout, so a run that hangs still reports what it saw.
RUN_LIMIT_S = 1350


@pytest.mark.timeout(1560)
def test_short_chaos_run_has_no_divergence(
    local_servers: infra.Endpoints, registry_url: str, tmp_path: Path
) -> None:
    # The run restarts the servers it finds with `cdc infra`: point it at the session's own
    # (the registry included: the fixture starts it, the run finds it).
    env = infra_env()
    chaos = subprocess.Popen(
        [
            CDC,
            "chaos",
            *("--events", "3500", "--rate", "100", "--keys", "300"),
            *("--kills", str(KILLS), "--broker-restarts", "1", "--es-outages", "1"),
            *("--es-slowdowns", "1", "--registry-outages", "1"),
            *("--pause", "4", "--outage", "8", "--window-timeout", "20"),
            *("--workdir", str(tmp_path / "chaos"), "--timeout", "480"),
            *(arg for mode in MODES for arg in ("--mode", mode)),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = chaos.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM, not the SIGKILL a timeout sends: `cdc chaos` then stops the services
        # it started, which would otherwise outlive it and load the rest of the suite.
        chaos.send_signal(signal.SIGTERM)
        stdout, stderr = chaos.communicate(timeout=150)
        pytest.fail(
            f"chaos run still going after {RUN_LIMIT_S} s:\n{stdout[-4000:]}\n{stderr[-3000:]}"
        )
    run = subprocess.CompletedProcess(chaos.args, chaos.returncode, stdout, stderr)
    summary = run.stdout[run.stdout.find("events produced") :]
    assert run.returncode == 0, (
        f"chaos run failed:\n{summary or run.stdout[-4000:]}\n{run.stderr[-3000:]}"
    )
    assert re.search(r"divergences\s+0\b", summary), summary
    kills = dict(re.findall(r"kills (\S+)\s+(\d+)", summary))
    assert sum(map(int, kills.values())) == KILLS, summary
    assert int(kills.get("application", 0)) == 1, summary  # the other hit one process
    assert re.search(r"mode switch\s+services -> application\b", summary), summary
    assert re.search(r"mode switch\s+application -> services\b", summary), summary
    assert re.search(r"broker restarts\s+1\b", summary), summary
    assert re.search(r"Elasticsearch outages\s+1\b", summary), summary
    assert re.search(r"registry outages\s+1\b", summary), summary
    refused = re.search(r"requests answered 503\s+(\d+)", summary)
    assert refused and int(refused.group(1)) >= 1, summary  # a restarting service met it
    assert "valid records quarantined" not in summary, summary  # the poison, and only it
    assert "no planted secret in any log" in summary
    assert len(re.findall(r": 0 duplicate \(key, sequence, op\)", summary)) == 2, summary
    assert "fault not injected" not in summary
