"""The main job: every promise of the project, on one machine, through Airflow.

Starts the local stack and Airflow's real services (api-server, scheduler,
dag-processor, triggerer), then drives the DAGs through the REST API:

 1. produce ledger events transactionally (with aborted batches and a poison record);
 2. start ``eos_stream__ledger`` and SIGKILL its Spark driver once mid-stream;
 3. leave an open transaction behind a killed producer; ``eos_health__ledger`` catches the stuck LSO;
    the producer's successor (same transactional.id) fences it and the transaction aborts;
 4. snapshot with ``eos_snapshot__ledger``, keep streaming, then damage the target;
 5. ``eos_recovery__ledger`` restores, replays from the snapshot's offsets, audits and resumes,
    while a producer keeps committing ledger events (a live topic, the normal case);
 6. a final audit against Kafka, a report on the terminal and in HTML.

A second pipeline of another shape, ``orders`` (spark_apps/orders: order lines and sales per
(sku, store)), streams through its own ``eos_stream__orders`` the whole time, undisturbed by
the ledger's crash, hanging transaction and recovery, and is audited exactly at the end. A
feed commits order lines every 2 s, so the report can show that the orders stream committed
batches while the ledger's recovery held the ledger stopped, with the same DAG run and the
same Spark driver before and after.

    .venv/bin/python -m demo.story                   (what `make demo` runs: Spark on local[*])
    .venv/bin/python -m demo.story --spark-cluster   (`make demo SPARK=cluster`: on the local
        standalone cluster of `scripts/stack.sh start-spark`, which it starts; spark_default points
        at its master, so both streams and the recovery's replay run there, one core each)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg2
from confluent_kafka import Producer
from psycopg2 import sql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airflow_provider_eos.links.spark_ui import SparkDriverUILink  # noqa: E402
from demo import report as html_report  # noqa: E402
from demo.airflow_api import AirflowApi  # noqa: E402
from demo.console import Console, failure_summary, print_report, quiet_console, save_task_log  # noqa: E402
from demo.env_files import STATE_DIR, read_env_file  # noqa: E402
from demo.feed import Feed  # noqa: E402
from spark_apps.eos_stream.audit.oracle import audit  # noqa: E402
from spark_apps.eos_stream.kafka.client_logs import with_python_logging  # noqa: E402
from spark_apps.eos_stream.run.config import PipelineConfig, PostgresTarget  # noqa: E402
from spark_apps.ledger.generator import ProduceSummary, ensure_topic, produce_ledger  # noqa: E402
from spark_apps.ledger.spec import LEDGER  # noqa: E402
from spark_apps.orders.generator import OrdersSummary, produce_orders  # noqa: E402
from spark_apps.orders.spec import LINES_TABLE, ORDERS, SALES_TABLE  # noqa: E402

PIPELINE = "ledger"
TOPIC = "ledger.events"
META, TARGET = "eos", "public"
# The ledger's DAGs, built by the DAG factory from .local/pipelines/ledger.yaml (scripts/airflow.sh).
STREAM, STOP, HEALTH, SNAPSHOT, RECOVERY = (f"eos_{kind}__{PIPELINE}"
                                           for kind in ("stream", "stop", "health", "snapshot", "recovery"))
# The second pipeline (.local/pipelines/orders.yaml): its stream and stop DAGs are the ones used.
ORDERS_PIPELINE, ORDERS_TOPIC = "orders", "orders.events"
ORDERS_META, ORDERS_TARGET = "orders_eos", "orders"
ORDERS_STREAM, ORDERS_STOP = f"eos_stream__{ORDERS_PIPELINE}", f"eos_stop__{ORDERS_PIPELINE}"
SPARK_UI_LINK = SparkDriverUILink.name
# dags/eos_downstream_example.py: scheduled on the ledger's target assets; unpausing it starts the
# pipeline's committed-offsets watcher on the triggerer.
DOWNSTREAM = f"eos_example_downstream__{PIPELINE}"
DAGS = [STREAM, STOP, HEALTH, SNAPSHOT, RECOVERY, ORDERS_STREAM, ORDERS_STOP, DOWNSTREAM]
# Unpaused just before first use: unpausing a scheduled DAG starts a run for its latest interval.
UNPAUSE_AT_START = [STREAM, STOP, HEALTH, RECOVERY, ORDERS_STREAM, ORDERS_STOP, DOWNSTREAM]

OPEN_TRANSACTION_RECORDS = 20
# Where the console's log (stderr, Python logging, librdkafka) and failed tasks' logs go.
CONSOLE_LOG = STATE_DIR / "demo" / "story.log"
TASK_LOGS = STATE_DIR / "demo" / "task-logs"
# Committed just before the driver's SIGKILL, so that it dies with work in hand.
KILL_BURST = 1000
# The producer killed inside its transaction, and the successor that fences it.
KILLED_PRODUCER = "demo-killed-producer"
OPEN_TRANSACTION = """
import sys
from confluent_kafka import Producer
p = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[4],
              "transaction.timeout.ms": int(sys.argv[3])})
p.init_transactions(30)
p.begin_transaction()
for i in range(20):  # OPEN_TRANSACTION_RECORDS
    p.produce(sys.argv[2], key=b"acct-00001", value=b'{"event_id": "never", "account_id": "acct-00001",'
              b' "amount_cents": 999999, "ts": "2026-01-01T00:00:00+00:00", "seq": -1}', partition=i % 4)
p.flush(30)
print("OPEN", flush=True)
import time; time.sleep(3600)
"""


class LsoSampler(threading.Thread):
    """Samples HW - LSO per partition of every demo topic each second, for the report's plot."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        super().__init__(daemon=True)
        from confluent_kafka.admin import AdminClient

        self.admin = AdminClient(with_python_logging({"bootstrap.servers": bootstrap}))
        self.topics = topics
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.started = time.monotonic()
        self.stop_event = threading.Event()

    def latest(self, committed: bool, topic: str = TOPIC) -> dict[int, int]:
        """Latest offset per partition: the LSO when ``committed``, else the high watermark."""
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        partitions = self.admin.list_topics(topic, timeout=10).topics[topic].partitions
        request = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
        level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
        result = self.admin.list_offsets(request, isolation_level=level)
        return {tp.partition: result[tp].result().offset for tp in request}

    def lag(self, topic: str = TOPIC) -> dict[int, int]:
        hw, lso = self.latest(committed=False, topic=topic), self.latest(committed=True, topic=topic)
        return {partition: hw[partition] - lso.get(partition, hw[partition]) for partition in hw}

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            for topic in self.topics:
                try:
                    for partition, lag in self.lag(topic).items():
                        self.samples.setdefault(f"{topic}[{partition}]", []).append(
                            (time.monotonic() - self.started, lag))
                except Exception:  # a sample missed while the broker is busy is not worth failing the demo
                    continue


def orders_feed(bootstrap: str, lines_per_tick: int) -> Feed:
    """Keeps order lines flowing for the whole story, so the orders stream has work to commit
    while the ledger crashes, hangs and is recovered. Every other transaction aborts."""
    return Feed(lambda tick: produce_orders(
        bootstrap, lines_per_tick, topic=ORDERS_TOPIC, orders_per_transaction=20, abort_every=2,
        seed=3000 + tick, first_seq=tick * 1_000_000, transactional_id="demo-orders-feed"), name="orders feed")


@dataclass
class Recovery:
    """The recovery stage's part of the report."""

    # The recovery DAG's tasks and their seconds, in the order they ran.
    steps: list[tuple[str, float]]
    # What the ledger feed committed while the recovery ran.
    during: list[ProduceSummary]
    # What the orders stream did while the recovery held the ledger stopped.
    orders_through: dict[str, Any]


class Story:
    def __init__(self, events: int, open_txn_timeout_ms: int, spark_cluster: bool = False) -> None:
        self.events = events
        self.open_txn_timeout_ms = open_txn_timeout_ms
        self.spark_cluster = spark_cluster
        self.console = Console(total=18)
        self.timings: dict[str, float] = {}
        self.runs: dict[str, str] = {}
        self.deferred: set[str] = set()
        # dag_id -> failed task -> the end of its log, for each run that failed
        self.failure_logs: dict[str, dict[str, str]] = {}
        # dag_id -> failed task -> why, in one line, and where its whole log is
        self.failures: dict[str, dict[str, str]] = {}
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())

    # ---------------------------------------------------------------- helpers
    def sh(self, *command: str, env: dict[str, str] | None = None) -> None:
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                       env=None if env is None else {**os.environ, **env})

    def db(self):
        conn = psycopg2.connect(host=self.stack["EOS_PG_HOST"], port=self.stack["EOS_PG_PORT"],
                                dbname=self.stack["EOS_PG_DB"], user=self.stack["EOS_PG_USER"],
                                password=self.stack["EOS_PG_PASSWORD"])
        conn.autocommit = True
        return conn

    def query(self, statement: sql.Composable | str, params: tuple = ()) -> list[tuple]:
        conn = self.db()
        try:
            with conn.cursor() as cur:
                cur.execute(statement, params)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def wait_until(self, what: str, condition, budget: float) -> float:
        started = time.monotonic()
        while not condition():
            elapsed = time.monotonic() - started
            if elapsed > budget:
                self.console.done_waiting()
                raise TimeoutError(f"gave up waiting for {what} after {budget:.0f}s")
            self.console.waiting(what, elapsed, budget)
            time.sleep(1)
        self.console.done_waiting()
        return time.monotonic() - started

    def run_dag(self, dag_id: str, conf: dict[str, Any], budget: float, expect: str = "success") -> str:
        run_id = self.api.trigger(dag_id, conf)

        def tick(elapsed: float) -> None:
            # A deferrable sensor shows as 'deferred' while its trigger runs on the triggerer. Any
            # run of the DAG counts: a scheduled run that started first does the watching (the
            # triggered one, queued behind it by max_active_runs=1, then resumes its finding).
            for ti in self.api.deferred_tasks(dag_id):
                self.deferred.add(f"{dag_id}.{ti['task_id']}")
            self.console.waiting(f"{dag_id} running", elapsed, budget)

        state = self.api.wait(dag_id, run_id, budget, tick=tick)
        self.console.done_waiting()
        self.runs[f"{dag_id} ({run_id})"] = state
        logs: dict[str, list[str]] = {}  # this run's failed tasks -> their logs
        if state == "failed":
            failed = [ti for ti in self.api.task_instances(dag_id, run_id) if ti["state"] == "failed"]
            logs = {ti["task_id"]: self.task_log(dag_id, run_id, ti) for ti in failed}
            # For the report (one line and a path each) and --json (the whole text).
            self.failure_logs[dag_id] = {task: "\n".join(lines) for task, lines in logs.items()}
            self.failures[dag_id] = {
                task: f"{failure_summary(lines)} (log: {save_task_log(TASK_LOGS, dag_id, task, lines)})"
                for task, lines in logs.items()}
        if state != expect:
            tails = "".join(f"\n--- {task}: last 60 lines\n" + "\n".join(lines[-60:]) for task, lines in logs.items())
            raise RuntimeError(f"{dag_id} ended {state}, expected {expect} (failed tasks: {list(logs)}){tails}")
        return run_id

    def task_log(self, dag_id: str, run_id: str, ti: dict[str, Any]) -> list[str]:
        """A failed task's log, read through Airflow's API: a failure in CI says why without the
        deployment's files."""
        try:
            return self.api.task_log(dag_id, run_id, ti["task_id"], ti["try_number"])
        except Exception as exc:  # the run's failure is the news; a log that cannot be read only says so
            return [f"(its log could not be read: {exc})"]

    def spark_ui_of(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """The stream task's "Spark driver UI" link, read through Airflow's API while the
        task runs, and whether the driver's UI answers there."""
        link = None

        def linked() -> bool:
            nonlocal link
            link = self.api.extra_links(dag_id, run_id, "run_pipeline").get(SPARK_UI_LINK) or None
            return link is not None

        self.wait_until(f"{dag_id}'s Spark UI link", linked, 120)
        assert link is not None
        try:
            with urllib.request.urlopen(f"{link.rstrip('/')}/StreamingQuery/", timeout=10) as response:
                serves = response.status == 200 and "Streaming Query" in response.read().decode(errors="replace")
        except OSError:
            serves = False
        return {"link": link, "serves": serves}

    def orders_batches(self) -> int:
        """Batches the orders pipeline committed so far."""
        if self.query("SELECT to_regclass(%s)", (f"{ORDERS_META}.stream_progress",))[0][0] is None:
            return 0
        rows = self.query(sql.SQL("SELECT count(*) FROM {}.stream_progress WHERE pipeline = %s").format(
            sql.Identifier(ORDERS_META)), (ORDERS_PIPELINE,))
        return int(rows[0][0])

    def orders_through_recovery(self, recovery: str, instances: list[dict[str, Any]],
                                drivers_before: set[int]) -> dict[str, Any]:
        """What the orders stream did while the ledger was stopped by its recovery (from the ledger's
        ``stop_stream`` to its ``resume_stream``): it kept its run and driver and kept committing."""
        tasks = {ti["task_id"]: ti for ti in instances}
        down_from = tasks["stop_stream"]["start_date"]
        down_to = (tasks.get("resume_stream") or {}).get("end_date") or self.api.run(RECOVERY, recovery)["end_date"]
        batches, rows, seconds = self.query(sql.SQL(
            "SELECT count(*) FILTER (WHERE input_rows > 0), coalesce(sum(input_rows), 0),"
            " extract(epoch FROM %s::timestamptz - %s::timestamptz)"
            " FROM {}.stream_progress WHERE pipeline = %s AND recorded_at BETWEEN %s AND %s").format(
            sql.Identifier(ORDERS_META)), (down_to, down_from, ORDERS_PIPELINE, down_from, down_to))[0]
        runs = [r["dag_run_id"] for r in self.api.recent_runs(ORDERS_STREAM)
                if (r.get("start_date") or "") >= self.started_at]
        drivers_after = {process.pid for process in self.spark_drivers(ORDERS_PIPELINE)}
        return {
            "ledger_stopped_s": round(float(seconds), 1),
            "batches_while_ledger_stopped": int(batches),
            "records_while_ledger_stopped": int(rows),
            "stream_runs": len(runs),
            "stream_run_state_after": self.api.run_state(ORDERS_STREAM, self.orders_run),
            "same_driver": bool(drivers_before) and drivers_before == drivers_after,
        }

    def orders_caught_up(self) -> bool:
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import AdminClient, OffsetSpec

        if self.query("SELECT to_regclass(%s)", (f"{ORDERS_META}.kafka_offsets",))[0][0] is None:
            return False
        admin = AdminClient(with_python_logging({"bootstrap.servers": self.stack["EOS_KAFKA_BOOTSTRAP"]}))
        partitions = admin.list_topics(ORDERS_TOPIC, timeout=10).topics[ORDERS_TOPIC].partitions
        request = {TopicPartition(ORDERS_TOPIC, p): OffsetSpec.latest() for p in partitions}
        result = admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED)
        stored = self.stored_offsets(ORDERS_META, ORDERS_PIPELINE)
        return all(stored.get((ORDERS_TOPIC, tp.partition), -1) >= result[tp].result().offset for tp in request)

    def stored_offsets(self, meta: str, pipeline: str) -> dict[tuple[str, int], int]:
        """The pipeline's stored next offset per (topic, partition)."""
        return {(t, p): o for t, p, o in self.query(
            sql.SQL("SELECT topic, partition, next_offset FROM {}.kafka_offsets WHERE pipeline = %s").format(
                sql.Identifier(meta)), (pipeline,))}

    def caught_up(self) -> bool:
        if not self.meta_ready():
            return False
        stored = self.stored_offsets(META, PIPELINE)
        lso = self.lso()
        return bool(lso) and all(stored.get((TOPIC, p), -1) >= offset for p, offset in lso.items())

    def lso(self) -> dict[int, int]:
        return self.sampler.latest(committed=True)

    def meta_ready(self) -> bool:
        """The app creates its bookkeeping tables when it first starts."""
        return self.query("SELECT to_regclass(%s)", (f"{META}.stream_progress",))[0][0] is not None

    def progress_runs(self) -> int:
        if not self.meta_ready():
            return 0
        rows = self.query(sql.SQL("SELECT count(DISTINCT run_id) FROM {}.stream_progress WHERE pipeline = %s").format(
            sql.Identifier(META)), (PIPELINE,))
        return int(rows[0][0]) if rows else 0

    def stream_runs(self) -> list[str]:
        return [r["dag_run_id"] for r in self.api.recent_runs(STREAM)
                if (r.get("start_date") or "") >= self.started_at]

    def spark_drivers(self, pipeline: str = PIPELINE) -> list[psutil.Process]:
        """The pipeline's Spark drivers: spark-submit names its application ``eos-<pipeline>``."""
        found = []
        for process in psutil.process_iter(["cmdline", "name"]):
            cmdline = process.info["cmdline"] or []
            if ("java" in (process.info["name"] or "") and "eos_stream/app.py" in " ".join(cmdline)
                    and f"eos-{pipeline}" in cmdline):
                found.append(process)
        return found

    # ---------------------------------------------------------------- the story
    def run(self) -> dict[str, Any]:
        """The story's stages in order (each section prints its own), then the report of both pipelines."""
        airflow_env = self.start()
        bootstrap = self.stack["EOS_KAFKA_BOOTSTRAP"]
        produced = self.produce(bootstrap)
        orders_produced, feed = self.start_orders(bootstrap)
        self.start_ledger()
        burst = self.kill_the_driver(bootstrap)
        more = self.hang_a_transaction(bootstrap)
        later = self.snapshot_then_produce(bootstrap)
        damaged = self.damage_the_target()
        recovery = self.recover(bootstrap)
        final = self.audit_the_ledger()
        orders_final = self.audit_and_stop_orders(feed, orders_produced)
        self.stop_the_ledger()
        assets, lineage = self.airflow_views(airflow_env)
        self.wait_for_stream_runs()
        result = self.ledger_result(final, damaged, (produced, burst, more, later, *recovery.during), recovery.steps)
        result["orders"] = self.orders_result(orders_final, orders_produced, recovery.orders_through)
        result["exact"] = final["ok"] and orders_final["ok"]
        result["assets"] = assets
        result["lineage"] = lineage
        result["spark"] = {"master": self.spark_master, "applications": self.cluster_applications(),
                           "driver_ui": self.spark_ui}
        self.write_html(result, recovery.steps)
        return result

    # ---------------------------------------------------------------- its sections
    def start(self) -> dict[str, str]:
        """Starts the stack and Airflow's services, waits for the DAGs, starts from a clean slate.

        :returns: airflow.env's settings."""
        c = self.console
        c.stage("starting the local stack (Kafka KRaft, PostgreSQL" + (", a Spark standalone master and worker"
                if self.spark_cluster else "") + ") and Airflow (api-server, scheduler, dag-processor, triggerer)")
        self.sh("bash", "scripts/stack.sh", "start")
        if self.spark_cluster:
            self.sh("bash", "scripts/stack.sh", "start-spark")
        # A fresh start, so the services read the current airflow.env (spark_default: local[*] or the master).
        self.sh("bash", "scripts/airflow.sh", "stop")
        self.sh("bash", "scripts/airflow.sh", "start",
                env={"EOS_SPARK_MASTER": "cluster" if self.spark_cluster else "local"})
        self.stack = read_env_file(STATE_DIR / "stack.env")
        airflow_env = read_env_file(STATE_DIR / "airflow.env")
        spark_conn = json.loads(airflow_env["AIRFLOW_CONN_SPARK_DEFAULT"])
        self.spark_master = spark_conn["host"] + (f":{spark_conn['port']}" if spark_conn.get("port") else "")
        self.started_ms = int(time.time() * 1000)
        passwords_file = Path(airflow_env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
        password = json.loads(passwords_file.read_text())["admin"]
        self.ui = airflow_env["AIRFLOW__API__BASE_URL"]
        self.login = ("admin", password)
        # The password stays in its file: never on the console or in a log.
        self.login_hint = f"login: admin / the password in {passwords_file}"

        c.stage(f"Airflow UI: {self.ui}  ({self.login_hint}); waiting for the DAGs to parse")
        self.api = AirflowApi(self.ui, *self.login)
        self.api.wait_for_dags(DAGS)
        self.check_definitions(Path(airflow_env["AIRFLOW__EOS__PIPELINE_CONFIG_DIR"]))
        self.reset()
        for dag_id in UNPAUSE_AT_START:
            self.api.unpause(dag_id)
        return airflow_env

    def produce(self, bootstrap: str) -> ProduceSummary:
        """The ledger's first events, with aborted batches and one poison record; starts the LSO sampler.

        :returns: what the producer committed and aborted."""
        self.console.stage(f"producing {self.events} ledger events transactionally (aborted batches, "
                           "one poison record)")
        ensure_topic(bootstrap, TOPIC, partitions=4)
        ensure_topic(bootstrap, ORDERS_TOPIC, partitions=3)
        self.sampler = LsoSampler(bootstrap, [TOPIC, ORDERS_TOPIC])
        self.sampler.start()
        return produce_ledger(bootstrap, self.events, topic=TOPIC, abort_every=5, poison=1, seed=2026,
                              transactional_id="demo-generator")

    def start_orders(self, bootstrap: str) -> tuple[list[OrdersSummary], Feed]:
        """Order lines, then the orders stream, then the feed that keeps it busy to the end.

        :returns: what was produced so far, and the running feed."""
        self.console.stage(f"order lines (aborted transactions, rejected and malformed lines) into {ORDERS_STREAM}, "
                           "a second pipeline of another shape that streams from now to the end")
        produced = [produce_orders(bootstrap, self.events // 2, topic=ORDERS_TOPIC, abort_every=5,
                                   malformed=1, rejected=2, seed=2027, transactional_id="demo-orders")]
        # Continuous, 3 s batches, its own target and meta schemas: all in orders.yaml.
        self.orders_run = self.api.trigger(ORDERS_STREAM, {})
        self.wait_until("the orders stream's first batches", lambda: self.orders_batches() >= 1, 240)
        feed = orders_feed(bootstrap, lines_per_tick=max(100, self.events // 50))
        feed.start()
        return produced, feed

    def start_ledger(self) -> None:
        """The ledger's stream, up to its first batches; then both streams' Spark UI links."""
        c = self.console
        c.stage(f"triggering {STREAM} (continuous, exactly_once) and waiting for its first batches")
        # Continuous, 2 s batches of at most 4000 records, targets created: all in ledger.yaml.
        self.stream_run = self.api.trigger(STREAM, {})
        self.wait_until("first micro-batches", lambda: self.progress_runs() >= 1 and bool(self.spark_drivers()), 240)
        self.spark_ui = {STREAM: self.spark_ui_of(STREAM, self.stream_run),
                         ORDERS_STREAM: self.spark_ui_of(ORDERS_STREAM, self.orders_run)}
        c.stage("each stream task links to its own driver's Spark UI: "
                + ", ".join(f"{dag} -> {ui['link']} ({'serves' if ui['serves'] else 'DOES NOT serve'})"
                            for dag, ui in self.spark_ui.items()))

    def kill_the_driver(self, bootstrap: str) -> ProduceSummary:
        """SIGKILL of the ledger's driver with events it has not applied yet; its operator restarts
        it, which catches up.

        :returns: what was committed just before the kill."""
        self.console.stage(f"{KILL_BURST} more events, then SIGKILL of the Spark driver mid-stream; "
                           "the operator restarts it")
        # Mid-stream whatever the first production's size and however long the stages before took:
        # the stream's next trigger cannot have applied a burst committed just now.
        burst = produce_ledger(bootstrap, KILL_BURST, topic=TOPIC, seed=11, first_seq=5_000_000,
                               transactional_id="demo-generator")
        stored, lso = self.stored_offsets(META, PIPELINE), self.lso()
        self.behind_at_kill = sum(max(0, offset - stored.get((TOPIC, p), 0)) for p, offset in lso.items())
        for process in self.spark_drivers():
            for child in process.children(recursive=True):
                child.send_signal(signal.SIGKILL)
            process.send_signal(signal.SIGKILL)
        self.wait_until("restarted driver's batches", lambda: self.progress_runs() >= 2, 240)
        self.wait_until("stream caught up with the LSO", self.caught_up, 300)
        return burst

    def hang_a_transaction(self, bootstrap: str) -> ProduceSummary:
        """A producer killed inside its transaction: the health DAG catches the stuck LSO; the
        producer's successor fences it, so the coordinator aborts the transaction; the stream resumes.

        :returns: what was committed behind the open transaction."""
        c = self.console
        c.stage("a producer dies inside an open transaction; more events queue behind it")
        child = subprocess.Popen([sys.executable, "-c", OPEN_TRANSACTION, bootstrap, TOPIC,
                                  str(self.open_txn_timeout_ms), KILLED_PRODUCER], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "OPEN"
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed_at = time.monotonic()
        more = produce_ledger(bootstrap, 2000, topic=TOPIC, seed=7, first_seq=10_000_000,
                              transactional_id="demo-generator")

        c.stage(f"{HEALTH} (deferrable LSO sensor on the triggerer) must catch the stuck LSO")
        self.health_run = self.run_dag(HEALTH, {}, budget=300, expect="failed")
        self.timings["stuck LSO detected after (s)"] = round(time.monotonic() - killed_at, 1)

        c.stage("the dead producer's successor starts with its transactional.id: the coordinator aborts "
                "the open transaction; the stream resumes")
        # As a restarted producer does: init_transactions fences the dead instance's epoch, and the
        # coordinator aborts its transaction then, not after transaction.timeout.ms (the backstop).
        # While it aborts, the coordinator answers "concurrent transactions", which librdkafka retries
        # and would log as a warning (log_level 3: errors only).
        Producer(with_python_logging({"bootstrap.servers": bootstrap, "transactional.id": KILLED_PRODUCER,
                                      "log_level": 3})).init_transactions(60)
        self.wait_until("LSO lag back to 0 and stream caught up",
                        lambda: all(v == 0 for v in self.sampler.lag().values()) and self.caught_up(), 300)
        return more

    def snapshot_then_produce(self, bootstrap: str) -> ProduceSummary:
        """A snapshot, then events it does not hold, applied by the stream.

        :returns: what was committed after the snapshot."""
        c = self.console
        c.stage(f"{SNAPSHOT}: consistent pg_dump with its Kafka offsets")
        self.api.unpause(SNAPSHOT)
        self.run_dag(SNAPSHOT, {}, budget=300)

        c.stage("more events after the snapshot")
        later = produce_ledger(bootstrap, max(2000, self.events // 4), topic=TOPIC, seed=99,
                               first_seq=20_000_000, transactional_id="demo-generator")
        self.wait_until("stream caught up with the LSO", self.caught_up, 300)
        return later

    def damage_the_target(self) -> dict[str, Any]:
        """Deleted and duplicated rows, corrupted balances.

        :returns: the audit of the damaged target."""
        self.console.stage("damaging the target: deleted rows, duplicated rows, corrupted balances")
        self.query(sql.SQL("DELETE FROM {}.ledger_events WHERE ctid IN (SELECT ctid FROM {}.ledger_events "
                           "ORDER BY random() LIMIT 100)").format(sql.Identifier(TARGET), sql.Identifier(TARGET)))
        self.query(sql.SQL("INSERT INTO {t}.ledger_events SELECT * FROM {t}.ledger_events LIMIT 50").format(
            t=sql.Identifier(TARGET)))
        self.query(sql.SQL("UPDATE {}.account_balances SET balance_cents = balance_cents + 777 WHERE account_id IN "
                           "(SELECT account_id FROM {}.account_balances LIMIT 10)").format(
            sql.Identifier(TARGET), sql.Identifier(TARGET)))
        return self.final_audit()

    def recover(self, bootstrap: str) -> Recovery:
        """The recovery DAG from the latest snapshot, while a producer keeps committing ledger events.

        :returns: its steps, the feed's production, and what the orders stream did meanwhile."""
        self.console.stage(f"{RECOVERY}: gate, stop, restore, replay, caught up, audit, resume; the ledger's "
                           f"producer keeps committing and {ORDERS_STREAM} keeps streaming")
        orders_drivers = {process.pid for process in self.spark_drivers(ORDERS_PIPELINE)}
        # A live topic is the normal case: what is committed after the replay started is the
        # resumed stream's work, and the final audit below holds it to it.
        ledger_feed = Feed(lambda tick: produce_ledger(
            bootstrap, 200, topic=TOPIC, batch_size=50, abort_every=4, seed=5000 + tick,
            first_seq=30_000_000 + tick * 10_000, transactional_id="demo-ledger-feed"), name="ledger feed")
        ledger_feed.start()
        try:
            recovery = self.run_dag(RECOVERY, {"snapshot": "latest"}, budget=900)
        finally:
            during = ledger_feed.stop()
        instances = self.api.task_instances(RECOVERY, recovery)
        # In the order they ran.
        ran = sorted((ti for ti in instances if ti.get("duration") is not None),
                     key=lambda ti: ti.get("start_date") or "")
        return Recovery(steps=[(ti["task_id"], round(float(ti["duration"]), 2)) for ti in ran], during=during,
                        orders_through=self.orders_through_recovery(recovery, instances, orders_drivers))

    def audit_the_ledger(self) -> dict[str, Any]:
        """:returns: the ledger's final audit, once its stream caught up with the LSO."""
        self.console.stage("final audit of the ledger against everything Kafka committed")
        self.wait_until("stream caught up with the LSO", self.caught_up, 300)
        return self.final_audit()

    def audit_and_stop_orders(self, feed: Feed, produced: list[OrdersSummary]) -> dict[str, Any]:
        """Stops the orders feed (its production joins ``produced``), audits the orders pipeline once
        caught up, and stops its stream through its stop DAG.

        :returns: the orders pipeline's final audit."""
        self.console.stage(f"the orders feed stops; final audit of {ORDERS_PIPELINE}, then {ORDERS_STOP} "
                           "stops its stream")
        produced.extend(feed.stop())
        self.wait_until("orders stream caught up with the LSO", self.orders_caught_up, 300)
        orders_final = self.final_audit(ORDERS_PIPELINE)
        self.run_dag(ORDERS_STOP, {}, budget=300)
        self.wait_until(f"{ORDERS_STREAM} run to end",
                        lambda: self.api.run_state(ORDERS_STREAM, self.orders_run) not in ("queued", "running"), 120)
        self.runs[f"{ORDERS_STREAM} ({self.orders_run})"] = self.api.run_state(ORDERS_STREAM, self.orders_run)
        return orders_final

    def stop_the_ledger(self) -> None:
        """A stop request the ledger's driver honours at a batch boundary."""
        self.console.stage("stopping the ledger stream at a batch boundary")
        self.query(sql.SQL("INSERT INTO {}.stream_control (pipeline, stop_requested_at, requested_by)"
                           " VALUES (%s, now(), 'demo') ON CONFLICT (pipeline) DO UPDATE SET"
                           " stop_requested_at = now(), requested_by = 'demo'").format(sql.Identifier(META)),
                   (PIPELINE,))
        self.wait_until("no Spark driver left", lambda: not self.spark_drivers(), 180)
        self.sampler.stop_event.set()

    def airflow_views(self, airflow_env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """:returns: the ledger's asset story and the OpenLineage story, as Airflow saw them."""
        self.console.stage(f"Airflow's asset events on the ledger's targets, and the downstream DAG {DOWNSTREAM} "
                           "they ran")
        assets = self.asset_story()
        lineage = self.lineage_story(Path(json.loads(airflow_env["AIRFLOW__OPENLINEAGE__TRANSPORT"])["log_file_path"]))
        return assets, lineage

    def wait_for_stream_runs(self) -> None:
        """Waits until every ledger stream run of this story has ended, and records their states."""
        self.wait_until(f"{STREAM} runs to end", lambda: all(
            self.api.run_state(STREAM, run_id) not in ("queued", "running") for run_id in self.stream_runs()), 120)
        for run_id in self.stream_runs():
            self.runs[f"{STREAM} ({run_id})"] = self.api.run_state(STREAM, run_id)

    def ledger_result(self, final: dict[str, Any], damaged: dict[str, Any], batches: tuple[ProduceSummary, ...],
                      steps: list[tuple[str, float]]) -> dict[str, Any]:
        """The ledger's part of the report.

        :param final: its final audit.
        :param damaged: the audit of the damaged target.
        :param batches: every ledger production of the story but the open transaction.
        :param steps: the recovery's tasks and their seconds, in the order they ran."""
        summary = final["summary"]
        committed = sum(b.committed + b.poison + b.malformed for b in batches)
        aborted = sum(b.aborted for b in batches) + OPEN_TRANSACTION_RECORDS
        return {
            "events_produced": committed + aborted,
            "events_committed_by_producers": committed,
            "events_committed_in_kafka (audit)": summary["committed_records"],
            "events_aborted_or_left_open": aborted,
            "rows_in_db": sum(p["rows"] for p in final["partitions"].values()),
            "duplicates": summary["duplicated"],
            "missing": summary["missing"],
            "balances_exact": final["aggregates"]["account_balances"]["keys_wrong"] == 0,
            "dead_lettered": summary["dead_lettered"],
            "damage_seen_before_recovery": {"duplicated": damaged["summary"]["duplicated"],
                                            "missing": damaged["summary"]["missing"],
                                            "balances_wrong": damaged["aggregates"]["account_balances"]["keys_wrong"]},
            "offsets behind at the SIGKILL": self.behind_at_kill,
            **self.timings,
            "recovery_steps_s": dict(steps),
            "tasks_seen_deferred": sorted(self.deferred),
            # Why the health DAG failed, as its task's log in Airflow says: one line and the log's path.
            "health_failed_because": "; ".join(f"{task}: {why}" for task, why in self.failures.get(HEALTH, {}).items()),
            "ledger_exact": final["ok"],
        }

    @staticmethod
    def orders_result(final: dict[str, Any], produced: list[OrdersSummary],
                      through_recovery: dict[str, Any]) -> dict[str, Any]:
        """The orders pipeline's part of the report.

        :param final: its final audit.
        :param produced: every orders production of the story.
        :param through_recovery: what its stream did while the ledger's recovery held the ledger stopped."""
        committed = sum(p.committed + p.rejected + p.malformed for p in produced)
        aborted = sum(p.aborted for p in produced)
        sales = final["aggregates"]["sku_store_sales"]
        return {
            "lines_produced": committed + aborted,
            "lines_committed_by_producers": committed,
            "lines_committed_in_kafka (audit)": final["summary"]["committed_records"],
            "lines_aborted": aborted,
            "rows_in_db": sum(p["rows"] for p in final["partitions"].values()),
            "duplicates": final["summary"]["duplicated"],
            "missing": final["summary"]["missing"],
            "sales_keys": sales["keys"],
            "sales_exact": sales["keys_wrong"] == 0,
            "dead_lettered": final["summary"]["dead_lettered"],
            "through_the_ledger_recovery": through_recovery,
            "exact": final["ok"],
        }

    def asset_story(self) -> dict[str, Any]:
        """What Airflow saw of the ledger's target assets in this story: the committed-offsets
        watcher's events (each with the offsets the target held everything below), the recovery's
        announcement, and the runs of the downstream DAG scheduled on them. Waits until the watcher
        has announced the final stored offsets and the downstream runs have finished."""
        stored = {str(p): int(o) for (t, p), o in self.stored_offsets(META, PIPELINE).items() if t == TOPIC}
        uris = self.api.scheduled_on(DOWNSTREAM)

        def payloads(uri: str) -> list[dict[str, Any]]:
            return [{**(e.get("extra") or {}).get("payload", {}), "from_trigger": bool(e["extra"].get("from_trigger")),
                     "timestamp": e["timestamp"]}
                    for e in self.api.asset_events(uri) if e["timestamp"] >= self.started_at]

        def final_announced() -> bool:
            watched = [p for p in payloads(uris[0]) if p["from_trigger"]] if uris else []
            return bool(watched) and watched[-1].get("offsets", {}).get(TOPIC) == stored

        self.wait_until("the watcher's event with the final offsets", final_announced, 120)
        runs = [r for r in self.api.recent_runs(DOWNSTREAM, limit=100)
                if (r.get("start_date") or "") >= self.started_at]
        self.wait_until(f"{DOWNSTREAM} runs to finish", lambda: all(
            self.api.run_state(DOWNSTREAM, r["dag_run_id"]) in ("success", "failed") for r in runs), 180)
        state_of = {r["dag_run_id"]: self.api.run_state(DOWNSTREAM, r["dag_run_id"]) for r in runs}
        states = Counter(state_of.values())
        events = payloads(uris[0])
        told = [self.api.xcom(DOWNSTREAM, run_id, "report_committed")
                for run_id, state in state_of.items() if state == "success"]
        return {
            "target_assets": uris,
            "events_per_target": {uri: len(payloads(uri)) for uri in uris},
            "changes": dict(Counter(e.get("change") for e in events)),
            "events": [{k: e.get(k) for k in ("timestamp", "change", "batch_id", "offsets", "from_trigger",
                                                "snapshot_id")} for e in events],
            "stored_offsets": {TOPIC: stored},
            "downstream_runs": dict(states),
            "downstream_told": sum(len(t or []) for t in told),
        }

    def lineage_story(self, events_file: Path) -> dict[str, Any]:
        """What the OpenLineage provider's listener wrote (its file transport) for the tasks that
        read Kafka and write or audit PostgreSQL: per job, the event types, the input and output
        datasets (namespace/name) and each dataset's data-quality assertions."""
        jobs = {f"{STREAM}.run_pipeline", f"{ORDERS_STREAM}.run_pipeline", f"{RECOVERY}.replay", f"{RECOVERY}.audit"}
        seen: dict[str, dict[str, Any]] = {}
        lines = events_file.read_text().splitlines() if events_file.exists() else []
        for line in lines:
            event = json.loads(line)
            name = (event.get("job") or {}).get("name")
            if name not in jobs or event.get("eventTime", "") < self.started_at:
                continue
            job = seen.setdefault(name, {"event_types": Counter(), "inputs": set(), "outputs": set(), "quality": {}})
            job["event_types"][event.get("eventType")] += 1
            for side in ("inputs", "outputs"):
                for dataset in event.get(side) or []:
                    job[side].add(f"{dataset['namespace']}/{dataset['name']}")
                    assertions = (dataset.get("facets") or {}).get("dataQualityAssertions")
                    if assertions:
                        job["quality"][dataset["name"]] = {a["assertion"]: a["success"]
                                                           for a in assertions["assertions"]}
        return {"events_file": str(events_file), "events_read": len(lines),
                "jobs": {name: {"event_types": dict(job["event_types"]), "inputs": sorted(job["inputs"]),
                                "outputs": sorted(job["outputs"]), "quality": job["quality"]}
                         for name, job in sorted(seen.items())}}

    def cluster_applications(self) -> list[dict[str, Any]]:
        """The applications the standalone master ran for this story (its JSON at <web UI>/json/),
        oldest first: the streams' drivers and the recovery's replay. None on local[*]."""
        if not self.spark_cluster:
            return []
        with urllib.request.urlopen(f"{self.stack['EOS_SPARK_MASTER_WEBUI']}/json/", timeout=10) as response:
            state = json.load(response)
        apps = [{key: app.get(key) for key in ("id", "name", "cores", "state", "starttime")}
                for app in state.get("activeapps", []) + state.get("completedapps", [])
                if app.get("starttime", 0) >= self.started_ms]
        return sorted(apps, key=lambda app: app["starttime"])

    def check_definitions(self, directory: Path) -> None:
        """The demo drives and audits what the pipeline definitions (scripts/airflow.sh) describe:
        a definition that drifted from the names below fails here, not as a wrong audit later."""
        from airflow_provider_eos.utils.definition_folder import find_definition

        for name, topic, target, meta, spec in (
                (PIPELINE, TOPIC, TARGET, META, "spark_apps.ledger.spec:LEDGER"),
                (ORDERS_PIPELINE, ORDERS_TOPIC, ORDERS_TARGET, ORDERS_META, "spark_apps.orders.spec:ORDERS")):
            definition = find_definition(directory, name)
            found = (definition.topics, definition.target_schema, definition.meta_schema, definition.spec)
            if found != ([topic], target, meta, spec):
                raise RuntimeError(f"pipeline {name!r} in {directory}: topics, target and meta schema, spec are "
                                   f"{found}; the demo expects {([topic], target, meta, spec)}")

    def reset(self) -> None:
        """A rerun starts from a clean slate: the demo's topic, tables, offsets and snapshots."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(with_python_logging({"bootstrap.servers": self.stack["EOS_KAFKA_BOOTSTRAP"]}))
        if TOPIC in admin.list_topics(timeout=10).topics:
            admin.delete_topics([TOPIC])[TOPIC].result(30)
            self.wait_until("old demo topic deleted", lambda: TOPIC not in admin.list_topics(timeout=10).topics, 60)
        self.query(sql.SQL("DROP TABLE IF EXISTS {t}.ledger_events, {t}.account_balances").format(
            t=sql.Identifier(TARGET)))
        self.query(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(META)))
        if ORDERS_TOPIC in admin.list_topics(timeout=10).topics:
            admin.delete_topics([ORDERS_TOPIC])[ORDERS_TOPIC].result(30)
            self.wait_until("old orders topic deleted",
                            lambda: ORDERS_TOPIC not in admin.list_topics(timeout=10).topics, 60)
        self.query(sql.SQL("DROP TABLE IF EXISTS {t}.{lines}, {t}.{sales}").format(
            t=sql.Identifier(ORDERS_TARGET), lines=sql.Identifier(LINES_TABLE), sales=sql.Identifier(SALES_TABLE)))
        self.query(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(ORDERS_META)))
        for folder in ("snapshots", "checkpoints", "checkpoints-orders"):
            subprocess.run(["rm", "-rf", str(STATE_DIR / folder)], check=True)

    def final_audit(self, pipeline: str = PIPELINE) -> dict[str, Any]:
        ledger = pipeline == PIPELINE
        config = PipelineConfig(
            pipeline=pipeline, topics=[TOPIC if ledger else ORDERS_TOPIC],
            kafka_bootstrap=self.stack["EOS_KAFKA_BOOTSTRAP"], spec="spark_apps.ledger.spec:LEDGER" if ledger
            else "spark_apps.orders.spec:ORDERS", target_schema=TARGET if ledger else ORDERS_TARGET,
            meta_schema=META if ledger else ORDERS_META,
            postgres=PostgresTarget(host=self.stack["EOS_PG_HOST"], port=int(self.stack["EOS_PG_PORT"]),
                                    dbname=self.stack["EOS_PG_DB"], user=self.stack["EOS_PG_USER"],
                                    password=self.stack["EOS_PG_PASSWORD"]),
        )
        # Called once the stream has caught up with the LSO: whatever Kafka
        # committed and the target lacks is missing, not "not yet applied".
        return audit(config, LEDGER if ledger else ORDERS, pending="missing")

    def write_html(self, result: dict[str, Any], steps: list[tuple[str, float]]) -> None:
        wall_offset = time.time() - (time.monotonic() - self.sampler.started)
        throughput: dict[str, list[tuple[float, float]]] = {}
        for pipeline, meta in ((PIPELINE, META), (ORDERS_PIPELINE, ORDERS_META)):
            rows = self.query(sql.SQL(
                "SELECT extract(epoch FROM recorded_at), input_rows, batch_duration_ms FROM {}.stream_progress"
                " WHERE pipeline = %s ORDER BY recorded_at").format(sql.Identifier(meta)), (pipeline,))
            throughput[f"{pipeline} rows/s"] = [(float(t) - wall_offset, rows_ / max(ms or 1, 1) * 1000)
                                                for t, rows_, ms in rows if rows_]
        orders = dict(result["orders"])
        orders.update({f"through the ledger's recovery: {k}": v
                       for k, v in orders.pop("through_the_ledger_recovery").items()})
        page = html_report.render({
            "exact": result["exact"],
            "summary": {k: v for k, v in result.items()
                        if k not in ("recovery_steps_s", "orders", "spark", "assets", "lineage")},
            "orders": orders,
            "spark": {"master": result["spark"]["master"],
                      **{app["id"]: f"{app['name']} ({app['cores']} core(s), {app['state']})"
                         for app in result["spark"]["applications"]}},
            "runs": self.runs,
            "lso_lag": self.sampler.samples,
            "throughput": throughput,
            "recovery_steps": steps,
        })
        out = STATE_DIR / "demo" / "report.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page)
        self.report_path = out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--open-txn-timeout-ms", type=int, default=300_000,
                        help="transaction.timeout.ms of the producer that dies inside its transaction: the "
                             "coordinator's own abort, should the story not fence it (below the broker's "
                             "transaction.max.timeout.ms)")
    parser.add_argument("--json", help="also write the final report as JSON to this file")
    parser.add_argument("--spark-cluster", action="store_true",
                        help="run Spark on the local standalone cluster (scripts/stack.sh start-spark, started "
                             "here) instead of local[*]: spark_default points at its master")
    args = parser.parse_args()
    terminal = quiet_console(CONSOLE_LOG)
    story = Story(args.events, args.open_txn_timeout_ms, spark_cluster=args.spark_cluster)
    try:
        result = story.run()
    except BaseException as exc:
        print(f"\nthe demo stopped: {type(exc).__name__}: {exc}\n(the whole traceback and every log line: "
              f"{CONSOLE_LOG})", file=terminal, flush=True)
        logging.getLogger("demo").exception("the demo stopped")
        return 2
    print_report(result, DOWNSTREAM)
    print(f"\nHTML report: {story.report_path}")
    print(f"Airflow UI:  {story.ui}  ({story.login_hint})")
    print(f"Logs:        {CONSOLE_LOG} (this console's), {TASK_LOGS}/ (failed tasks')")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "report_html": str(story.report_path),
                                               "runs": story.runs, "failure_logs": story.failure_logs},
                                              indent=2, default=str))
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
