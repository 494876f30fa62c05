"""Airflow, configured by scripts/airflow.sh, discovers this provider and parses
dags/ without import errors. Each check runs in a subprocess with
.local/airflow.env, the same environment the Airflow services get."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, STATE_DIR
from tests.helpers.airflow_tests_env import sourced_env

pytestmark = pytest.mark.integration

DIST = "airflow-provider-eos"
DAGS = ROOT / "dags"


@pytest.fixture(scope="module")
def airflow_env(stack: dict[str, str]) -> dict[str, str]:
    """Writes .local/airflow.env (keeping its metadata mode) and returns the
    environment a shell gets after sourcing it."""
    subprocess.run(["bash", str(ROOT / "scripts" / "airflow.sh"), "env"], check=True, timeout=120)
    env_file = STATE_DIR / "airflow.env"
    assert env_file.stat().st_mode & 0o077 == 0, "airflow.env holds a password: it must be private"
    env = sourced_env(env_file)
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(DAGS)
    return env


def _python(env: dict[str, str], code: str) -> dict:
    """Runs code in a fresh interpreter with env; the last stdout line is JSON."""
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_providers_manager_lists_this_provider(airflow_env) -> None:
    found = _python(
        airflow_env,
        "import json\n"
        "from airflow.providers_manager import ProvidersManager\n"
        "pm = ProvidersManager()\n"
        f"info = pm.providers.get({DIST!r})\n"
        "print(json.dumps(None if info is None else {'version': info.version, "
        "'package-name': info.data['package-name']}))\n",
    )
    assert found is not None, f"ProvidersManager does not list {DIST}"
    from airflow_provider_eos import __version__

    assert found == {"version": __version__, "package-name": DIST}


def test_airflow_cli_lists_this_provider(airflow_env) -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "providers", "list", "-o", "json"],
        env=airflow_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    start = result.stdout.index("[")  # skip any log lines before the JSON
    providers = {p["package_name"]: p for p in json.loads(result.stdout[start:])}
    assert DIST in providers, sorted(providers)


def test_connections_resolve_from_the_env_file(airflow_env, stack) -> None:
    conns = _python(
        airflow_env,
        "import json\n"
        "from airflow.sdk import Connection\n"
        "out = {}\n"
        "for cid in ('kafka_default', 'eos_postgres', 'spark_default'):\n"
        "    c = Connection.get(cid)\n"
        "    out[cid] = {'type': c.conn_type, 'host': c.host, 'port': c.port, 'schema': c.schema,\n"
        "                'login': c.login, 'has_password': bool(c.password), 'extra': c.extra_dejson}\n"
        "print(json.dumps(out))\n",
    )
    assert conns["kafka_default"]["type"] == "kafka"
    assert conns["kafka_default"]["extra"]["bootstrap.servers"] == stack["EOS_KAFKA_BOOTSTRAP"]
    pg = conns["eos_postgres"]
    assert (pg["type"], pg["host"], pg["port"], pg["schema"], pg["login"]) == (
        "postgres",
        stack["EOS_PG_HOST"],
        int(stack["EOS_PG_PORT"]),
        stack["EOS_PG_DB"],
        stack["EOS_PG_USER"],
    )
    assert pg["has_password"]
    assert (conns["spark_default"]["type"], conns["spark_default"]["host"]) == ("spark", "local[*]")


def test_dags_folder_loads_without_import_errors(airflow_env) -> None:
    bag = _python(
        airflow_env,
        "import inspect, json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        # Airflow 3.3 dropped include_examples (examples are a bundle of their own).
        "kw = {'include_examples': False} if 'include_examples' in inspect.signature(DagBag).parameters else {}\n"
        f"bag = DagBag(dag_folder={str(DAGS)!r}, **kw)\n"
        "print(json.dumps({'errors': {str(k): str(v) for k, v in bag.import_errors.items()},\n"
        "                  'dags': sorted(bag.dags)}))\n",
    )
    assert bag["errors"] == {}
    dag_files = [p for p in DAGS.rglob("*.py") if not p.name.startswith("_")]
    if dag_files:
        assert bag["dags"], f"{len(dag_files)} files in dags/ but no DAG loaded"


def test_the_env_file_sets_the_eos_options_airflow_config_shows(airflow_env, stack) -> None:
    """`airflow config get-value eos ...` (the CLI's own command) with .local/airflow.env: the stack's
    snapshot store (required: the provider has none) and Spark's Kafka connector jars."""
    from tests.integration.test_provider_config_cli import GET_VALUES

    result = subprocess.run([sys.executable, "-c", GET_VALUES, "snapshot_store", "pipeline_config_dir", "spark_jars",
                             "aside_retention_days"], env=airflow_env, cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("SHOWN ")][-1]
    assert json.loads(line[len("SHOWN "):]) == {
        "snapshot_store": str(STATE_DIR / "snapshots"), "pipeline_config_dir": str(STATE_DIR / "pipelines"),
        "spark_jars": stack["EOS_SPARK_JARS"], "aside_retention_days": "7"}
