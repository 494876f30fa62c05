"""The running lock against the real stack: it tells a connected driver from a
stopped one exactly, keeps a second driver out, and lets the recovery's stop
step return as soon as the driver is gone."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from spark_apps.eos_stream.state.control import AlreadyRunning, driver_running, hold_running_lock
from spark_apps.eos_stream.state.fencing import EXIT_FENCED
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.integration.test_snapshot_restore import PG_CONN, connections_env
from tests.streaming import pg_connect, pipeline_config, start_app

pytestmark = pytest.mark.integration


def test_running_lock_keeps_a_second_driver_out(stack: dict, unique_name: str) -> None:
    pipeline = f"lock{unique_name}"
    first, second, observer = pg_connect(stack), pg_connect(stack), pg_connect(stack)
    try:
        assert not driver_running(observer, pipeline)
        hold_running_lock(first, pipeline)
        assert driver_running(observer, pipeline)
        started = time.monotonic()
        with pytest.raises(AlreadyRunning, match=f"another driver of pipeline '{pipeline}'"):
            hold_running_lock(second, pipeline, wait_seconds=1.0)
        assert 0.9 < time.monotonic() - started < 10
        first.close()  # the driver's process ends: its session, and the lock, with it
        hold_running_lock(second, pipeline, wait_seconds=10.0)
        assert driver_running(observer, pipeline)
    finally:
        for conn in (first, second, observer):
            conn.close()


def test_stop_step_returns_when_the_driver_is_gone(stack: dict, tmp_path: Path, unique_name: str) -> None:
    from airflow_provider_eos.operators.stop import StopPipelineOperator
    from tests.helpers.deferral import run_deferrable

    os.environ.update(connections_env(stack))
    config = pipeline_config(stack, tmp_path, f"stop{unique_name}", trigger="processingTime",
                             trigger_interval="1 second")
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=2)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 500, topic=config["topics"][0], seed=3,
                   transactional_id=f"s{unique_name}")
    config_file = tmp_path / "pipeline.json"
    config_file.write_text(json.dumps(config))
    run = start_app(config, tmp_path, label="continuous")
    try:
        deadline = time.monotonic() + 180
        while not run.events("batch") and run.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert run.events("batch"), run.log()[-3000:]
        observer = pg_connect(stack)
        assert driver_running(observer, config["pipeline"])  # idle between batches, still running
        observer.close()
        started = time.monotonic()
        stop = StopPipelineOperator(task_id="stop", pipeline_config=str(config_file), postgres_conn_id=PG_CONN,
                                    fence=True, timeout_seconds=120, poll_interval=0.5, deferrable=True)
        activity, _deferred = run_deferrable(stop, {"run_id": "stop-test"})
        took = time.monotonic() - started
        assert activity["driver_running"] is False and activity["stop_requested_at"]
        # The stop step also bumps the epoch (a stop for recovery fences): the driver ends at a
        # batch boundary, fenced (3) if it sees the new epoch first, else stopped (0).
        assert run.process.wait(timeout=60) in (0, EXIT_FENCED), run.log()[-3000:]
        assert activity["epoch"] > run.events("resume")[0]["epoch"]
        print(f"stop step returned {took:.1f}s after the request")
    finally:
        if run.process.poll() is None:
            run.kill()


def test_a_deferred_stop_keeps_the_recovery_lock_and_fails_if_it_is_taken_over(stack: dict, tmp_path: Path,
                                                                             unique_name: str) -> None:
    """The recovery's stop waits in the triggerer, where no worker heartbeats the recovery lock:
    the trigger does, and fails the step when another run has taken the lock over. A driver is
    stood in for by a session holding the pipeline's running lock (what the app holds at start)."""
    from psycopg2 import sql

    from airflow_provider_eos.operators.restore import RecoveryLockOperator
    from airflow_provider_eos.operators.stop import StopPipelineOperator
    from airflow_provider_eos.recovery.lock import lock_table
    from tests.helpers.deferral import run_deferrable

    os.environ.update(connections_env(stack))
    config = pipeline_config(stack, tmp_path, f"dstop{unique_name}")
    run = {"run_id": f"recovery-{unique_name}"}
    RecoveryLockOperator(task_id="lock", pipeline_config=config, postgres_conn_id=PG_CONN).execute(run)
    driver, admin = pg_connect(stack), pg_connect(stack)
    admin.autocommit = True
    try:
        hold_running_lock(driver, config["pipeline"])
        stop = StopPipelineOperator(task_id="stop", pipeline_config=config, postgres_conn_id=PG_CONN, fence=True,
                                    hold_lock=True, timeout_seconds=60, poll_interval=0.5, defer_after=0,
                                    deferrable=True)
        with admin.cursor() as cur:
            cur.execute(sql.SQL("SELECT heartbeat_at FROM {}").format(lock_table(config["meta_schema"])))
            (beat_before,) = cur.fetchone()

        # The driver goes away 3 s into the deferred wait (counted from the deferral, not from
        # before the step: a slow step would otherwise find it gone and not defer at all): the
        # wait ends, its lock still this run's.
        import threading

        result, deferred = run_deferrable(stop, run, timeout=60,
                                          on_defer=lambda: threading.Timer(3.0, driver.close).start())
        assert deferred and result["driver_running"] is False and result["epoch"] >= 1, result
        with admin.cursor() as cur:
            cur.execute(sql.SQL("SELECT holder, heartbeat_at FROM {}").format(lock_table(config["meta_schema"])))
            holder, beat_after = cur.fetchone()
        assert holder == run["run_id"] and beat_after > beat_before, "the trigger kept the lock's heartbeat"

        # Another run takes the lock over while this run's stop waits: the step fails.
        driver = pg_connect(stack)
        hold_running_lock(driver, config["pipeline"])
        take_over = threading.Timer(2.0, lambda: admin.cursor().execute(
            sql.SQL("UPDATE {} SET holder = 'another-run'").format(lock_table(config["meta_schema"]))))
        with pytest.raises(Exception, match="taken over by another run"):
            run_deferrable(stop, run, timeout=60, on_defer=take_over.start)
    finally:
        driver.close()
        admin.close()
