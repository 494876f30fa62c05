"""The launchers (``airflow_provider_eos.launchers``): one per way of running an engine, chosen by
the engine, each keeping the config's secrets off its config file and command line."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_eos.launchers.child_process import ChildProcessLauncher
from airflow_provider_eos.launchers.choose import launcher_for
from airflow_provider_eos.launchers.in_process import InProcessLauncher
from airflow_provider_eos.launchers.protocol import run_to_end, secret_env, write_private_config
from airflow_provider_eos.launchers.result import AppRunResult
from airflow_provider_eos.launchers.spark_submit import SparkSubmission, SparkSubmitLauncher
from spark_apps.eos_stream.run.config import PipelineConfig, PostgresTarget

SECRET = "pa55-w0rd"


def _config(**change: Any) -> PipelineConfig:
    return PipelineConfig(pipeline="p", topics=["t"], spec="spark_apps.ledger.spec:LEDGER",
                          postgres=PostgresTarget(host="db", password=SECRET),
                          kafka_options={"sasl.password": "k-secret"}, **change)


def test_the_config_file_is_private_and_the_secrets_go_to_the_environment(tmp_path: Path) -> None:
    path = write_private_config(tmp_path, _config())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = Path(path).read_text()
    assert SECRET not in text and "k-secret" not in text and json.loads(text)["postgres"]["host"] == "db"
    env = secret_env(_config())
    assert env["EOS_PG_PASSWORD"] == SECRET and json.loads(env["EOS_KAFKA_OPTIONS_JSON"]) == {
        "sasl.password": "k-secret"}
    assert secret_env(PipelineConfig(pipeline="p", topics=["t"], spec="x:Y")) == {}


def test_one_launcher_per_engine() -> None:
    assert isinstance(launcher_for("spark"), SparkSubmitLauncher)
    assert isinstance(launcher_for("continuous"), ChildProcessLauncher)
    assert isinstance(launcher_for("direct"), InProcessLauncher)
    with pytest.raises(ValueError, match="unknown engine 'flink'"):
        launcher_for("flink")


def test_in_process_reads_the_engines_events_and_reports_its_failure() -> None:
    def engine(config: PipelineConfig) -> int:
        print(f'EOS-START {{"pipeline": "{config.pipeline}"}}')
        print("a log line")
        return 0

    launcher = InProcessLauncher(engine)
    result = run_to_end(launcher, _config())
    assert result.ok and result.events == [("start", {"pipeline": "p"})]

    def broken(config: PipelineConfig) -> int:
        raise RuntimeError("no broker")

    launcher = InProcessLauncher(broken)
    result = run_to_end(launcher, _config())
    assert result.returncode == 1 and result.reason() == "exit 1: failed: RuntimeError: no broker"
    assert isinstance(launcher.error, RuntimeError)


class FakeHook:
    def __init__(self, outcome: AppRunResult | Exception) -> None:
        self.outcome = outcome
        self.on_event: Any = None
        self.cleaned = self.killed = False

    def run_app(self, config: dict[str, Any]) -> AppRunResult:
        assert "password" not in config["postgres"] and "kafka_options" not in config
        self.on_event("ui", {"url": "http://driver:4040"})
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cleanup(self) -> None:
        self.cleaned = True

    def on_kill(self) -> None:
        self.killed = True


def test_spark_submit_yields_the_drivers_events_as_they_come_and_raises_what_the_hook_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hooks: list[FakeHook] = []
    outcomes: list[AppRunResult | Exception] = [AppRunResult(0, [("ui", {})]), RuntimeError("mixed Sparks")]

    def hook(self: SparkSubmission, config: PipelineConfig) -> FakeHook:
        assert config.postgres.password == SECRET  # the hook puts it into the environment
        hooks.append(FakeHook(outcomes.pop(0)))
        return hooks[-1]

    monkeypatch.setattr(SparkSubmission, "hook", hook)
    seen: list[str] = []
    result = run_to_end(SparkSubmitLauncher(SparkSubmission()), _config(), lambda kind, data: seen.append(kind))
    assert result.ok and seen == ["ui"] and hooks[0].cleaned
    launcher = SparkSubmitLauncher(SparkSubmission())
    with pytest.raises(RuntimeError, match="mixed Sparks"):
        run_to_end(launcher, _config())
    launcher.stop()
    assert hooks[1].killed
