"""Issue 10, test 10: SIGKILL of the supervising process (the Airflow worker side,
not the driver) mid-stream, then the task's retry.

The supervisor runs in a child Python process, as in an Airflow worker; its
spark-submit runs in its own session, so when the supervisor is SIGKILLed the
driver lives on as an orphan, still holding the pipeline's running lock. The
retry starts a new driver, whose start bumps the pipeline's epoch: the orphan is
fenced, exits, and frees the running lock the new driver waits for. In the end:
one driver, no hang on the running lock, the supervisor's log says what
happened, and the target is exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from psycopg2 import sql

from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.state.supervisor_lock import supervisor_running
from spark_apps.eos_stream.state.control import ADVISORY_LOCK_HOLDERS_SQL, running_lock_key
from tests.integration.test_stream_operator import airflow_conns, make_pipeline  # noqa: F401 (fixtures)
from tests.streaming import ROOT, definition_of, ledger_rows, pg_connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
# The worker imports the provider and the app from here (its working directory comes first on
# its sys.path). Point it at another checkout to run the same test against other code, e.g.
# `git archive <commit> | tar -x -C DIR` for the numbers before a change.
WORKER_ROOT = Path(os.environ.get("EOS_TEST_WORKER_ROOT") or ROOT)

# The worker's task process: runs the operator's execute and prints its XCom.
CHILD = """
import json, sys
from airflow_provider_eos.operators.stream import StreamingPipelineOperator
op = StreamingPipelineOperator(task_id="run_pipeline", **json.loads(sys.argv[1]))
print("EOS-TEST-SUMMARY " + json.dumps(op.execute({}), default=str), flush=True)
"""


def _start_worker(args: dict[str, Any], log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        # Not a session of its own: the worker's process; spark-submit makes its own session.
        return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=WORKER_ROOT, env=dict(os.environ))


def _drivers(pipeline: str) -> list[psutil.Process]:
    """The live spark-submit JVMs of the pipeline (the hook names the app ``eos-<pipeline>``)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if (proc.info["status"] != psutil.STATUS_ZOMBIE and "org.apache.spark.deploy.SparkSubmit" in cmdline
                and f"eos-{pipeline}" in cmdline):
            found.append(proc)
    return found


def _running_lock_holders(stack: dict, pipeline: str) -> int:
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM ({}) holders").format(ADVISORY_LOCK_HOLDERS_SQL),
                        {"key": running_lock_key(pipeline)})
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def _wait(condition: Any, timeout: float, what: str, worker: subprocess.Popen, log_path: Path) -> float:
    started = time.monotonic()
    while not condition():
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited {worker.returncode} while waiting for {what}:\n"
                                 f"{log_path.read_text(errors='replace')[-4000:]}")
        if time.monotonic() - started > timeout:
            raise AssertionError(f"no {what} after {timeout:.0f}s:\n{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    return time.monotonic() - started


def test_sigkilled_supervisor_then_retry_ends_with_one_driver(make_pipeline, airflow_conns):  # noqa: F811
    started = time.monotonic()
    p = make_pipeline("wloss")
    stack, config = airflow_conns, p.config
    schema = config["target_schema"]
    p.produce(2000, seed=31, transactional_id=f"a{p.name}")
    args = {"definition": definition_of(config, stream={"trigger": "processingTime", "trigger_interval": "1 second",
                                                         "max_offsets_per_trigger": 1000}),
            "restart_backoff": 1, "max_restarts": 0, "driver_memory": "1g",
            "spark_conf": {"spark.sql.shuffle.partitions": "2"}}
    first_log, retry_log = p.tmp_path / "worker-first.log", p.tmp_path / "worker-retry.log"
    first = _start_worker(args, first_log)
    retry: subprocess.Popen | None = None
    try:
        _wait(lambda: ledger_rows(stack, schema) == 2000, 240, "2000 rows applied", first, first_log)
        (orphan,) = _drivers(p.name)
        first.send_signal(signal.SIGKILL)  # the worker dies; its driver does not
        assert first.wait(30) == -signal.SIGKILL
        time.sleep(3)
        assert orphan.is_running() and orphan.status() != psutil.STATUS_ZOMBIE, "the driver died with its worker"
        assert _running_lock_holders(stack, p.name) == 1, "the orphan holds the running lock"
        deadline = time.monotonic() + 30
        while supervisor_running(p.pg(), p.name) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not supervisor_running(p.pg(), p.name), "the supervisor lock dies with the worker's session"

        retry_started = time.monotonic()
        retry = _start_worker(args, retry_log)
        gone, _alive = psutil.wait_procs([orphan], timeout=150)
        assert gone, f"the orphan is still running 150s after the retry started:\n{retry_log.read_text()[-4000:]}"
        orphan_gone_s = time.monotonic() - retry_started
        p.produce(1000, seed=32, first_seq=2000, transactional_id=f"b{p.name}")
        caught_up_s = _wait(lambda: ledger_rows(stack, schema) == 3000, 240, "3000 rows applied", retry, retry_log)
        drivers = _drivers(p.name)
        holders = _running_lock_holders(stack, p.name)
        assert len(drivers) == 1 and drivers[0].pid != orphan.pid, drivers
        assert holders == 1

        stop = StopPipelineOperator(task_id="stop", pipeline_config=config, timeout_seconds=120, poll_interval=0.5,
                                    deferrable=False).execute({})
        assert retry.wait(60) == 0, retry_log.read_text(errors="replace")[-4000:]
    finally:
        for worker in (first, retry):
            if worker is not None and worker.poll() is None:
                worker.kill()
                worker.wait(30)
        for driver in _drivers(p.name):  # never leave a JVM behind, whatever failed
            try:
                os.killpg(driver.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    log = retry_log.read_text(errors="replace")
    (summary,) = [json.loads(line.split(" ", 1)[1]) for line in log.splitlines()
                  if line.startswith("EOS-TEST-SUMMARY ")]
    print(f"\norphan gone {orphan_gone_s:.1f}s after the retry started; caught up {caught_up_s:.1f}s later; "
          f"drivers at the end {len(drivers)}, running lock holders {holders}; retry {summary['status']}, "
          f"attempts {[a['reason'] for a in summary['attempts']]}, orphan {summary['orphan']}")
    assert stop["stopped"] is True and summary["status"] == "stopped", summary
    assert len(summary["attempts"]) == 1 and summary["restarts"] == 0, "the retry did not wait out the running lock"
    assert orphan_gone_s < 90, "the new driver's epoch bump must end the orphan well within its 60s lock wait"
    assert summary["orphan"] and summary["orphan"]["fenced_at_epoch"] is not None, summary
    assert "a driver without a supervisor holds the running lock" in log
    assert "was fenced and has exited; the new driver holds the running lock at epoch" in log
    report = p.audit()
    result, balances = report["summary"], report["aggregates"]["account_balances"]
    print(f"audit: committed {result['committed_records']}, missing {result['missing']}, duplicated "
          f"{result['duplicated']}, balances wrong {balances['keys_wrong']}; {time.monotonic() - started:.0f}s")
    assert report["ok"], report
    assert result["committed_records"] == 3000 and result["missing"] == 0 and result["duplicated"] == 0
    assert balances["keys_wrong"] == 0
