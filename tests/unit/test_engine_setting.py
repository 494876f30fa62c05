"""``engine`` picks what runs a stream (the Spark app or the continuous engine); ``trigger`` keeps
Spark's meaning. ``trigger: continuous``, the old spelling, is read as ``engine: continuous`` for
one release, with a warning naming the fix."""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import pytest

from airflow_provider_eos.utils.pipeline_definition import (
    PipelineDefinition,
    PipelineDefinitionError,
    parse_definition,
)
from spark_apps.eos_stream.run.config import ConfigError, PipelineConfig, from_dict
from spark_apps.eos_stream.run.config_rules import refusals
from tests.streaming import ROOT

LEDGER = "spark_apps.ledger.spec:LEDGER"
DEPRECATED = r"trigger: continuous is deprecated .* Write engine: continuous instead"


def _app_config(**change: Any) -> dict[str, Any]:
    return {"pipeline": "p", "topics": ["p.events"], "spec": LEDGER, **change}


def _definition(**stream: Any) -> PipelineDefinition:
    return parse_definition({"name": "p", "topics": ["p.events"], "spec": LEDGER, "checkpoint_dir": "/ck/p",
                             "stream": stream}, source="p.yaml")


def _rules(**change: Any) -> list[str]:
    return [r.rule for r in refusals(from_dict(_app_config(**change)), load_spec=False)]


def test_spark_is_the_default_engine_and_continuous_is_chosen_by_engine() -> None:
    assert from_dict(_app_config()).engine == "spark" and _definition().stream.engine == "spark"
    continuous = _definition(engine="continuous")
    assert continuous.stream.trigger == "processingTime"
    config = continuous.app_config(kafka_bootstrap="k:9092", postgres={"host": "db"})
    assert (config["engine"], config["trigger"]) == ("continuous", "processingTime")
    assert _rules(engine="continuous") == [] and _rules(engine="spark", trigger="availableNow") == []


def test_an_unknown_engine_and_a_spark_trigger_on_the_continuous_engine_are_refused() -> None:
    assert _rules(engine="flink") == ["engine"]
    assert _rules(engine="continuous", trigger="availableNow") == ["engine"]
    with pytest.raises(PipelineDefinitionError, match=r"stream\.engine: engine 'continuous' takes no Spark trigger"):
        _definition(engine="continuous", trigger="availableNow")
    with pytest.raises(PipelineDefinitionError, match=r"stream\.engine: unknown engine 'flink'; choose one of "
                       r"spark, continuous"):
        _definition(engine="flink")


def test_trigger_continuous_is_still_read_as_engine_continuous_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match=DEPRECATED):
        config = from_dict(_app_config(trigger="continuous")).validate()
    assert (config.engine, config.trigger) == ("continuous", "processingTime")
    with pytest.warns(FutureWarning, match=DEPRECATED):
        definition = _definition(trigger="continuous")
    assert (definition.stream.engine, definition.stream.trigger) == ("continuous", "processingTime")
    # A run's tuning too, over a definition whose engine is Spark.
    with pytest.warns(FutureWarning, match=DEPRECATED):
        tuned = _definition(trigger="availableNow").tuned({"trigger": "continuous"})
    assert (tuned.stream.engine, tuned.stream.trigger) == ("continuous", "processingTime")


def test_the_old_spelling_prints_its_fix_once_per_process() -> None:
    # Python's default warning filters, as the app, the engine and a DAG processor run them.
    code = ("from spark_apps.eos_stream.run.config import from_dict\n"
            f"for _ in range(3):\n    from_dict({_app_config(trigger='continuous')!r})\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("FutureWarning: trigger: continuous is deprecated") == 1, done.stderr
    assert "Write engine: continuous instead" in done.stderr


def test_the_old_spelling_beside_another_engine_is_refused_and_unread_it_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"trigger 'continuous' .* contradicts engine 'spark': remove trigger"):
        from_dict(_app_config(trigger="continuous", engine="spark"))
    with pytest.raises(PipelineDefinitionError, match=r"contradicts engine 'spark'"):
        _definition(trigger="continuous", engine="spark")
    with pytest.raises(PipelineDefinitionError, match=r"this run's tuning .*contradicts engine 'spark'"):
        _definition().tuned({"trigger": "continuous", "engine": "spark"})
    # A config built in code, past the reader: the rule on trigger names the fix.
    built = PipelineConfig(pipeline="p", topics=["t"], spec=LEDGER, trigger="continuous")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning here: the refusal says it
        with pytest.raises(ConfigError, match=r"trigger 'continuous' is now engine 'continuous': set engine: "
                           r"continuous and remove trigger"):
            built.validate()


def test_the_launcher_and_the_stream_dag_decide_by_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_eos.dag_factory.stream import stream_params
    from airflow_provider_eos.hooks.stream_submit import EosStreamSubmitHook
    from airflow_provider_eos.launchers.child_process import ChildProcessLauncher
    from airflow_provider_eos.launchers.spark_submit import SparkSubmitLauncher
    from airflow_provider_eos.operators.stream import StreamingPipelineOperator

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "host": "local[*]"}')

    def launcher(**stream: Any) -> Any:
        return StreamingPipelineOperator(task_id="t", definition=_definition(**stream)).launcher()

    assert isinstance(launcher(), SparkSubmitLauncher)
    assert isinstance(launcher(engine="continuous"), ChildProcessLauncher)
    with pytest.warns(FutureWarning, match=DEPRECATED):
        assert isinstance(launcher(trigger="continuous"), ChildProcessLauncher)  # a definition written before engine
    # Nothing that is not Spark passes through the Spark hook, whichever spelling says so.
    hook = EosStreamSubmitHook()
    try:
        for config in (_app_config(engine="continuous"), _app_config(trigger="continuous")):
            with pytest.raises(AirflowFailException, match="the continuous engine is not spark-submitted"):
                hook.run_app(config)
    finally:
        hook.cleanup()
    params = stream_params(_definition())
    assert params["engine"].schema["enum"] == [None, "spark", "continuous"]
    assert "continuous" in params["trigger"].schema["enum"]  # the old spelling, for one release
