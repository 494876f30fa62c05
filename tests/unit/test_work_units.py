"""How the tests are dealt to the xdist workers (tests/conftest.py): the modules that share the
demo's Airflow deployment stay one unit, those whose DAG runs share the tests' own deployment
another, and a new module that uses either cannot slip out of its unit."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import (
    DAG_TEST_MODULES,
    DAG_TEST_UNIT,
    DEMO_DEPLOYMENT_MODULES,
    DEMO_DEPLOYMENT_UNIT,
    ROOT,
    work_unit,
)

# What makes a module share the demo's deployment: running airflow.sh (a path ending in a string
# literal; it rewrites airflow.env), or the Spark standalone cluster.
USES_THE_DEMO_DEPLOYMENT = re.compile(r"[\"/]airflow\.sh\"|\bspark_cluster\b")
# What makes a module register DAG runs in a metadata database: dag.test() through the helpers.
RUNS_DAGS = re.compile(r"_dag_test|_airflow_env\b")


def _test_modules() -> list[Path]:
    folders = [ROOT / "tests" / folder for folder in ("integration", "e2e", "packaging")]
    return sorted(p for folder in folders for p in folder.glob("test_*.py"))


def test_every_shared_module_exists() -> None:
    names = {p.name for p in _test_modules()}
    shared = DEMO_DEPLOYMENT_MODULES | DAG_TEST_MODULES
    assert shared <= names, shared - names
    assert not DEMO_DEPLOYMENT_MODULES & DAG_TEST_MODULES


def test_every_module_that_uses_the_demo_deployment_is_in_its_unit() -> None:
    users = {p.name for p in _test_modules() if USES_THE_DEMO_DEPLOYMENT.search(p.read_text())}
    assert users, "the pattern finds nothing: it no longer describes the tests"
    assert users <= DEMO_DEPLOYMENT_MODULES, users - DEMO_DEPLOYMENT_MODULES


def test_every_module_that_runs_dags_is_in_a_shared_unit() -> None:
    users = {p.name for p in _test_modules() if RUNS_DAGS.search(p.read_text())}
    assert users, "the pattern finds nothing: it no longer describes the tests"
    assert users <= DEMO_DEPLOYMENT_MODULES | DAG_TEST_MODULES, users - DEMO_DEPLOYMENT_MODULES - DAG_TEST_MODULES


def test_a_shared_module_is_one_unit_and_any_other_module_its_own() -> None:
    assert work_unit("tests/e2e/test_demo.py::test_x") == DEMO_DEPLOYMENT_UNIT
    assert work_unit("tests/integration/test_spark_cluster.py::test_x") == DEMO_DEPLOYMENT_UNIT
    assert work_unit("tests/integration/test_dags.py::test_y[a::b]") == DAG_TEST_UNIT
    assert work_unit("tests/integration/test_two_phase.py::test_z") == "tests/integration/test_two_phase.py"
    assert work_unit("tests/unit/test_cli.py::test_w") == "tests/unit/test_cli.py"
