"""Who may still write to a pipeline's target, and how a recovery takes it from them: the two_phase
batches and decided prepared parts a dead driver left in doubt (committed by a stop, rolled back
by a restore, with every other prepared part), the
pipeline's epoch (bumped, never waiting forever for its lock), who holds that lock when it stays
held, and the running lock a restore or rollback holds so that no driver starts under it.
Functions of the hook, as Flink's ``XaGroupOps`` are of its facade."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.state.running_lock import try_running_lock

log = logging.getLogger(__name__)


class StreamStillRunningError(AirflowException):
    """The pipeline may still be writing: restoring under it would be overwritten or interleaved."""


# How long a stop or fence waits for the pipeline's lock (held by a batch in flight) before
# it fails saying who holds it. A batch of a live driver ends well within it; a two_phase batch
# left in doubt by a dead driver holds it forever, and is committed first (commit_orphans).
DEFAULT_FENCE_WAIT = 120.0

# Who holds the pipeline's transaction-level advisory lock (eos:<pipeline>, see fencing.py):
# sessions with their application and state, and prepared transactions (no pid) by gid, found
# through their own transactionid lock (same virtualtransaction). A bigint advisory key shows
# in pg_locks as classid (high 32 bits) and objid (low 32 bits), objsubid 1.
_LOCK_HOLDERS = """
SELECT l.pid, a.application_name, host(a.client_addr), a.state,
       EXTRACT(EPOCH FROM now() - a.xact_start)::int, p.gid, p.prepared::text
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN pg_locks x ON l.pid IS NULL AND x.locktype = 'transactionid' AND x.pid IS NULL
  AND x.virtualtransaction = l.virtualtransaction
LEFT JOIN pg_prepared_xacts p ON p.transaction = x.transactionid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(%s, 0)
ORDER BY 1
"""


def commit_orphans(hook: Any, config: Any) -> list[str]:
    """Commits the pipeline's two_phase batches left in doubt by a dead driver, if no
    driver is connected; returns their gids.

    Such a batch was PREPAREd (data and offsets, written after its ownership check
    under the pipeline's lock) and never reached COMMIT PREPARED: it holds the
    pipeline's lock until someone resolves it, so an epoch bump, and with it a stop or
    fence, would wait forever. Committing it finishes exactly what the dead driver was
    about to do (a restarted driver does the same, ``start.claim``), so the target stays
    exact. Only while holding the running lock (no driver runs, none can start
    meanwhile): a live driver's prepared batch is its own to commit a moment later."""
    from spark_apps.eos_stream.sink import parts
    from spark_apps.eos_stream.sink.in_doubt import find_in_doubt, resolve_in_doubt

    probe = hook.connect()
    try:
        if not find_in_doubt(probe, config.pipeline) and not parts.decided(probe, config.meta_schema, config.pipeline):
            return []
    finally:
        probe.close()
    running = try_running_lock(hook, config.pipeline)
    if running is None:
        return []  # a live driver: its batch is in flight, not in doubt
    try:
        conn = hook.connect()
        try:
            committed = [t["gid"] for t in resolve_in_doubt(conn, config.pipeline, "commit")]
            # Prepared parts of a batch whose decision committed (sink.parts, P4): committed like an
            # in-doubt batch. Undecided parts stay: only a driver after its epoch bump, or a
            # restore, rolls them back (no decision can name them any more then).
            return committed + parts.resolve(conn, config.meta_schema, config.pipeline, undecided="keep")["committed"]
        finally:
            conn.close()
    finally:
        running.close()


def pipeline_lock_holders(hook: Any, pipeline: str) -> list[str]:
    """Who holds the pipeline's lock now, one line each (for an error message)."""
    from spark_apps.eos_stream.state import fencing

    conn = hook.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(_LOCK_HOLDERS, (fencing.pipeline_lock_key(pipeline),))
            rows = cur.fetchall()
        conn.rollback()
    finally:
        conn.close()
    out = []
    for pid, application, client, state, seconds, gid, prepared in rows:
        if pid is None:
            out.append(f"prepared transaction {gid!r} (in doubt since {prepared})" if gid else "a prepared transaction")
        else:
            out.append(f"pid {pid} ({application or 'no application_name'} from {client or 'local socket'}, "
                       f"{state}, in its transaction for {seconds}s)")
    return out


def bump_epoch(hook: Any, config: Any, by: str, reason: str, wait_seconds: float = DEFAULT_FENCE_WAIT,
               log: Any = None) -> int:
    """Bumps the pipeline's epoch in its own transaction (see ``fencing.bump_epoch``), never
    waiting forever for the pipeline's lock.

    A two_phase batch left in doubt by a dead driver holds that lock until resolved, so
    the pipeline's orphans are committed first (``commit_orphans``). The bump then waits at
    most ``wait_seconds`` (``lock_timeout``) for a batch in flight; should the lock still be
    held, orphans are looked for once more (the driver may have died meanwhile), and
    otherwise it fails naming the holders.

    :raises StreamStillRunningError: the lock stayed held for ``wait_seconds``."""
    from psycopg2 import errors as pg_errors

    from spark_apps.eos_stream.state import fencing

    for attempt in (1, 2):
        committed = commit_orphans(hook, config)
        if committed and log is not None:
            log.warning("committed the in-doubt two_phase batches of %s a dead driver left (they passed its "
                        "ownership check and held the pipeline's lock): %s", config.pipeline, committed)
        conn = hook.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT set_config('lock_timeout', %s, false)", (f"{int(wait_seconds * 1000)}ms",))
            conn.commit()
            return fencing.bump_epoch(conn, config.meta_schema, config.pipeline, by=by, reason=reason)
        except pg_errors.LockNotAvailable:
            conn.rollback()
            if attempt == 2 or not commit_orphans(hook, config):
                holders = pipeline_lock_holders(hook, config.pipeline) or ["nobody any more (released just now)"]
                raise StreamStillRunningError(
                    f"pipeline {config.pipeline!r}: could not bump its epoch within {wait_seconds:g}s, its lock "
                    f"({fencing.pipeline_lock_key(config.pipeline)}) is held by: {'; '.join(holders)}. A batch in "
                    "flight ends by itself: retry. A session that stays idle in its transaction can be ended with "
                    "pg_terminate_backend(pid); a prepared transaction of a driver that is still connected is "
                    "committed by it, or resolve it with COMMIT PREPARED once that driver is gone.") from None
        finally:
            conn.close()
    raise AssertionError("unreachable")


@contextmanager
def holding_running_lock(hook: Any, pipeline: str) -> Iterator[None]:
    """Holds the pipeline's running lock (the one every driver holds for its
    lifetime) while a recovery step changes the target: no driver can start
    meanwhile. Taking it, not probing it, closes the gap between "no driver
    runs" and the change.

    :raises StreamStillRunningError: a driver holds it."""
    conn = try_running_lock(hook, pipeline)
    if conn is None:
        raise StreamStillRunningError(
            f"pipeline {pipeline!r} may still be running: a driver of it is connected to the target database "
            "(it holds the pipeline's running lock)")
    try:
        yield
    finally:
        conn.close()  # releases the lock


def roll_back_in_doubt(hook: Any, pipeline: str) -> list[str]:
    """Rolls back the pipeline's two_phase transactions a dead driver left in doubt, under the
    running lock: they hold locks the swap needs, and belong to the state being replaced."""
    from spark_apps.eos_stream.sink import parts
    from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt

    conn = hook.connect()
    try:
        gids = [t["gid"] for t in resolve_in_doubt(conn, pipeline, "rollback")]
        # Prepared parts (sink.parts), decided or not: the restore replaces the state their
        # decision was made on, and they hold locks the swap needs.
        gids += parts.roll_back(conn, parts.pipeline_prefix(pipeline))
        parts.resolve(conn, hook.meta_schema, pipeline)  # forgets the decisions that named them
    finally:
        conn.close()
    if gids:
        log.warning("rolled back in-doubt transactions of %s: %s", pipeline, gids)
    return gids
