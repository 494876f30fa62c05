"""End to end: run the pipeline, snapshot it (eos_snapshot DAG), process more,
damage the target, then eos_recovery (dag.test) puts it back: the audit is
exact and the tables equal the undamaged reference. A dry run first changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg2 import sql

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.conftest import ROOT, STATE_DIR
from tests.streaming import audit, pg_connect, pipeline_config, run_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAG_TEST = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
out = []
for dag_id, conf in json.loads(sys.argv[2]):
    run = bag.get_dag(dag_id).test(run_conf=conf)
    out.append({"dag_id": dag_id, "state": str(run.state),
                "tasks": {ti.task_id: str(ti.state) for ti in run.get_task_instances()}})
print("RESULT " + json.dumps(out))
"""


def _airflow_env(stack: dict[str, str], config_dir: Path, store: Path) -> dict[str, str]:
    out = subprocess.run(["bash", "-c", 'set -a; source "$1"; env -0', "_", str(STATE_DIR / "airflow.env")],
                         capture_output=True, check=True, timeout=60).stdout.decode()
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    env.update({
        "EOS_PIPELINE_CONFIG_DIR": str(config_dir),
        "EOS_SNAPSHOT_STORE": str(store),
        "EOS_PG_BIN_DIR": "/usr/lib/postgresql/15/bin",
        "EOS_SPARK_JARS": stack["EOS_SPARK_JARS"],
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "PYTHONPATH": str(ROOT),
    })
    return env


def _dag_test(env: dict[str, str], runs: list, tmp: Path) -> list[dict]:
    log = tmp / f"dagtest-{len(list(tmp.glob('dagtest-*')))}.log"
    with open(log, "w") as handle:
        result = subprocess.run([sys.executable, "-c", DAG_TEST, str(ROOT / "dags"), json.dumps(runs)], env=env,
                                cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, timeout=420)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, text[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def _state(stack: dict, config: dict) -> dict:
    conn = pg_connect(stack)
    t, m = sql.Identifier(config["target_schema"]), sql.Identifier(config["meta_schema"])
    out = {}
    with conn.cursor() as cur:
        cur.execute("SET TIME ZONE 'UTC'")
        for table in ("ledger_events", "account_balances"):
            cur.execute(sql.SQL("SELECT count(*), md5(string_agg(x::text, ',' ORDER BY x::text)) FROM {}.{} x")
                        .format(t, sql.Identifier(table)))
            out[table] = cur.fetchone()
        cur.execute(sql.SQL("SELECT topic, partition, next_offset FROM {}.kafka_offsets ORDER BY 1, 2").format(m))
        out["offsets"] = cur.fetchall()
        cur.execute(sql.SQL('SELECT topic, partition, "offset" FROM {}.dead_letters ORDER BY 1, 2, 3').format(m))
        out["dead_letters"] = cur.fetchall()
    conn.close()
    return json.loads(json.dumps(out, default=str))


def test_recovery_dag_restores_and_replays_exactly(stack, tmp_path, unique_name) -> None:
    name = f"rec{unique_name}"
    bootstrap = stack["EOS_KAFKA_BOOTSTRAP"]
    config = pipeline_config(stack, tmp_path, name)
    topic = config["topics"][0]
    config_dir, store = tmp_path / "pipelines", tmp_path / "store"
    config_dir.mkdir()
    (config_dir / f"{name}.json").write_text(json.dumps(config))
    env = _airflow_env(stack, config_dir, store)
    ensure_topic(bootstrap, topic, partitions=4)

    produce_ledger(bootstrap, 3000, topic=topic, abort_every=4, malformed=1, seed=5, transactional_id=f"a{name}")
    assert run_app(config, tmp_path, label="first").process.returncode == 0
    [snap] = _dag_test(env, [["eos_snapshot", {"pipeline": name}]], tmp_path)
    assert snap["state"] == "success", snap

    produce_ledger(bootstrap, 2000, topic=topic, abort_every=3, malformed=2, seed=6, first_seq=10_000,
                   transactional_id=f"b{name}")
    assert run_app(config, tmp_path, label="second").process.returncode == 0
    reference = _state(stack, config)
    assert reference["ledger_events"][0] == 5000

    conn = pg_connect(stack)
    with conn.cursor() as cur:  # damage: lost rows, duplicated rows, corrupted balances
        t = sql.Identifier(config["target_schema"])
        cur.execute(sql.SQL("DELETE FROM {}.ledger_events WHERE seq % 11 = 0").format(t))
        cur.execute(sql.SQL("INSERT INTO {0}.ledger_events SELECT * FROM {0}.ledger_events LIMIT 100").format(t))
        cur.execute(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents * 2").format(t))
    conn.close()
    damaged = _state(stack, config)
    assert not audit(config, tmp_path)["ok"]

    conf = {"pipeline": name, "snapshot": "latest", "resume": False, "quiet_seconds": 1}
    [dry] = _dag_test(env, [["eos_recovery", {**conf, "dry_run": True}]], tmp_path)
    assert dry["state"] == "success", dry
    assert _state(stack, config) == damaged  # the dry run changed nothing
    [real] = _dag_test(env, [["eos_recovery", {**conf, "dry_run": False}]], tmp_path)
    assert real["state"] == "success", real
    assert real["tasks"]["resume_stream"] == "skipped" and real["tasks"]["release_lock"] == "success"

    report = audit(config, tmp_path)
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 5003
    after = _state(stack, config)
    assert after == reference, {k: (after[k], reference[k]) for k in after if after[k] != reference[k]}
