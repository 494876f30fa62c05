"""The Airflow deployment the tests' ``dag.test()`` runs use: one of their own beside the demo's.

The demo's api-server, scheduler and triggerer run from ``.local/airflow.env`` with their metadata
in the database ``airflow``, and the demo rewrites that file (Spark on the cluster, PostgreSQL
metadata) while it runs. A ``dag.test()`` in that metadata database would register its DAG where
the demo's scheduler looks. So these tests get a second deployment written by the same
``scripts/airflow.sh init``: its own home, env file, definition folder, lineage file and metadata
database (``airflow_tests``, PostgreSQL: some tests run two ``dag.test()`` interpreters at once),
and they can run beside the demo on another xdist worker.

``python -m tests.helpers.airflow_tests_env`` writes and migrates it (scripts/test.sh does so in the
background before pytest starts); the first test that needs it does the same if it is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from demo.env_files import STATE_DIR
from tests.helpers.locks import file_lock

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT_DIR = STATE_DIR / "airflow-tests"
ENV_FILE = DEPLOYMENT_DIR / "airflow.env"
METADATA_DB = "airflow_tests"
_MIGRATED = DEPLOYMENT_DIR / "migrated"


def _init() -> None:
    env = {**os.environ, "EOS_AIRFLOW_HOME": str(DEPLOYMENT_DIR / "home"), "EOS_AIRFLOW_ENV_FILE": str(ENV_FILE),
           "EOS_AIRFLOW_DEPLOYMENT_DIR": str(DEPLOYMENT_DIR), "EOS_AIRFLOW_METADATA": "postgres",
           "EOS_AIRFLOW_PG_DB": METADATA_DB, "EOS_SPARK_MASTER": "local"}
    subprocess.run(["bash", str(ROOT / "scripts" / "airflow.sh"), "init"], env=env, check=True, timeout=300,
                   cwd=ROOT)
    _MIGRATED.touch()


def own_airflow_env_file() -> Path:
    """The tests' deployment's env file, written and migrated once per machine (machine-wide lock)."""
    with file_lock(STATE_DIR / "airflow-tests.lock"):
        if not (_MIGRATED.exists() and ENV_FILE.exists()):
            _init()
    return ENV_FILE


def sourced_env(env_file: Path) -> dict[str, str]:
    """The environment a shell gets after sourcing ``env_file`` (an env file of scripts/airflow.sh)."""
    out = subprocess.run(["bash", "-c", 'set -a; source "$1"; env -0', "_", str(env_file)],
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def own_airflow_env() -> dict[str, str]:
    """The environment a shell gets after sourcing the tests' deployment's env file."""
    return sourced_env(own_airflow_env_file())


if __name__ == "__main__":
    print(own_airflow_env_file())
