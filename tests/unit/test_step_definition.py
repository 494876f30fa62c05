"""The pipeline steps (stop, snapshot, restore, replay, audit) take the pipeline's definition and
get the app's complete config from one call; ``pipeline_config`` is read for one release."""

from __future__ import annotations

import json

import pytest

from airflow_provider_eos.operators.replay import ReplayOperator
from airflow_provider_eos.operators.snapshot import SnapshotOperator
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

SECRET = "db-pa55"
DEFINITION = {"name": "orders", "topics": ["orders.events"], "spec": "spark_apps.ledger.spec:LEDGER",
              "checkpoint_dir": "/ck/orders", "meta_schema": "m_orders", "target_schema": "t_orders",
              "connections": {"kafka": "kafka_orders"}}


@pytest.fixture
def conns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_ORDERS", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": "orders-broker:9092", "sasl.password": "k"}}))
    monkeypatch.setenv("AIRFLOW_CONN_EOS_POSTGRES", json.dumps(
        {"conn_type": "postgres", "host": "db", "port": 5433, "login": "app", "password": SECRET, "schema": "w"}))


def test_a_steps_config_is_complete_from_one_call(conns: None) -> None:
    step = StopPipelineOperator(task_id="stop", definition=DEFINITION)
    config = step.app_config()
    assert isinstance(step.definition, PipelineDefinition) and step.hook.meta_schema == "m_orders"
    assert (config.pipeline, config.meta_schema, config.target_schema) == ("orders", "m_orders", "t_orders")
    # The definition's own Kafka connection, and the database with its password: nothing left to fill in.
    assert config.kafka_bootstrap == "orders-broker:9092" and config.kafka_options == {"sasl.password": "k"}
    assert (config.postgres.host, config.postgres.port, config.postgres.password) == ("db", 5433, SECRET)
    assert step.load_config() is config and step.app_config() is config  # read once, never mutated
    assert SECRET not in config.to_json()


def test_the_replay_runs_the_definitions_config_once_to_the_end_past_the_stop_request(conns: None) -> None:
    step = ReplayOperator(task_id="replay", definition=DEFINITION, kafka_config_id="kafka_orders",
                          checkpoint_dir="/ck/replay", kafka_options={"client.id": "replay"})
    config = step.app_config()
    replay = step.replay_config(config)
    assert (replay.engine, replay.trigger, replay.run_seconds, replay.ignore_stop_request) == (
        "spark", "availableNow", 0, True)
    assert replay.checkpoint_dir == "/ck/replay"
    assert replay.kafka_options == {"sasl.password": "k", "client.id": "replay"}
    assert config.checkpoint_dir == "/ck/orders" and not config.ignore_stop_request  # a new config, no mutation


def test_a_step_given_an_app_config_is_warned_and_still_reads_it(conns: None) -> None:
    with pytest.warns(FutureWarning, match="pipeline_config is deprecated"):
        step = SnapshotOperator(task_id="snap", pipeline_config={"pipeline": "orders", "topics": ["orders.events"],
                                                                "spec": "spark_apps.ledger.spec:LEDGER",
                                                                "meta_schema": "m_orders",
                                                                "kafka_bootstrap": "own:9092"})
    assert step.load_config().kafka_bootstrap == "own:9092" and step.hook.meta_schema == "m_orders"
    config = step.app_config()
    assert config.kafka_bootstrap == "own:9092" and config.postgres.password == SECRET
    with pytest.raises(ValueError, match="give the pipeline's definition"):
        SnapshotOperator(task_id="snap")
