"""The pipeline's running lock: a session-level advisory lock every driver holds for its
lifetime, whoever started it (``spark_apps.eos_stream.state.control``). While it is held a driver is
connected; taking it keeps any driver from starting."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def try_running_lock(hook: EosPostgresHook, pipeline: str) -> PgConnection | None:
    """The pipeline's running lock on a connection of its own, or None when a driver holds it.

    While the connection stays open no driver can start (a starting driver waits for the lock,
    then exits); closing it releases it."""
    from spark_apps.eos_stream.state.control import running_lock_key

    conn = hook.connect(application_name="eos-recovery")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (running_lock_key(pipeline),))
            got = bool((cur.fetchone() or (False,))[0])
    except BaseException:
        conn.close()
        raise
    if not got:
        conn.close()
        return None
    return conn


def running_lock_holder(hook: EosPostgresHook, pipeline: str) -> dict[str, Any] | None:
    """Who holds the pipeline's running lock, for logs.

    :return: the backend's ``pid`` (the database's, not the driver's), ``application_name``,
        ``client_addr``, ``client_port``, ``backend_start`` and ``age_seconds``; None when no
        driver is connected."""
    from spark_apps.eos_stream.state.control import ADVISORY_LOCK_HOLDERS_SQL, running_lock_key

    with hook.cursor() as cur:
        cur.execute(
            sql.SQL(
                "SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr, a.client_port,"
                " a.backend_start, EXTRACT(EPOCH FROM (now() - a.backend_start))::float8 AS age_seconds"
                " FROM pg_stat_activity a WHERE a.pid IN ({}) LIMIT 1"
            ).format(ADVISORY_LOCK_HOLDERS_SQL),
            {"key": running_lock_key(pipeline)},
        )
        row = cur.fetchone()
    if row is None:
        return None
    out = dict(row)
    out["backend_start"] = out["backend_start"].isoformat() if out["backend_start"] else None
    return out
