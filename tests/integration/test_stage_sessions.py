"""The continuous engine's staging sessions (``sink/staging.StageSessions``) against a real
PostgreSQL: a thread keeps its session from one COPY to the next, a COPY that fails closes it
and the next opens another (a backend the server ended, as a restart does, or a source that
failed mid-COPY), nothing of a failed COPY is kept, and ``close`` ends every thread's session."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.sink.staging import StageCopyError, StageSessions, create_stage, stage_table
from spark_apps.ledger.spec import LEDGER as SPEC
from tests.streaming import pg_connect


def _lines(table_columns: int, offsets: range) -> Iterator[bytes]:
    """One COPY chunk of rows whose every column but the coordinates is null."""
    rest = "\t\\N" * (table_columns - 3)
    yield "".join(f"t\t0\t{offset}{rest}\n" for offset in offsets).encode()


def _columns(pg_conn: Any, meta: str, name: str) -> int:
    with pg_conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM information_schema.columns WHERE table_schema = %s AND table_name = %s",
                    (meta, name))
        return int(cur.fetchone()[0])


def _staged(pg_conn: Any, meta: str, name: str) -> int:
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {}").format(stage_table(meta, name)))
        return int(cur.fetchone()[0])


@pytest.fixture
def sessions(stack: dict[str, str]) -> Iterator[tuple[StageSessions, list[Any]]]:
    opened: list[Any] = []

    def open_session() -> Any:
        opened.append(pg_connect(stack))
        return opened[-1]

    kept = StageSessions(open_session)
    yield kept, opened
    kept.close()


@pytest.fixture
def width(pg_conn: Any, meta: str) -> int:
    """The columns of a new stage ``st`` of the ledger's spec."""
    create_stage(pg_conn, SPEC, meta, "st")
    return _columns(pg_conn, meta, "st")


def test_a_thread_keeps_its_session_and_a_failed_copy_replaces_it(
        pg_conn: Any, meta: str, width: int, sessions: tuple[StageSessions, list[Any]]) -> None:
    kept, opened = sessions
    kept.copy(SPEC, meta, "st", _lines(width, range(0, 10)))
    kept.copy(SPEC, meta, "st", _lines(width, range(10, 20)))
    assert len(opened) == 1 and _staged(pg_conn, meta, "st") == 20

    with pg_conn.cursor() as cur:  # the server ends the session, as a restart does
        cur.execute("SELECT pg_terminate_backend(%s)", (opened[0].get_backend_pid(),))
    with pytest.raises(StageCopyError):
        kept.copy(SPEC, meta, "st", _lines(width, range(20, 30)))
    assert opened[0].closed
    kept.copy(SPEC, meta, "st", _lines(width, range(20, 30)))
    assert len(opened) == 2 and _staged(pg_conn, meta, "st") == 30

    def failing_source() -> Iterator[bytes]:
        yield from _lines(width, range(30, 40))
        raise RuntimeError("the Kafka read failed")

    with pytest.raises(RuntimeError, match="the Kafka read failed"):
        kept.copy(SPEC, meta, "st", failing_source())
    assert opened[1].closed and _staged(pg_conn, meta, "st") == 30  # the failed COPY kept nothing
    kept.copy(SPEC, meta, "st", _lines(width, range(30, 40)))
    assert len(opened) == 3 and _staged(pg_conn, meta, "st") == 40


def test_each_thread_has_its_own_session_and_close_ends_them_all(
        pg_conn: Any, meta: str, width: int, sessions: tuple[StageSessions, list[Any]]) -> None:
    kept, opened = sessions
    kept.copy(SPEC, meta, "st", _lines(width, range(0, 5)))
    other = threading.Thread(target=kept.copy, args=(SPEC, meta, "st", _lines(width, range(5, 10))))
    other.start()
    other.join()
    assert len(opened) == 2 and _staged(pg_conn, meta, "st") == 10
    kept.close()
    assert all(conn.closed for conn in opened)
