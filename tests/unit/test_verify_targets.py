"""``cdc verify``'s choice of targets per entity, without servers: what it compares, what it
skips and says so, and that a run comparing nothing is no agreement.

Silver's spill and the targets' comparisons are stand-ins here (they are proven against
real tables in ``tests/integration/test_cli_ops.py`` and ``test_merger_history.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cdc_cli import verify
from cdc_cli.verify import RowShape, TargetComparison, VerifyReport, render
from cdc_cli.verify_buckets import BucketSpill, key_text
from cdc_shared.config.entities import EntityConfig, HistoryConfig
from cdc_shared.config.pipeline import PipelineConfig
from pyspark.sql import types as T

SILVER = T.StructType([T.StructField("id", T.IntegerType()), T.StructField("name", T.StringType())])
PLAIN = EntityConfig(name="plain", source_topic="t.plain", key=["id"])
KEPT = EntityConfig(
    name="kept", source_topic="t.kept", key=["id"], history=HistoryConfig(enabled=True)
)


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every silver exists with two rows; every comparison agrees. Records (name, target)
    of each target compared (the history's by entity name)."""
    done: list[tuple[str, str]] = []

    def spill_silver(
        spark: Any, path: str, entity: EntityConfig, folder: Path, buckets: int | None
    ) -> tuple[RowShape, BucketSpill]:
        shape = RowShape.of(SILVER, entity)
        spill = BucketSpill(folder, 1)
        for key in (1, 2):
            spill.add(key_text((key,)), "h", key)
        return shape, spill

    def compare_target(target: str, name: str, *args: Any, **kwargs: Any) -> TargetComparison:
        done.append((name, target))
        return TargetComparison(target, name, rows=2, buckets=1)

    def compare_history(
        spark: Any, config: PipelineConfig, entity: EntityConfig, *args: Any
    ) -> TargetComparison:
        done.append((entity.name, "history"))
        return TargetComparison("history", config.layout.history(entity.name), rows=2, buckets=1)

    monkeypatch.setattr(verify, "is_delta_table", lambda spark, path: True)
    monkeypatch.setattr(verify, "spill_silver", spill_silver)
    monkeypatch.setattr(verify, "compare_target", compare_target)
    monkeypatch.setattr(verify, "compare_history", compare_history)
    return done


def _verify(*entities: EntityConfig, targets: tuple[str, ...] | None) -> VerifyReport:
    config = PipelineConfig(storage_root="/nowhere", entities=list(entities))
    return verify.verify(config, targets=targets, spark=object())  # type: ignore[arg-type]


def test_history_asked_for_an_entity_without_history_is_skipped_and_agrees_with_nothing(
    compared: list[tuple[str, str]],
) -> None:
    report = _verify(PLAIN, targets=("history",))
    assert compared == []
    (entity,) = report.entities
    (skipped,) = entity.targets
    assert (skipped.target, skipped.compared, skipped.rows) == ("history", False, 0)
    assert skipped.skipped is not None and "history is off" in skipped.skipped
    assert not report.ok  # nothing was compared: no agreement, exit 1
    text = render(report)
    assert "history is off for this entity" in text and "SKIPPED" in text
    assert text.splitlines()[-1] == "nothing compared: every target asked for was skipped"
    assert "agree" not in text
    assert report.to_dict()["entities"][0]["targets"][0]["skipped"] == skipped.skipped


def test_history_asked_for_compares_the_entities_with_history_and_skips_the_others(
    compared: list[tuple[str, str]],
) -> None:
    report = _verify(PLAIN, KEPT, targets=("history",))
    assert compared == [("kept", "history")]
    plain, kept = report.entities
    assert [t.compared for t in plain.targets] == [False]
    assert [t.compared for t in kept.targets] == [True]
    assert report.ok and (report.compared, report.skipped) == (1, 1)
    assert render(report).splitlines()[-1] == (
        "all compared targets agree with silver (1 skipped, not compared)"
    )


def test_by_default_each_entity_is_compared_on_the_targets_it_has(
    compared: list[tuple[str, str]],
) -> None:
    report = _verify(PLAIN, KEPT, targets=None)
    assert sorted(compared) == [
        ("cdc.kept", "change_topic"),
        ("cdc.plain", "change_topic"),
        ("kept", "elasticsearch"),
        ("kept", "history"),
        ("plain", "elasticsearch"),
    ]
    assert report.ok and report.skipped == 0
    assert render(report).splitlines()[-1] == "all targets agree with silver"
