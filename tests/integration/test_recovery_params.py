"""Trigger conf never chooses where a pipeline's recovery or snapshot DAG reads or writes (issue 10,
section 5; issue 11: the DAG is the pipeline).

Each run goes through ``dag.test()`` on the real DAGs, metadata DB and stack.
Another pipeline's name (also a path-traversing one), a snapshot store, a config
directory or schemas in the conf must be refused before anything is touched: no
meta schema created (the lock step creates it), no stop request, no lock row. A
valid conf passes the same first check, so the refusals are the conf's doing."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from spark_apps.ledger.generator import ensure_topic
from tests.conftest import ROOT
from tests.integration.test_recovery_dag import _airflow_env
from tests.streaming import pg_connect, pipeline_config, write_definition

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Several runs in one process: Airflow's import and the DagBag's parse are paid once.
RUN_MANY = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
results = []
for dag_id, conf in json.loads(sys.argv[2]):
    try:
        run = bag.get_dag(dag_id).test(run_conf=conf)
    except Exception as exc:  # Param validation refuses the run before it exists
        results.append({"refused_at_trigger": f"{type(exc).__name__}: {exc}"})
    else:
        results.append({"state": str(run.state),
                        "tasks": {ti.task_id: str(ti.state) for ti in run.get_task_instances()}})
print("RESULT " + json.dumps(results))
"""
# The steps that may run on a refused run: the refusal itself, and the rollback guard
# that finds no restore to undo.
MAY_SUCCEED_WHEN_REFUSED = {"needs_rollback"}


def _run(env: dict[str, str], runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """``dag.test()`` of each (dag id, conf) in turn, in one process: each run's result."""
    result = subprocess.run([sys.executable, "-c", RUN_MANY, str(ROOT / "dags"), json.dumps(runs)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300 + 60 * len(runs))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (result.stdout + result.stderr)[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def _schemas(stack: dict[str, str], names: list[str]) -> list[str]:
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s) ORDER BY 1", (names,))
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def _assert_refused(result: dict[str, Any], conf: dict[str, Any], first_task: str) -> None:
    if "refused_at_trigger" in result:  # a Param's schema: the run never existed
        return
    tasks = result["tasks"]
    assert result["state"] == "failed" and tasks.get(first_task) == "failed", (conf, result)
    ran = {t for t, s in tasks.items() if s in ("success", "running")} - MAY_SUCCEED_WHEN_REFUSED
    assert not ran, (conf, result)


def test_trigger_conf_cannot_choose_paths_or_traverse(stack, tmp_path, unique_name) -> None:
    name, outside = f"par{unique_name}", f"out{unique_name}"
    config_dir, store = tmp_path / "pipelines", tmp_path / "store"
    config = pipeline_config(stack, tmp_path, name)
    write_definition(config, config_dir)
    # A definition the deployment never offered, one level up: what "../<outside>" would reach.
    write_definition(pipeline_config(stack, tmp_path, outside), tmp_path)
    # A foreign definition directory offering the same pipeline name with other schemas.
    foreign_dir = tmp_path / "foreign-configs"
    write_definition(pipeline_config(stack, tmp_path, name, meta_schema=f"m_foreign{unique_name}",
                                     target_schema=f"t_foreign{unique_name}"), foreign_dir)
    foreign_store = tmp_path / "foreign-store"
    for topic in (config["topics"][0], f"ledger.{outside}"):
        ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    env = _airflow_env(stack, config_dir, store)
    watched = [f"m_{name}", f"t_{name}", f"m_{outside}", f"t_{outside}", f"m_foreign{unique_name}",
               f"t_foreign{unique_name}"]

    recovery, snapshot = f"eos_recovery__{name}", f"eos_snapshot__{name}"
    refused_confs = [
        (recovery, {"pipeline": f"../{outside}", "snapshot": "latest", "resume": False}),
        (recovery, {"pipeline": outside, "resume": False}),
        (recovery, {"snapshot_store": str(foreign_store), "resume": False}),
        (recovery, {"config_dir": str(foreign_dir), "resume": False}),
        (recovery, {"meta_schema": f"m_foreign{unique_name}", "target_schema": f"t_foreign{unique_name}"}),
        (snapshot, {"snapshot_store": str(foreign_store)}),
        (snapshot, {"pipeline": f"../{outside}"}),
    ]
    first_task = {recovery: "check_conf", snapshot: "pin_snapshot_store"}
    # One process for the refused runs. A refused run can only add (a schema, the foreign store), never
    # remove, so what none of them touched is still untouched after the last one.
    results = _run(env, refused_confs)
    for (dag_id, conf), result in zip(refused_confs, results, strict=True):
        _assert_refused(result, conf, first_task[dag_id])
    assert _schemas(stack, watched) == [], results  # nothing touched in the database
    assert not foreign_store.exists(), results

    # The same first check passes a valid conf: the run goes on to the gate and the (dry-run) lock.
    [ok] = _run(env, [(recovery, {"dry_run": True, "resume": False})])
    assert ok["tasks"]["check_conf"] == "success" and ok["tasks"]["gate"] == "success", ok
