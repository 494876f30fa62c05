"""The driver's stop and epoch poll (``state/control.StopSignal``) against a real PostgreSQL whose
server ends its connection, as a PostgreSQL restart does (seen in test_cdc_mirror.py's
immediate restart: the batch's retries reconnected the sink, then this poll's dead connection
made the driver exit). It opens a new connection and keeps polling; without ``reconnect`` it raises the connection's
error, and after ``outage_seconds`` of an unreachable database ``OutageTooLong``, naming the poll
and the database."""

from __future__ import annotations

from typing import Any

import psycopg2
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.sink.postgres import TargetUnavailable
from spark_apps.eos_stream.state import meta_tables
from spark_apps.eos_stream.state.control import StopSignal
from spark_apps.eos_stream.state.reconnect import OutageTooLong
from tests.streaming import pg_connect


def _cut(pg_conn: Any, conn: Any) -> None:
    """The server ends ``conn``'s session, as a restart does."""
    with pg_conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", (conn.get_backend_pid(),))
        assert cur.fetchone() == (True,)


def _request_stop(pg_conn: Any, schema: str, pipeline: str) -> None:
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("INSERT INTO {} (pipeline, stop_requested_at) VALUES (%s, now())").format(
            meta_tables.table(schema, meta_tables.CONTROL)), (pipeline,))


def test_a_cut_control_connection_is_opened_again(stack: dict[str, str], pg_conn: Any, meta: str) -> None:
    first = pg_connect(stack)
    opened: list[Any] = []

    def reconnect() -> Any:
        opened.append(pg_connect(stack))
        return opened[-1]

    signal = StopSignal(first, meta, "p", 0, epoch=0, reconnect=reconnect, outage_seconds=60)
    assert signal.requested() is None and signal.fenced() is None
    _cut(pg_conn, first)
    assert signal.requested() is None  # nothing known this poll; a new connection for the next
    assert len(opened) == 1 and signal.conn is opened[0] and first.closed
    _request_stop(pg_conn, meta, "p")
    assert (signal.requested() or "").startswith("stop requested at")  # read on the new connection
    assert signal.fenced() is None
    signal.conn.close()


def test_without_reconnect_a_cut_connection_raises(stack: dict[str, str], pg_conn: Any, meta: str) -> None:
    conn = pg_connect(stack)
    signal = StopSignal(conn, meta, "p", 0, epoch=0)
    _cut(pg_conn, conn)
    with pytest.raises((psycopg2.OperationalError, psycopg2.InterfaceError)):
        signal.requested()
    conn.close()


def test_an_outage_longer_than_allowed_raises(stack: dict[str, str], pg_conn: Any, meta: str) -> None:
    conn = pg_connect(stack)

    def unreachable() -> Any:  # as the driver's connect says it (sink/postgres.py)
        raise TargetUnavailable("cannot connect to PostgreSQL: the database system is starting up")

    signal = StopSignal(conn, meta, "p", 0, epoch=0, reconnect=unreachable, outage_seconds=0)
    _cut(pg_conn, conn)
    assert signal.fenced() is None  # the outage begins: nothing known
    with pytest.raises(OutageTooLong, match=r"step 'stop-and-fence poll' could not reach PostgreSQL .*@"):
        signal.fenced()  # longer than outage_seconds: the error names the step and the database
    conn.close()
