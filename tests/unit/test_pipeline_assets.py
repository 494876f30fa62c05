"""A pipeline's Assets from its definition and connections: topic URIs, target URIs with the
committed-offsets watcher, the stream's inlets, the recovery's announcement, and the example
downstream DAG. Connections come from AIRFLOW_CONN_* variables: nothing is contacted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_eos.dag_factory import pipeline_dags
from airflow_provider_eos.triggers.committed_offsets import CommittedOffsetsTrigger
from tests.unit.test_dag_factory import ROOT, _definition

CONNECTIONS = {
    "AIRFLOW_CONN_KAFKA_DEFAULT": json.dumps({"conn_type": "kafka",
                                              "extra": {"bootstrap.servers": "kafka-a.example:9093,kafka-b:9093"}}),
    "AIRFLOW_CONN_EOS_POSTGRES": json.dumps({"conn_type": "postgres", "host": "pg.example", "port": 6432,
                                             "login": "eos", "password": "not-in-any-uri", "schema": "warehouse"}),
}
LEDGER_TABLES = ("ledger_events", "account_balances")


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key, value in CONNECTIONS.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "alpha.yaml").write_text(json.dumps(_definition("alpha")))
    return tmp_path


def test_topics_and_targets_are_assets_with_the_providers_uris(ledger_dir: Path) -> None:
    dags = pipeline_dags(ledger_dir)
    stream = dags["eos_stream__alpha"].get_task("run_pipeline")
    assert [a.uri for a in stream.inlets] == ["kafka://kafka-a.example:9093/alpha.events"]
    assert stream.outlets == []  # the watcher announces the targets, with offsets; a task's end would not
    announce = dags["eos_recovery__alpha"].get_task("announce_recovered")
    expected = [f"postgres://pg.example:6432/warehouse/t_alpha/{table}" for table in LEDGER_TABLES]
    assert [a.uri for a in announce.outlets] == expected
    assert "not-in-any-uri" not in json.dumps([a.uri for a in announce.outlets])
    # One watcher, the same trigger on every target: Airflow runs one trigger for the pipeline.
    triggers = {json.dumps(w.trigger.serialize(), sort_keys=True) for a in announce.outlets for w in a.watchers}
    assert len(triggers) == 1
    trigger = announce.outlets[0].watchers[0].trigger
    assert isinstance(trigger, CommittedOffsetsTrigger)
    assert (trigger.pipeline, trigger.meta_schema, trigger.postgres_conn_id, trigger.asset_names) == (
        "alpha", "m_alpha", "eos_postgres", expected)
    # The recovery announces only after the audit passed and the old tables are gone.
    assert announce.upstream_task_ids == {"finalize"}


def test_without_readable_connections_the_dags_stay_and_have_no_assets(tmp_path: Path) -> None:
    (tmp_path / "alpha.yaml").write_text(json.dumps(_definition("alpha", connections={"kafka": "nowhere"})))
    dags = pipeline_dags(tmp_path)
    assert dags["eos_stream__alpha"].get_task("run_pipeline").inlets == []
    assert dags["eos_recovery__alpha"].get_task("announce_recovered").outlets == []


def test_the_example_downstream_dag_is_scheduled_on_the_targets(ledger_dir: Path) -> None:
    code = ("import json, sys\nfrom airflow.dag_processing.dagbag import DagBag\n"
            "bag = DagBag(dag_folder=sys.argv[1])\n"
            "dag = bag.dags['eos_example_downstream__alpha']\n"
            "assets = list(dag.timetable.asset_condition.objects)\n"
            "print(json.dumps({'errors': {str(k): str(v) for k, v in bag.import_errors.items()},"
            " 'paused': dag.is_paused_upon_creation, 'uris': [a.uri for a in assets],"
            " 'watchers': [len(a.watchers) for a in assets]}))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "AIRFLOW_HOME": str(ledger_dir / "airflow"),
           "AIRFLOW__EOS__PIPELINE_CONFIG_DIR": str(ledger_dir), **CONNECTIONS}
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "dags")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"errors": {}, "paused": True, "watchers": [1, 1],
                    "uris": [f"postgres://pg.example:6432/warehouse/t_alpha/{t}" for t in LEDGER_TABLES]}
