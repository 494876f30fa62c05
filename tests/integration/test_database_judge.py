"""The sink's error paths against the real database, without Spark (``tests/sink_harness``).

* a foreign key whose parent rows come later is "blocked": retried, never
  quarantined, applied once the parents exist, and loud when they never come;
* a data error that no single record explains fails the batch for good, naming its offsets;
* the guard connection (attempt counts, running lock) lost mid-batch is weather: retried, nothing lost.
"""

from __future__ import annotations

import psycopg2
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.sink.batch_sink import BatchBlocked, BatchStuck
from spark_apps.eos_stream.sink.poison_guard import batch_key
from spark_apps.eos_stream.sink.staging import StageCopyError
from tests.sink_harness import LedgerSink
from tests.streaming import dead_letter_count, pg_connect

pytestmark = pytest.mark.integration


def _add_account_foreign_key(sink: LedgerSink) -> None:
    """ledger_events.account_id must name a row of <target>.accounts, which starts empty."""
    target = sql.Identifier(sink.target)
    with sink.conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE {}.accounts (account_id varchar(64) PRIMARY KEY)").format(target))
        cur.execute(sql.SQL("ALTER TABLE {t}.ledger_events ADD FOREIGN KEY (account_id) REFERENCES {t}.accounts")
                    .format(t=target))
    sink.conn.commit()


def _add_parents(stack: dict, sink: LedgerSink) -> None:
    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("INSERT INTO {}.accounts SELECT 'acct-' || lpad(n::text, 5, '0')"
                            " FROM generate_series(0, 2) n").format(sql.Identifier(sink.target)))
    conn.close()


def test_children_before_their_parents_wait_and_land_once(stack: dict, unique_name: str) -> None:
    """Issue test 3: the batch's events reference accounts that another writer adds
    while the batch waits, once its first attempt was turned away (not after a fixed time,
    which a slow first attempt could outlast). Nothing is quarantined, no attempt is
    counted, everything lands once."""
    turned_away: list[dict] = []

    def parents_once_blocked(event: str, **fields: object) -> None:
        if event == "retry" and not turned_away:
            turned_away.append(fields)
            _add_parents(stack, s)

    with LedgerSink(stack, unique_name, notify=parents_once_blocked) as s:
        _add_account_foreign_key(s)
        result = s.process()
        assert result.applied == 10 and result.dead_lettered == 0
        assert result.transient_retries >= 1  # it did wait for the parents
        assert [(f["error_class"], f["sqlstate"]) for f in turned_away] == [("blocked", "23503")]
        assert s.sink.guard.failed_attempts(batch_key({("t", 0): 0})) == 0
        assert dead_letter_count(s.conn, {"meta_schema": s.meta, "pipeline": s.pipeline}) == 0
        assert s.events_and_count() == ((10, 10), 10)


def test_parents_that_never_come_fail_loudly_and_quarantine_nothing(stack: dict, unique_name: str) -> None:
    with LedgerSink(stack, unique_name, transient_retry_seconds=2) as s:
        _add_account_foreign_key(s)
        with pytest.raises(BatchBlocked, match=r"(?s)batch 0 \(offsets t\[0\] 0\.\.10\).*SQLSTATE 23503.*parent rows"):
            s.process()
        assert dead_letter_count(s.conn, {"meta_schema": s.meta, "pipeline": s.pipeline}) == 0
        assert s.events_and_count() == ((0, 0), None)


def test_a_batch_no_record_explains_fails_loudly_with_its_offsets(stack: dict, unique_name: str) -> None:
    """Failure transition 6s: staging fails with a data error on every attempt,
    isolation included. The batch fails, bounded, naming offsets and SQLSTATE;
    a later run fails at once instead of looping."""
    with LedgerSink(stack, unique_name, max_batch_attempts=2) as s:
        calls: list[bool] = []

        def failing_stage(stage_name: str, keep_raw: bool) -> int:
            calls.append(keep_raw)
            raise StageCopyError("[EOS-SQLSTATE 22021] CharacterNotInRepertoire: invalid byte sequence")

        def process() -> None:
            s.sink.process(0, {("t", 0): 0}, {("t", 0): 10}, failing_stage)

        with pytest.raises(BatchStuck, match=r"(?s)offsets t\[0\] 0\.\.10.*SQLSTATE 22021.*no single record"):
            process()
        assert calls == [False, False, True]  # two counted attempts, then isolation, which failed too
        with pytest.raises(BatchStuck):
            process()
        assert calls[3:] == [True]  # the next run isolates at once and stops
        assert s.events_and_count() == ((0, 0), None)


def test_the_guard_connection_lost_mid_batch_is_retried_and_loses_nothing(stack: dict, unique_name: str) -> None:
    """Issue test 6, on the guard connection (a server restart ends every session
    like this): the batch in flight commits, the next batch finds the guard gone,
    opens a new one and goes on. Nothing is lost, nothing applies twice."""
    opened: list[object] = []

    def reconnect_guard():
        opened.append(conn := pg_connect(stack))
        return conn

    with LedgerSink(stack, unique_name, reconnect_guard=reconnect_guard) as s:
        guard_pid = s.guard.get_backend_pid()
        fill = s.fill_stage

        def stage_then_lose_the_guard(stage_name: str, keep_raw: bool) -> int:
            killer = pg_connect(stack)
            with killer.cursor() as cur:  # returns once the backend has exited (30 s at most)
                cur.execute("SELECT pg_terminate_backend(%s, 30000)", (guard_pid,))
                assert cur.fetchone() == (True,)
            killer.close()
            return fill(stage_name, keep_raw)

        everything = s.records
        s.records = everything[:5]
        first = s.sink.process(0, {("t", 0): 0}, {("t", 0): 5}, stage_then_lose_the_guard)
        assert first.applied == 5 and len(opened) == 0  # committed; only forgetting its attempts failed
        s.records = everything[5:]
        second = s.sink.process(1, {("t", 0): 5}, {("t", 0): 10}, s.fill_stage)
        assert second.applied == 5 and second.transient_retries >= 1 and len(opened) == 1
        assert s.events_and_count() == ((10, 10), 10)
        with pytest.raises(psycopg2.InterfaceError):
            s.guard.cursor().execute("SELECT 1")  # the old guard is really gone


def test_a_database_that_cannot_store_utf8_is_refused_at_the_start(stack: dict, unique_name: str) -> None:
    """Text PostgreSQL cannot store in a LATIN1 database fails the staging COPY with 22P05, where no
    record can be blamed: the app refuses such a target up front, naming the fix (exit 2, no restarts)."""
    from spark_apps.eos_stream.run.config import ConfigError
    from spark_apps.eos_stream.run.preflight import check_encoding

    name = f"latin1_{unique_name}"
    admin = pg_connect(stack)
    with admin.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
                    .format(sql.Identifier(name)))
    try:
        latin1 = psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], dbname=name,
                                  user=stack["EOS_PG_USER"], password=stack["EOS_PG_PASSWORD"])
        try:
            with pytest.raises(ConfigError, match=r"encoding LATIN1.*UTF8"):
                check_encoding(latin1, "the test server")
        finally:
            latin1.close()
        check_encoding(admin, "the stack's database")  # UTF8: accepted
    finally:
        with admin.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.close()
