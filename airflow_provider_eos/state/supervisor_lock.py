"""The supervisor lock: a session-level advisory lock a StreamingPipelineOperator holds while it
supervises a pipeline. It keeps two supervisors off one pipeline, and lets a StopPipelineOperator
on another host see when the supervisor has ended. Its key is
``hashtextextended(supervisor_lock_key(meta_schema, pipeline), 0)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg2.extensions import connection as PgConnection

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def supervisor_lock_key(meta_schema: str, pipeline: str) -> str:
    """The advisory lock a StreamingPipelineOperator holds while it supervises the pipeline."""
    return f"eos-supervisor:{meta_schema}:{pipeline}"


def acquire_supervisor_lock(hook: EosPostgresHook, pipeline: str) -> PgConnection | None:
    """Takes the pipeline's supervisor lock.

    :param hook: built for the pipeline's meta schema (part of the key).
    :return: the connection that holds it (close it to release), or None when another session
        holds it."""
    conn = hook.connect(autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                        (supervisor_lock_key(hook.meta_schema, pipeline),))
            row = cur.fetchone()
    except Exception:
        conn.close()
        raise
    if row is None or not row[0]:
        conn.close()
        return None
    return conn


def supervisor_running(hook: EosPostgresHook, pipeline: str) -> bool:
    """Whether some session holds the pipeline's supervisor lock (as seen in pg_locks)."""
    from spark_apps.eos_stream.state.control import advisory_lock_held

    conn = hook.connect(autocommit=True)
    try:
        return advisory_lock_held(conn, supervisor_lock_key(hook.meta_schema, pipeline))
    finally:
        conn.close()
