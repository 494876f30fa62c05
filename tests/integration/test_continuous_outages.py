"""The continuous engine (``engines/continuous.py``, C7, C9-C12) against the real stack's weather:
its database sessions terminated at random moments while a transactional producer writes (every
fourth transaction aborted), a lock held on its target past ``lock_timeout``, a SIGTERM or a
stop request while a cycle waits on that lock, and its topic grown while it runs. Each ends with
the audit exact; the first two and the last without any exit of the engine, the others within
the documented bound, their cycle uncommitted.

Safe on a shared stack: every test has its own topic, schemas and pipeline, and terminates only
the sessions of the engine it started (found by their client ports).
"""

from __future__ import annotations

import contextlib
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.engines import continuous
from spark_apps.eos_stream.state import meta_tables
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from spark_apps.ledger.spec import BALANCES_TABLE, EVENTS_TABLE
from tests.helpers.continuous import LedgerProducer, request_stop, stop_when_caught_up, wait_for_batches
from tests.helpers.kafka import delete_topics
from tests.streaming import AppRun, audit, ledger_order, pg_connect, pipeline_config, start_continuous

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TERMINATIONS = 9
# SIGTERM or a stop, while a cycle waits on a lock: the lock wait ends within LOCK_TIMEOUT, the
# retry's wait then ends at once (SIGTERM) or at its first look at the stop (one poll).
END_BOUND_SECONDS = float(continuous.LOCK_TIMEOUT.rstrip("s")) + 2.0


@pytest.fixture
def runs() -> Iterator[list[AppRun]]:
    """The engines a test started: any still running at its end (a failed test) is SIGKILLed."""
    started: list[AppRun] = []
    yield started
    for run in started:
        if run.process.poll() is None:
            run.kill()


def _config(stack: dict, tmp_path: Path, name: str, partitions: int) -> dict:
    topic = f"ledger.{name}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=partitions)
    return pipeline_config(stack, tmp_path, name, topics=[topic], trigger="continuous",
                           max_offsets_per_trigger=300, stop_poll_seconds=0.5)


def _engine_backends(pg: Any, run: AppRun, port: int) -> list[int]:
    """The backend pids of the engine's sessions (its TCP connections to the database's port)."""
    try:
        ports = [c.laddr.port for c in psutil.Process(run.process.pid).net_connections("tcp")
                 if c.raddr and c.raddr.port == port]
    except psutil.NoSuchProcess:
        return []
    if not ports:
        return []
    with pg.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)", (ports,))
        return [row[0] for row in cur.fetchall()]


def _exact_but_split(stack: dict, config: dict, tmp_path: Path, events: int) -> dict:
    """The audit exact: every committed event once, balances and each account's ``last_seq``
    right (applied in order); returns ``ledger_order``'s counts."""
    report = audit(config, tmp_path)
    order = ledger_order(stack, config["target_schema"])
    summary = report["summary"]
    print(f"\n{config['pipeline']}: summary={summary} order={order} "
          f"balances={report['aggregates']['account_balances']}")
    assert summary["committed_records"] == events and summary["duplicated"] == 0 and summary["missing"] == 0
    assert report["aggregates"]["account_balances"]["keys_wrong"] == 0
    assert report["ok"] and report["exit_code"] == 0, report
    return order


def _exact(stack: dict, config: dict, tmp_path: Path, events: int) -> None:
    """As ``_exact_but_split``, on a topic that never grew: each account in one partition, in order."""
    order = _exact_but_split(stack, config, tmp_path, events)
    assert order["split_accounts"] == 0 and order["out_of_order_accounts"] == 0


def test_terminated_backends_do_not_end_the_engine(stack: dict, tmp_path: Path, unique_name: str,
                                                   runs: list[AppRun]) -> None:
    """C10: each of the engine's sessions (the claim's, the cycle's, the guard, the poll's, the
    part's) terminated at random moments, from its claim on, while the producer writes."""
    config = _config(stack, tmp_path, f"cbk{unique_name}", partitions=4)
    producer = LedgerProducer(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], 3000)
    producer.start()
    run = start_continuous(config, tmp_path, label="terminated")
    runs.append(run)
    rng = random.Random(unique_name)
    pg = pg_connect(stack)
    pg.autocommit = True
    terminated = 0
    try:
        while terminated < TERMINATIONS or producer.is_alive():
            # The first as soon as the engine has a session: in its claim, as in the runs that
            # ended before their first cycle.
            time.sleep(rng.uniform(0.2, 1.2) if terminated else 0.02)
            assert run.process.poll() is None, f"the engine exited:\n{run.log()[-3000:]}"
            backends = _engine_backends(pg, run, int(stack["EOS_PG_PORT"]))
            if backends and terminated < TERMINATIONS:
                with pg.cursor() as cur:
                    cur.execute("SELECT pg_terminate_backend(%s)", (rng.choice(backends),))
                    terminated += bool(cur.fetchone()[0])
    finally:
        pg.close()
    producer.join(120)
    assert producer.error is None and producer.aborted > 0
    stop_when_caught_up(stack, config, run, config["topics"])
    print(f"\nterminated={terminated} engine exits=0 restarts=0 resumes={len(run.events('resume'))} "
          f"claim retries={sum(e.get('step') == 'claim' for e in run.events('retry'))} "
          f"cycle retries={sum('batch_id' in e for e in run.events('retry'))} "
          f"progress rows deferred={len(run.events('progress_not_recorded'))}")
    assert len(run.events("resume")) == 1 and not run.events("error")
    _exact(stack, config, tmp_path, 3000)
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0])


def _lock_events(stack: dict, config: dict) -> Any:
    """A session holding the target's events table in ACCESS EXCLUSIVE mode until it ends."""
    conn = pg_connect(stack)
    conn.autocommit = False
    with conn.cursor() as cur:
        cur.execute(sql.SQL("LOCK TABLE {}.{} IN ACCESS EXCLUSIVE MODE").format(
            sql.Identifier(config["target_schema"]), sql.Identifier(EVENTS_TABLE)))
    return conn


def _produce(stack: dict, config: dict, events: int, seq: int) -> None:
    produced = produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], events, topic=config["topics"][0], batch_size=50,
                              abort_every=4, seed=seq, first_seq=seq)
    assert produced.committed == events


def _wait_for(run: AppRun, kind: str, test: Any, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [event for event in run.events(kind) if test(event)]
        if found:
            return found[0]
        assert run.process.poll() is None, run.log()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event in {timeout}s:\n{run.log()[-3000:]}")


@contextlib.contextmanager
def _cycle_waiting_on_a_lock(stack: dict, config: dict, tmp_path: Path, runs: list[AppRun],
                             more: int) -> Iterator[AppRun]:
    """An engine that committed 600 events and whose cycle of ``more`` events waits on a lock
    held on the target (its first lock timeout seen), until the block ends."""
    _produce(stack, config, 600, 0)
    run = start_continuous(config, tmp_path, label="lock")
    runs.append(run)
    wait_for_batches(run, 1, 120)
    lock = _lock_events(stack, config)
    try:
        _produce(stack, config, more, 600)
        _wait_for(run, "retry", lambda e: e.get("sqlstate") == "55P03", 30)
        yield run
    finally:
        lock.close()


def test_a_lock_held_past_lock_timeout_is_waited_out(stack: dict, tmp_path: Path, unique_name: str,
                                                     runs: list[AppRun]) -> None:
    """A lock on the target held three times ``lock_timeout``: the cycle's statements time out
    (55P03) and are retried until the lock goes; the engine never exits and ends exact."""
    config = _config(stack, tmp_path, f"clk{unique_name}", partitions=2)
    with _cycle_waiting_on_a_lock(stack, config, tmp_path, runs, 600) as run:
        time.sleep(2 * END_BOUND_SECONDS)
        assert run.process.poll() is None, run.log()[-3000:]
    stop_when_caught_up(stack, config, run, config["topics"])
    timeouts = sum(e.get("sqlstate") == "55P03" for e in run.events("retry"))
    print(f"\nlock timeouts retried={timeouts} engine exits=0 restarts=0")
    _exact(stack, config, tmp_path, 1200)
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0])


def _clear_stop(stack: dict, config: dict) -> None:
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {} SET stop_requested_at = NULL WHERE pipeline = %s").format(
                meta_tables.table(config["meta_schema"], meta_tables.CONTROL)), (config["pipeline"],))
        conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize("how", ["sigterm", "stop_request"])
def test_an_end_mid_cycle_is_bounded(stack: dict, tmp_path: Path, unique_name: str, how: str,
                                     runs: list[AppRun]) -> None:
    """C7, C9: a SIGTERM or a stop request while a cycle waits on a lock held for good ends the
    engine within ``END_BOUND_SECONDS`` (143 or 0), the cycle uncommitted; the restart ends exact."""
    config = _config(stack, tmp_path, f"cend{how[:4]}{unique_name}", partitions=2)
    with _cycle_waiting_on_a_lock(stack, config, tmp_path, runs, 300) as run:
        asked = time.monotonic()
        if how == "sigterm":
            run.process.send_signal(signal.SIGTERM)
        else:
            request_stop(stack, config)
        code = run.wait(60)
        took = time.monotonic() - asked
    stopped = run.events("stopped")[-1]
    print(f"\n{how}: exit {code} after {took:.2f}s (bound {END_BOUND_SECONDS}s) stopped={stopped}")
    assert code == (143 if how == "sigterm" else 0), run.log()[-3000:]
    assert took <= END_BOUND_SECONDS and stopped.get("cycle_abandoned"), run.log()[-3000:]
    _clear_stop(stack, config)
    rerun = start_continuous(config, tmp_path, label=f"{how}-rerun")
    runs.append(rerun)
    stop_when_caught_up(stack, config, rerun, config["topics"])
    _exact(stack, config, tmp_path, 900)
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0])


def _grow(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewPartitions

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_partitions([NewPartitions(topic, partitions)])[topic].result(30)


def _accounts_not_ending_on_their_last_event(stack: dict, config: dict) -> int:
    """Accounts whose balance's ``last_seq`` is not the highest ``seq`` of their events."""
    schema = config["target_schema"]
    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {} b JOIN (SELECT account_id, max(seq) AS last FROM {}"
                                " GROUP BY account_id) e USING (account_id) WHERE b.last_seq <> e.last").format(
                sql.Identifier(schema, BALANCES_TABLE), sql.Identifier(schema, EVENTS_TABLE)))
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def test_partitions_added_while_running_are_read_in_key_order(stack: dict, tmp_path: Path, unique_name: str,
                                                              runs: list[AppRun]) -> None:
    """A topic grown from 2 to 4 partitions while the engine runs with a backlog on the old two
    (its cycle held on a lock meanwhile): the new partitions are found at a poll and read from
    their earliest offset once the old ones are committed up to where they stood, so every
    account's last applied event is its last one (``last_seq``) although about half the accounts
    moved to a new partition."""
    # Cycles and fetches of 4 KiB (about 25 events): the old partitions' backlog is fetched in
    # many rounds, each of which would bring the new partitions' records too.
    config = {**_config(stack, tmp_path, f"cgrow{unique_name}", partitions=2), "continuous_max_bytes": 4096}
    topic, bootstrap = config["topics"][0], stack["EOS_KAFKA_BOOTSTRAP"]
    with _cycle_waiting_on_a_lock(stack, config, tmp_path, runs, 1200) as run:
        _grow(bootstrap, topic, 4)
        _produce(stack, config, 1200, 1800)  # a new producer: it writes to all four
    found = _wait_for(run, "partition_found", lambda e: True, 60)
    stop_when_caught_up(stack, config, run, [topic])
    assigned = run.events("partitions_assigned")
    largest = max(b["bytes"] for b in run.events("batch"))
    print(f"\ngrow: found={found} assigned={assigned} exits=0 largest cycle={largest} bytes")
    assert 3000 < largest <= 4096 + 1024  # cycles ended on the byte bound, passing it by a record at most
    assert [e["partitions"] for e in assigned] == [[f"{topic}[2]", f"{topic}[3]"]]
    order = _exact_but_split(stack, config, tmp_path, 3000)
    # The audit takes a spread key's last record in any of its partitions as right; the events'
    # seq is their production order, so applied in order, each account's last is its highest.
    stale = _accounts_not_ending_on_their_last_event(stack, config)
    print(f"\ngrow: accounts over two partitions={order['split_accounts']} ending on an older event={stale}")
    assert order["split_accounts"] > 0 and stale == 0
    delete_topics(bootstrap, topic)
