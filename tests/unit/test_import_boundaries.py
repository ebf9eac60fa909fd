"""Packages talk through ``cdc_shared``, never by importing one another.

A service (or the operator CLI) that imports another service's package couples their
releases and hides a contract inside one of them; the contracts (table columns, the
replay header, the unavailable-value placeholder, the tombstone expiry) live in
``cdc_shared``. The one exception is where the services are started together in one
application (``cdc run``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("cdc_ingestor", "cdc_merger", "cdc_publisher_es", "cdc_publisher_kafka", "cdc_cli")
#: Each package's source folder, and the top-level packages of ours it may import.
ALLOWED = {
    ROOT / "shared" / "cdc_shared": {"cdc_shared"},
    ROOT / "devkit" / "cdc_devkit": {"cdc_shared", "cdc_devkit", "cdc_cli"},
    **{
        folder: {"cdc_shared", folder.name}
        for folder in (ROOT / "services").glob("*/cdc_*")
        if folder.is_dir()
    },
}
#: ``cdc run`` starts every service in one Spark application.
STARTS_THE_SERVICES = ROOT / "services" / "cli" / "cdc_cli" / "application.py"
OURS = ("cdc_shared", "cdc_devkit", *SERVICES)


def imported_packages(module: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of each import of ours in ``module``, nested ones too."""
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in OURS:
                yield node.lineno, top


def test_every_package_of_ours_is_checked() -> None:
    names = {folder.name for folder in ALLOWED}
    assert set(OURS) <= names, set(OURS) - names


def test_no_package_imports_a_service_it_does_not_own() -> None:
    crossings = [
        f"{module.relative_to(ROOT)}:{line} imports {package}"
        for folder, allowed in ALLOWED.items()
        for module in sorted(folder.rglob("*.py"))
        if module != STARTS_THE_SERVICES
        for line, package in imported_packages(module)
        if package not in allowed
    ]
    assert not crossings, "\n".join(crossings)


def test_the_check_sees_a_crossing(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from cdc_merger.apply import apply_batch\n")
    assert list(imported_packages(module)) == [(2, "cdc_merger")]
