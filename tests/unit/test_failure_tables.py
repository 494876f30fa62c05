"""Each failure-transition table is written once, in the docstring of the module whose methods
it describes; a doc that shows one as a table names the same transitions, or this fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SINK = ROOT / "spark_apps" / "eos_stream" / "sink"
DOC = ROOT / "docs" / "streaming_app.md"
# (module whose docstring holds the table, the ids' pattern in the docstring and in the doc's table rows)
TABLES = [
    (SINK / "batch_sink.py", r"(?:\d+s?)"),
    (SINK / "parts.py", r"P\d+"),
    (SINK / "apply_ahead.py", r"A\d+"),
]


def _docstring_ids(module: Path, ids: str) -> list[str]:
    doc = ast.get_docstring(ast.parse(module.read_text())) or ""
    return re.findall(rf"^({ids})\. ", doc, re.M)


def _doc_table_ids(ids: str) -> list[str]:
    return re.findall(rf"^\| ({ids}) \|", DOC.read_text(), re.M)


@pytest.mark.parametrize(("module", "ids"), TABLES, ids=lambda v: getattr(v, "name", v))
def test_the_docs_table_names_the_transitions_of_the_modules_docstring(module: Path, ids: str) -> None:
    in_code = _docstring_ids(module, ids)
    assert len(in_code) >= 3, f"{module.name}'s docstring holds no failure-transition table"
    assert _doc_table_ids(ids) == in_code, f"docs/streaming_app.md's table and {module.name}'s docstring differ"
    assert f"spark_apps/eos_stream/sink/{module.name}" in DOC.read_text()


def test_each_table_is_written_in_one_module_only() -> None:
    for module, ids in TABLES[1:]:  # the lettered ones; numbered lists are common in docstrings
        for other in SINK.glob("*.py"):
            if other != module:
                assert not set(_docstring_ids(other, ids)), f"{other.name} repeats {module.name}'s transitions"
