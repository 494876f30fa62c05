"""Size of the code outside the tests: no module over 500 lines, no function over 60 (which module
may import which: test_import_rules.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ("airflow_provider_eos", "spark_apps", "dags", "bench")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60
# Modules that may stay over MAX_MODULE_LINES, each with why.
MODULE_ALLOWED: dict[str, str] = {}
# Functions that may stay over MAX_FUNCTION_LINES ("path:name"), each with why.
FUNCTION_ALLOWED: dict[str, str] = {}


def _modules() -> list[Path]:
    return sorted(p for top in MEASURED for p in (ROOT / top).rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_module_is_over_500_lines() -> None:
    over = {_name(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert set(over) <= set(MODULE_ALLOWED), f"modules over {MAX_MODULE_LINES} lines: {over}"
    stale = set(MODULE_ALLOWED) - set(over)
    assert not stale, f"allowed but no longer over: remove {sorted(stale)} from MODULE_ALLOWED"


def test_no_function_is_over_60_lines() -> None:
    over = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{_name(path)}:{node.name}"] = lines
    assert set(over) <= set(FUNCTION_ALLOWED), f"functions over {MAX_FUNCTION_LINES} lines: " \
        f"{ {k: v for k, v in over.items() if k not in FUNCTION_ALLOWED} }"
    stale = set(FUNCTION_ALLOWED) - set(over)
    assert not stale, f"allowed but no longer over: remove {sorted(stale)} from FUNCTION_ALLOWED"

