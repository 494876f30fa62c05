"""The docs and the code speak to a user, who knows neither the development's work periods nor the
documents the design came from: they name the concept instead ("the poison-loop guard", "the
in-doubt recovery"). The history of the work belongs in the history files, which are left out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "airflow_provider_eos", "spark_apps", "dags", "demo", "bench", "tests",
           "scripts", "setup.cfg", "Makefile")
# The history files: where dated runs and the work's periods are told on purpose.
HISTORY = {"CHANGELOG.md", "bench/results/HISTORY.md"}
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
TEXT_SUFFIXES = {".md", ".py", ".cfg", ".toml", ".yaml", ".yml", ".sh", ".json", ".txt", ".sql", ".pom", ".xml", ""}

# A numbered work period ("session 18", "Sessions 15 and 16") and a numbered design document
# ("Seed 001"). A random generator's seed ("seed=42", "the shuffle's random seed") is a concept.
FORBIDDEN = re.compile(r"\bsessions? \d+\b|\bseeds? 0\d\d\b|\bseed documents?\b", re.IGNORECASE)


def _tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--", *SCANNED], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    if listed.returncode == 0 and listed.stdout.strip():
        return listed.stdout.split()
    # Not a git checkout (an unpacked sdist): walk the same places.
    found = []
    for name in SCANNED:
        path = ROOT / name
        found += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return [p.relative_to(ROOT).as_posix() for p in found]


def _scanned_files() -> list[Path]:
    return [ROOT / name for name in _tracked_files()
            if name not in HISTORY and name != THIS_FILE and Path(name).suffix in TEXT_SUFFIXES
            and (ROOT / name).is_file()]


def test_the_scan_covers_the_docs_and_the_code() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in _scanned_files()}
    assert "README.md" in names and "docs/testing.md" in names and "demo/story.py" in names
    assert not names & HISTORY


@pytest.mark.parametrize("text", [
    "## Session 19 (2026-11-27): proven snapshots",
    "since session 18",
    "(sessions 15 and 16; docs/benchmarks.md)",
    "Seed 001 asks first that data reach the target",
    "(seed 001's procedure for a commit left in doubt)",
])
def test_the_pattern_catches_the_work_history(text: str) -> None:
    assert FORBIDDEN.search(text)


@pytest.mark.parametrize("text", [
    "produce_ledger(bootstrap, 3000, seed=21)",
    "the figures shuffled in each (the shuffle's random seed is recorded)",
    "a session-level advisory lock held by the operator",
    "its tcp_keepalives_* settings for the session",
])
def test_the_pattern_leaves_concepts_alone(text: str) -> None:
    assert not FORBIDDEN.search(text)


def test_no_doc_or_code_names_a_work_session_or_a_design_document() -> None:
    hits = []
    for path in _scanned_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "name the concept, not the work's history (that goes to CHANGELOG.md):\n" + "\n".join(hits)
