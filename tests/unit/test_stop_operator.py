"""The one stop operator's construction and its trigger's serialized form (pure; the stop
itself runs against the real stack in test_stream_operator, test_running_lock and the DAGs)."""

from __future__ import annotations

import json

import pytest

from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.triggers.stream_stopped import StreamStoppedTrigger


def test_the_trigger_survives_its_serialized_form() -> None:
    trigger = StreamStoppedTrigger(pipeline="p", meta_schema="m", postgres_conn_id="pg", quiet_seconds=3,
                                   poke_interval=0.5, timeout_seconds=60, lock={"key": "db/t/p", "holder": "run-1"})
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_provider_eos.triggers.stream_stopped.StreamStoppedTrigger"
    again = StreamStoppedTrigger(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (classpath, kwargs)
    assert kwargs["lock"] == {"key": "db/t/p", "holder": "run-1"} and kwargs["quiet_seconds"] == 3.0


def test_a_lock_holding_wait_must_end_before_the_lock_could_be_taken_over() -> None:
    with pytest.raises(ValueError, match="shorter than lock_ttl"):
        StopPipelineOperator(task_id="s", pipeline_config={}, hold_lock=True, timeout_seconds=900, lock_ttl=900)
    StopPipelineOperator(task_id="s", pipeline_config={}, hold_lock=False, timeout_seconds=900, lock_ttl=900)
