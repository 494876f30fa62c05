"""The DAG factory: each pipeline definition yields its own DAGs, ids, schedules and resume target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_eos.dag_factory import pipeline_dags

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("stream", "stop", "health", "snapshot", "recovery")


def _definition(name: str, **more: object) -> dict:
    return {"name": name, "topics": [f"{name}.events"], "spec": "spark_apps.ledger.spec:LEDGER",
            "target_schema": f"t_{name}", "meta_schema": f"m_{name}", "checkpoint_dir": f"/tmp/cp/{name}", **more}


@pytest.fixture
def two_pipelines(tmp_path: Path) -> Path:
    (tmp_path / "alpha.yaml").write_text(json.dumps(_definition(
        "alpha", stream={"trigger": "availableNow", "schedule": "*/10 * * * *"},
        snapshot={"schedule": None}, connections={"kafka": "kafka_alpha"})))
    (tmp_path / "beta.yml").write_text(json.dumps(_definition("beta", delivery="two_phase",
                                                              health={"hanging_after": 120})))
    return tmp_path


def test_each_pipeline_gets_its_own_dags(two_pipelines: Path) -> None:
    dags = pipeline_dags(two_pipelines)
    assert set(dags) == {f"eos_{kind}__{name}" for kind in KINDS for name in ("alpha", "beta")}
    for name in ("alpha", "beta"):
        for kind in KINDS:
            dag = dags[f"eos_{kind}__{name}"]
            assert {"eos", f"pipeline:{name}"} <= set(dag.tags)
            if kind != "stop":  # one run at a time per pipeline, never across pipelines
                assert dag.max_active_runs == 1, dag.dag_id
    # Schedules come from each definition.
    assert dags["eos_stream__alpha"].timetable.expression == "*/10 * * * *"
    assert dags["eos_stream__beta"].timetable.__class__.__name__ == "NullTimetable"
    assert dags["eos_snapshot__alpha"].timetable.__class__.__name__ == "NullTimetable"
    assert dags["eos_snapshot__beta"].timetable.expression == "0 * * * *"
    # What the tasks do comes from the definition, with the deployment's default connections for the rest.
    alpha_run = dags["eos_stream__alpha"].get_task("run_pipeline")
    alpha = alpha_run.definition
    assert (alpha.name, alpha.topics, alpha_run.kafka_config_id, alpha_run.postgres_conn_id) == (
        "alpha", ["alpha.events"], "kafka_alpha", "eos_postgres")
    beta_run = dags["eos_stream__beta"].get_task("run_pipeline")
    beta = beta_run.definition
    assert (beta.delivery, beta.meta_schema, beta_run.kafka_config_id) == ("two_phase", "m_beta",
                                                                                 "kafka_default")
    # The task holds the validated definition; a run's tuning comes apart, from resolve_run.
    assert "resolve_run" in beta_run.tuning and "tuning" in beta_run.template_fields
    assert "definition" not in beta_run.template_fields and beta.stream.replay_engine == "auto"
    assert dags["eos_health__alpha"].get_task("lso_lag").topics == ["alpha.events"]
    # The health check keeps each pipeline's stuck-since times in its own meta schema, across runs.
    lso = dags["eos_health__beta"].get_task("lso_lag")
    assert (lso.pipeline, lso.meta_schema, lso.postgres_conn_id, lso.hanging_after) == (
        "beta", "m_beta", "eos_postgres", 120.0)
    assert lso.persistent and dags["eos_health__alpha"].get_task("lso_lag").hanging_after == 900.0
    # One stop operator: graceful for eos_stop, fenced and lock-holding for the recovery; both wait deferred.
    stop = dags["eos_stop__beta"].get_task("stop_pipeline")
    assert stop.definition.name == "beta" and stop.pipeline_config is None
    assert stop.deferrable and not stop.fence and not stop.hold_lock
    stop_stream = dags["eos_recovery__beta"].get_task("stop_stream")
    assert type(stop_stream) is type(stop) and stop_stream.fence and stop_stream.hold_lock and stop_stream.deferrable
    caught_up = dags["eos_recovery__beta"].get_task("wait_caught_up")
    assert type(caught_up).__name__ == "StreamCaughtUpSensor" and caught_up.deferrable
    assert (caught_up.pipeline, caught_up.meta_schema) == ("beta", "m_beta")
    restore = dags["eos_recovery__beta"].get_task("restore")
    assert restore.definition.name == "beta" and restore.definition.target_schema == "t_beta"


def test_a_cdc_source_adds_its_checks_to_the_health_summary(tmp_path: Path) -> None:
    (tmp_path / "shop.yaml").write_text(json.dumps(_definition(
        "shop", topics=["shop.public.customers", "shop.public.lines"],
        cdc={"connectors": ["shop-source"], "kafka_connect_conn_id": "connect_shop",
             "replication_slots": ["shop_a", "shop_b"], "source_postgres_conn_id": "shop_db",
             "max_held_bytes": 1000, "max_held_age_seconds": None})))
    (tmp_path / "plain.yaml").write_text(json.dumps(_definition("plain")))
    dags = pipeline_dags(tmp_path)
    health = dags["eos_health__shop"]
    # The LSO sensor watches the change topics, as any topics.
    assert health.get_task("lso_lag").topics == ["shop.public.customers", "shop.public.lines"]
    connector = health.get_task("connector")
    assert (connector.connectors, connector.kafka_connect_conn_id) == (["shop-source"], "connect_shop")
    slots = [health.get_task(f"replication_slot__{slot}") for slot in ("shop_a", "shop_b")]
    assert [(s.slot_name, s.postgres_conn_id, s.max_held_bytes, s.max_age_seconds) for s in slots] == [
        ("shop_a", "shop_db", 1000, None), ("shop_b", "shop_db", 1000, None)]
    summary = health.get_task("summary")
    assert summary.check_task_ids[-3:] == ["connector", "replication_slot__shop_a", "replication_slot__shop_b"]
    assert {"connector", "replication_slot__shop_a"} <= summary.upstream_task_ids
    assert not {"connector", "replication_slot__shop_a"} & set(dags["eos_health__plain"].task_ids)


def _mirror(transactions: str) -> dict:
    return {"topic_prefix": "bank", "transactions": transactions, "tables": [
        {"source": "public.accounts", "key": ["id"], "columns": {"id": "bigint", "balance": "numeric"}}]}


def test_a_mirror_of_whole_transactions_checks_how_long_it_holds_one(tmp_path: Path) -> None:
    topics = ["bank.public.accounts"]
    (tmp_path / "whole.yaml").write_text(json.dumps({**_definition(
        "whole", topics=[*topics, "bank.transaction"], mirror=_mirror("whole"), health={"max_transaction_wait": 90}),
        "spec": None}))
    (tmp_path / "per_key.yaml").write_text(json.dumps({**_definition(
        "per_key", topics=topics, mirror=_mirror("per_key")), "spec": None}))
    dags = pipeline_dags(tmp_path)
    held = dags["eos_health__whole"].get_task("held_transactions")
    assert (held.pipeline, held.meta_schema, held.postgres_conn_id, held.max_wait_seconds) == (
        "whole", "m_whole", "eos_postgres", 90.0)
    assert dags["eos_health__whole"].get_task("summary").check_task_ids[-1] == "held_transactions"
    assert "held_transactions" not in dags["eos_health__per_key"].task_ids


def test_a_recovery_resumes_its_own_pipeline_and_no_other(two_pipelines: Path) -> None:
    dags = pipeline_dags(two_pipelines)
    for name in ("alpha", "beta"):
        resume = dags[f"eos_recovery__{name}"].get_task("resume_stream")
        assert resume.trigger_dag_id == f"eos_stream__{name}"
        assert not resume.conf  # the stream DAG's definition gives the mode; nothing to pass
        # Every step of one pipeline's recovery works on that pipeline's own schemas.
        for task in dags[f"eos_recovery__{name}"].tasks:
            definition = getattr(task, "definition", None)
            if definition is not None:
                assert (definition.name, definition.meta_schema) == (name, f"m_{name}"), task.task_id


def test_a_bad_definition_gets_an_invalid_dag_and_hides_no_other(two_pipelines: Path) -> None:
    (two_pipelines / "gamma.yaml").write_text(json.dumps(_definition("gamma", delivery="sometimes")))
    dags = pipeline_dags(two_pipelines)
    assert "eos_invalid__gamma" in dags and "eos_stream__alpha" in dags and "eos_recovery__beta" in dags
    assert not any(dag_id.endswith("__gamma") and not dag_id.startswith("eos_invalid") for dag_id in dags)
    assert "delivery" in dags["eos_invalid__gamma"].doc_md


def test_a_missing_or_empty_directory_is_one_invalid_dag_and_an_error(tmp_path: Path, caplog) -> None:
    for directory, said in ((tmp_path / "missing", "no pipeline definition directory at"),
                            (tmp_path, "no pipeline definition in")):
        caplog.clear()
        dags = pipeline_dags(directory)
        assert list(dags) == ["eos_invalid__pipeline_config_dir"]
        assert said in (dags["eos_invalid__pipeline_config_dir"].doc_md or "")
        assert [r.levelname for r in caplog.records if said in r.getMessage()] == ["ERROR"]


def test_the_dags_folder_reads_the_provider_config_and_no_eos_environment(two_pipelines: Path) -> None:
    """dags/ in a fresh interpreter: [eos] pipeline_config_dir (via AIRFLOW__EOS__...) decides, an
    EOS_* variable of earlier versions is ignored, and there is no import error."""
    code = ("import json, sys\nfrom airflow.dag_processing.dagbag import DagBag\n"
            "bag = DagBag(dag_folder=sys.argv[1])\n"
            "print(json.dumps({'errors': {str(k): str(v) for k, v in bag.import_errors.items()},"
            " 'dags': sorted(bag.dags)}))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "AIRFLOW_HOME": str(two_pipelines / "airflow"),
           "AIRFLOW__EOS__PIPELINE_CONFIG_DIR": str(two_pipelines),
           "EOS_PIPELINE_CONFIG_DIR": str(two_pipelines / "elsewhere")}
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "dags")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    bag = json.loads(result.stdout.strip().splitlines()[-1])
    assert bag["errors"] == {}
    assert bag["dags"] == sorted(f"eos_{kind}__{name}" for kind in KINDS for name in ("alpha", "beta"))


DEFERRING = """
import json
import os
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor, StreamLivenessSensor
steps = [StopPipelineOperator(task_id="stop", pipeline_config={}),
         LastStableOffsetLagSensor(task_id="lso", topics=["t"]),
         StreamLivenessSensor(task_id="live", pipeline="p", max_age_seconds=1),
         StreamCaughtUpSensor(task_id="caught", pipeline="p", topics=["t"])]
print(json.dumps({type(step).__name__: step.deferrable for step in steps}))
"""


def _deferrable_by_default(tmp_path: Path, default_deferrable: str) -> dict[str, bool]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": default_deferrable}
    result = subprocess.run([sys.executable, "-c", DEFERRING], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_steps_used_directly_follow_operators_default_deferrable(tmp_path: Path) -> None:
    """Airflow's convention: ``[operators] default_deferrable`` (False unless set) is the default."""
    assert set(_deferrable_by_default(tmp_path, "True").values()) == {True}
    # Unset, in this process: Airflow's default.
    from airflow_provider_eos.operators.stop import StopPipelineOperator
    from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor

    assert not StopPipelineOperator(task_id="stop", pipeline_config={}).deferrable
    assert not LastStableOffsetLagSensor(task_id="lso", topics=["t"]).deferrable


def test_the_factorys_waits_defer_whatever_the_deployment_default(two_pipelines: Path) -> None:
    from airflow.configuration import conf

    # This process runs with Airflow's default (False): the factory's True is its own.
    assert not conf.getboolean("operators", "default_deferrable", fallback=False)
    dags = pipeline_dags(two_pipelines)
    deferring = {(dag_id, task.task_id): task.deferrable for dag_id, dag in dags.items() for task in dag.tasks
                 if hasattr(task, "deferrable") and type(task).__module__.startswith("airflow_provider_eos.")}
    assert set(deferring.values()) == {True}, deferring
    # Every wait of a pipeline's DAGs: the health sensors, the recovery's gate, stop and catch-up, the stop DAG.
    assert {task for _, task in deferring} == {"lso_lag", "liveness", "caught_up", "gate", "stop_stream",
                                               "wait_caught_up", "stop_pipeline"}


def test_the_waits_that_may_start_again_ride_out_a_stale_defer_exit(tmp_path: Path) -> None:
    """The recovery's gate, stop and catch-up and the stop DAG's wait get one retry (Airflow can fail
    a deferred task whose trigger fired before the scheduler saw its deferring attempt exit); the
    health sensors, whose failure is the finding, and every other task keep the definition's."""
    (tmp_path / "alpha.yaml").write_text(json.dumps(_definition("alpha")))
    (tmp_path / "beta.yaml").write_text(json.dumps(_definition(
        "beta", airflow={"retries": 3, "retry_delay_seconds": 30})))
    dags = pipeline_dags(tmp_path)
    waits = {"gate", "stop_stream", "wait_caught_up", "stop_pipeline"}
    for name, expected in (("alpha", 1), ("beta", 3)):
        retries = {task.task_id: task.retries for dag_id, dag in dags.items() if dag_id.endswith(f"__{name}")
                   for task in dag.tasks}
        assert {retries[task] for task in waits} == {expected}, retries
        assert retries["lso_lag"] == (0 if name == "alpha" else 3), retries
    stop = dags["eos_stop__alpha"].get_task("stop_pipeline")
    assert stop.retry_delay.total_seconds() == 2
    assert dags["eos_stop__beta"].get_task("stop_pipeline").retry_delay.total_seconds() == 30


def test_a_tasks_parse_builds_only_its_own_dag(two_pipelines: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When Airflow parses the file to run one task, its parsing context names the task's DAG: only
    that DAG is built, and it is the DAG the full parse builds (same tasks, same outlets); a context
    naming no pipeline's DAG (an invalid one) gets the full parse."""
    full = pipeline_dags(two_pipelines)
    for kind in KINDS:
        wanted = f"eos_{kind}__beta"
        monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", wanted)
        only = pipeline_dags(two_pipelines)
        assert list(only) == [wanted]
        assert only[wanted].task_ids == full[wanted].task_ids
        assert [t.outlets for t in only[wanted].tasks] == [t.outlets for t in full[wanted].tasks]
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", "eos_invalid__gamma")
    assert set(pipeline_dags(two_pipelines)) == set(full)


def test_a_tasks_parse_imports_only_its_own_dags_builder(two_pipelines: Path) -> None:
    """A health task's parse does not import the recovery DAG's builder (nor its TriggerDagRunOperator)."""
    probe = ("import sys; from airflow_provider_eos.dag_factory import pipeline_dags; "
             f"dags = pipeline_dags({str(two_pipelines)!r}); "
             "print(sorted(dags), 'airflow_provider_eos.dag_factory.recovery' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "_AIRFLOW_PARSING_CONTEXT_DAG_ID": "eos_health__alpha"})
    assert out.stdout.strip().splitlines()[-1] == "['eos_health__alpha'] False", out.stdout + out.stderr
