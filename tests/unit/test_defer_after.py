"""Every deferrable step checks in the worker before it defers (``base.poll_before_defer``): a
condition that already holds, or holds within ``defer_after``, is answered without a deferral,
so no trigger can fire before the deferring process has ended (apache/airflow#72716)."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_provider_eos.operators.base import poll_before_defer
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor
from airflow_provider_eos.utils.lso_watch import PartitionOffsets


class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_condition_that_holds_at_once_is_answered_in_the_worker_without_waiting() -> None:
    clock, calls = FakeClock(), []

    def check() -> str:
        calls.append(clock.now)
        return "stopped"

    assert poll_before_defer(check, lambda r: r == "stopped", 10, 2, clock, clock.sleep) == ("stopped", True)
    assert calls == [0.0] and clock.sleeps == []


def test_it_polls_until_the_condition_holds_or_the_seconds_are_up() -> None:
    clock = FakeClock()
    answers = iter([1, 2, 3])
    assert poll_before_defer(lambda: next(answers), lambda r: r == 3, 10, 2, clock, clock.sleep) == (3, True)
    assert clock.sleeps == [2, 2]

    clock, checks = FakeClock(), []
    result = poll_before_defer(lambda: checks.append(clock.now) or len(checks), lambda r: False, 5, 2, clock,
                               clock.sleep)
    assert result == (4, False) and checks == [0, 2, 4, 5]  # the last sleep is cut to what is left
    clock = FakeClock()
    assert poll_before_defer(lambda: "x", lambda r: False, 0, 2, clock, clock.sleep) == ("x", False)
    assert clock.sleeps == []  # defer_after=0: one check, then defer


def _caught_up_sensor(reports: list[dict[str, Any]], defer_after: float) -> StreamCaughtUpSensor:
    sensor = StreamCaughtUpSensor(task_id="caught_up", pipeline="p", topics=["t"], poke_interval=0.01, timeout=60,
                                  defer_after=defer_after, deferrable=True)
    answers = iter(reports)
    sensor.check = lambda: next(answers)  # type: ignore[method-assign]
    return sensor


def test_the_caught_up_sensor_returns_from_the_worker_when_caught_up_within_defer_after() -> None:
    behind, caught_up = {"ok": False, "message": "behind by 3"}, {"ok": True, "message": "caught up"}
    assert _caught_up_sensor([behind, caught_up], defer_after=5).execute({}) == caught_up
    with pytest.raises(TaskDeferred) as deferred:  # still behind after defer_after: the trigger waits
        _caught_up_sensor([behind, behind, behind], defer_after=0.015).execute({})
    assert 0 < deferred.value.trigger.timeout_seconds <= 60  # what is left of the sensor's timeout


class _Offsets:
    """A KafkaOffsetsHook that returns the given offsets, one observation after another."""

    def __init__(self, *observations: dict[tuple[str, int], PartitionOffsets]) -> None:
        self.observations = list(observations)

    def partition_offsets(self, topics: list[str], include_earliest: bool = False) -> dict:
        return self.observations.pop(0) if len(self.observations) > 1 else self.observations[0]


def _gate(hook: _Offsets, defer_after: float) -> LastStableOffsetLagSensor:
    sensor = LastStableOffsetLagSensor(task_id="gate", topics=["t"], watch_mode="gate", poke_interval=0.01,
                                       timeout=60, defer_after=defer_after, deferrable=True)
    sensor.__dict__["hook"] = hook  # the cached_property's slot
    return sensor


def test_the_gate_opens_in_the_worker_when_no_partition_is_stuck() -> None:
    clear = {("t", 0): PartitionOffsets(high_watermark=10, last_stable=10)}
    report = _gate(_Offsets(clear), defer_after=5).execute({})
    assert report["partitions"][0]["lag"] == 0
    # A live producer: lag on every observation, but the LSO moves between two of them.
    moving = _gate(_Offsets({("t", 0): PartitionOffsets(12, 10)}, {("t", 0): PartitionOffsets(15, 13)}), 5)
    assert moving.execute({}) is not None


def test_a_gate_still_waiting_defers_the_same_watch_with_the_same_deadline() -> None:
    held = {("t", 0): PartitionOffsets(high_watermark=12, last_stable=10)}
    sensor = _gate(_Offsets(held), defer_after=0.015)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert trigger.deadline == sensor._deadline and trigger.watch.to_json() == sensor._watch.to_json()
