"""A mirror pipeline end to end on the real stack, under each fault once. Debezium's PostgreSQL
connector on Kafka Connect publishes five source tables' changes (tests/helpers/cdc_workload.py:
composite keys, jsonb, numeric(20,6) and unconstrained numeric, timestamptz, date, time, bytea,
an array, NULLs, a TOASTed text left unchanged by updates, primary-key changes, deletes) while
an application changes them in multi-row transactions. One driver streams all five tables from
a declarative definition (``spec: "mirror:<file>"``), exactly_once, and two aggregates.

One pipeline serves the module (its connector, slot and first driver start once). Each fault
test runs the workload for WORKLOAD_SECONDS, adds a column the definition does not list to one
source table on the way (the stream adds it to the target in the batch that first carries
it), and does its fault in the middle: the driver SIGKILLed before a batch commits, the Kafka
Connect worker SIGKILLed, the Kafka broker SIGKILLed, PostgreSQL (source and target share the
cluster) restarted in immediate mode. A driver that exits is restarted as the operator's
supervisor would, once its exit is shown to be a retryable failure. Then, once the stream
holds the last transaction and its stored offsets are the change topics' last stable offsets,
every target table equals its source table over the source's columns now and each aggregate
equals its GROUP BY (tests/helpers/cdc_oracle.py).

Negative control, once: an older offset range replayed without the stored offsets' check (what
at-least-once does) moves rows back in time, and the same comparison sees it; replayed with the
check, nothing moves."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from bench.harness import kafka_connect_connection
from tests.helpers.cdc_oracle import change_counts, compare, high_watermarks, replay, stored_offsets, topics_written
from tests.helpers.cdc_source import drop_source_schema, wait_until
from tests.helpers.cdc_workload import (
    KEYS,
    SOURCE_DDL,
    NewColumn,
    Workload,
    holds_marks,
    mirror_connector,
    mirror_definition,
)
from tests.helpers.cdc_workload import target_of as target_table
from tests.helpers.stack_faults import Restart, kill_broker, kill_connect_worker, restart_postgres_immediate, stack_sh
from tests.streaming import AppRun, dead_letter_count, pg_connect, pipeline_config, start_app

# Kills the broker, the Connect worker and restarts PostgreSQL: run alone (scripts/test.sh).
pytestmark = [pytest.mark.stack_faults]
CONNECT_CONN = "eos_cdc_mirror_connect"
WORKLOAD_SECONDS = 22
ADD_COLUMN_AFTER = 4  # seconds into the workload
FAULT_AFTER = 9  # seconds into the workload
RETRYABLE_EXIT = 1  # spark_apps/eos_stream/app.py: failed, a supervisor restarts it
BROKER_LOST = "could not be established. Node may not be available"  # Kafka's Java client, in the driver's log


@dataclass
class Mirror:
    """The module's pipeline: source schema, connector, app config, its drivers (newest last)."""

    env: dict[str, str]
    schema: str
    slot: str
    connector: str
    config: dict[str, Any]
    tmp_path: Path
    hook: KafkaConnectHook
    workload: Workload
    target: Any
    drivers: list[AppRun] = field(default_factory=list)
    supervised_exits: list[int] = field(default_factory=list)
    runs: int = 0

    @property
    def topics(self) -> list[str]:
        return list(self.config["topics"])

    def start_driver(self, label: str, env_extra: dict[str, str] | None = None) -> AppRun:
        self.drivers.append(start_app(self.config, self.tmp_path, env_extra=env_extra, label=label))
        self.drivers[-1].outlives_test = True  # the module's stream, driven by its tests in turn
        return self.drivers[-1]

    def supervise(self) -> None:
        """The operator's supervisor: a driver that exited is restarted, if its exit is retryable."""
        if self.drivers and self.drivers[-1].process.poll() is None:
            return
        if self.drivers:
            code = self.drivers[-1].process.returncode
            assert code == RETRYABLE_EXIT, f"driver exited {code}:\n{self.drivers[-1].log()[-4000:]}"
            self.supervised_exits.append(code)
        self.start_driver(f"driver-{len(self.drivers)}")

    def log_lines(self, text: str) -> int:
        """Lines of every driver's log that hold ``text``."""
        return sum(line.count(text) for run in self.drivers for line in run.log().splitlines())

    def events(self, kind: str, since: int = 0) -> list[dict[str, Any]]:
        return [event for run in self.drivers[since:] for event in run.events(kind)]


@pytest.fixture(scope="module")
def mirror(connect: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mirror]:
    env, unique = connect, uuid.uuid4().hex[:10]
    schema, tmp_path = f"cdc_{unique}", tmp_path_factory.mktemp("cdc_mirror")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(f"AIRFLOW_CONN_{CONNECT_CONN.upper()}", kafka_connect_connection(env))
        workload = Workload(env, schema)
        with workload.conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        workload._write(list(SOURCE_DDL))
        for _ in range(5):  # rows for the connector's initial snapshot (op 'r')
            workload.transaction()
        definition = tmp_path / "mirror.yaml"
        definition.write_text(json.dumps(mirror_definition(schema), indent=2))  # JSON is YAML
        config = pipeline_config(env, tmp_path, f"mirror_{unique}", topics=[f"{schema}.{schema}.{t}" for t in KEYS],
                                 spec=f"mirror:{definition}", trigger="processingTime", trigger_interval="2 seconds",
                                 max_offsets_per_trigger=400)
        state = Mirror(env, schema, f"dbz_{unique}", f"mirror-{unique}", config, tmp_path,
                       KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN), workload, pg_connect(env))
        try:
            state.hook.put_connector_config(state.connector, mirror_connector(env, schema, state.slot))
            wait_until(f"{state.connector} RUNNING", lambda: not state.hook.connector_problems(state.connector))
            wait_until("the change topics", lambda: topics_written(env["EOS_KAFKA_BOOTSTRAP"], state.topics))
            yield state
        finally:
            for run in state.drivers:
                run.kill()
            state.target.close()
            stack_sh("start")  # a fault test that failed may have left the broker or the worker down
            stack_sh("start-connect")
            state.hook.delete_connector(state.connector)
            workload.close()
            drop_source_schema(env, state.slot, schema)


def catch_up(mirror: Mirror, timeout: float = 300) -> float:
    """A last transaction on every table, then waits until the target holds it and the stored
    offsets are the change topics' last stable offsets (supervising the driver meanwhile).
    Returns the seconds it took."""
    started = time.monotonic()
    marks = mirror.workload.marker()

    def caught_up() -> bool:
        mirror.supervise()
        if not holds_marks(mirror.target, mirror.config["target_schema"], marks):
            return False
        return stored_offsets(mirror.target, mirror.config) == high_watermarks(mirror.env["EOS_KAFKA_BOOTSTRAP"],
                                                                                mirror.topics)

    wait_until("the target at the last transaction and the stored offsets at the LSO", caught_up,
               timeout=timeout, interval=2)
    return time.monotonic() - started


def ensure_streaming(mirror: Mirror) -> None:
    """A driver that has applied a batch: one that is still starting would meet a fault only
    after it, and a test of that fault could not fail."""
    mirror.supervise()
    if not mirror.drivers[-1].events("batch"):
        catch_up(mirror)


def check_oracle(mirror: Mirror, label: str) -> dict[str, tuple[int, int]]:
    """Every table and aggregate: source rows > 0, rows that differ 0; no dead letters."""
    oracle = compare(mirror.workload.conn, mirror.schema, mirror.target, mirror.config["target_schema"])
    print(f"{label}: oracle (source rows, rows that differ): {oracle}")
    assert all(count > 0 and differ == 0 for count, differ in oracle.values()), oracle
    assert dead_letter_count(mirror.target, mirror.config) == 0
    return oracle


def run_with_fault(mirror: Mirror, label: str, new_column: NewColumn | None,
                   fault: Callable[[], str]) -> dict[str, tuple[int, int]]:
    """The workload for WORKLOAD_SECONDS, adding ``new_column`` ADD_COLUMN_AFTER seconds in and
    calling ``fault`` (which returns what it saw) FAULT_AFTER seconds in; then catch-up and the
    oracle. Asserts the stream added the new column to the target."""
    workload, drivers_before = mirror.workload, len(mirror.drivers)
    stop = threading.Event()
    thread = threading.Thread(target=workload.run, args=(WORKLOAD_SECONDS, stop, new_column, ADD_COLUMN_AFTER),
                              daemon=True)
    transactions, started = workload.stats.transactions, time.monotonic()
    thread.start()
    try:
        time.sleep(FAULT_AFTER)
        assert thread.is_alive() and workload.error is None, f"the workload ended before the fault: {workload.error}"
        seen = fault()
        thread.join(WORKLOAD_SECONDS + 180)
        assert not thread.is_alive() and workload.error is None, workload.error
    finally:
        stop.set()
    workload_seconds = time.monotonic() - started
    caught_up_after = catch_up(mirror)
    mirror.runs += 1
    oracle = check_oracle(mirror, label)
    print(f"{label}: {seen}; {workload.stats.transactions - transactions} source transactions, "
          f"workload and fault {workload_seconds:.0f}s, caught up {caught_up_after:.0f}s after, {workload.stats}")
    if new_column is not None:
        added = [e for e in mirror.events("mirror_columns_added", since=max(drivers_before - 1, 0))
                 if e["table"] == target_table(new_column.table) and new_column.column in e["columns"]]
        assert added, f"no driver added {new_column.column} to {new_column.table}"
    return oracle


def _wait_connector_running(mirror: Mirror, timeout: float = 180) -> None:
    wait_until(f"{mirror.connector} and its task RUNNING",
               lambda: not mirror.hook.connector_problems(mirror.connector), timeout=timeout, interval=2)


@pytest.mark.timeout(900)
def test_driver_sigkill_before_a_batch_commits(mirror: Mirror) -> None:
    """The driver dies by SIGKILL before its fourth batch commits (sink/batch_sink.py's fault
    points), while the workload runs; another one starts from the stored offsets."""
    for run in mirror.drivers:
        run.kill()
    killed = mirror.start_driver("killed", {"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": "4"})
    wait_until("the driver's first batch", lambda: killed.events("batch") or killed.process.poll() is not None,
               timeout=300)

    def fault() -> str:
        # -9: the app SIGKILLed its own process group (its last line may die with the JVM that relays it).
        assert killed.wait(120) == -9, killed.log()[-3000:]
        assert len(killed.events("batch")) == 3, killed.log()[-3000:]
        restarted = mirror.start_driver("restarted")
        wait_until("the restarted driver's first batch", lambda: restarted.events("batch"), timeout=300)
        assert restarted.events("resume")[0]["write_path"] == "staged"
        return f"driver killed before batch 4 committed; restarted, resumed at {restarted.events('resume')[0]}"

    run_with_fault(mirror, "driver SIGKILL", NewColumn("customers", "loyalty", "numeric(12,3)",
                                                       lambda r: f"{r.randint(0, 10**6)}.{r.randint(0, 999):03d}"),
                   fault)


@pytest.mark.timeout(900)
def test_connect_worker_sigkill(mirror: Mirror) -> None:
    """The Kafka Connect worker dies by SIGKILL mid-workload; ``stack.sh start-connect`` starts
    another; its Debezium task resumes from the offsets Connect committed with the records."""
    ensure_streaming(mirror)

    def fault() -> str:
        before = high_watermarks(mirror.env["EOS_KAFKA_BOOTSTRAP"], mirror.topics)
        restart = kill_connect_worker()
        _wait_connector_running(mirror)
        # The new worker's task publishes what the workload commits from now on.
        wait_until("changes published by the new worker", lambda: any(
            high_watermarks(mirror.env["EOS_KAFKA_BOOTSTRAP"], mirror.topics)[t] > before[t] + 10
            for t in mirror.topics), timeout=120)
        return f"connect worker {restart.killed} SIGKILLed, {restart.started} up after {restart.down_seconds:.0f}s"

    run_with_fault(mirror, "connect SIGKILL", NewColumn("visits", "rating", "smallint", lambda r: r.randint(-5, 5)),
                   fault)


@pytest.mark.timeout(900)
def test_kafka_broker_sigkill(mirror: Mirror) -> None:
    """The broker dies by SIGKILL mid-workload; ``stack.sh start`` starts it again. Connect's
    task and the driver ride it out, or fail and are restarted (the task by Connect's REST
    API, as the health DAG's operator would; the driver by the supervisor)."""
    ensure_streaming(mirror)
    restarted_tasks: list[str] = []

    def fault() -> str:
        restart = kill_broker()
        deadline = time.monotonic() + 120
        while mirror.hook.connector_problems(mirror.connector):
            if time.monotonic() > deadline:
                raise AssertionError(mirror.hook.connector_problems(mirror.connector))
            if "FAILED" in json.dumps(mirror.hook.get_connector_status(mirror.connector)):
                restarted_tasks.append(json.dumps(mirror.hook.get_connector_status(mirror.connector))[:2000])
                mirror.hook.restart_connector(mirror.connector, include_tasks=True, only_failed=True)
            time.sleep(2)
        return (f"broker {restart.killed} SIGKILLed, {restart.started} up after {restart.down_seconds:.0f}s; "
                f"failed connector tasks restarted: {restarted_tasks}")

    drivers, lost = len(mirror.drivers), mirror.log_lines(BROKER_LOST)
    run_with_fault(mirror, "broker SIGKILL", NewColumn("rates", "source_note", "varchar(40)",
                                                       lambda r: f"feed {r.randint(0, 9)}"), fault)
    lost_after = mirror.log_lines(BROKER_LOST)
    print(f"broker SIGKILL: drivers restarted {len(mirror.drivers) - drivers}, driver lines on the lost broker "
          f"{lost_after - lost}")
    assert lost_after > lost or len(mirror.drivers) > drivers, "the driver never saw the broker go"


@pytest.mark.timeout(900)
def test_postgres_immediate_restart(mirror: Mirror) -> None:
    """PostgreSQL restarted in immediate mode mid-workload: the source (Debezium's slot), the
    target (the driver) and the application lose their connections at once."""
    ensure_streaming(mirror)
    drivers, cut = len(mirror.drivers), mirror.workload.stats.connection_errors
    outcome: list[Restart] = []

    def fault() -> str:
        outcome.append(restart_postgres_immediate(lambda: pg_connect(mirror.env)))
        mirror.target.close()  # the test's own connection was cut too
        mirror.target = pg_connect(mirror.env)
        _wait_connector_running(mirror)
        return f"postgres restarted in immediate mode, down {outcome[0].down_seconds:.0f}s"

    run_with_fault(mirror, "postgres immediate restart", NewColumn("events", "region", "text",
                                                                   lambda r: r.choice(["eu", "us", None])), fault)
    assert mirror.workload.stats.connection_errors > cut, "the application never lost its connection"
    retries = mirror.events("retry", since=drivers - 1)
    exits = len(mirror.drivers) - drivers
    print(f"postgres immediate restart: driver retries {len(retries)}, driver restarts {exits}")
    assert retries, "the driver never saw the restart"
    # The batch retries on new connections, and so does the stop poll (state/control.StopSignal).
    assert not exits, f"the driver exited instead of riding out the restart: {mirror.supervised_exits}"


@pytest.mark.timeout(600)
def test_negative_control_replay_without_the_offsets_check(mirror: Mirror) -> None:
    """Older changes replayed with the stored offsets' check change nothing; without it (as
    at-least-once would) they move rows back in time, and the oracle sees it."""
    ensure_streaming(mirror)
    if not mirror.runs:  # alone: a workload without a fault first, so that there are updates to replay
        run_with_fault(mirror, "no fault", None, lambda: "no fault")
    catch_up(mirror)
    oracle = check_oracle(mirror, "before the replay")
    for run in mirror.drivers:
        run.kill()
    customers = mirror.topics[0]
    ops = change_counts(mirror.env["EOS_KAFKA_BOOTSTRAP"], customers, stored_offsets(mirror.target,
                                                                                      mirror.config)[customers])
    print(f"{customers}: {ops}")
    assert ops["unchanged TOAST"] > 0 and ops["d"] > 0 and ops["u"] > 0, ops  # the test saw what it tests
    half = {t: end // 2 for t, end in stored_offsets(mirror.target, mirror.config).items()}
    assert replay(mirror.env, mirror.config, half, skip_applied=True) == 0
    source, target_schema = mirror.workload.conn, mirror.config["target_schema"]
    assert compare(source, mirror.schema, mirror.target, target_schema) == oracle
    applied = replay(mirror.env, mirror.config, half, skip_applied=False)
    damaged = compare(source, mirror.schema, mirror.target, target_schema)
    print(f"replayed {applied} older changes without the offsets' check: {damaged}")
    assert applied > 0 and damaged["customers"][1] > 0 and damaged["order_lines"][1] > 0, damaged
