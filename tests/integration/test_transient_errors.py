"""Poison means the data, never the weather, against the real stack: a lock
timeout storm that outlasts max_batch_attempts quarantines no valid record,
and once the lock clears everything lands exactly once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.state import meta_tables
from spark_apps.eos_stream.state.ddl import run_ddl
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from spark_apps.ledger.spec import ledger_ddl
from tests.streaming import audit, dead_letter_count, pg_connect, pipeline_config, run_app, start_app

pytestmark = pytest.mark.integration

EVENTS = 200


def _retries(tmp_path: Path) -> list[str]:
    return [line for log in tmp_path.glob("storm-*.log") for line in log.read_text(errors="replace").splitlines()
            if line.startswith("EOS-RETRY ")]


# lock_timeout=1s for the app's sessions only (libpq's PGOPTIONS in its
# environment): ALTER ROLE or ALTER DATABASE would reach every other test
# running on this database.
APP_ENV = {"PGOPTIONS": "-c lock_timeout=1000"}


def _storm_pipeline(stack: dict, tmp_path: Path, name: str, poison: int = 0) -> dict:
    """A one-partition pipeline with EVENTS valid events (plus ``poison``), its
    targets created up front, as in production, so the lock can come first."""
    config = pipeline_config(stack, tmp_path, name, max_batch_attempts=1)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    produce_ledger(bootstrap, EVENTS, topic=topic, seed=21, poison=poison, transactional_id=f"t{name}")
    setup = pg_connect(stack)
    with setup.cursor() as cur:
        run_ddl(cur, [*ledger_ddl(config["target_schema"]), *meta_tables.ddl_statements(config["meta_schema"])])
    setup.close()
    return config


def test_lock_timeout_storm_quarantines_nothing(stack: dict, tmp_path: Path, unique_name: str) -> None:
    app_env = APP_ENV
    config = _storm_pipeline(stack, tmp_path, f"storm{unique_name}")
    holder, observer = pg_connect(stack), pg_connect(stack)
    held = threading.Event()
    hold: dict = {}

    def hold_the_lock() -> None:
        """SHARE lock on the aggregate target (a long-running report, a manual
        LOCK) until the app has been turned away more often than
        max_batch_attempts allows. The code before the fix shows no retries
        (it restarts and then quarantines, invisibly until its batch
        commits), so there the lock is held for the full 120 s."""
        started = time.monotonic()
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(sql.SQL("LOCK TABLE {}.account_balances IN SHARE MODE").format(
                sql.Identifier(config["target_schema"])))
            held.set()
            while time.monotonic() - started < 120 and len(_retries(tmp_path)) < 3:
                time.sleep(0.5)
            cur.execute("ROLLBACK")
        hold["seconds"] = time.monotonic() - started

    locker = threading.Thread(target=hold_the_lock, daemon=True)
    locker.start()
    assert held.wait(30)
    exits = []
    try:
        for attempt in range(6):  # what a supervisor does: restart after each failure
            run = run_app(config, tmp_path, timeout=420, env_extra=app_env, label=f"storm-{attempt}")
            exits.append(run.process.returncode)
            if run.process.returncode == 0:
                break
    finally:
        locker.join(240)
    dead = dead_letter_count(observer, config)
    retries = _retries(tmp_path)
    report = audit(config, tmp_path)
    summary = report["summary"]
    print(f"lock held {hold.get('seconds', -1):.0f}s; exits {exits}; transient retries {len(retries)}; "
          f"valid events dead-lettered {dead}; audit ok={report['ok']} missing={summary['missing']} "
          f"duplicated={summary['duplicated']} rows expected {summary['committed_records']}")
    for conn in (holder, observer):
        conn.close()
    assert dead == 0, f"{dead} valid events quarantined for a lock timeout"
    assert exits == [0], exits  # retried in the driver, never counted as a failed attempt
    assert len(retries) >= 3 and all('"sqlstate": "55P03"' in line for line in retries), retries
    assert report["ok"], report
    assert summary["committed_records"] == EVENTS and summary["missing"] == 0 and summary["duplicated"] == 0
    assert report["aggregates"]["account_balances"]["actual_event_count"] == EVENTS


def test_lock_timeout_during_record_by_record_rolls_the_batch_back(
        stack: dict, tmp_path: Path, unique_name: str) -> None:
    """A batch already being isolated (one real poison record, its data error
    counted by an earlier driver that died: past max_batch_attempts) meets a
    lock timeout: the records it hits are not quarantined; the whole batch
    rolls back and is retried, and in the end only the poison record is
    dead-lettered, with its SQLSTATE."""
    from spark_apps.eos_stream.kafka.ranges import EARLIEST
    from spark_apps.eos_stream.sink.poison_guard import PoisonGuard, batch_key

    config = _storm_pipeline(stack, tmp_path, f"rbr{unique_name}", poison=1)
    counter = pg_connect(stack)
    PoisonGuard(counter, config["meta_schema"], config["pipeline"], max_attempts=1).record_failure(
        batch_key({(config["topics"][0], 0): EARLIEST}), "data: counted by a driver that died", counted=True)
    counter.close()

    holder = pg_connect(stack)
    with holder.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(sql.SQL("LOCK TABLE {}.account_balances IN SHARE MODE").format(
            sql.Identifier(config["target_schema"])))
    run = start_app(config, tmp_path, env_extra=APP_ENV, label="storm-rbr")
    deadline = time.monotonic() + 240
    while len(_retries(tmp_path)) < 2 and run.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    holder.rollback()
    holder.close()
    try:
        exit_code = run.wait(240)
    finally:
        if run.process.poll() is None:
            run.kill()
    observer = pg_connect(stack)
    with observer.cursor() as cur:
        cur.execute(sql.SQL("SELECT sqlstate, error FROM {} WHERE pipeline = %s").format(
            meta_tables.table(config["meta_schema"], meta_tables.DEAD_LETTERS)), (config["pipeline"],))
        dead = cur.fetchall()
    observer.close()
    report = audit(config, tmp_path)
    print(f"exit {exit_code}; transient retries {len(_retries(tmp_path))}; dead letters {len(dead)} "
          f"({sorted({d[0] for d in dead}, key=str)}); audit ok={report['ok']}")
    assert exit_code == 0, run.log()[-3000:]
    assert any(batch["record_by_record"] for batch in run.events("batch"))
    assert len(_retries(tmp_path)) >= 2
    assert len(dead) == 1 and dead[0][0] == "22001" and "value too long" in dead[0][1], dead
    assert report["ok"], report
    assert report["aggregates"]["account_balances"]["actual_event_count"] == EVENTS
