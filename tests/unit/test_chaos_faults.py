"""The chaos run's fault plan, its record and its verdict, without running it.

The registry outage is planned like every other fault, shows in the summary like the
Elasticsearch outages, and a valid record quarantined (as unknown_schema: what a registry
fault misread as the record's would do) is a divergence that fails the run.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from cdc_devkit.chaos import (
    ChaosOptions,
    ChaosResult,
    FaultRecord,
    plan_faults,
    summary_rows,
    switch_points,
)
from cdc_devkit.checks import Difference, PoisonCheck


def test_registry_outages_are_planned_and_shuffled_with_the_other_faults() -> None:
    options = ChaosOptions(
        kills=7, broker_restarts=1, es_outages=1, es_slowdowns=1, registry_outages=2
    )
    plan = plan_faults(options, random.Random(42))
    assert Counter(plan) == {
        "kill": 7,
        "broker restart": 1,
        "es outage": 1,
        "es slowdown": 1,
        "registry outage": 2,
    }
    assert plan == plan_faults(options, random.Random(42)), "same seed, same plan"
    assert (
        plan_faults(ChaosOptions(kills=3, registry_outages=0), random.Random(1)).count(
            "registry outage"
        )
        == 0
    ), "none unless asked for (the default)"
    assert ChaosOptions().registry_outages == 0


def _table(result: ChaosResult) -> str:
    return "\n".join(f"{label:<28}{value}" for label, value in summary_rows(result))


def test_deployments_switch_at_equal_shares_of_the_kills() -> None:
    """Each mode before the last is killed; kills too few for the last switch: at the end."""
    plan = ["kill", "es-outage", "kill", "broker-restart", "kill", "kill"]
    assert switch_points(plan, 2) == [5]  # two kills in each mode
    assert switch_points(plan, 3) == [5, 6]  # 2, 1, 1: the first mode the remainder
    assert switch_points(["kill", "es-outage", "kill"], 3) == [3, 4]  # the third: at the end


def test_the_summary_counts_registry_outages_and_the_requests_they_refused() -> None:
    result = ChaosResult(faults=FaultRecord(registry_outages=1, registry_refused=5))
    table = _table(result)
    assert re.search(r"^registry outages\s+1$", table, re.M), table
    assert re.search(r"^  requests answered 503\s+5$", table, re.M), table
    quiet = _table(ChaosResult())
    assert re.search(r"^registry outages\s+0$", quiet, re.M), quiet
    assert "requests answered 503" not in quiet


def test_a_valid_record_quarantined_as_unknown_schema_is_a_divergence() -> None:
    poison = [("chaos.customers", 0, 17, "bad_avro")]
    clean = ChaosResult(
        outputs=[Difference("silver/customers", compared=10)],
        poison=PoisonCheck(injected=1),
        exit_codes={"ingestor": 0},
    )
    assert clean.divergences == 0 and clean.passed
    # A record the producer wrote valid (not among the poison) found in quarantine.
    misread = ChaosResult(
        outputs=clean.outputs,
        poison=PoisonCheck(
            injected=len(poison), unexpected=[("chaos.customers", 1, 40, "unknown_schema")]
        ),
        exit_codes=clean.exit_codes,
    )
    assert misread.divergences == 1 and not misread.passed
    assert "valid records quarantined 1" in misread.poison.describe()  # type: ignore[union-attr]
