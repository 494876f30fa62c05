"""A definition's ``spark:`` and ``airflow:`` sections reach the tasks the factory builds."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from airflow_provider_eos.dag_factory import pipeline_dags
from airflow_provider_eos.hooks.app_config import complete_app_config
from airflow_provider_eos.hooks.stream_submit import EosStreamSubmitHook

CALLS: list[str] = []


def alert(context: object) -> None:  # the team's failure callback, named module:function
    CALLS.append("alert")


def _definition(**more: object) -> dict:
    return {"name": "big", "topics": ["big.events"], "spec": "spark_apps.ledger.spec:LEDGER",
            "target_schema": "t_big", "meta_schema": "m_big", "checkpoint_dir": "/tmp/cp/big", **more}


SECTIONS = {
    "spark": {"conf": {"spark.sql.shuffle.partitions": "8", "spark.executor.memory": "1g"},
              "driver_memory": "3g", "executor_memory": "4g", "executor_cores": 2, "max_cores": 6,
              "packages": ["org.example:extra_2.13:1.0"]},
    "airflow": {"owner": "payments-team", "queue": "sensors", "spark_queue": "spark", "pool": "eos",
                "retries": 2, "retry_delay_seconds": 30, "tags": ["team:payments"],
                "on_failure_callback": "tests.unit.test_definition_sections:alert"},
}


def test_airflow_settings_reach_every_task_and_spark_tasks_get_their_queue(tmp_path: Path) -> None:
    (tmp_path / "big.yaml").write_text(json.dumps(_definition(**SECTIONS)))
    dags = pipeline_dags(tmp_path)
    assert not [d for d in dags if d.startswith("eos_invalid")], dags
    spark_tasks = {("eos_stream__big", "run_pipeline"), ("eos_recovery__big", "replay")}
    for dag in dags.values():
        assert "team:payments" in dag.tags
        for task in dag.tasks:
            where = (dag.dag_id, task.task_id)
            assert task.owner == "payments-team" and task.pool == "eos" and task.retries == 2, where
            assert task.retry_delay == timedelta(seconds=30), where
            assert task.queue == ("spark" if where in spark_tasks else "sensors"), where
            callbacks = task.on_failure_callback
            assert callbacks and [c.__name__ for c in callbacks] == ["alert"], where
    replay = dags["eos_recovery__big"].get_task("replay")
    assert replay.driver_memory == "3g"
    assert replay.spark_conf["spark.executor.memory"] == "4g"  # the resource wins over conf
    assert replay.spark_conf["spark.jars.packages"] == "org.example:extra_2.13:1.0"


def test_the_replay_takes_the_definitions_engine_and_only_a_direct_one_leaves_spark_queue(tmp_path: Path) -> None:
    for engine, threshold, queue in (("auto", 1234, "spark"), ("spark", 0, "spark"), ("direct", 0, "sensors")):
        stream = {"replay_engine": engine, "replay_direct_max_records": threshold}
        (tmp_path / "big.yaml").write_text(json.dumps(_definition(**{**SECTIONS, "stream": stream})))
        replay = pipeline_dags(tmp_path)["eos_recovery__big"].get_task("replay")
        assert (replay.engine, replay.direct_max_records, replay.queue) == (engine, threshold, queue)


def test_the_streams_submit_carries_the_spark_section(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": "k:9092", "security.protocol": "SASL_SSL",
                                         "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "pw"}}))
    monkeypatch.setenv("AIRFLOW__EOS__SPARK_JARS", "/jars/kafka.jar")
    (tmp_path / "big.yaml").write_text(json.dumps(_definition(spark={**SECTIONS["spark"], "jars": ["/jars/x.jar"]})))
    operator = pipeline_dags(tmp_path)["eos_stream__big"].get_task("run_pipeline")
    operator.tuning = {}  # as rendered: this run tunes nothing

    class Pg:
        def app_target(self) -> dict[str, object]:
            return {"host": "db", "port": 5432, "dbname": "d", "user": "u", "options": {}}

        def app_password(self) -> str:
            return "secret"

    config = complete_app_config(operator.pipeline, kafka_config_id=operator.connection("kafka"),
                                 postgres=Pg())  # type: ignore[arg-type]
    hook: EosStreamSubmitHook = operator.spark_submission().hook(config)
    command = hook._build_spark_submit_command("app.py")
    assert command[command.index("--driver-memory") + 1] == "3g"
    assert command[command.index("--jars") + 1] == "/jars/kafka.jar,/jars/x.jar"
    assert "spark.executor.cores=2" in command and "spark.cores.max=6" in command
    # The connection's credentials travel in the environment, never on the command line.
    assert not any("pw" in part for part in command)
    assert json.loads(hook._secret_env["EOS_KAFKA_OPTIONS_JSON"])["sasl.password"] == "pw"
    hook.cleanup()
