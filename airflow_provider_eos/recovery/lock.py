"""The recovery lock: one recovery of a target at a time, across workers and crashes; and the
target's key, from which the lock row, the scratch databases' names and the swap lock derive.

A row keyed by ``database/target_schema/pipeline`` in ``{meta_schema}.recovery_locks``
holds the DAG run id that owns the target's recovery. Every lock-guarded step
re-acquires it (re-entrant for its own run, so a cleared or rerun task goes on),
refreshes its heartbeat from a background thread while it works, and fails if
another run took the lock over (fencing a run that was presumed dead).

A run whose worker dies without the teardown that releases the lock leaves the
row behind; once its heartbeat is older than the TTL, the next run takes it over.

Failure transitions:

* lock held by another live run (fresh heartbeat): the step fails with
  :class:`RecoveryLockedError`, nothing is touched;
* lock left by a dead run (stale heartbeat): taken over, logged with the dead holder;
* lock taken from this run while a step works (it was presumed dead): the step
  fails when its work ends, so the run does not go on as a zombie;
* the heartbeat cannot reach the database: logged, retried at the next beat;
  the TTL is several beats long.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook

# The lock rows' table, in each pipeline's meta schema.
LOCK_TABLE = "recovery_locks"
DEFAULT_LOCK_TTL = 900.0  # seconds without a heartbeat before a lock counts as abandoned
BEATS_PER_TTL = 4

log = logging.getLogger(__name__)


class RecoveryLockedError(AirflowException):
    """Another recovery holds the lock for this target."""


def target_lock_key(dbname: str, target_schema: str, pipeline: str) -> str:
    """The key of one restore target: recovery lock row, scratch names and swap lock derive from it."""
    return f"{dbname}/{target_schema}/{pipeline}"


def swap_lock_key(target_key: str) -> str:
    """Advisory lock key: snapshots take it shared (session), a swap exclusively (transaction)."""
    return "eos:swap:" + target_key


def lock_table(meta_schema: str) -> sql.Composed:
    """``<meta_schema>.recovery_locks``, quoted."""
    return sql.SQL("{}.{}").format(sql.Identifier(meta_schema), sql.Identifier(LOCK_TABLE))


def _create_lock_table(cur: Any, meta_schema: str) -> None:
    table = lock_table(meta_schema)
    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(meta_schema)))
    cur.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (lock_key text PRIMARY KEY, holder text NOT NULL,"
        " acquired_at timestamptz NOT NULL DEFAULT now(),"
        " heartbeat_at timestamptz NOT NULL DEFAULT now())").format(table))
    # Tables made before heartbeats existed.
    cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS heartbeat_at timestamptz"
                        " NOT NULL DEFAULT now()").format(table))


def acquire_lock(hook: EosPostgresHook, key: str, holder: str, ttl_seconds: float) -> dict[str, Any]:
    """Takes the lock row for ``key``, or refreshes it for its holder.

    Re-entrant: the same holder (a DAG run id) gets it again, so a cleared or rerun task of that
    run goes on. A row whose heartbeat is older than ``ttl_seconds`` belonged to a run that died
    without its teardown, and is taken over.

    :param hook: built for the pipeline's meta schema (the row lives there).
    :return: ``acquired`` and the holder row; ``taken_over_from`` names the dead holder when
        there was one."""
    meta_schema = hook.meta_schema
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            table = lock_table(meta_schema)
            _create_lock_table(cur, meta_schema)
            cur.execute(sql.SQL("SELECT holder FROM {} WHERE lock_key = %s FOR UPDATE").format(table), (key,))
            previous = (cur.fetchone() or (None,))[0]
            cur.execute(sql.SQL(
                "INSERT INTO {t} (lock_key, holder) VALUES (%s, %s) ON CONFLICT (lock_key) DO UPDATE"
                " SET holder = EXCLUDED.holder, heartbeat_at = now(),"
                " acquired_at = CASE WHEN {t}.holder = EXCLUDED.holder THEN {t}.acquired_at ELSE now() END"
                " WHERE {t}.holder = EXCLUDED.holder OR {t}.heartbeat_at < now() - make_interval(secs => %s)"
                " RETURNING holder").format(t=table), (key, holder, ttl_seconds))
            won = cur.fetchone() is not None
            cur.execute(sql.SQL("SELECT holder, acquired_at, heartbeat_at FROM {} WHERE lock_key = %s")
                        .format(table), (key,))
            row = cur.fetchone()
        conn.commit()
    finally:
        conn.close()
    return {"acquired": won, "key": key, "holder": row[0] if row else None,
            "acquired_at": row[1].isoformat() if row else None,
            "heartbeat_at": row[2].isoformat() if row else None,
            "taken_over_from": previous if won and previous not in (None, holder) else None}


def heartbeat_lock(hook: EosPostgresHook, key: str, holder: str) -> bool:
    """Marks the holder alive; False when the lock is no longer its own."""
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {} SET heartbeat_at = now() WHERE lock_key = %s AND holder = %s")
                        .format(lock_table(hook.meta_schema)), (key, holder))
            alive = cur.rowcount > 0
        conn.commit()
        return alive
    finally:
        conn.close()


def release_lock(hook: EosPostgresHook, key: str, holder: str) -> bool:
    """Deletes the holder's row; False when it held none."""
    meta_schema = hook.meta_schema
    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{LOCK_TABLE}"',))
            if (cur.fetchone() or (None,))[0] is None:
                return False
            cur.execute(sql.SQL("DELETE FROM {} WHERE lock_key = %s AND holder = %s").format(
                lock_table(meta_schema)), (key, holder))
            released = cur.rowcount > 0
        conn.commit()
        return released
    finally:
        conn.close()


def recovery_hold(hook: EosPostgresHook, pipeline: str, target_schema: str,
                  ttl_seconds: float) -> dict[str, Any] | None:
    """The live recovery of the pipeline's target, or None.

    A recovery holds its row ``<database>/<target_schema>/<pipeline>`` and heartbeats it; a row
    whose heartbeat is older than ``ttl_seconds`` belongs to a dead run and holds nothing.

    :return: ``holder``, ``acquired_at``, ``heartbeat_at`` and ``heartbeat_age_seconds``
        (database clock)."""
    from airflow_provider_eos.state.meta import exists, table

    with hook.cursor() as cur:
        if not exists(cur, hook, LOCK_TABLE):
            return None
        cur.execute(
            sql.SQL(
                "SELECT holder, acquired_at, heartbeat_at,"
                " EXTRACT(EPOCH FROM (now() - heartbeat_at))::float8 AS heartbeat_age_seconds"
                " FROM {} WHERE lock_key = current_database() || '/' || %s || '/' || %s"
                " AND heartbeat_at >= now() - make_interval(secs => %s)"
            ).format(table(hook, LOCK_TABLE)),
            (target_schema, pipeline, float(ttl_seconds)),
        )
        row = cur.fetchone()
    if row is None:
        return None
    out = dict(row)
    for key in ("acquired_at", "heartbeat_at"):
        out[key] = out[key].isoformat()
    return out


def take_lock(hook: Any, key: str, holder: str, ttl: float) -> dict[str, Any]:
    """Acquires (or re-enters) the lock or raises :class:`RecoveryLockedError`.

    :param hook: an ``EosPostgresHook`` built for the pipeline's meta schema (the lock row lives there)."""
    result = acquire_lock(hook, key, holder, ttl)
    if not result["acquired"]:
        raise RecoveryLockedError(
            f"another recovery of {key} is running (lock held by {result['holder']} since {result['acquired_at']}, "
            f"last heartbeat {result['heartbeat_at']}; a lock without heartbeat for {ttl:g}s is taken over)"
        )
    if result.get("taken_over_from"):
        log.warning("recovery lock %s taken over from %s: its heartbeat was older than %gs",
                    key, result["taken_over_from"], ttl)
    return result


@contextmanager
def holding_lock(hook: Any, key: str, holder: str, ttl: float) -> Iterator[dict[str, Any]]:
    """Holds the lock for the duration of a step, heartbeating every ``ttl / 4`` seconds."""
    result = take_lock(hook, key, holder, ttl)
    stop = threading.Event()
    lost: list[str] = []

    def beat() -> None:
        while not stop.wait(ttl / BEATS_PER_TTL):
            try:
                if not heartbeat_lock(hook, key, holder):
                    lost.append(key)
                    return
            except Exception as exc:  # a missed beat is retried; the TTL spans several
                log.warning("recovery lock heartbeat for %s failed: %s", key, exc)

    thread = threading.Thread(target=beat, name=f"eos-lock-heartbeat-{key}", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(timeout=5)
    if lost or not heartbeat_lock(hook, key, holder):
        raise RecoveryLockedError(
            f"recovery lock {key} was taken over by another run while this step worked "
            f"(this run was presumed dead); its result must not be trusted"
        )
