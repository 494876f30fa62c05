"""The change-data-capture source in tests: the source database's test schema, its transactions,
and the connector's replication slot (tests/conftest.py's ``connect`` and ``source`` fixtures)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg2 import sql

from bench.harness import drop_replication_slot, drop_source_schema, source_connection, wait_until

__all__ = ["Source", "drop_slot", "drop_source_schema", "pause_connector", "source_connection", "wait_until",
           "write_source"]


@dataclass
class Source:
    """An autocommit connection to the source database, and the test's schema in it."""

    conn: Any
    schema: str


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
    """Drops the connector's slot once its WAL sender has let go (``bench.harness.drop_replication_slot``)."""
    drop_replication_slot(source.conn, slot)


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
