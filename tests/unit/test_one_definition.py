"""Each shared fact is defined once in the code: the partition key, the delivery modes and the
contracts between recovery's tasks. A second definition would drift from the first."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("airflow_provider_eos", "spark_apps")
# Each name, and the one module that may define it.
ONE_HOME = {
    "TopicPartition": "spark_apps/eos_stream/kafka/partitions.py",
    "MODES": "spark_apps/eos_stream/sink/modes.py",
    "RecoverySettings": "airflow_provider_eos/recovery/contracts.py",
    "ChosenSnapshot": "airflow_provider_eos/recovery/contracts.py",
    "Restored": "airflow_provider_eos/recovery/contracts.py",
    "Replayed": "airflow_provider_eos/recovery/contracts.py",
}


def definitions(source: str) -> list[str]:
    """The names a module binds at any depth by assignment, annotated assignment (a
    ``TypeAlias`` too) or class statement (imports are uses, not definitions)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            found.append(node.name)
        elif isinstance(node, ast.Assign):
            found += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found.append(node.target.id)
    return found


def _where_defined() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            for name in definitions(path.read_text()):
                if name in ONE_HOME:
                    where[name].append(path.relative_to(ROOT).as_posix())
    return where


def test_each_shared_fact_is_defined_once_in_its_home() -> None:
    where = _where_defined()
    assert {name: where.get(name, []) for name in ONE_HOME} == {name: [home] for name, home in ONE_HOME.items()}


def test_the_scan_sees_every_kind_of_definition() -> None:
    source = ("TopicPartition = tuple[str, int]\nMODES: dict = {}\nclass Restored: pass\n"
              "def f():\n    Replayed = 1\n\nChosenSnapshot: TypeAlias = int\n"
              "from x import RecoverySettings\nRecoverySettings.x = 1\n")
    assert sorted(definitions(source)) == ["ChosenSnapshot", "MODES", "Replayed", "Restored", "TopicPartition"]
