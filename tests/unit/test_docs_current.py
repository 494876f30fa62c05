"""The docs describe the project as it is, every page is reachable, and every repository path
they name exists.

- ``docs/README.md`` says it lists every page: a page missing from it is found by nobody.
- The user pages carry no development history: no commit hash, no "issue N", no dated diary
  entry. The history (what changed, earlier measurements) is in CHANGELOG.md and
  bench/results/HISTORY.md. A results table may name the commit and the date it measured, in a
  row of its own: that is what the figure is of, not a story of how it came to be.
- A path written in backticks (``spark_apps/eos_stream/run/config_rules.py``) exists in the
  repository, so a moved file does not leave the docs pointing at nothing.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

# A commit hash: 7 to 40 hex digits with a letter and a digit, not part of a longer word or a
# UUID (a value in an example). The letter-and-digit rule leaves numbers and words alone.
COMMIT = re.compile(r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
INLINE_CODE = re.compile(r"`([^`\s]+)`")


def _prose(page: Path) -> Iterator[tuple[int, str, bool]]:
    """Each line outside fenced code blocks: (number, text, is a table row)."""
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line, line.lstrip().startswith("|")


def history_in(line: str, table_row: bool) -> list[str]:
    """What in one line of a doc is development history (empty: none)."""
    found = [f"issue number {m.group(0)!r}" for m in ISSUE.finditer(line)]
    if not table_row:  # a results table may name the commit and the day it measured
        found += [f"commit {m.group(0)}" for m in COMMIT.finditer(line)]
        found += [f"date {m.group(0)}" for m in DATE.finditer(line)]
    return found


@pytest.mark.parametrize(("line", "table_row"), [
    ("Throughput: code 2a2cbc3 (`bench/results/sink_throughput.json`). Rerun at abb7b73", False),
    ("of the restore (issue 10). It now ends `stopped` without starting.", False),
    ("**2026-11-26, the audit read by worker processes**", False),
    ("(one Spark run, ~45 s; issue 22 test 5)", True),
])
def test_the_history_patterns_catch_a_diary(line: str, table_row: bool) -> None:
    assert history_in(line, table_row)


@pytest.mark.parametrize(("line", "table_row"), [
    ("| 100,000 | e933e7e, 2026-11-27 | 3.3 |", True),
    ("- uuid arrays: the name-based UUID of its bytes (`b68a35a7-17ad-35b3-af2a-ae46edb4545a`).", False),
    ("1,000,000 events, 20 tables, 4096 partitions, the deadline 1234567 ms", False),
    ("a decade of snapshots kept, `keep_last: 48`", False),
])
def test_the_history_patterns_leave_results_and_values_alone(line: str, table_row: bool) -> None:
    assert not history_in(line, table_row)


def test_no_page_carries_development_history() -> None:
    hits = [f"{page.relative_to(ROOT)}:{number}: {', '.join(found)}: {line.strip()[:100]}"
            for page in PAGES for number, line, table_row in _prose(page)
            if (found := history_in(line, table_row))]
    assert not hits, ("the docs say what is, the history goes to CHANGELOG.md or bench/results/HISTORY.md "
                      "(a results table may name its commit):\n" + "\n".join(hits))


def test_the_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", index))
    missing = sorted(page.name for page in DOCS.glob("*.md") if page.name != "README.md" and page.name not in linked)
    assert not missing, f"docs/README.md lists every page; add {missing}"
    assert not linked - {page.name for page in DOCS.glob("*.md")} - {"README.md"}, "it links no missing page"


def _tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if listed.returncode == 0 and listed.stdout.strip():
        return listed.stdout.split()
    return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]


def _repository() -> tuple[set[str], set[str], set[str]]:
    """The tracked files, the top-level directories, every file's name."""
    tracked = set(_tracked())
    return tracked, {t.split("/")[0] for t in tracked if "/" in t}, {t.rsplit("/", 1)[-1] for t in tracked}


def missing_path(written: str, tracked: set[str], tops: set[str], names: set[str]) -> str | None:
    """The repository path ``written`` in backticks names, if it does not exist (None: it exists,
    or it is no repository path: a runtime path, a placeholder, an example of the user's)."""
    path = written.split("::")[0].split("#")[0].rstrip(".,;:")
    if any(c in path for c in "<>{}*$"):
        return None
    if "/" not in path:  # a bare module file name names one in the repository
        return path if path.endswith(".py") and path not in names else None
    if path.split("/")[0] not in tops:
        return None
    if path.rstrip("/") in tracked or any(t.startswith(path.rstrip("/") + "/") for t in tracked):
        return None
    # tests/streaming.spark_submit: a module's attribute.
    module = path.rsplit("/", 1)
    return None if f"{module[0]}/{module[1].split('.')[0]}.py" in tracked else path


@pytest.mark.parametrize(("written", "missing"), [
    ("spark_apps/eos_stream/config_rules.py", True),
    ("records.py", True),
    ("spark_apps/eos_stream/run/config_rules.py", False),
    ("tests/streaming.spark_submit", False),
    ("tests/integration/test_two_phase.py::test_stop_stream", False),
    ("docs/audit.md#dead-letters", False),
    ("spark_apps/eos_stream/cdc/", False),
    (".local/pipelines/ledger.yaml", False),
    ("eos_stream__<name>", False),
])
def test_the_path_check(written: str, missing: bool) -> None:
    assert (missing_path(written, *_repository()) is not None) == missing


def test_every_repository_path_in_the_docs_exists() -> None:
    repository = _repository()
    hits = [f"{page.relative_to(ROOT)}:{number}: {missing}"
            for page in PAGES for number, line, _table in _prose(page)
            for written in INLINE_CODE.findall(line)
            if (missing := missing_path(written, *repository))]
    assert not hits, "these paths are not in the repository (moved? renamed?):\n" + "\n".join(hits)
