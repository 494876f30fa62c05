"""Whole source transactions end to end (``mirror.transactions: whole``): a source application with
rules across tables (tests/helpers/bank_app.py), Debezium's connector on the real Kafka Connect
worker with its transaction topic, and a mirror on each engine, while a reader polls the mirror in
REPEATABLE READ and checks the rules on every poll.

Each test has a source schema and connector of its own, and streams their topics into a pipeline
of its own while it runs the application (transfers, settlements of 160 changes, larger than a
batch, compactions with deletes)
and kills the driver or the engine mid-stream once, at the sink's ``before_commit`` point of a batch
that holds records, then starts it again. Once the stored offsets reach every topic's end, the
mirror must equal the source table by table and the aggregate its ``GROUP BY``.

With whole transactions the reader must see no violation. The negative control: the same run with
``transactions: per_key`` (batches end inside settlements) must show violations to the same reader."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from airflow_provider_eos.hooks.kafka_connect import KafkaConnectHook
from airflow_provider_eos.state.stop_requests import set_stop_request
from airflow_provider_eos.utils.debezium_config import postgres_connector_config
from tests.helpers.bank_app import Bank, Reader, mirror_section
from tests.helpers.cdc_oracle import high_watermarks, stored_offsets, topics_written
from tests.helpers.cdc_source import Source, drop_slot, source_connection, wait_until
from tests.helpers.stack_faults import kill_connect_worker, restart_postgres_immediate
from tests.integration.test_snapshot_restore import KAFKA_CONN as RECOVERY_KAFKA
from tests.integration.test_snapshot_restore import PG_BIN, connections_env
from tests.integration.test_snapshot_restore import PG_CONN as RECOVERY_PG
from tests.streaming import AppRun, pg_connect, pipeline_config, start_app, start_continuous

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
CONNECT_CONN = "eos_whole_tx_connect"
WORKLOAD_SECONDS = 24
BATCH = 100  # max_offsets_per_trigger: a settlement (160 changes) spans two batches or more
HELD_IN_DATABASE_BYTES = 16 * 1024  # continuous_max_bytes under a settlement's records
KILL = {"EOS_FAULT_POINT": "before_commit", "EOS_FAULT_AT_BATCH": "4", "EOS_FAULT_SKIP_EMPTY": "1"}
FAULT_AFTER = 10  # seconds into the application's run


@dataclass
class BankSource:
    """A test's source: the bank's schema, its connector and the topics it writes."""

    env: dict[str, str]
    bank: Bank
    connector: str

    @property
    def change_topics(self) -> list[str]:
        return [f"{self.bank.schema}.{self.bank.schema}.{table}" for table in ("accounts", "ledger")]

    @property
    def transaction_topic(self) -> str:
        return f"{self.bank.schema}.transaction"


@pytest.fixture
def bank_source(connect: dict[str, str]) -> Iterator[BankSource]:
    env, unique = connect, uuid.uuid4().hex[:10]
    schema, slot, connector = f"bank_{unique}", f"dbz_{unique}", f"bank-{unique}"
    host, port = env["EOS_CONNECT_URL"].removeprefix("http://").split(":")
    conn = source_connection(env)
    bank = Bank(conn, schema, reconnect=lambda: source_connection(env))
    bank.create()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(f"AIRFLOW_CONN_{CONNECT_CONN.upper()}", json.dumps(
            {"conn_type": "kafka_connect", "host": host, "port": int(port), "schema": "http"}))
        hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)
        source = BankSource(env, bank, connector)
        try:
            hook.put_connector_config(connector, postgres_connector_config(
                env, schema, slot, [f"{schema}.accounts", f"{schema}.ledger"]))
            wait_until(f"{connector} RUNNING", lambda: not hook.connector_problems(connector))
            bank.open()
            topics = [*source.change_topics, source.transaction_topic]
            wait_until("the change and transaction topics", lambda: topics_written(env["EOS_KAFKA_BOOTSTRAP"], topics),
                       timeout=180)
            yield source
        finally:
            hook.delete_connector(connector)
            conn = bank.conn  # another one, if a PostgreSQL restart cut the first
            conn.autocommit = True
            drop_slot(Source(conn, schema), slot)
            with conn.cursor() as cur:
                cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            conn.close()


def _config(source: BankSource, tmp_path: Path, engine: str, transactions: str) -> dict[str, Any]:
    name = f"{engine[:4]}_{transactions[:4]}_{uuid.uuid4().hex[:8]}"
    topics = source.change_topics + ([source.transaction_topic] if transactions == "whole" else [])
    return pipeline_config(source.env, tmp_path, name, topics=topics, spec=None,
                           mirror=mirror_section(source.bank.schema, transactions), engine=engine,
                           trigger="processingTime", trigger_interval="1 second", max_offsets_per_trigger=BATCH)


def _start(config: dict[str, Any], tmp_path: Path, label: str, faults: dict[str, str] | None = None) -> AppRun:
    if config["engine"] == "continuous":
        return start_continuous(config, tmp_path, label=label, env_extra=faults)
    return start_app(config, tmp_path, label=label, env_extra=faults)


def _caught_up(source: BankSource, config: dict[str, Any], target: Any) -> bool:
    """The stored offsets at every topic's end and the mirror equal to its source. Offsets alone
    are not enough: a Connect worker that was restarted may not have republished the rest of the
    source's changes yet, and the topics' ends would then be where the stream already is."""
    ends = high_watermarks(source.env["EOS_KAFKA_BOOTSTRAP"], list(config["topics"]))
    if stored_offsets(target, config) != ends:
        return False
    return not any(_differences(source, target, config["target_schema"]).values())


def _caught_up_while_running(source: BankSource, config: dict[str, Any], target: Any, run: AppRun,
                             what: str) -> None:
    """Waits until ``run`` caught up (``_caught_up``); fails with its log if it exits first."""
    wait_until(what, lambda: (run.process.poll() is None and _caught_up(source, config, target))
               or run.process.poll() is not None, timeout=240, interval=1)
    assert run.process.poll() is None, run.log()[-3000:]


def _reader(source: BankSource, config: dict[str, Any]) -> Reader:
    """The REPEATABLE READ reader of ``config``'s mirror."""
    env = source.env
    return Reader({"host": env["EOS_PG_HOST"], "port": int(env["EOS_PG_PORT"]), "dbname": env["EOS_PG_DB"],
                   "user": env["EOS_PG_USER"], "password": env["EOS_PG_PASSWORD"]}, config["target_schema"])


def _differences(source: BankSource, target: Any, target_schema: str) -> dict[str, int]:
    """Rows that differ between each source table and its mirror, and between ledger_sums and the
    source ledger's GROUP BY."""
    queries = {"accounts": "SELECT id, balance FROM {}.accounts",
               "ledger": "SELECT id, account, amount FROM {}.ledger",
               "ledger_sums": "SELECT account, sum(amount) FROM {}.ledger GROUP BY account"}
    found = {}
    for name, query in queries.items():
        with source.bank.conn.cursor() as cur:
            cur.execute(sql.SQL(query).format(sql.Identifier(source.bank.schema)))
            expected = set(cur.fetchall())
        with target.cursor() as cur:
            mirrored = "SELECT account, total FROM {}.ledger_sums" if name == "ledger_sums" else query
            cur.execute(sql.SQL(mirrored).format(sql.Identifier(target_schema)))
            found[name] = len(expected ^ set(cur.fetchall()))
    return found


def _stream_under_a_kill(source: BankSource, config: dict[str, Any], tmp_path: Path,
                         fault: Callable[[], str] | None = None) -> tuple[Reader, dict]:
    """The pipeline streams while the application writes and the reader polls; its first run is
    killed at a batch's commit and a second one catches up. ``fault``, if given, is called
    FAULT_AFTER seconds into the application's run. Returns the reader and what happened."""
    reader = _reader(source, config)
    stop_reader, stop_bank = threading.Event(), threading.Event()
    reading = threading.Thread(target=reader.run, args=(stop_reader,), daemon=True)
    writing = threading.Thread(target=source.bank.run, args=(WORKLOAD_SECONDS, stop_bank), daemon=True)
    transactions_before, seen_fault = source.bank.transactions, None
    killed = _start(config, tmp_path, "killed", KILL)
    runs = [killed]
    try:
        reading.start()
        wait_until("the first run's first batch", lambda: killed.events("batch") or killed.process.poll() is not None,
                   timeout=180, interval=0.2)
        writing.start()
        started = time.monotonic()
        assert killed.wait(180) == -9, killed.log()[-3000:]
        runs.append(_start(config, tmp_path, "restarted"))
        if fault is not None:
            time.sleep(max(0.0, started + FAULT_AFTER - time.monotonic()))
            assert writing.is_alive(), "the application ended before the fault"
            seen_fault = fault()
        writing.join(WORKLOAD_SECONDS + 120)
        assert not writing.is_alive() and source.bank.error is None, source.bank.error
        target = pg_connect(source.env)  # opened after the fault: a PostgreSQL restart would cut it
        _caught_up_while_running(source, config, target, runs[-1],
                                 "the stored offsets at every topic's end, the mirror equal to its source")
        time.sleep(1.5)  # the reader's last polls see the final state
    finally:
        stop_bank.set()
        stop_reader.set()
        reading.join(30)
        for run in runs:
            run.kill()
    assert reader.error is None, reader.error
    differ = _differences(source, target, config["target_schema"])
    target.close()
    seen = {"polls": reader.polls, "violations": reader.violations, "examples": reader.examples,
            "source transactions": source.bank.transactions - transactions_before, "rows that differ": differ,
            "first run's exit": killed.process.returncode, "fault": seen_fault,
            "lost connections (application, reader)": (source.bank.connection_errors, reader.connection_errors),
            "engine runs": len(runs)}
    return reader, seen


@pytest.mark.parametrize("engine", ["spark", "continuous"])
def test_a_reader_never_sees_a_state_the_source_never_had(bank_source: BankSource, tmp_path: Path,
                                                           engine: str) -> None:
    config = _config(bank_source, tmp_path, engine, "whole")
    reader, seen = _stream_under_a_kill(bank_source, config, tmp_path)
    print(f"\n{engine}, transactions: whole: {seen}")
    assert reader.polls >= 100, seen
    assert reader.violations == 0, seen
    assert seen["rows that differ"] == {"accounts": 0, "ledger": 0, "ledger_sums": 0}, seen


@pytest.mark.parametrize("engine", ["spark", "continuous"])
def test_per_key_lets_a_reader_see_partial_transactions(bank_source: BankSource, tmp_path: Path,
                                                        engine: str) -> None:
    """The negative control: the same reader, the same application, batches that end inside
    source transactions. The mirror still ends equal to its source (per key)."""
    config = _config(bank_source, tmp_path, engine, "per_key")
    reader, seen = _stream_under_a_kill(bank_source, config, tmp_path)
    print(f"\n{engine}, transactions: per_key: {seen}")
    assert reader.violations > 0, seen
    assert seen["rows that differ"] == {"accounts": 0, "ledger": 0, "ledger_sums": 0}, seen


def _whole_through(bank_source: BankSource, tmp_path: Path, fault: Callable[[], Any]) -> tuple[Reader, dict]:
    """A whole-transactions run on the continuous engine (the cheaper start) with ``fault`` (a
    daemon's restart) mid-stream; the connector RUNNING again before the run goes on. Asserts what
    every fault must leave: no violation, the mirror equal to its source."""
    config = _config(bank_source, tmp_path, "continuous", "whole")
    hook = KafkaConnectHook(kafka_connect_conn_id=CONNECT_CONN)

    def fault_then_connector() -> str:
        restart = fault()
        wait_until(f"{bank_source.connector} RUNNING again",
                   lambda: not hook.connector_problems(bank_source.connector), timeout=180, interval=1)
        return f"{fault.__name__}: {restart.killed} then {restart.started}, down {restart.down_seconds:.1f}s"

    reader, seen = _stream_under_a_kill(bank_source, config, tmp_path, fault_then_connector)
    print(f"\ncontinuous, transactions: whole, {fault.__name__}: {seen}")
    assert seen["fault"] and reader.polls >= 100 and reader.violations == 0, seen
    assert seen["rows that differ"] == {"accounts": 0, "ledger": 0, "ledger_sums": 0}, seen
    return reader, seen


@pytest.mark.stack_faults  # kills the Connect worker the other tests share: run alone (scripts/test.sh)
def test_a_connect_worker_sigkill_keeps_transactions_whole(bank_source: BankSource, tmp_path: Path) -> None:
    """The Kafka Connect worker SIGKILLed mid-stream and started again: the connector resumes from
    its stored source offsets, inside or between source transactions, and the reader still sees
    only states the source had."""
    _whole_through(bank_source, tmp_path, kill_connect_worker)


@pytest.mark.stack_faults  # restarts the PostgreSQL cluster every test shares: run alone (scripts/test.sh)
def test_a_postgres_restart_keeps_transactions_whole(bank_source: BankSource, tmp_path: Path) -> None:
    """PostgreSQL (source and target share the cluster) restarted in immediate mode mid-stream: the
    application, the reader, the connector and the engine all lose their sessions. The engine
    rides it out without an exit, and the reader still sees only states the source had."""

    def restart_postgres() -> Any:
        return restart_postgres_immediate(lambda: pg_connect(bank_source.env))

    reader, seen = _whole_through(bank_source, tmp_path, restart_postgres)
    assert reader.connection_errors > 0 and bank_source.bank.connection_errors > 0, seen
    assert seen["engine runs"] == 2, seen  # the killed run and the one that rode out the restart


def _snapshot_mid_stream(source: BankSource, config: dict[str, Any], tmp_path: Path, reader: Reader,
                         stop_reader: threading.Event) -> tuple[dict, int, int]:
    """Streams while the application writes, takes a snapshot that holds part of a transaction,
    then stops the stream with a stop request once it caught up. Returns the snapshot's summary
    and the source transactions before and after it."""
    stop_bank = threading.Event()
    writing = threading.Thread(target=source.bank.run, args=(WORKLOAD_SECONDS, stop_bank), daemon=True)
    run = _start(config, tmp_path, "streaming")
    threading.Thread(target=reader.run, args=(stop_reader,), daemon=True).start()
    try:
        wait_until("the first batch", lambda: run.events("batch") or run.process.poll() is not None,
                   timeout=180, interval=0.2)
        writing.start()
        time.sleep(WORKLOAD_SECONDS / 4)
        snap = _snapshot_holding_changes(source, config, tmp_path)
        before = source.bank.transactions
        writing.join(WORKLOAD_SECONDS + 120)
        assert not writing.is_alive() and source.bank.error is None, source.bank.error
        target = pg_connect(source.env)
        wait_until("the stream caught up", lambda: _caught_up(source, config, target), timeout=240, interval=1)
        target.close()
        set_stop_request(_recovery_hook(config), config["pipeline"], True)
        assert run.wait(120) == 0, run.log()[-3000:]  # a stop request ends a run with 0
    finally:
        stop_bank.set()
        run.kill()
    return snap, before, source.bank.transactions


def _snapshot_holding_changes(source: BankSource, config: dict[str, Any], tmp_path: Path,
                              attempts: int = 8) -> dict[str, Any]:
    """A snapshot whose committed state holds part of a source transaction (a settlement larger
    than a batch, held until its last change is read): each attempt waits for held changes, then
    snapshots at once, until a snapshot holds some. Its restore must bring them back, or the
    replay from its offsets would never complete that transaction."""
    from airflow_provider_eos.operators.snapshot import SnapshotOperator

    held = sql.SQL("SELECT count(*) FROM {}.held_changes").format(sql.Identifier(config["meta_schema"]))
    conn = pg_connect(source.env)
    conn.autocommit = True

    def holding() -> bool:
        with conn.cursor() as cur:
            cur.execute(held)
            return cur.fetchone()[0] > 0

    try:
        for attempt in range(attempts):
            wait_until("changes held by the mirror", holding, timeout=60, interval=0.02)
            snap = SnapshotOperator(task_id="snap", pipeline_config=str(tmp_path / "pipeline.json"),
                                    postgres_conn_id=RECOVERY_PG, pg_bin_dir=PG_BIN,
                                    snapshot_store=str(tmp_path / "store")).execute({"run_id": f"snap-{attempt}"})
            if snap["tables"].get(_held_table(config)):
                return snap
    finally:
        conn.close()
    raise AssertionError(f"none of {attempts} snapshots taken while changes were held holds any")


def _held_table(config: dict[str, Any]) -> str:
    """The pipeline's ``held_changes`` as a snapshot's and a restore's summaries name it."""
    return f"{config['meta_schema']}.held_changes"


def _recovery_hook(config: dict[str, Any]) -> Any:
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook

    return PgToolsHook(postgres_conn_id=RECOVERY_PG, meta_schema=config["meta_schema"])


def test_a_restore_then_a_replay_keep_transactions_whole(bank_source: BankSource, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The recovery's two steps on a whole mirror: the snapshot taken mid-stream restored (its
    tables and its stored offsets, held changes included), then the change topics replayed from
    those offsets by a run that ignores the recovery's stop request, while the reader polls all
    along. A restore that put back the tables one by one, a snapshot that was not one state, or a
    replay that started inside a transaction or lost the held part of one would each show here."""
    from airflow_provider_eos.operators.restore import RestoreOperator

    for key, value in connections_env(bank_source.env).items():
        monkeypatch.setenv(key, value)
    # Cycles of at most 16 kB hold a settlement's first part past their in-memory bound, so the
    # database holds it (``engines/cycle_hold``, H3), and a snapshot can take it.
    config = {**_config(bank_source, tmp_path, "continuous", "whole"), "continuous_max_bytes": HELD_IN_DATABASE_BYTES}
    (tmp_path / "pipeline.json").write_text(json.dumps(config))
    reader = _reader(bank_source, config)
    stop_reader = threading.Event()
    try:
        snap, at_snapshot, at_end = _snapshot_mid_stream(bank_source, config, tmp_path, reader, stop_reader)
        polls_before_restore = reader.polls
        restored = RestoreOperator(task_id="restore", pipeline_config=str(tmp_path / "pipeline.json"),
                                   postgres_conn_id=RECOVERY_PG, pg_bin_dir=PG_BIN, quiet_seconds=0,
                                   release_lock=True, kafka_config_id=RECOVERY_KAFKA,
                                   snapshot_store=str(tmp_path / "store")).execute({"run_id": "restore"})
        assert restored["snapshot_id"] == snap["snapshot_id"], restored
        assert restored["tables"][_held_table(config)] > 0, restored  # part of a transaction
        target = pg_connect(bank_source.env)
        assert any(_differences(bank_source, target, config["target_schema"]).values())  # back in time
        replay = _start({**config, "ignore_stop_request": True}, tmp_path, "replay")
        try:
            _caught_up_while_running(bank_source, config, target, replay, "the replay caught up")
            time.sleep(1.5)  # the reader's last polls see the final state
        finally:
            replay.kill()
        replayed = sum(batch["applied"] for batch in replay.events("batch"))
        differ = _differences(bank_source, target, config["target_schema"])
        target.close()
    finally:
        stop_reader.set()
    set_stop_request(_recovery_hook(config), config["pipeline"], False)
    seen = {"polls": reader.polls, "polls after the restore began": reader.polls - polls_before_restore,
            "violations": reader.violations, "examples": reader.examples,
            "source transactions before, after the snapshot": (at_snapshot, at_end - at_snapshot),
            "changes applied by the replay": replayed, "rows that differ": differ,
            "held changes restored": restored["tables"][_held_table(config)]}
    print(f"\ncontinuous, transactions: whole, restore then replay: {seen}")
    assert reader.error is None, reader.error
    assert at_end > at_snapshot and replayed > 0, seen
    assert seen["polls after the restore began"] >= 50 and reader.violations == 0, seen
    assert differ == {"accounts": 0, "ledger": 0, "ledger_sums": 0}, seen
