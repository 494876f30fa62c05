"""A mirror pipeline's Airflow side on the real stack: Debezium on Kafka Connect publishes three
source tables (test_cdc_mirror.py's schema and application), and the pipeline's own DAGs, built
from its definition (a ``mirror:`` spec and a ``cdc`` section), run through ``dag.test()``.

Health: the health DAG passes while the connector runs and the slots hold little WAL, then fails
with a summary that names the paused connector and the replication slot holding more WAL than
allowed. Recovery: a snapshot through the snapshot DAG, the mirror damaged (rows deleted and
altered, an aggregate group lost, a row that the source never had), the recovery DAG run while
the application keeps changing the source; after catch-up every mirror table equals its source
(EXCEPT both ways) and the aggregate equals its GROUP BY."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from bench.harness import kafka_connect_connection
from tests.helpers.cdc_oracle import compare, high_watermarks, stored_offsets, topics_written
from tests.helpers.cdc_source import (
    Source,
    drop_slot,
    pause_connector,
    source_connection,
    wait_until,
    write_source,
)
from tests.helpers.cdc_workload import KEYS, SOURCE_DDL, Workload, mirror_connector, mirror_definition
from tests.integration.test_recovery_dag import _airflow_env, _dag_test
from tests.streaming import pg_connect, pipeline_config, run_direct_replay, write_definition

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONNECT_CONN = "eos_cdc_airflow_connect"
SOURCE_CONN = "eos_cdc_airflow_source"
# WAL is the whole PostgreSQL cluster's: under xdist the other worker's tests write into the same
# cluster, and a healthy run once saw both slots hold ~20 MiB (8 MiB was the limit then). Far above
# that, far below the WAL written while the connector is paused (FILLER).
MAX_HELD_BYTES = 96 * 1024**2
# ~150 MiB of WAL in one transaction, in a table the connector does not capture. (With 1 MiB logical
# decoding messages instead, which Debezium reads too, the resumed connector was not back to
# RUNNING within 120 s.)
FILLER = "INSERT INTO filler SELECT g, repeat(md5(g::text), 12) FROM generate_series(1, 300000) g"
# The application's last rows before a comparison, keyed by a negative mark (the workload's keys are positive).
LAST_ROWS = ["INSERT INTO customers VALUES ({mark}, 'last', 0, now(), NULL, NULL, NULL)",
             "INSERT INTO order_lines VALUES ({mark}, {mark}, 'z', 1, 1)",
             "INSERT INTO events VALUES ({mark}, 'last', now(), NULL)"]


@dataclass
class MirrorPipeline:
    stack: dict[str, str]
    source: Source
    config: dict[str, Any]
    connector: str
    slot: str
    idle_slot: str
    hook: KafkaConnectHook
    airflow: dict[str, str]
    workload: Workload
    tmp: Path
    stop: threading.Event = field(default_factory=threading.Event)  # ends the application's changes
    catch_ups: int = 0
    first_runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.config["pipeline"])


def _connections(stack: dict[str, str]) -> dict[str, str]:
    """Connect's REST API, and the source database as the cluster's superuser (the slot's age
    reads pg_ls_waldir(), which needs pg_monitor)."""
    return {f"AIRFLOW_CONN_{CONNECT_CONN.upper()}": kafka_connect_connection(stack),
            f"AIRFLOW_CONN_{SOURCE_CONN.upper()}": json.dumps({
                "conn_type": "postgres", "host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
                "login": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"],
                "schema": stack["EOS_SOURCE_PG_DB"]})}


def _apply(pipeline: MirrorPipeline, label: str) -> None:
    """What the change topics hold, applied by the Spark-less replay (the stream's claim and sink),
    past a recovery's stop request as a resumed stream would."""
    done = run_direct_replay({**pipeline.config, "ignore_stop_request": True}, pipeline.tmp, label=label)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _catch_up(pipeline: MirrorPipeline) -> None:
    """The application's last rows written; applies until the stored offsets reach the change topics'
    last stable offsets with those rows in the mirror: the pipeline has read past every change."""
    pipeline.catch_ups += 1
    mark = -pipeline.catch_ups
    write_source(pipeline.source, [row.format(mark=mark) for row in LAST_ROWS])
    target, schema = pg_connect(pipeline.stack), pipeline.config["target_schema"]
    rounds = 0

    def caught_up() -> bool:
        nonlocal rounds
        rounds += 1
        _apply(pipeline, f"catch-up{-mark}-{rounds}")
        with target.cursor() as cur:
            cur.execute(sql.SQL("SELECT (SELECT count(*) FROM {0}.customers WHERE id = %(m)s)"
                                " + (SELECT count(*) FROM {0}.lines WHERE order_id = %(m)s)"
                                " + (SELECT count(*) FROM {0}.events WHERE id = %(m)s)")
                        .format(sql.Identifier(schema)), {"m": mark})
            last = (cur.fetchone() or (0,))[0]
        ends = high_watermarks(pipeline.stack["EOS_KAFKA_BOOTSTRAP"], list(pipeline.config["topics"]))
        return last == 3 and stored_offsets(target, pipeline.config) == ends

    try:
        wait_until("the mirror caught up with the change topics", caught_up, timeout=180, interval=2)
    finally:
        target.close()


@pytest.fixture(scope="module")
def mirror(connect: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[MirrorPipeline]:
    """A mirror pipeline of three source tables, its connector RUNNING, what it published applied;
    its definition names the connector and two slots: the connector's, and one nobody reads."""
    stack, tmp, suffix = connect, tmp_path_factory.mktemp("cdc_airflow"), uuid.uuid4().hex[:8]
    source = Source(source_connection(stack), f"cdc_af{suffix}")
    with source.conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(source.schema)))
    write_source(source, [*SOURCE_DDL, "CREATE TABLE filler (id bigint PRIMARY KEY, pad text)"])
    workload = Workload(stack, source.schema)
    for _ in range(5):  # rows for the connector's initial snapshot (op 'r')
        workload.transaction()
    (tmp / "mirror.yaml").write_text(json.dumps(mirror_definition(source.schema)))
    topics = [f"{source.schema}.{source.schema}.{table}" for table in KEYS]
    config = pipeline_config(stack, tmp, f"cdcaf{suffix}", topics=topics, spec=f"mirror:{tmp / 'mirror.yaml'}")
    slot, idle_slot, connector = f"dbz_af{suffix}", f"idle_af{suffix}", f"mirror-af{suffix}"
    write_definition(config, tmp / "pipelines", stream={"replay_engine": "direct"}, snapshot={"schedule": None},
                     health={"stuck_after": 10, "poke_interval": 1, "sensor_timeout": 10},
                     cdc={"connectors": [connector], "kafka_connect_conn_id": CONNECT_CONN,
                          "replication_slots": [slot, idle_slot], "source_postgres_conn_id": SOURCE_CONN,
                          "max_held_bytes": MAX_HELD_BYTES})
    airflow = {**_airflow_env(stack, tmp / "pipelines", tmp / "store"), **_connections(stack)}
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
    pipeline = MirrorPipeline(stack, source, config, connector, slot, idle_slot, hook, airflow, workload, tmp)
    with pytest.MonkeyPatch.context() as patch:  # this process's hook reads the connections too
        for key, value in _connections(stack).items():
            patch.setenv(key, value)
        yield from _running(pipeline)


def _running(pipeline: MirrorPipeline) -> Iterator[MirrorPipeline]:
    """The pipeline with its connector created, what it published applied, a slot nobody reads
    created, its health DAG and snapshot DAG run once (``first_runs``); all removed after."""
    stack, source, hook, connector = pipeline.stack, pipeline.source, pipeline.hook, pipeline.connector
    topics = list(pipeline.config["topics"])
    try:
        hook.put_connector_config(connector, mirror_connector(stack, source.schema, pipeline.slot))
        wait_until(f"{connector} RUNNING", lambda: not hook.connector_problems(connector))
        wait_until("the change topics", lambda: topics_written(stack["EOS_KAFKA_BOOTSTRAP"], topics))
        _apply(pipeline, "first")
        with source.conn.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (pipeline.idle_slot,))
        # The pipeline's first DAG runs, in one process (each costs Airflow's start): its health, then a snapshot.
        pipeline.first_runs = _dag_test(pipeline.airflow, [[f"eos_health__{pipeline.name}", {}],
                                                           [f"eos_snapshot__{pipeline.name}", {}]], pipeline.tmp)
        yield pipeline
    finally:
        pipeline.stop.set()
        source.conn.rollback()  # a failed write_source leaves its transaction open
        source.conn.autocommit = True
        hook.delete_connector(connector)
        drop_slot(source, pipeline.slot)
        drop_slot(source, pipeline.idle_slot)
        pipeline.workload.close()
        with source.conn.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(source.schema)))
        source.conn.close()


def _health(pipeline: MirrorPipeline) -> tuple[dict[str, Any], str]:
    """One run of the pipeline's health DAG: its result, and the summary's verdict from its log."""
    logs = set(pipeline.tmp.glob("dagtest-*.log"))
    [run] = _dag_test(pipeline.airflow, [[f"eos_health__{pipeline.name}", {}]], pipeline.tmp)
    [log] = set(pipeline.tmp.glob("dagtest-*.log")) - logs
    text = log.read_text(errors="replace")
    verdict = text[text.find("Stream health:"):] if "Stream health:" in text else text[-5000:]
    return run, verdict


@pytest.mark.timeout(600)
def test_the_health_dag_names_a_paused_connector_and_a_slot_holding_wal(mirror: MirrorPipeline) -> None:
    checks = ("connector", f"replication_slot__{mirror.slot}", f"replication_slot__{mirror.idle_slot}")
    healthy = mirror.first_runs[0]  # the connector RUNNING, both slots holding little WAL
    assert healthy["state"] == "success", healthy
    assert all(healthy["tasks"][check] == "success" for check in checks), healthy

    pause_connector(mirror.hook, mirror.connector)
    # WAL that no reader of the idle slot (nor the paused connector) confirms.
    write_source(mirror.source, [FILLER])
    try:
        failed, verdict = _health(mirror)
    finally:
        mirror.hook.resume_connector(mirror.connector)
    print(verdict[:3000])
    assert failed["state"] == "failed" and failed["tasks"]["summary"] == "failed", failed
    assert all(failed["tasks"][check] == "failed" for check in checks), failed
    assert re.search(rf"\[FAIL\] connector: connector '{mirror.connector}' is PAUSED", verdict), verdict
    assert re.search(rf"\[FAIL\] replication_slot__{mirror.idle_slot}: replication slot '{mirror.idle_slot}' "
                     rf"holds back \d+ bytes .* more than the {MAX_HELD_BYTES} bytes", verdict), verdict
    wait_until(f"{mirror.connector} RUNNING again", lambda: not mirror.hook.connector_problems(mirror.connector))
    drop_slot(mirror.source, mirror.idle_slot)


def _damage(pipeline: MirrorPipeline) -> None:
    """Rows deleted and altered in every mirror table, a group of the aggregate lost, and a row
    the source never had."""
    conn = pg_connect(pipeline.stack)
    t = sql.Identifier(pipeline.config["target_schema"])
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DELETE FROM {}.customers WHERE id % 3 = 0").format(t))
        cur.execute(sql.SQL("UPDATE {}.customers SET balance = balance + 1, notes = 'damaged'").format(t))
        cur.execute(sql.SQL("UPDATE {}.lines SET qty = qty * 2 WHERE line_no % 2 = 0").format(t))
        cur.execute(sql.SQL("DELETE FROM {}.sku_totals WHERE sku = (SELECT min(sku) FROM {}.sku_totals)")
                    .format(t, t))
        cur.execute(sql.SQL("INSERT INTO {}.events VALUES (-99, 'never', now(), NULL)").format(t))
    conn.close()


def _keep_changing(workload: Workload, stop: threading.Event) -> None:
    """The application, a multi-row transaction a second until stopped: enough to change the
    source all through a recovery, few enough for the resumed stream to catch up in seconds."""
    try:
        while not stop.is_set():
            workload.transaction()
            stop.wait(1.0)
    except BaseException as exc:  # reported by the test's main thread
        workload.error = exc


@pytest.mark.timeout(900)
def test_a_mirror_recovers_through_the_dags_while_its_source_keeps_changing(mirror: MirrorPipeline) -> None:
    snap = mirror.first_runs[1]
    assert snap["state"] == "success", snap
    for _ in range(10):  # changes after the snapshot: the recovery's replay brings them back
        mirror.workload.transaction()
    _apply(mirror, "after-snapshot")
    target = pg_connect(mirror.stack)
    try:
        _damage(mirror)
        damaged = compare(mirror.source.conn, mirror.source.schema, target, mirror.config["target_schema"])
        assert all(damaged[t][1] > 0 for t in ("customers", "order_lines", "events", "sku_totals")), damaged

        thread = threading.Thread(target=_keep_changing, args=(mirror.workload, mirror.stop), daemon=True)
        thread.start()
        started = mirror.workload.stats.transactions
        conf = {"snapshot": "latest", "resume": False, "quiet_seconds": 1, "dry_run": False}
        try:
            [run] = _dag_test(mirror.airflow, [[f"eos_recovery__{mirror.name}", conf]], mirror.tmp)
        finally:
            mirror.stop.set()
            thread.join(60)
        during = mirror.workload.stats.transactions - started
        assert mirror.workload.error is None, mirror.workload.error
        assert run["state"] == "success", run
        assert run["tasks"]["finalize"] == "success" and run["tasks"]["rollback"] == "skipped", run
        summary = run["summary"]
        # The snapshot's rows put back, and the change topics replayed from its offsets: a mirror adds
        # no row per change, so what the replay moved past is counted by the offsets.
        assert summary["rows_restored"] > 0 and summary["replay_engine"]["records_to_replay"] > 0, summary
        assert summary["offsets_replayed"] >= summary["replay_engine"]["records_to_replay"], summary
        assert summary["audit"]["ok"] and summary["audit"]["summary"]["rows"] == "not compared", summary
        assert during >= 10, f"the source changed only {during} times during the recovery"

        _catch_up(mirror)
        oracle = compare(mirror.source.conn, mirror.source.schema, target, mirror.config["target_schema"])
        print(f"oracle (source rows, rows that differ): {oracle}; {during} source transactions during the "
              f"recovery; recovery summary {json.dumps(summary, default=str)[:1500]}")
        assert all(count > 0 and differ == 0 for count, differ in oracle.values()), oracle
    finally:
        target.close()
