"""Issue 10, test 2: a recovery while the supervisor sleeps in its restart backoff.

The review's scenario: the recovery's stop step runs while the supervisor waits to
restart a crashed driver (no driver is connected); the recovery then rewinds the target;
a supervisor that read the stop request only before its backoff would restart the app
during the restore. Here the supervisor reads the stop request during its backoff and
ends without restarting; the stop step (whose "stopped" includes "no supervisor") waits
for exactly that, well within the backoff; the recovery's epoch bump would have fenced a
restarted driver anyway; and the replay ends exact."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from psycopg2 import sql

from airflow_provider_eos.operators.restore import RecoveryLockOperator
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.recovery.lock import recovery_hold
from spark_apps.eos_stream.state import fencing
from tests.integration.test_stream_operator import Watcher, airflow_conns, make_pipeline  # noqa: F401 (fixtures)
from tests.streaming import ledger_rows, pg_connect, start_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# The stop request ends it within BACKOFF_POLL_SECONDS (5 s), so a long one costs no time; long
# enough that the recovery steps (about 7 s) fit in it on a loaded machine too.
BACKOFF = 60.0
RECOVERY_RUN = "recovery-during-backoff"


def _rewind_partition_0(stack: dict, config: dict, to_offset: int) -> tuple[int, int]:
    """What a restore's swap does to one partition, in one transaction under the pipeline lock."""
    target, meta = sql.Identifier(config["target_schema"]), sql.Identifier(config["meta_schema"])
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            fencing.lock_pipeline(cur, config["pipeline"])
            cur.execute(sql.SQL("SELECT next_offset FROM {}.kafka_offsets WHERE pipeline = %s AND partition = 0")
                        .format(meta), (config["pipeline"],))
            (applied_to,) = cur.fetchone()
            cur.execute(sql.SQL(
                "UPDATE {t}.account_balances b SET balance_cents = b.balance_cents - d.amount,"
                " event_count = b.event_count - d.events FROM (SELECT account_id, sum(amount_cents) AS amount,"
                " count(*) AS events FROM {t}.ledger_events WHERE kafka_partition = 0 AND kafka_offset >= %s"
                " GROUP BY account_id) d WHERE b.account_id = d.account_id").format(t=target), (to_offset,))
            cur.execute(sql.SQL("DELETE FROM {t}.ledger_events WHERE kafka_partition = 0 AND kafka_offset >= %s")
                        .format(t=target), (to_offset,))
            removed = cur.rowcount
            cur.execute(sql.SQL("UPDATE {m}.kafka_offsets SET next_offset = %s WHERE pipeline = %s"
                                " AND partition = 0").format(m=meta), (to_offset, config["pipeline"]))
            cur.execute("COMMIT")
        return int(applied_to), removed
    finally:
        conn.close()


def test_restore_while_the_supervisor_is_in_restart_backoff(make_pipeline, airflow_conns):  # noqa: F811
    started = time.monotonic()
    p = make_pipeline("rbo")
    stack, config = airflow_conns, p.config
    p.produce(3000, seed=21, transactional_id=f"a{p.name}")
    watcher = Watcher(p.operator(trigger="processingTime", trigger_interval="1 second", max_offsets_per_trigger=1000,
                                 restart_backoff=BACKOFF, max_backoff=BACKOFF, max_restarts=2))
    watcher.start()
    recovery_lock = RecoveryLockOperator(task_id="lock", pipeline_config=config)
    try:
        first = watcher.live_hook(event="batch", timeout=240)
        deadline = time.monotonic() + 240
        while ledger_rows(stack, config["target_schema"]) < 3000 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ledger_rows(stack, config["target_schema"]) == 3000
        driver_epoch = first.events[[k for k, _ in first.events].index("resume")][1]["epoch"]

        os.killpg(first.pid, signal.SIGKILL)  # the driver dies; the supervisor sleeps BACKOFF seconds
        first.source._submit_sp.wait(30)  # the spark-submit of this run (its launcher's hook)
        killed_at = time.monotonic()

        # The recovery, step by step, all inside the supervisor's backoff.
        recovery_lock.execute({"run_id": RECOVERY_RUN})
        assert recovery_hold(p.pg(), p.name, config["target_schema"], 900) is not None  # the supervisor's key
        stop = StopPipelineOperator(task_id="stop", pipeline_config=config, timeout_seconds=60, poll_interval=0.5,
                                    deferrable=False).execute({"run_id": RECOVERY_RUN})
        assert stop["driver_running"] is False and stop["supervisor_running"] is False, stop
        assert stop["waited_s"] < BACKOFF, "the stop request ends the supervisor's backoff early"
        conn = pg_connect(stack)
        conn.autocommit = False
        fence_epoch = fencing.bump_epoch(conn, config["meta_schema"], p.name, by=RECOVERY_RUN, reason="restore")
        conn.close()
        applied_to, removed = _rewind_partition_0(stack, config, 200)
        assert applied_to > 1000 and removed > 800  # offsets count transaction markers too
        recovery_steps_s = time.monotonic() - killed_at
        assert recovery_steps_s < BACKOFF, f"the recovery steps took {recovery_steps_s:.1f}s, past the backoff"
        p.produce(500, seed=22, first_seq=3000, transactional_id=f"b{p.name}")

        # The replay: availableNow from the rewound offsets, under the recovery's stop request.
        # The supervisor's backoff ends while it runs.
        replay = start_app({**config, "ignore_stop_request": True}, p.tmp_path,
                           env_extra={"EOS_PG_PASSWORD": stack["EOS_PG_PASSWORD"]}, label="replay")
        watcher.join(BACKOFF + 90)
        assert not watcher.is_alive(), "the supervisor did not end after its backoff"
        supervisor_ended = time.monotonic() - killed_at
        replay_running = replay.process.poll() is None
        try:
            replay.wait(300)
        except subprocess.TimeoutExpired:
            replay.kill()
            raise AssertionError(f"the replay did not finish in 300s:\n{replay.log()[-3000:]}") from None
        replay_ended = time.monotonic() - killed_at
    finally:
        if watcher.is_alive():
            watcher.op.on_kill()
            watcher.join(60)
        RecoveryLockOperator(task_id="unlock", pipeline_config=config, action="release").execute(
            {"run_id": RECOVERY_RUN})

    assert watcher.error is None, watcher.error
    summary = watcher.result
    print(f"\nsupervisor: status {summary['status']}, {len(summary['attempts'])} attempt(s), restarts "
          f"{summary['restarts']}: {[a['reason'] for a in summary['attempts']]}; recovery steps "
          f"{recovery_steps_s:.1f}s; the supervisor ended {supervisor_ended:.1f}s after the kill (backoff "
          f"{BACKOFF:g}s, the replay {'still running' if replay_running else 'done'} then), the replay "
          f"{replay_ended:.1f}s after it")
    assert summary["status"] == "stopped", summary
    assert len(summary["attempts"]) == 1 and summary["restarts"] == 0, (
        f"the supervisor restarted the app during the restore: {summary['attempts']}")
    assert "SIGKILL" in summary["attempts"][0]["reason"]
    assert replay.process.returncode == 0, replay.log()[-3000:]
    replay_epoch = replay.events("resume")[0]["epoch"]
    # Had it restarted, its driver could not have written: every batch checks the epoch.
    assert driver_epoch < fence_epoch < replay_epoch, (driver_epoch, fence_epoch, replay_epoch)
    assert replay.events("resume")[0]["stored_offsets"].count('"0": 200') == 1  # replayed from the rewind
    report = p.audit()
    result, balances = report["summary"], report["aggregates"]["account_balances"]
    print(f"audit: committed {result['committed_records']}, missing {result['missing']}, duplicated "
          f"{result['duplicated']}, balances wrong {balances['keys_wrong']}; {time.monotonic() - started:.0f}s")
    assert report["ok"], report
    assert result["committed_records"] == 3500 and result["missing"] == 0 and result["duplicated"] == 0
    assert balances["keys_wrong"] == 0
