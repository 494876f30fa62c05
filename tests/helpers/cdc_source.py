"""The change-data-capture source in tests: the source database's test schema, its transactions,
and the connector's replication slot (tests/conftest.py's ``connect`` and ``source`` fixtures)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg2
from psycopg2 import sql

T = TypeVar("T")


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 120.0, interval: float = 1.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {result!r})")
        time.sleep(interval)


@dataclass
class Source:
    """An autocommit connection to the source database, and the test's schema in it."""

    conn: Any
    schema: str


def source_connection(env: dict[str, str]) -> Any:
    """An autocommit connection to the source database, as the cluster's superuser."""
    conn = psycopg2.connect(host=env["EOS_PG_HOST"], port=env["EOS_PG_PORT"], user=env["EOS_PG_USER"],
                            password=env["EOS_PG_PASSWORD"], dbname=env["EOS_SOURCE_PG_DB"])
    conn.autocommit = True
    return conn


def write_source(source: Source, statements: list[str]) -> None:
    """One multi-row transaction on the source schema."""
    conn = source.conn
    conn.autocommit = False
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SET LOCAL search_path = {}").format(sql.Identifier(source.schema)))
        for statement in statements:
            cur.execute(statement)
    conn.commit()
    conn.autocommit = True


def drop_slot(source: Source, slot: str) -> None:
    """Drops the connector's slot once its WAL sender has let go: a slot left behind would hold
    the stack's WAL for ever."""
    def released() -> bool:
        with source.conn.cursor() as cur:
            cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            row = cur.fetchone()
            if row is None:
                return True
            if row[0]:
                return False
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return True
    wait_until(f"slot {slot} released", released, timeout=60)


def pause_connector(hook: Any, name: str) -> None:
    """Pauses the connector ``name`` and waits until it and each of its tasks report PAUSED: a
    task still running could confirm WAL written after the pause (its heartbeats confirm what
    it skips), and a slot the test means to fill would not hold it."""
    hook.pause_connector(name)

    def paused() -> bool:
        status = hook.get_connector_status(name)
        tasks = status.get("tasks") or []
        return bool(tasks) and {status["connector"]["state"], *(task["state"] for task in tasks)} == {"PAUSED"}

    wait_until(f"{name} and its tasks paused", paused)
