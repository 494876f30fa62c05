"""Which module may import which, read from the source (``ast``), every import counted: those at a
module's top, inside functions and under ``TYPE_CHECKING``.

- no circle: no module imports itself through others (``run/config.py`` and ``run/config_rules.py``
  once did);
- the stream's packages import only downward (``LAYERS``);
- the provider's ``utils`` import nothing of the provider's other packages, which all build on them;
- the app (``spark_apps``) imports no Airflow: it runs on Spark without it;
- an engine (``engines/``: Spark, continuous, the direct replay) imports no other engine, not
  even through the modules they share (``SHARED``), which import none; every other module of
  ``engines/`` belongs to one engine alone;
- the benchmarks import neither the tests nor the demo (their harness is ``bench/harness.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("airflow_provider_eos", "spark_apps", "bench")
STREAM = "spark_apps.eos_stream"
# The stream's packages, lowest first: a module imports only from its own package or a lower one
# (same rank: neither imports the other). app.py, the spark-submit entry, is above them all.
LAYERS = {"kafka": 0, "records": 0, "events": 0, "known_keys": 0, "collector": 0, "errors": 1, "state": 1,
          "sink": 2, "cdc": 3, "run": 3, "audit": 4, "engines": 4, "app": 5}
ENGINES_PACKAGE = f"{STREAM}.engines"
ENGINES = {"the Spark engine": f"{ENGINES_PACKAGE}.spark", "the continuous engine": f"{ENGINES_PACKAGE}.continuous",
           "the direct replay": f"{ENGINES_PACKAGE}.direct_replay"}
# What the engines share: the start and the loop's pieces (the package's own docstring too).
SHARED = {ENGINES_PACKAGE, f"{ENGINES_PACKAGE}.start", f"{ENGINES_PACKAGE}.shared"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, Path]:
    """Every module of PACKAGES by its dotted name (a package by its own name)."""
    return {_module_name(path): path for top in PACKAGES for path in sorted((ROOT / top).rglob("*.py"))}


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every dotted name the code of ``module`` imports: ``import a.b`` gives ``a.b``; ``from a
    import b`` gives ``a`` and ``a.b`` (``b`` may be a module); relative imports are resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _local_imports(module: str) -> set[str]:
    """The modules of PACKAGES that ``module`` imports (not itself)."""
    path = _sources()[module]
    names = imported_names(path.read_text(), module, path.name == "__init__.py")
    return {name for name in names if name in _sources() and name != module}


@cache
def _graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(_local_imports(module)) for module in _sources()}


def circles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: dict[str, frozenset[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for other in graph.get(todo.pop(), ()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def test_no_module_imports_itself_through_others() -> None:
    assert circles(_graph()) == []


def test_the_circle_check_finds_a_circle_and_reads_every_kind_of_import() -> None:
    assert circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x.y import Z\n"
              "def f():\n    from . import sibling\n    import p.q\n")
    assert {"x.y", "x.y.Z", "pkg.sibling", "p.q"} <= imported_names(source, "pkg.mod")
    assert "pkg.mod.inner" in imported_names("from .inner import g\n", "pkg.mod", is_package=True)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if module.startswith(STREAM + ".") and len(parts) > 2 else None


@pytest.mark.parametrize("module", sorted(m for m in _sources() if _layer(m)))
def test_the_streams_packages_import_only_downward(module: str) -> None:
    own = _layer(module)
    assert own in LAYERS, f"{own} has no rank in LAYERS"
    for other in _graph()[module]:
        layer = _layer(other)
        if layer is None or layer == own:
            continue
        assert layer in LAYERS, f"{layer} has no rank in LAYERS"
        assert LAYERS[layer] < LAYERS[own], f"{module} ({own}) imports {other} ({layer}): upward or sideways"


def test_kafka_and_records_import_nothing_of_the_app_above_them() -> None:
    for module, imports in _graph().items():
        if _layer(module) in ("kafka", "records"):
            assert {m for m in imports if _layer(m) not in (None, _layer(module))} == set(), module


def test_the_providers_utils_import_nothing_of_the_provider_above_them() -> None:
    utils = "airflow_provider_eos.utils"
    upward = {module: sorted(m for m in imports if m.startswith("airflow_provider_eos.")
                             and not (m == utils or m.startswith(utils + ".")))
              for module, imports in _graph().items() if module == utils or module.startswith(utils + ".")}
    assert {module: found for module, found in upward.items() if found} == {}


def _importing(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules of ``package`` that import a top-level package of ``forbidden`` (PACKAGES or not),
    with what they import of it."""
    found = {}
    for module, path in _sources().items():
        if module == package or module.startswith(package + "."):
            names = imported_names(path.read_text(), module, path.name == "__init__.py")
            if wrong := sorted(n for n in names if n.split(".")[0] in forbidden):
                found[module] = wrong
    return found


def test_the_app_imports_no_airflow() -> None:
    assert _importing("spark_apps", ("airflow", "airflow_provider_eos")) == {}
    assert _importing("airflow_provider_eos", ("airflow",)), "the check sees an import of Airflow"


def test_no_engine_imports_another() -> None:
    for name, module in ENGINES.items():
        assert module in _sources(), f"{name}: {module} is gone; update ENGINES"
        others = {other for other, engine in ENGINES.items() if engine in reachable(_graph(), module)}
        assert others == set(), f"{name} ({module}) imports {sorted(others)}"


def test_what_the_engines_share_imports_no_engine() -> None:
    for module in sorted(SHARED):
        assert module in _sources(), f"{module} is gone; update SHARED"
        engines = {name for name, engine in ENGINES.items() if engine in reachable(_graph(), module)}
        assert engines == set(), f"{module}, shared by the engines, imports {sorted(engines)}"


def test_every_module_of_the_engines_package_is_an_engine_shared_or_one_engines_own() -> None:
    """A module two engines import is shared and belongs in SHARED (where it is checked to import
    no engine); one no engine imports is dead."""
    package = [m for m in _sources() if m.startswith(ENGINES_PACKAGE + ".")]
    for module in sorted(set(package) - SHARED - set(ENGINES.values())):
        users = sorted(name for name, engine in ENGINES.items() if module in reachable(_graph(), engine))
        assert len(users) == 1, f"{module} is imported by {users or 'no engine'}"


def test_the_benchmarks_import_neither_the_tests_nor_the_demo() -> None:
    assert _importing("bench", ("tests", "demo")) == {}
    assert _importing("bench", ("spark_apps",)), "the check sees what a package imports"
