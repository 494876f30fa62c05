"""Fencing, the streaming app's side, against the real stack: a driver whose
target was put back under it, or whose epoch was bumped, writes nothing more
and exits 3 (fenced); a stop requested before its first batch is honoured."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.state import fencing, meta_tables
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import AppRun, audit, pg_connect, pipeline_config, run_app, start_app

pytestmark = pytest.mark.integration


def _wait_for(condition, timeout: float, run: AppRun, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if run.process.poll() is not None:
            raise AssertionError(f"the driver exited {run.process.returncode} while waiting for {what}:\n"
                                 f"{run.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f}s:\n{run.log()[-3000:]}")
        time.sleep(0.5)


def _rows(stack: dict, config: dict) -> int:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (sql.SQL("{}.ledger_events").format(
            sql.Identifier(config["target_schema"])).as_string(cur),))
        if cur.fetchone() == (None,):
            conn.close()
            return 0
        cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events").format(sql.Identifier(config["target_schema"])))
        (count,) = cur.fetchone()
    conn.close()
    return count


def _stop_or_kill(stack: dict, config: dict, run: AppRun, timeout: float = 60) -> int:
    """Ends a driver that did not exit by itself (the code before fencing): a
    stop request, then SIGKILL. Returns its exit code."""
    if run.process.poll() is None:
        conn = pg_connect(stack)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, now(), 'test')"
                                " ON CONFLICT (pipeline) DO UPDATE SET stop_requested_at = now()").format(
                meta_tables.table(config["meta_schema"], meta_tables.CONTROL)), (config["pipeline"],))
        try:
            run.wait(timeout)
        except subprocess.TimeoutExpired:
            run.kill()
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {} SET stop_requested_at = NULL WHERE pipeline = %s").format(
                meta_tables.table(config["meta_schema"], meta_tables.CONTROL)), (config["pipeline"],))
        conn.close()
    return run.process.returncode


def test_rewind_under_a_running_driver_fences_it(stack: dict, tmp_path: Path, unique_name: str) -> None:
    """Issue 10, test 1. Partition 0 is put back from ~1,500 to offset 200 under
    a continuous exactly_once driver, in one transaction and WITHOUT bumping the
    epoch: the per-partition check alone must stop the driver's next batch,
    which would otherwise store offsets past the gap (GREATEST) and lose
    ~1,300 events for good."""
    config = pipeline_config(stack, tmp_path, f"rew{unique_name}", trigger="processingTime",
                             trigger_interval="1 second", max_offsets_per_trigger=1000)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    target, meta = sql.Identifier(config["target_schema"]), sql.Identifier(config["meta_schema"])
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 3000, topic=topic, seed=11, transactional_id=f"r1{unique_name}")
    driver = start_app(config, tmp_path, label="continuous")
    try:
        _wait_for(lambda: _rows(stack, config) == 3000, 240, driver, "3000 rows applied")
        conn = pg_connect(stack)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT next_offset FROM {}.kafka_offsets WHERE pipeline = %s AND partition = 0")
                        .format(meta), (config["pipeline"],))
            (applied_to,) = cur.fetchone()
            assert applied_to > 1000, applied_to  # "about 1,500"
            # What a restore's swap does to one partition, in one transaction
            # under the pipeline lock (so no batch is half-way), epoch untouched.
            cur.execute("BEGIN")
            fencing.lock_pipeline(cur, config["pipeline"])
            cur.execute(sql.SQL(
                "UPDATE {t}.account_balances b SET balance_cents = b.balance_cents - d.amount,"
                " event_count = b.event_count - d.events FROM (SELECT account_id, sum(amount_cents) AS amount,"
                " count(*) AS events FROM {t}.ledger_events WHERE kafka_partition = 0 AND kafka_offset >= 200"
                " GROUP BY account_id) d WHERE b.account_id = d.account_id").format(t=target))
            cur.execute(sql.SQL("DELETE FROM {t}.ledger_events WHERE kafka_partition = 0 AND kafka_offset >= 200")
                        .format(t=target))
            rewound = cur.rowcount
            cur.execute(sql.SQL("UPDATE {m}.kafka_offsets SET next_offset = 200 WHERE pipeline = %s"
                                " AND partition = 0").format(m=meta), (config["pipeline"],))
            cur.execute("COMMIT")
        conn.close()
        print(f"partition 0 put back from {applied_to} to 200: {rewound} rows removed")
        produce_ledger(bootstrap, 1000, topic=topic, seed=12, first_seq=3000, transactional_id=f"r2{unique_name}")
        try:
            exit_code = driver.wait(180)
        except subprocess.TimeoutExpired:  # the code before fencing keeps running
            exit_code = _stop_or_kill(stack, config, driver)
        fenced_log = driver.log()
    finally:
        if driver.process.poll() is None:
            driver.kill()

    resumed = run_app({**config, "trigger": "availableNow"}, tmp_path, label="resume")
    report = audit(config, tmp_path)
    summary, balances = report["summary"], report["aggregates"]["account_balances"]
    print(f"driver exit {exit_code}; after the resume: missing {summary['missing']}, duplicated "
          f"{summary['duplicated']}, balances wrong {balances['keys_wrong']} of {balances['keys']}, "
          f"rows expected {summary['committed_records']}")
    assert exit_code == fencing.EXIT_FENCED, fenced_log[-3000:]
    errors = driver.events("error")
    assert errors and errors[-1]["kind"] == "fenced", errors
    assert "put back below this batch's start" in errors[-1]["message"] and f"{topic}[0]" in errors[-1]["message"]
    assert resumed.process.returncode == 0, resumed.log()[-3000:]
    assert resumed.events("resume")[0]["stored_offsets"].count('"0": 200') == 1  # resumed from the database
    assert report["ok"], report
    assert summary["missing"] == 0 and summary["duplicated"] == 0 and balances["keys_wrong"] == 0
    assert summary["committed_records"] == 4000 and summary["dead_lettered"] == 0


def test_an_idle_driver_whose_epoch_was_bumped_exits_fenced(stack: dict, tmp_path: Path, unique_name: str) -> None:
    """No new data, so no batch would ever check the epoch: the stop poll must,
    or the orphan would hold the running lock (and keep its successor out)."""
    config = pipeline_config(stack, tmp_path, f"idle{unique_name}", trigger="processingTime",
                             trigger_interval="1 second")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    produce_ledger(bootstrap, 300, topic=topic, seed=13, transactional_id=f"i{unique_name}")
    driver = start_app(config, tmp_path, label="idle")
    try:
        _wait_for(lambda: _rows(stack, config) == 300, 240, driver, "300 rows applied")
        time.sleep(2)  # idle: every trigger since finds nothing new
        conn = pg_connect(stack)
        conn.autocommit = False
        epoch = fencing.bump_epoch(conn, config["meta_schema"], config["pipeline"], by="test", reason="fence test")
        conn.close()
        bumped = time.monotonic()
        try:
            exit_code = driver.wait(60)
        except subprocess.TimeoutExpired:
            exit_code = _stop_or_kill(stack, config, driver)
        took = time.monotonic() - bumped
    finally:
        if driver.process.poll() is None:
            driver.kill()
    print(f"epoch bumped to {epoch}; driver exit {exit_code} after {took:.1f}s")
    assert exit_code == fencing.EXIT_FENCED, driver.log()[-3000:]
    assert took < 15, took
    assert driver.events("error")[-1]["kind"] == "fenced"
    assert driver.events("resume")[0]["epoch"] == epoch - 1
    assert _rows(stack, config) == 300


def test_a_stop_requested_before_the_first_batch_is_honoured(stack: dict, tmp_path: Path,
                                                             unique_name: str) -> None:
    """A supervisor restarting the stream while a recovery holds the stop
    request must not get a batch in; the recovery's own replay run
    (ignore_stop_request) still runs."""
    config = pipeline_config(stack, tmp_path, f"early{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 500, topic=topic, seed=14, transactional_id=f"e{unique_name}")
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        for statement in meta_tables.ddl_statements(config["meta_schema"]):
            cur.execute(statement)
        cur.execute(sql.SQL("INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, now(), 'test')")
                    .format(meta_tables.table(config["meta_schema"], meta_tables.CONTROL)), (config["pipeline"],))
        epoch_before = fencing.current_epoch(cur, config["meta_schema"], config["pipeline"])
    stopped = run_app(config, tmp_path, label="stopped")
    rows_after_stopped_run = _rows(stack, config)
    print(f"stopped run: exit {stopped.process.returncode}, {len(stopped.events('batch'))} batches, "
          f"{rows_after_stopped_run} rows")
    assert stopped.process.returncode == 0, stopped.log()[-3000:]
    assert rows_after_stopped_run == 0 and stopped.events("batch") == []
    assert stopped.events("stopped")[0]["before_first_batch"] is True
    with conn.cursor() as cur:  # it fenced no one on its way out
        assert fencing.current_epoch(cur, config["meta_schema"], config["pipeline"]) == epoch_before

    replay = run_app({**config, "ignore_stop_request": True}, tmp_path, label="replay")
    assert replay.process.returncode == 0, replay.log()[-3000:]
    assert _rows(stack, config) == 500
    report = audit(config, tmp_path)
    assert report["ok"] and report["summary"]["committed_records"] == 500, report
    conn.close()
