"""Packages talk through ``cdc_shared``, never by importing one another; ``cdc_shared``'s
modules import one another without a loop.

A service (or the operator CLI) that imports another service's package couples their
releases and hides a contract inside one of them; the contracts (table columns, the
replay header, the unavailable-value placeholder, the tombstone expiry) live in
``cdc_shared``. The one exception is where the services are started together in one
application (``cdc run``). A loop among ``cdc_shared``'s modules is only hidden, not
gone, by an import inside a function: the check counts those too.
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


SHARED = ROOT / "shared"


def imported_modules(module: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of each import in ``module``, nested ones too (for ``from A
    import b``: ``A`` and ``A.b``, which may be a module)."""
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def shared_import_graph(root: Path = SHARED) -> dict[str, set[str]]:
    """Each ``cdc_shared`` module (by dotted name) -> the ``cdc_shared`` modules it imports."""
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, imported in imported_modules(path):
            target = module_of(imported) if imported.startswith("cdc_shared") else None
            if target is not None and target != name:
                graph[name].add(target)
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each loop of ``graph`` found by a depth-first walk, as the modules along it."""
    loops: list[list[str]] = []
    finished: set[str] = set()

    def walk(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                loops.append([*path[path.index(target) :], target])
            elif target not in finished:
                walk(target, [*path, target])
        finished.add(name)

    for name in sorted(graph):
        if name not in finished:
            walk(name, [name])
    return loops


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


def test_cdc_shared_has_no_import_loop() -> None:
    loops = import_loops(shared_import_graph())
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)


def test_the_check_sees_a_loop_hidden_in_a_function(tmp_path: Path) -> None:
    package = tmp_path / "cdc_shared"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("def f():\n    from cdc_shared.sets import g\n")
    (package / "sets.py").write_text("from cdc_shared.config import f\n")
    loops = import_loops(shared_import_graph(tmp_path))
    assert ["cdc_shared.config", "cdc_shared.sets", "cdc_shared.config"] in loops, loops
