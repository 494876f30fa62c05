"""The local PostgreSQL does what the exactly-once sink relies on: two-phase
commit (PREPARE TRANSACTION survives its session) and dump/restore tools of the
server's own major version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psycopg2
import pytest
from psycopg2 import sql

pytestmark = pytest.mark.integration


def _server_major(pg_conn) -> int:
    with pg_conn.cursor() as cur:
        cur.execute("SHOW server_version_num")
        return int(cur.fetchone()[0]) // 10000


def _prepared_gids(pg_conn) -> set[str]:
    with pg_conn.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        return {row[0] for row in cur.fetchall()}


def test_max_prepared_transactions_enabled(pg_conn) -> None:
    with pg_conn.cursor() as cur:
        cur.execute("SHOW max_prepared_transactions")
        assert int(cur.fetchone()[0]) > 0


@pytest.fixture
def twopc_table(pg_conn, unique_name):
    # Schema-qualified: the user's own schema (eos) may exist and come first on search_path.
    table = sql.Identifier("public", f"eos_test_2pc_{unique_name}")
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, note text)").format(table))
    gids: list[str] = []
    yield table, gids
    leftover = _prepared_gids(pg_conn) & set(gids)
    with pg_conn.cursor() as cur:
        for gid in leftover:
            cur.execute("ROLLBACK PREPARED %s", (gid,))
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


def _prepare_insert(pg_dsn: str, table: sql.Identifier, gid: str, row_id: int) -> None:
    """Inserts one row in a transaction, prepares it, and closes the session."""
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True  # BEGIN/PREPARE are sent as written
    try:
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table), (row_id, gid))
            cur.execute("PREPARE TRANSACTION %s", (gid,))
    finally:
        conn.close()


def _rows(pg_conn, table: sql.Identifier) -> list[int]:
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(table))
        return [row[0] for row in cur.fetchall()]


def test_prepared_transaction_round_trip(pg_conn, pg_dsn, twopc_table, unique_name) -> None:
    table, gids = twopc_table
    commit_gid, rollback_gid = f"eos-test-{unique_name}-c", f"eos-test-{unique_name}-r"
    gids += [commit_gid, rollback_gid]

    _prepare_insert(pg_dsn, table, commit_gid, 1)
    _prepare_insert(pg_dsn, table, rollback_gid, 2)

    # Prepared, its session gone: listed, and its rows still invisible.
    assert {commit_gid, rollback_gid} <= _prepared_gids(pg_conn)
    assert _rows(pg_conn, table) == []

    # A different session finishes each one.
    with pg_conn.cursor() as cur:
        cur.execute("COMMIT PREPARED %s", (commit_gid,))
        cur.execute("ROLLBACK PREPARED %s", (rollback_gid,))

    assert _rows(pg_conn, table) == [1]
    assert not {commit_gid, rollback_gid} & _prepared_gids(pg_conn)
    # A gid is finished exactly once.
    with pytest.raises(psycopg2.errors.UndefinedObject), pg_conn.cursor() as cur:
        cur.execute("COMMIT PREPARED %s", (commit_gid,))


def _tool(major: int, name: str) -> Path:
    path = Path(f"/usr/lib/postgresql/{major}/bin/{name}")
    assert path.is_file() and os.access(path, os.X_OK), f"{name} of PostgreSQL {major} is not installed"
    return path


def _tool_major(path: Path) -> int:
    # e.g. "pg_dump (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.split(")")[1].split()[0].split(".")[0])


def test_dump_tools_match_server_major(pg_conn, pg_dsn, twopc_table, stack) -> None:
    major = _server_major(pg_conn)
    pg_dump, pg_restore = _tool(major, "pg_dump"), _tool(major, "pg_restore")
    assert _tool_major(pg_dump) == major
    assert _tool_major(pg_restore) == major

    # And they work against this server: a custom-format dump lists the table.
    table, _ = twopc_table
    name = table.strings[-1]
    env = {**os.environ, "PGPASSWORD": stack["EOS_PG_PASSWORD"]}
    dump = subprocess.run(
        [str(pg_dump), "--dbname", pg_dsn, "-Fc", "-t", f"public.{name}"],
        capture_output=True,
        env=env,
        check=True,
        timeout=120,
    ).stdout
    listing = subprocess.run(
        [str(pg_restore), "--list"], input=dump, capture_output=True, check=True, timeout=120
    ).stdout.decode()
    assert f"TABLE public {name} " in listing
