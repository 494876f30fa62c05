"""Unit tests of LsoLagTrigger serialization, the health/gate decision and the sensor's wiring
(fake offsets only; the real broker is exercised in tests/integration/test_lso_sensor.py)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta

import pytest
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from airflow_provider_eos.sensors.lso_lag import GATE_DEFERRAL_SLACK, LastStableOffsetLagSensor
from airflow_provider_eos.triggers.lso_lag import LsoLagTrigger, evaluate, event_payload
from airflow_provider_eos.utils.lso_watch import LsoWatch, PartitionOffsets

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
    assert evaluate("gate", watch, watch.observe(6, pending)) is None  # stuck: the gate waits


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


class _HeldOffsets:
    """A KafkaOffsetsHook whose every partition has lag behind an LSO that never moves."""

    def partition_offsets(self, topics, include_earliest=False):
        return {(t, 0): PartitionOffsets(9, 3) for t in topics}


def test_sensor_defers_after_its_worker_check_with_the_rest_of_its_timeout():
    # defer_after=0: one observation in the worker (see test_defer_after.py), then the trigger.
    sensor = LastStableOffsetLagSensor(
        task_id="lso", topics=T, watch_mode="gate", stuck_after=5, poke_interval=1, timeout=42, defer_after=0,
        deferrable=True,
    )
    sensor.__dict__["hook"] = _HeldOffsets()
    before = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert isinstance(deferred.value.trigger, LsoLagTrigger)
    assert deferred.value.method_name == "execute_complete"
    kwargs = deferred.value.trigger.serialize()[1]
    assert kwargs["mode"] == "gate"
    # The gate's own deadline is the sensor's timeout; Airflow's deferral timeout only
    # backs it up, one poke + one request + slack later, so the gate's report wins.
    assert before + 42 <= kwargs["deadline"] <= time.time() + 42
    slack = 1 + 10 + GATE_DEFERRAL_SLACK
    assert timedelta(seconds=41 + slack) <= deferred.value.timeout <= timedelta(seconds=42 + slack)
    assert kwargs["watch_state"]["partitions"]  # the worker's observation goes on in the trigger

    health = LastStableOffsetLagSensor(task_id="lso", topics=T, watch_mode="health", timeout=42, defer_after=0,
                                       deferrable=True)
    health.__dict__["hook"] = _HeldOffsets()
    with pytest.raises(TaskDeferred) as deferred:
        health.execute({})
    assert timedelta(seconds=41) <= deferred.value.timeout <= timedelta(seconds=42)
    assert deferred.value.trigger.serialize()[1]["deadline"] is None


def test_gate_passes_on_advancing_lso_and_gives_up_at_the_deadline():
    stuck = (T, 1)
    watch = LsoWatch(stuck_after=5)
    # First sight: lag everywhere, age unknown -> wait.
    r = watch.observe(0, {(T, 0): PartitionOffsets(4, 1), stuck: PartitionOffsets(9, 3)})
    assert evaluate("gate", watch, r, deadline=100, poke_interval=1) is None
    # Partition 0's LSO moved (still lag), partition 1's did not yet for 5 s -> still unknown.
    r = watch.observe(1, {(T, 0): PartitionOffsets(8, 5), stuck: PartitionOffsets(9, 3)})
    assert [p.name for p in r.unconfirmed] == [f"{T}[1]"]
    assert evaluate("gate", watch, r, deadline=100, poke_interval=1) is None
    # Partition 1 stuck for stuck_after: waits (the coordinator may still abort it) ...
    r = watch.observe(5, {(T, 0): PartitionOffsets(12, 8), stuck: PartitionOffsets(11, 3)})
    assert [p.name for p in r.stuck] == [f"{T}[1]"]
    assert evaluate("gate", watch, r, deadline=100, poke_interval=1) is None
    assert evaluate("gate", watch, r) is None  # no deadline: the task's timeout decides
    # ... until the next poke would come after the deadline: 'stuck', naming it.
    r = watch.observe(99.5, {(T, 0): PartitionOffsets(20, 15), stuck: PartitionOffsets(12, 3)})
    assert evaluate("gate", watch, r, deadline=100, poke_interval=1) == "stuck"
    payload = event_payload("gate", "stuck", r)
    first = payload["message"].splitlines()[0]
    assert f"{T}[1] LSO 3 lag 9 for 99.5s (open)" in first and f"{T}[0]" not in first
    # The coordinator aborts it: the gate opens although partition 0 still has lag.
    r = watch.observe(100.5, {(T, 0): PartitionOffsets(25, 21), stuck: PartitionOffsets(14, 14)})
    assert not r.all_caught_up
    assert evaluate("gate", watch, r, deadline=100, poke_interval=1) == "ok"


def test_gate_timeout_without_a_stuck_partition_and_hanging_fails_at_once():
    watch = LsoWatch(stuck_after=60)
    r = watch.observe(0, {(T, 0): PartitionOffsets(4, 1)})
    assert evaluate("gate", watch, r, deadline=0.5, poke_interval=1) == "timeout"
    assert "not yet seen advancing" in r.gate_summary()

    watch = LsoWatch(stuck_after=5, txn_max_timeout_ms=10_000, margin=1)
    watch.observe(0, {(T, 0): PartitionOffsets(4, 1)})
    r = watch.observe(11, {(T, 0): PartitionOffsets(4, 1)})
    assert evaluate("gate", watch, r, deadline=1_000, poke_interval=1) == "stuck"


def test_sensor_poke_gate_gives_up_naming_the_stuck_partition(monkeypatch):
    sensor = LastStableOffsetLagSensor(
        task_id="lso", topics=T, watch_mode="gate", stuck_after=0.2, poke_interval=0.1, timeout=0.6,
        deferrable=False,
    )
    monkeypatch.setattr(
        LastStableOffsetLagSensor, "hook", _FakeStuckHook({(T, 0): PartitionOffsets(7, 2)}), raising=False
    )
    started = time.monotonic()
    with pytest.raises(AirflowException, match=rf"stuck last stable offset:\ngate closed: stuck .*{T}\[0\] LSO 2"):
        sensor.execute({})
    assert time.monotonic() - started < 0.6 + 0.5


class _FakeStuckHook:
    def __init__(self, frame):
        self.frame = frame

    def partition_offsets(self, topics, include_earliest=True):
        return self.frame


def test_sensor_execute_complete():
    sensor = LastStableOffsetLagSensor(task_id="lso", topics=[T])
    assert sensor.execute_complete({}, {"status": "ok", "report": {"x": 1}, "message": ""}) == {"x": 1}
    with pytest.raises(AirflowException, match="stuck last stable offset"):
        sensor.execute_complete({}, {"status": "stuck", "message": "table"})
    with pytest.raises(AirflowException, match="boom"):
        sensor.execute_complete({}, {"status": "error", "message": "boom"})


def test_event_carries_the_watch_state_and_hanging_after_serializes():
    trigger = LsoLagTrigger(topics=[T], mode="health", stuck_after=3, hanging_after=20)
    kwargs = trigger.serialize()[1]
    assert kwargs["hanging_after"] == 20 and kwargs["watch_state"]["hanging_after"] == 20
    report = trigger.watch.observe(0, {(T, 0): PartitionOffsets(4, 1)})
    payload = event_payload("health", "stuck", report, trigger.watch)
    again = LsoWatch.from_json(json.loads(json.dumps(payload["watch_state"])))
    assert again.to_stored(5)[0].stuck_for == 5 and again.hanging_after == 20
    assert event_payload("health", "stuck", report)["watch_state"] is None


def test_open_transaction_of_picks_the_producer_holding_the_lso():
    from airflow_provider_eos.hooks.kafka_transactions import open_transaction_of

    rows = [
        {"ProducerId": 1, "ProducerEpoch": 0, "CurrentTransactionStartOffset": None},
        {"ProducerId": 2, "ProducerEpoch": 3, "CurrentTransactionStartOffset": 40},
        {"ProducerId": 3, "ProducerEpoch": 1, "CurrentTransactionStartOffset": 17},
    ]
    assert open_transaction_of(rows, 40)["ProducerId"] == 2
    assert open_transaction_of(rows, 99)["ProducerId"] == 3  # the LSO moved: the oldest open one
    assert open_transaction_of(rows[:1], 0) is None


def test_sensor_hanging_failure_names_producer_and_abort(monkeypatch):
    from airflow_provider_eos.hooks import kafka_transactions

    monkeypatch.setattr(
        kafka_transactions.KafkaTransactionsHook, "describe_producers",
        lambda self, topic, partition: [{"ProducerId": 77, "ProducerEpoch": 2, "CurrentTransactionStartOffset": 1}],
    )
    watch = LsoWatch(stuck_after=1, hanging_after=5)
    watch.observe(0, {(T, 0): PartitionOffsets(4, 1)})
    report = watch.observe(6, {(T, 0): PartitionOffsets(4, 1)})
    pushed = {}

    class _Ti:
        def xcom_push(self, key, value):
            pushed[key] = value

    sensor = LastStableOffsetLagSensor(task_id="lso", topics=[T], kafka_config_id="k", hanging_after=5)
    with pytest.raises(AirflowException) as failure:
        sensor.execute_complete({"ti": _Ti()}, event_payload("health", "stuck", report))
    abort = {"action": "abort", "kafka_config_id": "k", "topic": T, "partition": 0, "start_offset": 1,
             "confirm_abort": True}
    assert pushed["eos_hanging"][0]["abort"] == abort
    assert pushed["eos_hanging"][0]["producer"]["producer_id"] == 77
    message = str(failure.value)
    assert "hanging transaction" in message and "producer id 77 epoch 2" in message
    assert json.dumps(abort) in message
