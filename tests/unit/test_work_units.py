"""How the tests are dealt to the two xdist workers (tests/conftest.py): the modules that share one
Airflow deployment stay one unit, and a new module that uses it cannot slip out of that unit."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT, SHARED_AIRFLOW_MODULES, SHARED_AIRFLOW_UNIT, work_unit

# What makes a module share the deployment: running airflow.sh (a path ending in a string literal;
# it rewrites airflow.env), the Spark standalone cluster, or a DAG run (dag.test()) registered in
# the metadata database.
USES_THE_DEPLOYMENT = re.compile(r"[\"/]airflow\.sh\"|\bspark_cluster\b|_dag_test|_airflow_env\b|DagBag")


def _test_modules() -> list[Path]:
    folders = [ROOT / "tests" / folder for folder in ("integration", "e2e", "packaging")]
    return sorted(p for folder in folders for p in folder.glob("test_*.py"))


def test_every_shared_module_exists() -> None:
    names = {p.name for p in _test_modules()}
    assert SHARED_AIRFLOW_MODULES <= names, SHARED_AIRFLOW_MODULES - names


def test_every_module_that_uses_the_deployment_is_in_the_shared_unit() -> None:
    users = {p.name for p in _test_modules() if USES_THE_DEPLOYMENT.search(p.read_text())}
    assert users, "the pattern finds nothing: it no longer describes the tests"
    assert users <= SHARED_AIRFLOW_MODULES, users - SHARED_AIRFLOW_MODULES


def test_a_shared_module_is_one_unit_and_any_other_module_its_own() -> None:
    assert work_unit("tests/e2e/test_demo.py::test_x") == SHARED_AIRFLOW_UNIT
    assert work_unit("tests/integration/test_dags.py::test_y[a::b]") == SHARED_AIRFLOW_UNIT
    assert work_unit("tests/integration/test_two_phase.py::test_z") == "tests/integration/test_two_phase.py"
    assert work_unit("tests/unit/test_cli.py::test_w") == "tests/unit/test_cli.py"
