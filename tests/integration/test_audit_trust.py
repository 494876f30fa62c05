"""The audit trusted both ways, on the real stack: green only when the target is
right (a valid record wrongly quarantined is red: PostgreSQL takes its insert when
the audit tries it), red only when it is wrong (records Kafka deleted, a stream
still running, records the database refuses in the dead letters), and never hung
by partitions whose remaining offsets are markers or deleted records."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import IsolationLevel, Producer
from confluent_kafka import TopicPartition as KafkaTP
from confluent_kafka.admin import AdminClient, OffsetSpec
from psycopg2 import sql

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.streaming import ROOT, audit, pg_connect, pipeline_config, run_app, start_app

pytestmark = pytest.mark.integration


# The seq of the account's last remaining event: what last_seq holds had the
# deleted event never been applied.
LAST_SEQ_OF_ACCOUNT = sql.SQL("(SELECT e.seq FROM {t}.ledger_events e WHERE e.account_id = b.account_id"
                              " ORDER BY e.kafka_partition DESC, e.kafka_offset DESC LIMIT 1)")


def _event(seq: int) -> bytes:
    return json.dumps({"event_id": f"ev-{seq}", "account_id": f"acct-{seq % 17:05d}", "amount_cents": seq % 900 - 300,
                       "ts": "2026-01-01T00:00:00+00:00", "seq": seq}).encode()


def _produce(bootstrap: str, topic: str, partition: int, count: int, txn_id: str, *, first_seq: int,
             abort: bool = False) -> None:
    """One transaction of ``count`` ledger events into one partition, committed or aborted."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id})
    producer.init_transactions(30)
    producer.begin_transaction()
    for seq in range(first_seq, first_seq + count):
        producer.produce(topic, value=_event(seq), partition=partition)
    producer.flush(30)
    if abort:
        producer.abort_transaction(30)
    else:
        producer.commit_transaction(30)


def _offsets(bootstrap: str, topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """(earliest, LSO) per partition."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions = [KafkaTP(topic, p) for p in admin.list_topics(topic, timeout=15).topics[topic].partitions]
    out = []
    for spec in (OffsetSpec.earliest(), OffsetSpec.latest()):
        futures = admin.list_offsets({tp: spec for tp in partitions}, isolation_level=IsolationLevel.READ_COMMITTED,
                                     request_timeout=30)
        out.append({tp.partition: future.result().offset for tp, future in futures.items()})
    return out[0], out[1]


def _delete_before(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_records([KafkaTP(topic, partition, offset)], operation_timeout=30).values():
        future.result(30)


def _audit_cli(config: dict[str, Any], tmp_path: Path, *flags: str, timeout: float) -> dict[str, Any]:
    """The audit CLI as a child process with its own time limit, so a hang fails the test."""
    path = tmp_path / f"{config['pipeline']}-audit-cli.json"
    path.write_text(json.dumps(config))
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.audit", "--config", str(path), *flags],
                                capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the audit did not finish in {timeout:g}s") from None
    report = json.loads(result.stdout)
    report.update(exit_code=result.returncode, stderr=result.stderr, seconds=round(time.monotonic() - started, 1))
    return report


def test_retention_deleted_prefix_keeps_an_exact_target_green(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"aret{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 3000, topic=topic, abort_every=4, batch_size=250, seed=21,
                   transactional_id=f"ar{unique_name}")
    run = run_app(config, tmp_path, label="retention")
    assert run.process.returncode == 0, run.log()[-3000:]
    assert audit(config, tmp_path)["ok"]

    _earliest, lso = _offsets(bootstrap, topic)
    _delete_before(bootstrap, topic, 0, lso[0] // 2)  # what retention does to the oldest segments
    report = audit(config, tmp_path)
    summary, balances = report["summary"], report["aggregates"]["account_balances"]
    print(f"\nafter deleting partition 0 below {lso[0] // 2}: ok={report['ok']} mismatches={report['mismatches']} "
          f"unexpected={summary['unexpected']} rows_below_earliest={summary.get('rows_below_earliest')} "
          f"balances wrong={balances['keys_wrong']} of {balances['keys']} ({balances.get('checked_against')})")
    assert report["ok"], report
    assert summary["unexpected"] == 0 and summary["missing"] == 0 and balances["keys_wrong"] == 0
    assert summary["rows_below_earliest"] > 0
    assert summary["committed_records"] + summary["rows_below_earliest"] == 3000
    assert "ledger_events" in balances["checked_against"]

    # Below the earliest offset a dead letter is judged by its stored raw value.
    target, meta = sql.Identifier(config["target_schema"]), sql.Identifier(config["meta_schema"])
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(sql.SQL(
            "DELETE FROM {t}.ledger_events WHERE kafka_partition = 0 AND kafka_offset = (SELECT kafka_offset"
            " FROM {t}.ledger_events WHERE kafka_partition = 0 ORDER BY kafka_offset LIMIT 1 OFFSET 5)"
            " RETURNING kafka_topic, kafka_offset, event_id, account_id, amount_cents, ts, seq").format(t=target))
        t, o, event_id, account, amount, ts, seq = cur.fetchone()
        cur.execute(sql.SQL("UPDATE {t}.account_balances b SET balance_cents = balance_cents - %s,"
                            " event_count = event_count - 1, last_seq = {last} WHERE account_id = %s").format(
                    t=target, last=LAST_SEQ_OF_ACCOUNT.format(t=target)), (amount, account))
        raw = json.dumps({"event_id": event_id, "account_id": account, "amount_cents": amount,
                          "ts": ts.isoformat(), "seq": seq}).encode()
        cur.execute(sql.SQL('INSERT INTO {m}.dead_letters (pipeline, topic, partition, "offset", value, error)'
                            " VALUES (%s, %s, 0, %s, %s, 'missing required field')").format(m=meta),
                    (config["pipeline"], t, o, raw))
        cur.execute("COMMIT")
    valid_quarantined = audit(config, tmp_path)

    def quarantined(value: bytes) -> dict[str, Any]:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {m}.dead_letters SET value = %s").format(m=meta), (value,))
        return audit(config, tmp_path)

    malformed_quarantined = quarantined(b"{not json")
    # Values parse_record accepts and PostgreSQL refuses: asked, the database says no.
    too_long = quarantined(raw.replace(account.encode(), b"x" * 300))  # varchar overflow, 22001
    bad_zone = quarantined(raw.replace(b'"ts": "', b'"ts": "2026-01-01T00:00:00+16:00", "_": "'))  # 22009
    print(f"a dead letter below the earliest offset: valid value -> ok={valid_quarantined['ok']} "
          f"{valid_quarantined['mismatches']}; malformed value -> ok={malformed_quarantined['ok']}; "
          f"too long -> ok={too_long['ok']} {too_long['summary'].get('dead_letter_trials')}; "
          f"+16:00 -> ok={bad_zone['ok']} {bad_zone['summary'].get('dead_letter_trials')}")
    assert valid_quarantined["mismatches"] == ["dead_letters:wrongly_quarantined"], valid_quarantined
    assert malformed_quarantined["ok"], malformed_quarantined
    assert too_long["ok"], too_long
    assert bad_zone["ok"], bad_zone
    assert valid_quarantined["summary"]["dead_letter_trials"] == {"applies": 1}
    assert too_long["summary"]["dead_letter_trials"] == {"refused:22001": 1}
    [bad_zone_trial] = bad_zone["summary"]["dead_letter_trials"]
    assert bad_zone_trial.startswith("refused:22") or bad_zone_trial == "does_not_parse", bad_zone_trial

    # Still red when the part Kafka no longer holds is wrong: one row there twice.
    with conn.cursor() as cur:
        cur.execute(sql.SQL("INSERT INTO {t} SELECT * FROM {t} WHERE kafka_partition = 0 AND kafka_offset = "
                            "(SELECT min(kafka_offset) FROM {t} WHERE kafka_partition = 0)").format(
                    t=sql.Identifier(config["target_schema"], "ledger_events")))
    conn.close()
    damaged = audit(config, tmp_path)
    assert not damaged["ok"] and damaged["summary"]["duplicated"] == 1, damaged
    assert "account_balances" in damaged["mismatches"]  # the carrier now disagrees with the balances


def test_a_valid_record_wrongly_quarantined_is_red(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"aquar{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=1)
    # One record that is not JSON: truly poison. (Values the database refuses are tried on the
    # stored-value path in the test above: on the staged path such a record still fails the
    # run until issue 22 §1 lands.)
    produce_ledger(bootstrap, 1500, topic=topic, seed=22, malformed=1, transactional_id=f"aq{unique_name}")
    run = run_app(config, tmp_path, label="quarantine")
    assert run.process.returncode == 0, run.log()[-3000:]
    clean = audit(config, tmp_path)
    assert clean["ok"], clean
    target, meta = sql.Identifier(config["target_schema"]), sql.Identifier(config["meta_schema"])
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        # What the record-by-record fallback did under a lock-timeout storm: the
        # record's row and its share of the balance are gone, a dead letter instead.
        cur.execute("BEGIN")
        cur.execute(sql.SQL(
            "DELETE FROM {t}.ledger_events WHERE kafka_offset = (SELECT kafka_offset FROM {t}.ledger_events"
            " ORDER BY kafka_offset LIMIT 1 OFFSET 700) RETURNING kafka_topic, kafka_partition, kafka_offset,"
            " event_id, account_id, amount_cents, ts, seq").format(t=target))
        t, p, o, event_id, account, amount, ts, seq = cur.fetchone()
        cur.execute(sql.SQL("UPDATE {t}.account_balances b SET balance_cents = balance_cents - %s,"
                            " event_count = event_count - 1, last_seq = {last} WHERE account_id = %s").format(
                    t=target, last=LAST_SEQ_OF_ACCOUNT.format(t=target)), (amount, account))
        raw = json.dumps({"event_id": event_id, "account_id": account, "amount_cents": amount,
                          "ts": ts.isoformat(), "seq": seq}).encode()
        cur.execute(sql.SQL('INSERT INTO {m}.dead_letters (pipeline, topic, partition, "offset", value, error,'
                            " sqlstate) VALUES (%s, %s, %s, %s, %s, %s, %s)").format(m=meta),
                    (config["pipeline"], t, p, o, raw,
                     "rejected by the database: canceling statement due to lock timeout", "55P03"))
        cur.execute("COMMIT")
        cur.execute(sql.SQL("SELECT balance_cents FROM {t}.account_balances WHERE account_id = %s").format(t=target),
                    (account,))
        [balance_before] = cur.fetchone()

    def set_sqlstate(code: str | None) -> dict[str, Any]:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {m}.dead_letters SET sqlstate = %s WHERE pipeline = %s").format(m=meta),
                        (code, config["pipeline"]))
        return audit(config, tmp_path)

    try:
        lock_timeout = audit(config, tmp_path)
        no_sqlstate = set_sqlstate(None)
        # The stored SQLSTATE says "data error", but the database takes the record now: not poison.
        data_error = set_sqlstate("22001")
    finally:
        conn.close()
    # The trials left nothing behind: no staging table, no row, no balance changed.
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s"
                    " AND starts_with(tablename, 'eos_audit_trial_')", (config["meta_schema"],))
        assert cur.fetchone()[0] == 0
        cur.execute(sql.SQL("SELECT count(*), sum(balance_cents) FROM {t}.account_balances"
                            " WHERE account_id = %s").format(t=target), (account,))
        balance_after = cur.fetchone()
        cur.execute(sql.SQL("SELECT count(*) FROM {t}.ledger_events WHERE kafka_offset = %s").format(t=target), (o,))
        assert cur.fetchone()[0] == 0
    conn.close()
    assert balance_after == (1, balance_before), (balance_after, balance_before)
    for name, report in (("55P03", lock_timeout), ("no sqlstate", no_sqlstate), ("22001", data_error)):
        print(f"\ndead letter with {name}: ok={report['ok']} mismatches={report['mismatches']} "
              f"by_class={report['summary'].get('dead_letters_by_class')} "
              f"wrongly_quarantined={report['summary'].get('wrongly_quarantined')}")
    assert not lock_timeout["ok"], lock_timeout
    assert lock_timeout["mismatches"] == ["dead_letters:wrongly_quarantined"]
    assert lock_timeout["summary"]["dead_letters_by_class"] == {"not_data:55P03": 1, "parse": 1}
    (why,) = lock_timeout["dead_letters"]["wrongly_quarantined"]
    assert (why["offset"], why["sqlstate"]) == (o, "55P03") and "not a data error" in why["reason"]

    for report in (no_sqlstate, data_error):
        assert not report["ok"], report
        assert report["mismatches"] == ["dead_letters:wrongly_quarantined"]
        (why,) = report["dead_letters"]["wrongly_quarantined"]
        assert why["offset"] == o and why["trial"] == "applies", why
        assert "its own insert into the targets succeeds" in why["reason"]
        assert report["summary"]["dead_letter_trials"] == {"applies": 1, "does_not_parse": 1}
    assert no_sqlstate["summary"]["dead_letters_by_class"] == {"parse": 2}
    # (set_sqlstate sets it on the malformed record's dead letter too: still poison, it does not parse)
    assert data_error["summary"]["dead_letters_by_class"] == {"data_exception": 2}

    # The topic removed from the definition, another in its place that the stream now reads,
    # with events of the same accounts: the old topic's rows, offsets and dead letters are
    # retired (reported, not compared); the balances are checked against the carrier's rows for
    # it, and each account's last_seq comes from the new topic, applied after the old one.
    other = f"{topic}.next"
    ensure_topic(bootstrap, other, partitions=1)
    produce_ledger(bootstrap, 300, topic=other, seed=24, first_seq=100_000, transactional_id=f"aq2{unique_name}")
    moved = {**config, "topics": [other]}
    assert run_app(moved, tmp_path, label="moved").process.returncode == 0
    retired = audit(moved, tmp_path)
    assert retired["ok"], retired
    assert retired["retired_topics"] == {topic: {"stored_offsets": {"0": clean["kafka"][f"{topic}:0"]["stored_offset"]},
                                                 "rows": {"ledger_events": 1499}, "dead_letters": 2}}, retired
    assert retired["summary"]["committed_records"] == 300
    assert retired["aggregates"]["account_balances"]["keys_wrong"] == 0


def test_a_latest_value_out_of_kafka_order_is_red(stack: dict, tmp_path: Path, unique_name: str) -> None:
    """last_seq must be the in-order fold of the account's events: an earlier event's seq
    there is red even though every sum is right, and putting it back is green again."""
    config = pipeline_config(stack, tmp_path, f"alast{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 800, topic=topic, accounts=40, seed=23, transactional_id=f"al{unique_name}")
    run = run_app(config, tmp_path, label="latest")
    assert run.process.returncode == 0, run.log()[-3000:]
    assert audit(config, tmp_path)["ok"]

    target = sql.Identifier(config["target_schema"])
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(
                "SELECT account_id, last_seq, (SELECT min(seq) FROM {t}.ledger_events e"
                " WHERE e.account_id = b.account_id) FROM {t}.account_balances b WHERE event_count > 1"
                " ORDER BY account_id LIMIT 1").format(t=target))
            account, last, first = cur.fetchone()
            assert first < last
            cur.execute(sql.SQL("UPDATE {t}.account_balances SET last_seq = %s WHERE account_id = %s")
                        .format(t=target), (first, account))
        out_of_order = audit(config, tmp_path)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {t}.account_balances SET last_seq = %s WHERE account_id = %s")
                        .format(t=target), (last, account))
        restored = audit(config, tmp_path)
    finally:
        conn.close()
    balances = out_of_order["aggregates"]["account_balances"]
    print(f"\nlast_seq of {account} set from {last} to {first}: ok={out_of_order['ok']} "
          f"mismatches={out_of_order['mismatches']} wrong_keys={balances['wrong_keys']}")
    assert out_of_order["mismatches"] == ["account_balances"], out_of_order
    assert balances["wrong_keys"] == [[account]] and balances["keys_wrong"] == 1
    assert balances["expected_balance_cents"] == balances["actual_balance_cents"]  # the sums were right
    assert restored["ok"], restored

    # After a replay the stored offsets must reach its goal: the CLI's --goal.
    stored = {str(p): restored["kafka"][f"{topic}:{p}"]["stored_offset"] for p in (0, 1)}
    reached = _audit_cli(config, tmp_path, "--goal", json.dumps({topic: stored}), timeout=120)
    short = _audit_cli(config, tmp_path, "--goal", json.dumps({topic: {**stored, "1": stored["1"] + 5}}), timeout=120)
    assert reached["exit_code"] == 0 and reached["goal"][f"{topic}:1"]["short"] == 0, reached
    assert short["exit_code"] == 1 and short["mismatches"] == [f"goal_not_reached:{topic}:1"], short
    assert short["summary"]["goal_shortfall"] == 5


def test_a_key_spread_over_partitions_may_hold_any_partitions_last_value(
        stack: dict, tmp_path: Path, unique_name: str) -> None:
    """One account's events in two partitions (as an unkeyed producer writes them). The apply keeps
    each batch's highest (partition, offset), so the stored last_seq depends on where batches end:
    written here in two batches by the sink itself (``tests/sink_harness``), the second holding only
    partition 0's tail, it is partition 0's last seq. Green (the audit used to expect partition 1's
    and call it wrong); partition 1's last seq is green too (other batch ends make it); a seq that
    is no partition's last is red."""
    from tests.sink_harness import LedgerSink

    config = pipeline_config(stack, tmp_path, f"aspread{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    account = "acct-spread"
    values = {(p, o): json.dumps({"event_id": f"ev-{p}-{o}", "account_id": account, "amount_cents": 10 * p + o,
                                  "ts": "2026-01-01T00:00:00+00:00", "seq": 100 * p + o}).encode()
              for p in (0, 1) for o in range(3)}
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"as{unique_name}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for (p, _o), value in sorted(values.items()):
        producer.produce(topic, value=value, partition=p)  # offsets 0-2 in each partition
    producer.flush(30)
    producer.commit_transaction(30)

    names = (config["target_schema"], config["meta_schema"], config["pipeline"])
    with LedgerSink(stack, unique_name, names=names) as sink:
        for batch_id, batch in enumerate(([(1, 0), (1, 1), (1, 2), (0, 0)], [(0, 1), (0, 2)])):
            sink.process_records(batch_id, [(topic, p, o, None, values[(p, o)]) for p, o in batch])
        balances = sql.SQL("{}.account_balances").format(sql.Identifier(sink.target))
        reports = {}
        for last_seq in (None, 102, 1):  # as the batches left it (2), partition 1's last, partition 0's middle
            with sink.conn.cursor() as cur:
                if last_seq is not None:
                    cur.execute(sql.SQL("UPDATE {} SET last_seq = %s").format(balances), (last_seq,))
                cur.execute(sql.SQL("SELECT last_seq FROM {}").format(balances))
                stored = cur.fetchone()[0]
            sink.conn.commit()
            reports[stored] = audit(config, tmp_path)
    print(f"\n{account}: last_seq -> ok: {dict((k, r['ok']) for k, r in reports.items())}")
    assert sorted(reports) == [1, 2, 102]
    for stored in (2, 102):
        assert reports[stored]["ok"], reports[stored]
        assert reports[stored]["aggregates"]["account_balances"]["keys_spread_over_partitions"] == 1
    wrong = reports[1]
    assert wrong["mismatches"] == ["account_balances"], wrong
    assert wrong["aggregates"]["account_balances"]["wrong_keys"] == [[account]]


def test_an_audit_while_the_stream_runs_does_not_false_alarm(stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"arun{unique_name}", trigger="processingTime",
                             trigger_interval="1 second", max_offsets_per_trigger=150, run_seconds=240)
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=2)
    produce_ledger(bootstrap, 1500, topic=topic, seed=23, transactional_id=f"arun-a{unique_name}")
    producing_error: list[BaseException] = []

    def keep_producing() -> None:
        try:
            for i in range(10):
                produce_ledger(bootstrap, 150, topic=topic, seed=100 + i, first_seq=10_000 + 150 * i,
                               batch_size=50, abort_every=3, transactional_id=f"arun-b{unique_name}")
                time.sleep(1.0)
        except BaseException as exc:  # surfaced by the assertion below
            producing_error.append(exc)

    producer = threading.Thread(target=keep_producing)
    driver = start_app(config, tmp_path, label="running")
    reports: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 180
        while not driver.events("batch") and time.monotonic() < deadline and driver.process.poll() is None:
            time.sleep(0.5)
        assert driver.events("batch"), driver.log()[-3000:]
        producer.start()
        for _ in range(4):
            reports.append(audit(config, tmp_path))
            time.sleep(2.0)
        producer.join(120)
        meta = sql.Identifier(config["meta_schema"])
        conn = pg_connect(stack)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("INSERT INTO {}.stream_control (pipeline, stop_requested_at, requested_by)"
                                " VALUES (%s, now(), 'test') ON CONFLICT (pipeline) DO UPDATE"
                                " SET stop_requested_at = now()").format(meta), (config["pipeline"],))
        conn.close()
        driver.wait(120)
    finally:
        if driver.process.poll() is None:
            driver.kill()
    assert not producing_error, producing_error
    for i, report in enumerate(reports):
        s = report["summary"]
        running = report.get("snapshot", {}).get("driver_running")
        print(f"\naudit {i} during the run: ok={report['ok']} driver_running={running} "
              f"compared={s['committed_records']} not_yet_applied={s.get('not_yet_applied')} "
              f"missing={s['missing']} mismatches={report['mismatches']}")
    assert all(r["ok"] for r in reports), [r for r in reports if not r["ok"]]
    assert all(r["snapshot"]["driver_running"] for r in reports)
    assert any(r["summary"]["not_yet_applied"] > 0 for r in reports)  # some audit ran behind the stream

    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DELETE FROM {}.stream_control").format(sql.Identifier(config["meta_schema"])))
    conn.close()
    drained = run_app({**config, "trigger": "availableNow", "run_seconds": 0}, tmp_path, label="drain")
    assert drained.process.returncode == 0, drained.log()[-3000:]
    final = audit(config, tmp_path)
    assert final["ok"] and final["summary"]["not_yet_applied"] == 0, final
    assert final["summary"]["committed_records"] == 3000


def test_partitions_left_with_markers_or_nothing_do_not_hang_the_audit(
        stack: dict, tmp_path: Path, unique_name: str) -> None:
    config = pipeline_config(stack, tmp_path, f"ahang{unique_name}")
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    ensure_topic(bootstrap, topic, partitions=3)
    for partition in range(3):
        _produce(bootstrap, topic, partition, 50, f"ah{partition}{unique_name}", first_seq=100 * partition)
    # Partition 0 ends with an aborted transaction: aborted records and markers only.
    _produce(bootstrap, topic, 0, 40, f"ah0{unique_name}", first_seq=1000, abort=True)
    run = run_app(config, tmp_path, label="markers")
    assert run.process.returncode == 0, run.log()[-3000:]
    _earliest, lso = _offsets(bootstrap, topic)
    _delete_before(bootstrap, topic, 1, lso[1])  # partition 1: every record deleted
    _delete_before(bootstrap, topic, 2, lso[2] - 1)  # partition 2: only its last commit marker left
    earliest, _lso = _offsets(bootstrap, topic)
    assert earliest[1] == lso[1] and earliest[2] == lso[2] - 1

    report = _audit_cli(config, tmp_path, timeout=90)
    print(f"\naudit over marker-only and emptied partitions: exit {report['exit_code']} in {report['seconds']}s, "
          f"ok={report['ok']} committed={report['summary']['committed_records']} "
          f"rows_below_earliest={report['summary']['rows_below_earliest']}")
    assert report["ok"] and report["exit_code"] == 0, report
    assert report["summary"]["committed_records"] == 50
    assert report["summary"]["rows_below_earliest"] == 100

    timed_out = _audit_cli(config, tmp_path, "--timeout", "0.001", timeout=90)
    print(f"with --timeout 0.001: exit {timed_out['exit_code']}: {timed_out['stderr'].strip()}")
    assert timed_out["exit_code"] == 2 and timed_out["ok"] is False
    assert timed_out["stderr"].startswith("audit timed out after 0.001s reading Kafka;")
    assert f"{topic}[0] at offset 0 of {lso[0]}" in timed_out["stderr"]
    assert f"{topic}[1]" not in timed_out["stderr"]  # nothing left to read there
    assert {(u["topic"], u["partition"]) for u in timed_out["unfinished"]} >= {(topic, 0)}


def test_a_compacted_topic_is_refused_by_the_audit_and_the_replay(stack: dict, tmp_path: Path,
                                                                  unique_name: str) -> None:
    from spark_apps.eos_stream.audit import oracle as audit_module
    from spark_apps.eos_stream.engines import direct_replay
    from spark_apps.eos_stream.run.config import ConfigError, from_dict
    from spark_apps.ledger.spec import LEDGER

    config = pipeline_config(stack, tmp_path, f"acomp{unique_name}")
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], partitions=1,
                 config={"cleanup.policy": "compact,delete"})
    app_config = from_dict(config)
    app_config.postgres.password = stack["EOS_PG_PASSWORD"]
    with pytest.raises(ConfigError, match=r"audit refused: Kafka topic\(s\) \['ledger\.acomp.*cleanup.policy=compact"):
        audit_module.audit(app_config, LEDGER)
    with pytest.raises(ConfigError, match="replay refused"):
        direct_replay.replay(app_config)
