"""StreamingPipelineOperator and its spark-submit hook without the stack: config, command line,
supervision decisions (restart, backoff, config error, exhausted restarts, stop pending)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.stream_submit import AppRunResult, EosStreamSubmitHook, parse_event
from airflow_provider_eos.operators.stream import PipelineConfigError, StreamingPipelineOperator

SECRET = "s3cr3t-Pa55"


@pytest.fixture
def conns(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": "broker:9092"}}))
    monkeypatch.setenv("AIRFLOW_CONN_EOS_POSTGRES", json.dumps(
        {"conn_type": "postgres", "host": "db", "port": 5433, "login": "app", "password": SECRET,
         "schema": "warehouse"}))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[*]"}))
    monkeypatch.setenv("EOS_SPARK_JARS", "/jars/a.jar,/jars/b.jar")


def test_config_from_params_and_connections(conns):
    op = StreamingPipelineOperator(task_id="t", pipeline="p", topics="a, b", create_targets="True",
                                   max_offsets_per_trigger="100", stop_poll_seconds=0.5)
    config = op.build_config()
    assert config["kafka_bootstrap"] == "broker:9092"
    assert config["postgres"] == {"host": "db", "port": 5433, "dbname": "warehouse", "user": "app"}
    assert config["topics"] == ["a", "b"] and config["create_targets"] is True
    assert config["max_offsets_per_trigger"] == 100 and config["run_seconds"] == 0
    assert SECRET not in json.dumps(config)


@pytest.mark.parametrize("bad", [{"trigger": "continuous"}, {"delivery": "maybe"},
                                 {"extra_config": {"pipeline": "x"}}])
def test_invalid_arguments_fail_without_retry(conns, bad):
    op = StreamingPipelineOperator(task_id="t", pipeline="p", topics=["a"], **bad)
    with pytest.raises(AirflowException):
        op.build_config()


def test_command_line_holds_no_secret_and_env_does(conns):
    hook = EosStreamSubmitHook(postgres_password=SECRET, kafka_options={"sasl.jaas.config": "hidden"})
    try:
        command = hook.build_command({"pipeline": "p", "postgres": {"host": "db"}})
        line = " ".join(command)
        assert SECRET not in line and "hidden" not in line
        assert "--config" in command and command[command.index("--config") - 1].endswith("eos_stream/app.py")
        assert "spark.ui.enabled=false" in line and "spark.driver.host=127.0.0.1" in line
        assert "--jars /jars/a.jar,/jars/b.jar" in line and "--py-files" not in line  # local master
        assert hook._env_vars["EOS_PG_PASSWORD"] == SECRET
        assert json.loads(hook._env_vars["EOS_KAFKA_OPTIONS_JSON"]) == {"sasl.jaas.config": "hidden"}
        assert stat.S_IMODE(os.stat(hook.config_path).st_mode) == 0o600
        with pytest.raises(AirflowException):
            hook.write_config({"postgres": {"password": "x"}})
    finally:
        hook.cleanup()


def test_non_local_master_ships_a_zip_and_keeps_secrets_off_the_command_line(conns, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster"}}))
    hook = EosStreamSubmitHook(postgres_password=SECRET)
    try:
        line = " ".join(hook.build_command({"pipeline": "p"}))
        assert SECRET not in line and "spark_apps.zip" in line and "spark.driver.host" not in line
        assert "--properties-file" in line
        with open(hook._properties_file) as f:
            assert f"spark.yarn.appMasterEnv.EOS_PG_PASSWORD={SECRET}" in f.read()
    finally:
        hook.cleanup()


def test_event_parsing_and_reasons():
    assert parse_event('EOS-BATCH {"batch_id": 3}') == ("batch", {"batch_id": 3})
    assert parse_event("INFO something") is None
    failed = AppRunResult(1, [("error", {"kind": "unavailable", "message": "no broker"})])
    assert failed.reason() == "exit 1: unavailable: no broker" and not failed.config_error
    assert AppRunResult(-9).reason() == "killed by SIGKILL (no EOS-ERROR line)"
    assert AppRunResult(2).config_error
    assert AppRunResult(0, [("stopped", {"reason": "stop requested"})]).reason() == "stopped (stop requested)"


class FakePg:
    def __init__(self, stop_at: str | None = None) -> None:
        self.stop_at = stop_at
        self.cleared: list[str] = []

    def app_target(self) -> dict[str, Any]:
        return {"host": "db", "port": 5432, "dbname": "d", "user": "u"}

    def app_password(self) -> str:
        return SECRET

    def acquire_supervisor_lock(self, pipeline: str) -> Any:
        return FakeConn()

    def clear_stop(self, pipeline: str) -> None:
        self.cleared.append(pipeline)

    def stop_requested_at(self, pipeline: str) -> str | None:
        return self.stop_at


class FakeConn:
    def close(self) -> None:
        pass


class FakeSubmit:
    def __init__(self, results: list[AppRunResult], configs: list[dict[str, Any]]) -> None:
        self.results, self.configs = results, configs

    def run_app(self, config: dict[str, Any]) -> AppRunResult:
        self.configs.append(dict(config))
        return self.results.pop(0)

    def cleanup(self) -> None:
        pass


def _operator(monkeypatch, results: list[AppRunResult], pg: FakePg | None = None, **kwargs: Any):
    op = StreamingPipelineOperator(task_id="t", pipeline="p", topics=["a"], restart_backoff=0.01, **kwargs)
    configs: list[dict[str, Any]] = []
    pg = pg or FakePg()
    monkeypatch.setattr(op, "pg_hook", lambda: pg)
    monkeypatch.setattr(op, "submit_hook", lambda _pg: FakeSubmit(results, configs))
    return op, configs, pg


BATCH = ("batch", {"batch_id": 0, "applied": 10, "dead_lettered": 1, "end_offsets": '{"a": {"0": 10}}'})


def test_restarts_after_failures_then_succeeds(conns, monkeypatch):
    op, configs, pg = _operator(monkeypatch, [AppRunResult(-9), AppRunResult(1, [("error", {"kind": "failed",
                                "message": "boom"})]), AppRunResult(0, [BATCH])], max_restarts=2)
    summary = op.execute({})
    assert pg.cleared == ["p"] and len(configs) == 3
    assert summary["status"] == "finished" and summary["restarts"] == 2
    assert [a["reason"] for a in summary["attempts"]][:2] == ["killed by SIGKILL (no EOS-ERROR line)",
                                                            "exit 1: failed: boom"]
    assert summary["rows_applied"] == 10 and summary["end_offsets"] == {"a": {"0": 10}}


def test_config_error_fails_at_once(conns, monkeypatch):
    op, configs, _ = _operator(monkeypatch, [AppRunResult(2, [("error", {"kind": "config", "message": "bad spec"})])])
    with pytest.raises(PipelineConfigError, match="bad spec"):
        op.execute({})
    assert len(configs) == 1


def test_exhausted_restarts_fail_with_every_reason(conns, monkeypatch):
    fail = [AppRunResult(1, [("error", {"kind": "unavailable", "message": f"no broker {i}"})]) for i in range(2)]
    op, configs, _ = _operator(monkeypatch, fail, max_restarts=1)
    with pytest.raises(AirflowException) as err:
        op.execute({})
    text = str(err.value)
    assert "restarts exhausted" in text and "no broker 0" in text and "no broker 1" in text
    assert len(configs) == 2


def test_failure_during_a_stop_request_is_not_restarted(conns, monkeypatch):
    op, configs, _ = _operator(monkeypatch, [AppRunResult(1)], pg=FakePg(stop_at="2026-01-01T00:00:00"))
    assert op.execute({})["status"] == "stopped" and len(configs) == 1


def test_backoff_doubles_up_to_the_cap():
    op = StreamingPipelineOperator(task_id="t", pipeline="p", topics=["a"], restart_backoff=5, max_backoff=12)
    assert [op.backoff(n) for n in (1, 2, 3)] == [5, 10, 12]


def test_processing_time_restart_gets_the_remaining_run_seconds(conns, monkeypatch):
    op, configs, _ = _operator(monkeypatch, [AppRunResult(1), AppRunResult(0)], trigger="processingTime",
                               run_seconds=100, max_restarts=1)
    op.execute({})
    assert configs[0]["run_seconds"] <= 100 and 90 < configs[1]["run_seconds"] < configs[0]["run_seconds"] + 0.01
