"""A stream's signs of life, read at once: the driver's running lock, the supervisor's lock,
the newest progress row and the pending stop request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from airflow_provider_eos.state.supervisor_lock import supervisor_lock_key
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def stream_activity(hook: EosPostgresHook, pipeline: str) -> dict[str, Any]:
    """Whether a driver of the pipeline is connected (its running lock), whether a supervisor
    (StreamingPipelineOperator) holds it, when it last recorded progress and whether a stop is
    requested.

    :param hook: built for the pipeline's meta schema.
    :return: ``driver_running``, ``supervisor_running``, ``last_progress_at``, ``seconds_since``
        (database clock) and ``stop_requested_at``."""
    from spark_apps.eos_stream.state.control import advisory_lock_held, driver_running

    meta_schema = hook.meta_schema
    conn = hook.connect()
    try:
        result: dict[str, Any] = {
            "driver_running": driver_running(conn, pipeline), "last_progress_at": None,
            "supervisor_running": advisory_lock_held(conn, supervisor_lock_key(meta_schema, pipeline)),
            "stop_requested_at": None, "seconds_since": None}
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s), to_regclass(%s), now()", (
                f'"{meta_schema}"."{meta_tables.PROGRESS}"', f'"{meta_schema}"."{meta_tables.CONTROL}"'))
            row = cur.fetchone()
            assert row is not None
            progress, control, now = row
            if progress is not None:
                cur.execute(sql.SQL("SELECT max(recorded_at) FROM {} WHERE pipeline = %s").format(
                    meta_tables.table(meta_schema, meta_tables.PROGRESS)), (pipeline,))
                last = (cur.fetchone() or (None,))[0]
                result["last_progress_at"] = last
                result["seconds_since"] = (now - last).total_seconds() if last else None
            if control is not None:
                cur.execute(sql.SQL("SELECT stop_requested_at FROM {} WHERE pipeline = %s").format(
                    meta_tables.table(meta_schema, meta_tables.CONTROL)), (pipeline,))
                result["stop_requested_at"] = (cur.fetchone() or (None,))[0]
        conn.rollback()
        return result
    finally:
        conn.close()
