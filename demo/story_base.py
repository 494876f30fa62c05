"""What every stage of the story stands on: the stack and Airflow started, the database and the
REST API at hand, DAG runs awaited and their failures kept, Spark drivers found, audits run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import psycopg2
from psycopg2 import sql

from demo.airflow_api import AirflowApi
from demo.cdc_app import change_topics
from demo.console import Console, failure_summary, save_task_log
from demo.env_files import STATE_DIR, read_env_file
from demo.lso_sampler import LsoSampler
from demo.names import (
    DAGS,
    META,
    MIRROR_META,
    MIRROR_PIPELINE,
    MIRROR_TARGET,
    ORDERS_META,
    ORDERS_PIPELINE,
    ORDERS_TARGET,
    ORDERS_TOPIC,
    PIPELINE,
    ROOT,
    SOURCE_SCHEMA,
    SPARK_UI_LINK,
    TARGET,
    TASK_LOGS,
    TOPIC,
    TOPIC_PREFIX,
    UNPAUSE_AT_START,
)
from spark_apps.eos_stream.audit.oracle import audit
from spark_apps.eos_stream.engines import continuous as continuous_engine
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.run.config import PipelineConfig, PostgresTarget
from spark_apps.ledger.spec import LEDGER
from spark_apps.orders.spec import LINES_TABLE, ORDERS, SALES_TABLE


def _is_spark_driver(info: dict[str, Any], pipeline: str) -> bool:
    cmdline = info["cmdline"] or []
    return ("java" in (info["name"] or "") and "eos_stream/app.py" in " ".join(cmdline)
            and f"eos-{pipeline}" in cmdline)


def _is_continuous_engine(info: dict[str, Any], pipeline: str) -> bool:
    cmdline = info["cmdline"] or []
    if continuous_engine.__name__ not in cmdline or "--config" not in cmdline[:-1]:
        return False
    try:
        config = json.loads(Path(cmdline[cmdline.index("--config") + 1]).read_text())
    except (OSError, ValueError):  # the engine's run ended and its directory went with it
        return False
    return bool(config.get("pipeline") == pipeline)


class StoryBase:
    """The story's machinery; its stages are in ``orders_stages``, ``ledger_stages`` and
    ``airflow_views``."""

    # Set by ``start``: the stack's and Airflow's settings, the API client, the login.
    stack: dict[str, str]
    api: AirflowApi
    spark_master: str
    started_ms: int
    ui: str
    login: tuple[str, str]
    login_hint: str
    # Set by the stages: the LSO sampler, the streams' runs and Spark UIs, the report's file.
    sampler: LsoSampler
    orders_run: str
    mirror_run: str
    stream_run: str
    spark_ui: dict[str, dict[str, Any]]
    behind_at_kill: int
    health_run: str
    report_path: Path
    # scripts/stack.sh start-connect, running in the background (``start_connect``).
    connect_start: subprocess.Popen | None = None

    def __init__(self, events: int, open_txn_timeout_ms: int, spark_cluster: bool = False) -> None:
        self.events = events
        self.open_txn_timeout_ms = open_txn_timeout_ms
        self.spark_cluster = spark_cluster
        self.console = Console(total=23)
        self.timings: dict[str, float] = {}
        self.runs: dict[str, str] = {}
        self.deferred: set[str] = set()
        # dag_id -> failed task -> the end of its log, for each run that failed
        self.failure_logs: dict[str, dict[str, str]] = {}
        # dag_id -> failed task -> why, in one line, and where its whole log is
        self.failures: dict[str, dict[str, str]] = {}
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())

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

    def stored_offsets(self, meta: str, pipeline: str) -> dict[tuple[str, int], int]:
        """The pipeline's stored next offset per (topic, partition)."""
        return {(t, p): o for t, p, o in self.query(
            sql.SQL("SELECT topic, partition, next_offset FROM {}.kafka_offsets WHERE pipeline = %s").format(
                sql.Identifier(meta)), (pipeline,))}

    def driver_runs(self, meta: str, pipeline: str) -> int:
        """The Spark drivers that committed batches of ``pipeline`` so far (each records its run id)."""
        if self.query("SELECT to_regclass(%s)", (f"{meta}.stream_progress",))[0][0] is None:
            return 0
        rows = self.query(sql.SQL("SELECT count(DISTINCT run_id) FROM {}.stream_progress WHERE pipeline = %s").format(
            sql.Identifier(meta)), (pipeline,))
        return int(rows[0][0]) if rows else 0

    def committed_ends(self, topics: list[str]) -> dict[tuple[str, int], int]:
        """Each partition's last stable offset (a read_committed reader's end), for the topics that exist."""
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import AdminClient, OffsetSpec

        admin = AdminClient(with_python_logging({"bootstrap.servers": self.stack["EOS_KAFKA_BOOTSTRAP"]}))
        listed = admin.list_topics(timeout=10).topics
        request = {TopicPartition(topic, p): OffsetSpec.latest()
                   for topic in topics if topic in listed for p in listed[topic].partitions}
        if not request:
            return {}
        result = admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED)
        return {(tp.topic, tp.partition): result[tp].result().offset for tp in request}

    def caught_up_with(self, meta: str, pipeline: str, topics: list[str]) -> bool:
        """The pipeline's stored offsets reached every partition's last stable offset."""
        if self.query("SELECT to_regclass(%s)", (f"{meta}.kafka_offsets",))[0][0] is None:
            return False
        ends, stored = self.committed_ends(topics), self.stored_offsets(meta, pipeline)
        return bool(ends) and all(stored.get(tp, -1) >= offset for tp, offset in ends.items())

    def spark_drivers(self, pipeline: str = PIPELINE) -> list[psutil.Process]:
        """The pipeline's Spark drivers: spark-submit names its application ``eos-<pipeline>``."""
        return [process for process in psutil.process_iter(["cmdline", "name"])
                if _is_spark_driver(process.info, pipeline)]

    def stream_engines(self, pipeline: str) -> list[psutil.Process]:
        """The processes that stream ``pipeline``, found in one scan: its Spark drivers, or its
        continuous engine (``python -m spark_apps.eos_stream.engines.continuous --config <file>``,
        the file naming it)."""
        return [process for process in psutil.process_iter(["cmdline", "name"])
                if _is_spark_driver(process.info, pipeline) or _is_continuous_engine(process.info, pipeline)]

    def engines_to_kill(self, pipeline: str) -> list[tuple[psutil.Process, list[psutil.Process]]]:
        """The processes that stream ``pipeline``, each with its children, found now (before what
        follows must happen fast). A fault that must land on them fails here, naming what it looked
        for, rather than killing nothing.

        :raises RuntimeError: when no such process runs."""
        engines = self.stream_engines(pipeline)
        if not engines:
            raise RuntimeError(f"no process streams {pipeline!r}: looked for a Spark driver (a java process running "
                               f"eos_stream/app.py as application eos-{pipeline}) and for a continuous engine "
                               f"({continuous_engine.__name__} --config naming {pipeline!r})")
        return [(process, process.children(recursive=True)) for process in engines]

    @staticmethod
    def signal_trees(trees: list[tuple[psutil.Process, list[psutil.Process]]], signum: int) -> None:
        """``signum`` to each process of ``engines_to_kill``'s list, its children first: SIGSTOP
        freezes a tree where it stands (it can commit nothing more), SIGKILL ends it."""
        for process, children in trees:
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.send_signal(signum)
            process.send_signal(signum)

    def start_connect(self) -> None:
        """``scripts/stack.sh start-connect`` in the background: the worker joins its group while
        other things happen (Airflow starting, a restart after its SIGKILL)."""
        self.connect_start = subprocess.Popen(["bash", "scripts/stack.sh", "start-connect"], cwd=ROOT,
                                              stdout=subprocess.DEVNULL)

    def start(self) -> dict[str, str]:
        """Starts the stack and Airflow's services, waits for the DAGs, starts from a clean slate.

        :returns: airflow.env's settings."""
        c = self.console
        spark = ", a Spark standalone master and worker" if self.spark_cluster else ""
        c.stage(f"starting the local stack (Kafka KRaft, PostgreSQL, Kafka Connect{spark}) and Airflow "
                "(api-server, scheduler, dag-processor, triggerer)")
        self.sh("bash", "scripts/stack.sh", "start")
        self.start_connect()
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
        self.end_earlier_runs()
        self.reset()
        for dag_id in UNPAUSE_AT_START:
            self.api.unpause(dag_id)
        return airflow_env

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
        mirror = find_definition(directory, MIRROR_PIPELINE)
        seen = (mirror.topics, mirror.target_schema, mirror.meta_schema, mirror.mirror is not None)
        wanted = (change_topics(TOPIC_PREFIX, SOURCE_SCHEMA), MIRROR_TARGET, MIRROR_META, True)
        if seen != wanted:
            raise RuntimeError(f"pipeline {MIRROR_PIPELINE!r} in {directory}: topics, target and meta schema, a "
                               f"mirror section are {seen}; the demo expects {wanted}")

    def end_earlier_runs(self) -> None:
        """A demo stopped half-way (Ctrl-C, ``make demo-down``) leaves its DAG runs running in
        Airflow's database, and the scheduler takes them up again: their streams would hold the
        pipelines (one active run each) while this run's wait behind them. They are marked
        failed, and their drivers must be gone before the reset drops what they write."""
        ended = {dag_id: runs for dag_id in DAGS if (runs := self.api.end_unfinished_runs(dag_id))}
        if not ended:
            return
        self.console.note(f"ended the unfinished runs of an earlier demo: {ended}")
        pipelines = (PIPELINE, ORDERS_PIPELINE, MIRROR_PIPELINE)
        self.wait_until("the earlier demo's drivers and engines gone",
                        lambda: not any(self.stream_engines(p) for p in pipelines), 180)

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
