"""The provider's metrics (docs/metrics.md) reach a real StatsD listener: a UDP socket in this test,
set as Airflow's ``[metrics] statsd_host/statsd_port``, while a pipeline's own DAGs run on the real
stack with ``dag.test()``: its stream (rows per second, rows applied, dead letters per batch), a
snapshot and a real recovery (a timer per step), then its health check while a producer holds a
transaction open on partition 0 and the database holds a prepared transaction (LSO lag and seconds
stuck per partition, records behind, last batch age, new dead letters, in-doubt transactions).

The DAG runs happen in a fresh interpreter that initializes Airflow's Stats from ``[metrics]``
exactly as the task runner's ``main()`` does in a worker; every packet is read back from the socket."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from tests.conftest import ROOT
from tests.helpers.dag_test_process import end_process_group
from tests.integration.test_recovery_dag import _airflow_env
from tests.integration.test_stream_operator import airflow_conns, make_pipeline  # noqa: F401 - fixtures
from tests.streaming import pg_connect, write_definition

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# The task runner's stats initialization (airflow/sdk/execution_time/task_runner.py main()), then the
# runs; at "pause" it waits for a line on stdin (the test sets the next run's scene meanwhile).
DAG_RUNS = """
import json, sys
from airflow.sdk.configuration import conf
from airflow.sdk.observability import stats
from airflow.sdk.observability.metrics import stats_utils
stats.initialize(factory=stats_utils.get_stats_factory(),
                 export_legacy_names=conf.getboolean("metrics", "legacy_names_on"))
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
out = []
for entry in json.loads(sys.argv[2]):
    if entry == "pause":
        print("EOS-TEST-PAUSE " + json.dumps(out), flush=True)
        sys.stdin.readline()
        continue
    dag_id, run_conf = entry
    run = bag.get_dag(dag_id).test(run_conf=run_conf)
    out.append({"dag_id": dag_id, "state": str(run.state),
                "tasks": {ti.task_id: str(ti.state) for ti in run.get_task_instances()}})
print("EOS-TEST-RESULT " + json.dumps(out), flush=True)
"""


class StatsdListener(threading.Thread):
    """A StatsD server reduced to its socket: every ``name:value|type`` line it receives, in order."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._done = threading.Event()
        self._quiet = threading.Event()  # set by each receive that times out: nothing was waiting

    def run(self) -> None:
        while not self._done.is_set():
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                self._quiet.set()
                continue
            self.lines += data.decode().splitlines()  # the client may pack several lines per packet

    def drain(self, timeout: float = 30) -> None:
        """Returns once every datagram sent before the call has been read: a receive that times
        out after it found nothing waiting in the socket."""
        self._quiet.clear()
        assert self._quiet.wait(timeout), f"the StatsD socket did not go quiet within {timeout}s"

    def stop(self) -> None:
        self._done.set()
        self.join(5)
        self.sock.close()

    def received(self, prefix: str) -> dict[str, list[tuple[float, str]]]:
        """name -> [(value, type)] of every line whose name starts with ``prefix``."""
        out: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for line in self.lines:
            name, _, rest = line.partition(":")
            value, _, kind = rest.partition("|")
            if name.startswith(prefix):
                out[name].append((float(value), kind.split("|")[0]))
        return out


@pytest.fixture
def statsd() -> Any:
    listener = StatsdListener()
    listener.start()
    yield listener
    listener.stop()


def _metrics_env(stack: dict[str, str], config_dir: Path, store: Path, statsd_port: int) -> dict[str, str]:
    """The recovery tests' Airflow environment, with Airflow's StatsD client pointed at ``statsd_port``."""
    return {**_airflow_env(stack, config_dir, store), "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1", "AIRFLOW__METRICS__STATSD_PORT": str(statsd_port),
            "AIRFLOW__METRICS__STATSD_PREFIX": "airflow"}


class DagRuns:
    """The DAG runs of one interpreter (``DAG_RUNS``), read line by line (task logs included)."""

    def __init__(self, env: dict[str, str], runs: list[Any]) -> None:
        self.output: list[str] = []
        # A session of its own: what the interpreter forks (the OpenLineage listener's workers) goes
        # with it in close().
        self.process = subprocess.Popen([sys.executable, "-c", DAG_RUNS, str(ROOT / "dags"), json.dumps(runs)],
                                        env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def until(self, marker: str) -> list[dict[str, Any]]:
        """The runs' results printed with ``marker`` (``EOS-TEST-PAUSE`` or ``EOS-TEST-RESULT``)."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            if line.startswith(marker + " "):
                return list(json.loads(line.split(" ", 1)[1]))
        raise AssertionError(f"the DAG runs ended (exit {self.process.wait()}) before {marker}:\n"
                             + "".join(self.output[-80:]))

    def resume(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def close(self) -> None:
        """Lets the interpreter end by itself (after its last run it exits), then ends its process
        group: a process it forked and left behind would outlive the test (seen in CI: an
        OpenLineage listener worker, orphaned when the interpreter was killed right after its result)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(60)
        end_process_group(self.process)
        self.process.wait(30)


def _open_transaction(bootstrap: str, topic: str) -> subprocess.Popen:
    """A producer holding a transaction open on ``topic``[0] (tests/helpers/txn_producer.py)."""
    process = subprocess.Popen([sys.executable, "-m", "tests.helpers.txn_producer", bootstrap, topic, "0", "5",
                                "60000"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    ready = json.loads(process.stdout.readline() if process.stdout else "{}")
    assert ready.get("ready"), ready
    return process


def test_metrics_reach_statsd(make_pipeline, statsd, stack) -> None:  # noqa: F811 - imported fixture
    started = time.monotonic()
    p = make_pipeline("met")
    p.produce(300, malformed=2)
    config_dir = p.tmp_path / "pipelines"
    # replay_engine spark, not the default auto (direct for 300 records, a few hundred ms): a replay
    # step known to last more than a second tells the timer's milliseconds from seconds.
    write_definition({**p.config, "create_targets": True}, config_dir, stream={"replay_engine": "spark"},
                     health={"stuck_after": 2, "sensor_timeout": 6, "poke_interval": 1})
    env = _metrics_env(stack, config_dir, p.tmp_path / "store", statsd.port)
    name, topic = p.name, p.topic.replace(".", "__")
    base = f"airflow.eos.{name}"

    stream = [f"eos_stream__{name}", {"trigger": "availableNow", "max_restarts": 0}]
    recovery = [f"eos_recovery__{name}", {"snapshot": "latest", "resume": False}]
    check = [f"eos_health__{name}", {"max_age_seconds": 600, "prepared_older_than": 0}]
    runs = DagRuns(env, [stream, [f"eos_snapshot__{name}", {}], recovery, "pause", check])
    holder, conn, gid = None, pg_connect(stack), f"eos-test-metrics-{name}"
    try:
        first = runs.until("EOS-TEST-PAUSE")
        assert [r["state"] for r in first] == ["success"] * 3, first
        # Unhealthy on purpose: partition 0's LSO held by an open transaction, an in-doubt prepared
        # transaction in the target database, and the two malformed records as new dead letters.
        holder = _open_transaction(stack["EOS_KAFKA_BOOTSTRAP"], p.topic)
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("PREPARE TRANSACTION %s", (gid,))
        runs.resume()
        health = runs.until("EOS-TEST-RESULT")[-1]
    finally:
        runs.close()
        if holder is not None:
            holder.kill()
            holder.wait(10)
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", (gid,))
            if cur.fetchone():
                cur.execute("ROLLBACK PREPARED %s", (gid,))
        conn.close()
    assert health["state"] == "failed", health
    assert health["tasks"]["lso_lag"] == "failed" and health["tasks"]["summary"] == "failed", health
    statsd.drain()  # the sender has exited: its last datagrams are read

    # Airflow's own metrics arrived: the listener hears Airflow's StatsD client (else nothing below can).
    assert statsd.received(f"airflow.ti.finish.eos_stream__{name}.run_pipeline."), statsd.lines[-20:]
    got = statsd.received(base + ".")
    pg = pg_connect(stack)
    with pg.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events").format(sql.Identifier(p.config["target_schema"])))
        [[events]] = cur.fetchall()
    pg.close()

    part0, part1 = f"{base}.partition.{topic}.0", f"{base}.partition.{topic}.1"
    steps = ("lock", "stop_stream", "choose_snapshot", "retention_check", "restore", "replay", "audit", "finalize")
    expected = {f"{base}.{m}" for m in ("rows_per_second", "rows_applied", "dead_letters", "last_batch_age_seconds",
                                        "new_dead_letters", "in_doubt_transactions", "in_doubt_oldest_seconds")}
    expected |= {f"{part}.{m}" for part in (part0, part1) for m in ("lso_lag", "lso_stuck_seconds", "records_behind")}
    expected |= {f"{base}.recovery.{step}" for step in steps}
    # Every metric of the scheme arrived, and nothing else under the pipeline's name.
    assert set(got) == expected, {"missing": sorted(expected - set(got)), "unexpected": sorted(set(got) - expected)}

    # The stream: one gauge and two counters per batch.
    assert got[f"{base}.rows_per_second"] and all(v > 0 and k == "g" for v, k in got[f"{base}.rows_per_second"])
    assert sum(v for v, _ in got[f"{base}.rows_applied"]) == events == 300, got[f"{base}.rows_applied"]
    assert sum(v for v, _ in got[f"{base}.dead_letters"]) == 2 and {k for _, k in got[f"{base}.dead_letters"]} == {"c"}

    # The recovery: a timer (milliseconds) for each step that reports its duration.
    timers = {step: got[f"{base}.recovery.{step}"] for step in steps}
    assert all(len(v) == 1 and v[0][1] == "ms" and v[0][0] >= 0 for v in timers.values()), timers
    assert timers["replay"][0][0] > 1000  # a Spark app ran: more than a second

    # The health check, failed or passed, measured and sent.
    assert got[f"{part0}.lso_lag"] == [(5.0, "g")] and got[f"{part1}.lso_lag"] == [(0.0, "g")], got
    [(stuck, _)] = got[f"{part0}.lso_stuck_seconds"]
    assert stuck >= 2 and got[f"{part1}.lso_stuck_seconds"] == [(0.0, "g")]
    assert got[f"{part0}.records_behind"] == [(0.0, "g")] == got[f"{part1}.records_behind"]
    [(age, _)] = got[f"{base}.last_batch_age_seconds"]
    assert 0 <= age < 600
    assert got[f"{base}.new_dead_letters"] == [(2.0, "g")]
    [(in_doubt, _)] = got[f"{base}.in_doubt_transactions"]
    [(oldest, _)] = got[f"{base}.in_doubt_oldest_seconds"]
    assert in_doubt >= 1 and oldest > 0
    print(f"metrics test: {len(statsd.lines)} StatsD lines, {time.monotonic() - started:.0f}s")
