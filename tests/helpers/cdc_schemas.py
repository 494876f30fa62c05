"""A target schema and a bookkeeping schema of their own for a CDC test, dropped after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from psycopg2 import sql

from spark_apps.eos_stream.state import meta_tables


@contextmanager
def cdc_schemas(pg_conn, target: str, meta: str,
                tables: Callable[[sql.Identifier], list[sql.Composable]]) -> Iterator[tuple[str, str]]:
    """Creates ``meta``'s bookkeeping tables and ``target`` with ``tables(target)``; yields both names."""
    with pg_conn.cursor() as cur:
        for statement in meta_tables.ddl_statements(meta):
            cur.execute(statement)
        cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(target)))
        for statement in tables(sql.Identifier(target)):
            cur.execute(statement)
    try:
        yield target, meta
    finally:
        with pg_conn.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(target)))
            cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(meta)))
