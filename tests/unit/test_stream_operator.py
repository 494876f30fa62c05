"""StreamingPipelineOperator and its spark-submit hook without the stack: config, command line,
supervision decisions (restart, backoff, config error, exhausted restarts, stop pending)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_eos.hooks.stream_submit import AppRunResult, EosStreamSubmitHook, parse_event
from airflow_provider_eos.operators.stream import StreamingPipelineOperator
from airflow_provider_eos.operators.stream_errors import AppRefusedConfigError, PipelineDataLostError
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

SECRET = "s3cr3t-Pa55"


@pytest.fixture
def conns(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": "broker:9092"}}))
    monkeypatch.setenv("AIRFLOW_CONN_EOS_POSTGRES", json.dumps(
        {"conn_type": "postgres", "host": "db", "port": 5433, "login": "app", "password": SECRET,
         "schema": "warehouse"}))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[*]"}))
    monkeypatch.setenv("AIRFLOW__EOS__SPARK_JARS", "/jars/a.jar,/jars/b.jar")


def definition(stream: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A pipeline definition's dict form, as a DAG passes it (rendered)."""
    return {"name": "p", "topics": ["a"], "spec": "spark_apps.ledger.spec:LEDGER", "checkpoint_dir": "/cp",
            "stream": stream or {}, **top}


def test_config_from_the_definition_and_connections(conns):
    op = StreamingPipelineOperator(task_id="t", stop_poll_seconds=0.5, definition=definition(
        {"create_targets": "True", "max_offsets_per_trigger": "100", "trigger": "availableNow"},
        topics=["a", "b"]))
    config = op.build_config()
    assert config.kafka_bootstrap == "broker:9092"
    assert json.loads(config.to_json())["postgres"] == {"host": "db", "port": 5433, "dbname": "warehouse",
                                                        "user": "app", "options": {}}
    assert config.topics == ["a", "b"] and config.create_targets is True
    assert config.max_offsets_per_trigger == 100 and config.run_seconds == 0
    assert config.stop_poll_seconds == 0.5 and config.spec == "spark_apps.ledger.spec:LEDGER"
    # The one complete config holds the password; its JSON, which the app gets, never does.
    assert config.postgres.password == SECRET and SECRET not in config.to_json()


def test_a_definition_model_and_its_connections(conns):
    model = PipelineDefinition.model_validate(definition(connections={"kafka": "kafka_other"}))
    op = StreamingPipelineOperator(task_id="t", definition=model, postgres_conn_id="eos_postgres")
    assert op.definition is model and op.pipeline is model  # no tuning: the definition itself
    assert (op.connection("kafka"), op.connection("postgres"), op.connection("spark")) == (
        "kafka_other", "eos_postgres", "spark_default")
    assert op.restart_policy() == (model.stream.max_restarts, model.stream.restart_backoff)


@pytest.mark.parametrize("bad", [{"stream": {"trigger": "always"}}, {"delivery": "maybe"},
                                 {"pipeline": "x"}, {"spec": None}])
def test_an_invalid_definition_fails_without_retry(conns, bad):
    op = StreamingPipelineOperator(task_id="t", definition={**definition(), **bad})
    with pytest.raises(AirflowFailException):
        op.build_config()


def test_command_line_holds_no_secret_and_env_does(conns, monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    hook = EosStreamSubmitHook(postgres_password=SECRET, kafka_options={"sasl.jaas.config": "hidden"})
    try:
        command = hook.build_command({"pipeline": "p", "postgres": {"host": "db"}})
        line = " ".join(command)
        assert SECRET not in line and "hidden" not in line
        assert "--config" in command and command[command.index("--config") - 1].endswith("eos_stream/app.py")
        assert "spark.ui.port=0" in line and "spark.driver.host=127.0.0.1" in line
        assert "--jars /jars/a.jar,/jars/b.jar" in line and "--py-files" not in line  # local master
        assert hook._env_vars["EOS_PG_PASSWORD"] == SECRET
        assert hook._env_vars["SPARK_LOCAL_IP"] == "127.0.0.1"  # the driver's UI binds to it, not 0.0.0.0
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


def test_a_local_masters_driver_jvm_runs_c1_only_unless_the_user_says_otherwise(conns, monkeypatch):
    def driver_options(**hook_args: Any) -> list[str]:
        hook = EosStreamSubmitHook(**hook_args)
        try:
            command = hook.build_command({"pipeline": "p"})
        finally:
            hook.cleanup()
        return [command[i + 1] for i, arg in enumerate(command)
                if arg == "--conf" and command[i + 1].startswith("spark.driver.defaultJavaOptions=")]

    assert driver_options() == ["spark.driver.defaultJavaOptions=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"]
    mine = {"spark.driver.defaultJavaOptions": "-XX:+UseG1GC"}
    assert driver_options(conf=mine) == ["spark.driver.defaultJavaOptions=-XX:+UseG1GC"]
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "spark://m:7077"}))
    assert driver_options() == []  # a cluster's driver: the JVM's defaults


def test_event_parsing_and_reasons():
    assert parse_event('EOS-BATCH {"batch_id": 3}') == ("batch", {"batch_id": 3})
    assert parse_event("INFO something") is None
    # Seen in CI: the JVM's stderr glued to an event line on the shared pipe.
    glued = ('EOS-STOPPED {"reason": "stop requested at 2026-11-24T07:13:30.866518+00:00"}26/11/24 07:13:31 '
             "WARN DAGScheduler: Failed to cancel job group aee4cf9f. Cannot find active jobs for it.")
    assert parse_event(glued) == ("stopped", {"reason": "stop requested at 2026-11-24T07:13:30.866518+00:00"})
    assert parse_event("EOS-FINISHED") == ("finished", {})
    assert parse_event("EOS-BATCH {not json") is None
    failed = AppRunResult(1, [("error", {"kind": "unavailable", "message": "no broker"})])
    assert failed.reason() == "exit 1: unavailable: no broker" and not failed.config_error
    assert AppRunResult(-9).reason() == "killed by SIGKILL (no EOS-ERROR line)"
    assert AppRunResult(2).config_error
    assert AppRunResult(0, [("stopped", {"reason": "stop requested"})]).reason() == "stopped (stop requested)"


HOLD = {"holder": "recovery-run-1", "acquired_at": "2026-01-01T00:00:00", "heartbeat_at": "2026-01-01T00:00:01",
        "heartbeat_age_seconds": 3.0}
DRIVER = {"pid": 4242, "application_name": "eos-stream", "client_addr": "127.0.0.1", "client_port": 50000,
          "backend_start": "2026-01-01T00:00:00", "age_seconds": 60.0}


class FakePg:
    """The bookkeeping hook's answers, as sequences: each call takes the next one (the last repeats)."""

    def __init__(self, stop_at: str | None = None, stops: list[str | None] | None = None,
                 holds: list[dict[str, Any] | None] | None = None,
                 drivers: list[dict[str, Any] | None] | None = None) -> None:
        self.stops = list(stops) if stops is not None else [stop_at]
        self.holds = list(holds) if holds is not None else [None]
        self.drivers = list(drivers) if drivers is not None else [None]
        self.cleared: list[str] = []
        self.calls: list[str] = []

    @staticmethod
    def _next(answers: list[Any]) -> Any:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def recovery_hold(self, pipeline: str, target_schema: str, ttl_seconds: float) -> dict[str, Any] | None:
        self.calls.append("hold")
        return self._next(self.holds)

    def running_lock_holder(self, pipeline: str) -> dict[str, Any] | None:
        self.calls.append("driver")
        return self._next(self.drivers)

    def app_target(self) -> dict[str, Any]:
        return {"host": "db", "port": 5432, "dbname": "d", "user": "u", "options": {}}

    def app_password(self) -> str:
        return SECRET

    def acquire_supervisor_lock(self, pipeline: str) -> Any:
        return FakeConn()

    def set_stop_request(self, pipeline: str, requested: bool, by: str = "") -> None:
        assert not requested  # the stream operator only clears an old request before a launch
        self.cleared.append(pipeline)

    def stop_requested_at(self, pipeline: str) -> str | None:
        self.calls.append("stop")
        return self._next(self.stops)


class FakeConn:
    def close(self) -> None:
        pass


class FakeLauncher:
    """A launcher (``launchers.protocol.AppLauncher``) whose runs end as ``results`` say."""

    def __init__(self, results: list[AppRunResult], configs: list[dict[str, Any]]) -> None:
        self.results, self.configs = results, configs

    def start(self, config: Any) -> None:
        self.configs.append(asdict(config))
        self.result_of_run = self.results.pop(0)

    def events(self) -> Any:
        yield from self.result_of_run.events

    def stop(self) -> None:
        pass

    def result(self) -> AppRunResult:
        return self.result_of_run


def _operator(monkeypatch, results: list[AppRunResult], pg: FakePg | None = None, trigger: str = "availableNow",
              **kwargs: Any):
    op = StreamingPipelineOperator(task_id="t", definition=definition({"trigger": trigger}),
                                   **{"restart_backoff": 0.01, **kwargs})
    configs: list[dict[str, Any]] = []
    pg = pg or FakePg()
    monkeypatch.setattr(op, "pg_hook", lambda: pg)
    # The operator reads and writes the pipeline's state through functions of its hook: each
    # asks the fake for its answer.
    for name in ("recovery_hold", "running_lock_holder", "acquire_supervisor_lock", "set_stop_request",
                 "stop_requested_at"):
        monkeypatch.setattr(f"airflow_provider_eos.operators.stream.{name}",
                            lambda hook, *args, _name=name, **kw: getattr(hook, _name)(*args, **kw))
    monkeypatch.setattr(op, "launcher", lambda: FakeLauncher(results, configs))
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
    with pytest.raises(AppRefusedConfigError, match="bad spec"):
        op.execute({})
    assert len(configs) == 1


@pytest.mark.parametrize("pg", [FakePg(), FakePg(stop_at="2026-01-01T00:00:00")], ids=["running", "stop requested"])
def test_lost_data_fails_at_once_without_a_restart(conns, monkeypatch, pg):
    lost = AppRunResult(4, [("error", {"kind": "data_lost", "message": "t-0: stored offset 5, log starts at 9"})])
    op, configs, _ = _operator(monkeypatch, [lost, AppRunResult(0)], pg=pg, max_restarts=5)
    with pytest.raises(PipelineDataLostError, match="stored offset 5, log starts at 9") as err:
        op.execute({})
    assert isinstance(err.value, AirflowFailException), "no Airflow retry either"
    assert len(configs) == 1 and "stop" not in pg.calls, "decided without a restart, whatever holds"


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
    op = StreamingPipelineOperator(task_id="t", definition=definition(), restart_backoff=5, max_backoff=12)
    assert [op.backoff(n) for n in (1, 2, 3)] == [5, 10, 12]


def test_processing_time_restart_gets_the_remaining_run_seconds(conns, monkeypatch):
    op, configs, _ = _operator(monkeypatch, [AppRunResult(1), AppRunResult(0)], trigger="processingTime",
                               run_seconds=100, max_restarts=1)
    op.execute({})
    assert configs[0]["run_seconds"] <= 100 and 90 < configs[1]["run_seconds"] < configs[0]["run_seconds"] + 0.01


# ---------------------------------------------------------------- fencing, stops, recoveries, orphans
FENCED = AppRunResult(3, [("error", {"kind": "fenced", "message": "pipeline 'p' was fenced: its epoch is 7"})])
SLOW_BACKOFF = 3600.0  # a test that waited for it would hit pytest's timeout


def test_fenced_result_and_reason():
    assert FENCED.fenced and FENCED.reason() == "fenced (exit 3): pipeline 'p' was fenced: its epoch is 7"
    assert AppRunResult(3).fenced and AppRunResult(3).reason() == "fenced (exit 3): no EOS-ERROR line"
    assert not AppRunResult(1).fenced and not AppRunResult(0, [("error", {"kind": "fenced"})]).fenced
    assert not FENCED.config_error


@pytest.mark.timeout(30)
def test_fenced_exit_restarts_at_once_counted_apart(conns, monkeypatch):
    op, configs, _ = _operator(monkeypatch, [FENCED, AppRunResult(0, [BATCH])], restart_backoff=SLOW_BACKOFF,
                               max_restarts=0)
    summary = op.execute({})
    assert len(configs) == 2 and summary["status"] == "finished"
    assert summary["restarts"] == 0 and summary["fenced_restarts"] == 1
    assert summary["attempts"][0]["fenced"] is True and summary["attempts"][0]["reason"].startswith("fenced (exit 3)")


@pytest.mark.parametrize("pg", [FakePg(stop_at="2026-01-01T00:00:00"), FakePg(holds=[None, HOLD])],
                         ids=["stop requested", "recovery holds"])
def test_fenced_while_a_stop_or_a_recovery_holds_does_not_start(conns, monkeypatch, pg):
    op, configs, _ = _operator(monkeypatch, [FENCED], pg=pg, restart_backoff=SLOW_BACKOFF)
    summary = op.execute({})
    assert summary["status"] == "stopped" and len(configs) == 1 and summary["fenced_restarts"] == 0


def test_fenced_while_another_driver_runs_fails_saying_so(conns, monkeypatch):
    monkeypatch.setattr("airflow_provider_eos.operators.stream.OWN_LOCK_RELEASE_SECONDS", 0.2)
    pg = FakePg(drivers=[None, DRIVER])  # none at the start; one holds the running lock after the fence
    op, configs, _ = _operator(monkeypatch, [FENCED, AppRunResult(0)], pg=pg)
    with pytest.raises(AirflowException, match=r"another driver now holds its running lock.*backend pid 4242"):
        op.execute({})
    assert len(configs) == 1, "never two drivers"


def test_own_drivers_lock_lingering_briefly_is_not_another_driver(conns, monkeypatch):
    pg = FakePg(drivers=[None, DRIVER, None])  # our exited driver's backend still ends
    op, configs, _ = _operator(monkeypatch, [FENCED, AppRunResult(0)], pg=pg)
    assert op.execute({})["status"] == "finished" and len(configs) == 2


def test_fenced_restarts_are_bounded(conns, monkeypatch):
    op, configs, _ = _operator(monkeypatch, [FENCED, FENCED, FENCED], max_fenced_restarts=2, max_restarts=5)
    with pytest.raises(AirflowException, match=r"fenced restarts exhausted \(2 restarts"):
        op.execute({})
    assert len(configs) == 3


@pytest.mark.parametrize("pg", [FakePg(stops=[None, "2026-01-01T00:00:00"]),
                                FakePg(holds=[None, None, HOLD])], ids=["stop requested", "recovery holds"])
def test_stop_or_recovery_during_the_backoff_prevents_the_restart(conns, monkeypatch, pg):
    """The issue's review: the stop step passed while the supervisor slept in its backoff,
    and the supervisor restarted the app during the restore."""
    op, configs, _ = _operator(monkeypatch, [AppRunResult(-9), AppRunResult(0, [BATCH])], pg=pg, max_restarts=3)

    class Backoff:
        def wait(self, seconds: float) -> bool:
            pg.calls.append("backoff")
            return False

        def is_set(self) -> bool:
            return False

    op._killed = Backoff()  # type: ignore[assignment]
    summary = op.execute({})
    assert summary["status"] == "stopped" and len(configs) == 1 and summary["restarts"] == 0
    after = pg.calls[len(pg.calls) - pg.calls[::-1].index("backoff"):]
    assert after and after[0] == "stop", f"the stop request is read again after the backoff: {pg.calls[-5:]}"


def test_a_recovery_holding_the_pipeline_delays_the_first_start(conns, monkeypatch):
    monkeypatch.setattr("airflow_provider_eos.operators.stream.RECOVERY_POLL_SECONDS", 0.01)
    pg = FakePg(holds=[HOLD, HOLD, None])
    op, configs, _ = _operator(monkeypatch, [AppRunResult(0)], pg=pg)
    assert op.execute({})["status"] == "finished" and len(configs) == 1
    assert pg.calls[:3] == ["hold", "hold", "hold"] and pg.cleared == ["p"], "the stop is cleared only after"


def test_a_recovery_that_never_ends_fails_the_start(conns, monkeypatch):
    monkeypatch.setattr("airflow_provider_eos.operators.stream.RECOVERY_POLL_SECONDS", 0.01)
    pg = FakePg(holds=[HOLD])
    op, configs, _ = _operator(monkeypatch, [AppRunResult(0)], pg=pg, recovery_wait=0.05)
    with pytest.raises(AirflowException, match="recovery recovery-run-1 still holds its target"):
        op.execute({})
    assert configs == [] and pg.cleared == [], "neither started nor the recovery's stop cleared"


def test_an_orphan_found_at_start_is_reported_fenced(conns, monkeypatch, capsys):
    pg = FakePg(drivers=[DRIVER, None])
    resume = ("resume", {"epoch": 9, "stored_offsets": "{}"})
    op, _configs, _ = _operator(monkeypatch, [AppRunResult(0, [resume, BATCH])], pg=pg)
    summary = op.execute({})
    assert summary["orphan"]["pid"] == 4242 and summary["orphan"]["fenced_at_epoch"] == 9
    captured = capsys.readouterr()  # the task logger writes through structlog
    text = captured.out + captured.err
    assert "a driver without a supervisor holds the running lock (database backend pid 4242" in text
    assert "was fenced and has exited; the new driver holds the running lock at epoch 9" in text


@pytest.mark.timeout(30)
def test_a_stop_ends_a_long_backoff_early(conns, monkeypatch):
    """A StopPipelineOperator waits for the supervisor lock: a 300s backoff must not keep it waiting."""
    monkeypatch.setattr("airflow_provider_eos.operators.stream.BACKOFF_POLL_SECONDS", 0.01)
    pg = FakePg(stops=[None, None, "2026-01-01T00:00:00"])
    op, configs, _ = _operator(monkeypatch, [AppRunResult(1), AppRunResult(0)], pg=pg, restart_backoff=SLOW_BACKOFF)
    summary = op.execute({})
    assert summary["status"] == "stopped" and len(configs) == 1 and summary["restarts"] == 0


def test_a_runs_tuning_applies_to_the_stream_section_only_and_is_checked(conns):
    model = PipelineDefinition.model_validate(definition())
    op = StreamingPipelineOperator(task_id="t", definition=model,
                                   tuning={"trigger": "availableNow", "max_offsets_per_trigger": None})
    assert op.pipeline.stream.trigger == "availableNow" and model.stream.trigger == "processingTime"
    assert op.pipeline.stream.max_offsets_per_trigger == model.stream.max_offsets_per_trigger
    assert op.build_config().trigger == "availableNow"
    op.tuning = {"max_offsets_per_trigger": 0}  # as a rendered template sets it
    with pytest.raises(AirflowFailException, match=r"this run's tuning \{'max_offsets_per_trigger': 0\}: "
                       r"stream\.max_offsets_per_trigger: max_offsets_per_trigger must be at least 1$"):
        op.build_config()
    op.tuning = {"trigerr": "availableNow"}
    with pytest.raises(AirflowFailException, match=r"stream\.trigerr: unknown key; did you mean 'trigger'\?"):
        op.build_config()
