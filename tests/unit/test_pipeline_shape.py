"""One shape for a pipeline: the app's PipelineConfig is the source of every app field and its
default; the definition, its app config and the stream operator must agree with it."""

from __future__ import annotations

import inspect
import json
import subprocess
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from airflow_provider_eos.operators.replay import ReplayOperator
from airflow_provider_eos.operators.stream import StreamingPipelineOperator
from airflow_provider_eos.utils.pipeline_definition import (
    APP_FIELD_RENAMES,
    DEFINITION_ONLY,
    PipelineDefinition,
    StreamSettings,
    app_field_places,
)
from spark_apps.eos_stream.run.config import (
    RUN_FIELDS,
    PipelineConfig,
    default_of,
    from_dict,
    pipeline_fields,
    required_fields,
)

ROOT = Path(__file__).resolve().parents[2]
# Required in the definition though the app has a default for local runs: a deployment names
# durable storage. The only deliberate difference; anything else here is a disagreement.
REQUIRED_ONLY_IN_DEFINITION = {"checkpoint_dir"}
MINIMAL = {"name": "p", "topics": ["a"], "spec": "pkg.mod:SPEC", "checkpoint_dir": "/cp"}


def _model(place: str) -> type[PipelineDefinition] | type[StreamSettings]:
    return PipelineDefinition if place == "top" else StreamSettings


@pytest.mark.parametrize("key", pipeline_fields())
def test_each_app_field_has_one_place_with_the_apps_type_and_default(key: str) -> None:
    place, name = app_field_places()[key]
    other = "stream" if place == "top" else "top"
    assert name not in _model(other).model_fields, f"{key} is in both the definition's top level and its stream"
    declared = _model(place).model_fields[name]
    assert declared.annotation == typing.get_type_hints(PipelineConfig)[key], key
    if key in required_fields():
        assert declared.is_required(), f"{key} is required by the app and optional in the definition"
    elif key in REQUIRED_ONLY_IN_DEFINITION:
        assert declared.is_required(), key
    else:
        assert not declared.is_required() and declared.default == default_of(key), (
            f"{key}: the definition's default {declared.default!r} is not the app's {default_of(key)!r}")


def test_the_definition_holds_nothing_else_but_what_the_app_never_sees() -> None:
    places = {(place, name) for place, name in app_field_places().values()}
    for place in ("top", "stream"):
        own = set(_model(place).model_fields) - {name for p, name in places if p == place}
        assert own == set(DEFINITION_ONLY[place]), place
    assert set(APP_FIELD_RENAMES) <= set(pipeline_fields())
    assert not set(RUN_FIELDS) & {name for _, name in places}, "a run's field is in the definition"
    assert set(pipeline_fields()) | set(RUN_FIELDS) == {f.name for f in fields(PipelineConfig)}


def test_a_minimal_definition_gives_the_apps_defaults() -> None:
    definition = PipelineDefinition.model_validate(MINIMAL)
    config = definition.app_config(kafka_bootstrap="k:9092", postgres={"host": "db"})
    assert set(config) == set(pipeline_fields()) | {"kafka_bootstrap", "postgres"}
    app = from_dict(config).validate()
    bare = from_dict({"pipeline": "p", "topics": ["a"], "spec": "pkg.mod:SPEC", "checkpoint_dir": "/cp"})
    for key in pipeline_fields():
        assert getattr(app, key) == getattr(bare, key), key


def test_the_operator_takes_the_definition_and_restates_no_field() -> None:
    params = inspect.signature(StreamingPipelineOperator.__init__).parameters
    definition_names = set(PipelineDefinition.model_fields) | set(StreamSettings.model_fields) | set(pipeline_fields())
    restated = definition_names & set(params) - {"max_restarts", "restart_backoff"}
    assert not restated, f"the operator restates definition fields {sorted(restated)}: take them from the definition"
    # Its restart policy defaults to the definition's (None), and a run's fields to the app's.
    assert params["max_restarts"].default is None and params["restart_backoff"].default is None
    for key in set(params) & set(RUN_FIELDS):
        if params[key].default is None:  # kafka_options: None means none, as the app's empty default
            assert not default_of(key), key
        else:
            assert params[key].default == default_of(key), key


def test_the_operators_config_is_the_definitions(monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": "broker:9092"}}))
    monkeypatch.setenv("AIRFLOW_CONN_EOS_POSTGRES", json.dumps(
        {"conn_type": "postgres", "host": "db", "port": 5433, "login": "app", "schema": "w"}))
    definition = PipelineDefinition.model_validate(MINIMAL)
    config = StreamingPipelineOperator(task_id="t", definition=definition).build_config()
    expected = definition.app_pipeline_config(kafka_bootstrap="broker:9092", postgres=json.loads(config.to_json())[
        "postgres"], run_seconds=default_of("run_seconds"), stop_poll_seconds=default_of("stop_poll_seconds"))
    assert config == expected


def test_the_replay_operators_engine_defaults_are_the_definitions() -> None:
    params = inspect.signature(ReplayOperator.__init__).parameters
    stream = StreamSettings.model_fields
    assert params["engine"].default == stream["replay_engine"].default == "auto"
    assert params["direct_max_records"].default == stream["replay_direct_max_records"].default


def test_no_generic_module_names_an_example_pipeline() -> None:
    examples = sorted(p.name for p in (ROOT / "spark_apps").iterdir()
                      if p.is_dir() and p.name not in ("eos_stream", "__pycache__"))
    assert examples, "no example pipeline packages found"
    found = subprocess.run(["git", "grep", "-n", "-i", "-w", "-E", "|".join(examples), "--",
                            "airflow_provider_eos", "spark_apps/eos_stream"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 1, f"generic code names an example pipeline:\n{found.stdout}"
