"""Each service's usage line names the command that is installed for it."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest
from cdc_shared.contracts.layout import command_name

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("cdc_ingestor", "cdc_merger", "cdc_publisher_kafka", "cdc_publisher_es")


@pytest.mark.parametrize("package", MODULES)
def test_a_service_is_named_by_its_installed_command(package: str) -> None:
    service = importlib.import_module(f"{package}.main").SERVICE
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[command_name(service)] == f"{package}.main:main"
