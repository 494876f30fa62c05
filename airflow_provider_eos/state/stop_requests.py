"""A pipeline's stop request (``<meta_schema>.stream_control``): the app stops at its next batch
boundary when it is set, and a supervisor does not restart it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg2 import sql

from airflow_provider_eos.state.meta import exists, table
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def set_stop_request(hook: EosPostgresHook, pipeline: str, requested: bool, by: str = "eos-recovery") -> str | None:
    """Sets or clears the pipeline's stop request.

    :param hook: built for the pipeline's meta schema (the control table is created if missing).
    :param requested: True sets it (the app stops at its next batch boundary, a supervisor does
        not restart it); False clears it (before a launch: an old request would stop the new
        run at once).
    :param by: who asked, recorded with the request.
    :return: the request's time (ISO), None when cleared."""
    meta_schema = hook.meta_schema
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            for statement in meta_tables.ddl_statements(meta_schema):
                cur.execute(statement)
            cur.execute(
                sql.SQL("INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, {}, %s)"
                        " ON CONFLICT (pipeline) DO UPDATE SET stop_requested_at = EXCLUDED.stop_requested_at,"
                        " requested_by = EXCLUDED.requested_by RETURNING stop_requested_at").format(
                    meta_tables.table(meta_schema, meta_tables.CONTROL),
                    sql.SQL("now()" if requested else "NULL")),
                (pipeline, by),
            )
            at = (cur.fetchone() or (None,))[0]
        conn.commit()
        return at.isoformat() if at else None
    finally:
        conn.close()


def stop_requested_at(hook: EosPostgresHook, pipeline: str) -> str | None:
    """When the pipeline's pending stop was requested (ISO), or None."""
    with hook.cursor() as cur:
        if not exists(cur, hook, meta_tables.CONTROL):
            return None
        cur.execute(
            sql.SQL("SELECT stop_requested_at FROM {} WHERE pipeline = %s").format(table(hook, meta_tables.CONTROL)),
            (pipeline,),
        )
        row = cur.fetchone()
    return row["stop_requested_at"].isoformat() if row and row["stop_requested_at"] else None
