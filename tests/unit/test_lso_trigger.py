"""Unit tests of LsoLagTrigger serialization, the health/gate decision and the sensor's wiring
(fake offsets only; the real broker is exercised in tests/integration/test_lso_sensor.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from airflow_provider_eos.lso_lag import LsoWatch, PartitionOffsets
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.triggers.lso_lag import LsoLagTrigger, evaluate

T = "orders"


def test_serialize_is_plain_json_and_round_trips():
    trigger = LsoLagTrigger(
        topics=(T, "payments"),
        kafka_config_id="k",
        mode="gate",
        stuck_after=7,
        poke_interval=2,
        txn_max_timeout_ms=120_000,
        margin=3,
    )
    trigger.watch.observe(50, {(T, 0): PartitionOffsets(5, 2)})
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_provider_eos.triggers.lso_lag.LsoLagTrigger"
    assert json.loads(json.dumps(kwargs)) == kwargs  # only JSON types
    again = LsoLagTrigger(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (classpath, kwargs)
    assert again.topics == [T, "payments"] and again.mode == "gate"
    report = again.watch.observe(57, {(T, 0): PartitionOffsets(5, 2)})
    assert report.partitions[0].classification == "open"


def test_invalid_mode_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        LsoLagTrigger(topics=[T], mode="sometimes")


def test_health_and_gate_decisions():
    watch = LsoWatch(stuck_after=5)
    healthy = {(T, 0): PartitionOffsets(0, 0)}
    r = watch.observe(0, healthy)
    assert evaluate("health", watch, r) is None  # window not complete
    assert evaluate("gate", watch, r) == "ok"
    r = watch.observe(5, healthy)
    assert evaluate("health", watch, r) == "ok"

    watch = LsoWatch(stuck_after=5)
    pending = {(T, 0): PartitionOffsets(4, 1)}
    assert evaluate("gate", watch, watch.observe(0, pending)) is None
    assert evaluate("health", watch, watch.observe(5, pending)) == "stuck"


class _FakeHook:
    def __init__(self, frames):
        self.frames = list(frames)

    def get_admin_client(self):
        return object()

    def partition_offsets(self, topics, include_earliest=True):
        import time

        time.sleep(0.5)  # a blocking call: must not block the event loop
        return self.frames.pop(0) if len(self.frames) > 1 else self.frames[0]


def test_trigger_runs_blocking_calls_off_the_event_loop(monkeypatch):
    trigger = LsoLagTrigger(topics=[T], mode="health", stuck_after=0.3, poke_interval=0.05)
    hook = _FakeHook([{(T, 0): PartitionOffsets(3, 1)}])
    monkeypatch.setattr(trigger, "_make_hook", lambda: hook)

    async def main():
        gaps = []

        async def ticker():
            loop = asyncio.get_running_loop()
            last = loop.time()
            while True:
                await asyncio.sleep(0.01)
                now = loop.time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        event = await asyncio.wait_for(trigger.run().__anext__(), 5)
        tick.cancel()
        return event, max(gaps)

    event, max_gap = asyncio.run(main())
    assert event.payload["status"] == "stuck"
    assert event.payload["report"]["partitions"][0]["classification"] == "open"
    # On the loop, the 0.5 s call would stall the 10 ms ticker for >= 0.5 s; off it,
    # only scheduling noise remains (up to ~0.08 s seen on a loaded 2-core CI machine).
    assert max_gap < 0.25


def test_trigger_reports_errors_as_events(monkeypatch):
    trigger = LsoLagTrigger(topics=[T])

    def boom():
        raise RuntimeError("no such connection")

    monkeypatch.setattr(trigger, "_make_hook", boom)
    event = asyncio.run(trigger.run().__anext__())
    assert event.payload["status"] == "error" and "no such connection" in event.payload["message"]


def test_sensor_defers_immediately_with_timeout():
    sensor = LastStableOffsetLagSensor(
        task_id="lso", topics=T, watch_mode="gate", stuck_after=5, poke_interval=1, timeout=42
    )
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert isinstance(deferred.value.trigger, LsoLagTrigger)
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout == timedelta(seconds=42)
    assert deferred.value.trigger.serialize()[1]["mode"] == "gate"


def test_sensor_execute_complete():
    sensor = LastStableOffsetLagSensor(task_id="lso", topics=[T])
    assert sensor.execute_complete({}, {"status": "ok", "report": {"x": 1}, "message": ""}) == {"x": 1}
    with pytest.raises(AirflowException, match="stuck last stable offset"):
        sensor.execute_complete({}, {"status": "stuck", "message": "table"})
    with pytest.raises(AirflowException, match="boom"):
        sensor.execute_complete({}, {"status": "error", "message": "boom"})
