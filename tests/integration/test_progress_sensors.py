"""Liveness and caught-up sensors and triggers against the real stack: liveness passes on a
fresh progress row and times out (with the row's age) on a stale one; caught-up reports the
lag before a run and passes after an availableNow run."""

from __future__ import annotations

import asyncio
import time

import pytest
from airflow.sdk.exceptions import AirflowSensorTimeout, TaskDeferred
from psycopg2 import sql

from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor, StreamLivenessSensor
from airflow_provider_eos.state.meta import ensure_meta_tables
from airflow_provider_eos.triggers.stream_progress import StreamCaughtUpTrigger, StreamLivenessTrigger
from tests.integration.test_stream_operator import airflow_conns, make_pipeline  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _first_event(trigger, timeout: float = 60):
    async def first():
        return await asyncio.wait_for(trigger.run().__anext__(), timeout)

    return asyncio.run(first()).payload


def _insert_progress(p, age_seconds: float, batch_id: int) -> None:
    hook = p.pg()
    ensure_meta_tables(hook, )
    with hook.cursor() as cur:
        cur.execute(
            sql.SQL("INSERT INTO {}.stream_progress (pipeline, run_id, batch_id, input_rows, recorded_at)"
                    " VALUES (%s, 'test-run', %s, 7, now() - make_interval(secs => %s))").format(
                sql.Identifier(p.config["meta_schema"])),
            (p.name, batch_id, age_seconds),
        )


def test_liveness_fresh_passes_stale_times_out(make_pipeline):  # noqa: F811 - imported fixture
    p = make_pipeline("live")
    kwargs = {"pipeline": p.name, "meta_schema": p.config["meta_schema"], "max_age_seconds": 60}
    # Never ran: no progress row at all.
    never = StreamLivenessTrigger(poke_interval=0.2, timeout_seconds=0.5, **kwargs)
    assert _first_event(never)["status"] == "timeout"

    _insert_progress(p, age_seconds=3600, batch_id=0)
    poke = StreamLivenessSensor(task_id="live_poke", deferrable=False, poke_interval=0.5, timeout=2, **kwargs)
    with pytest.raises(AirflowSensorTimeout, match=r"recorded 36[0-9][0-9]s ago"):
        poke.execute({})
    # One check in the worker (defer_after=0), then the wait in the trigger.
    deferring = StreamLivenessSensor(task_id="live_defer", poke_interval=0.5, timeout=4, defer_after=0, deferrable=True,
                                     **kwargs)
    started = time.monotonic()
    with pytest.raises(TaskDeferred) as deferred:
        deferring.execute({})
    in_worker = time.monotonic() - started
    trigger = deferred.value.trigger
    # What is left of its timeout after the check in the worker, however long that check took.
    assert isinstance(trigger, StreamLivenessTrigger) and 4 - in_worker <= trigger.timeout_seconds < 4
    event = _first_event(type(trigger)(**trigger.serialize()[1]))  # round trip through its JSON kwargs
    assert event["status"] == "timeout" and event["report"]["age_seconds"] >= 3600
    with pytest.raises(AirflowSensorTimeout, match="liveness not satisfied"):
        deferring.execute_complete({}, event)

    _insert_progress(p, age_seconds=0, batch_id=1)
    assert _first_event(StreamLivenessTrigger(poke_interval=0.2, timeout_seconds=5, **kwargs))["status"] == "ok"
    report = StreamLivenessSensor(task_id="live_ok", deferrable=True, **kwargs).execute({})  # passes without deferring
    assert report["ok"] and report["last_progress"]["batch_id"] == 1


def test_caught_up_reports_lag_then_passes_after_a_run(make_pipeline):  # noqa: F811 - imported fixture
    p = make_pipeline("caught")
    p.produce(600, abort_every=3)
    kwargs = {"pipeline": p.name, "topics": [p.topic], "meta_schema": p.config["meta_schema"]}
    before = StreamCaughtUpSensor(task_id="before", deferrable=False, poke_interval=0.5, timeout=1, **kwargs)
    with pytest.raises(AirflowSensorTimeout, match="partitions behind"):
        before.execute({})
    lag = before.last_report
    assert lag is not None and lag["total_lag"] >= 600 and all(p_["never_stored"] for p_ in lag["partitions"])
    event = _first_event(StreamCaughtUpTrigger(poke_interval=0.2, timeout_seconds=0.5, **kwargs))
    assert event["status"] == "timeout" and event["report"]["total_lag"] == lag["total_lag"]

    summary = p.operator().execute({})
    assert summary["rows_applied"] == 600

    event = _first_event(StreamCaughtUpTrigger(poke_interval=0.2, timeout_seconds=10, **kwargs))
    assert event["status"] == "ok", event
    assert event["report"]["total_lag"] == 0  # stored offsets reach the LSO, markers included
    report = StreamCaughtUpSensor(task_id="after", deferrable=True, **kwargs).execute({})
    assert report["ok"] and {x["lag"] for x in report["partitions"]} == {0}
