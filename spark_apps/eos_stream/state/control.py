"""Graceful stop (at a batch boundary, on a control-table request or a time
limit) and the running lock that tells the outside world a driver is alive."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.state import fencing, meta_tables
from spark_apps.eos_stream.state.reconnect import Outage, describe_connection


class AlreadyRunning(RuntimeError):
    """Another driver of the pipeline holds its running lock (retryable)."""


def running_lock_key(pipeline: str) -> str:
    return "eos:running:" + pipeline


def hold_running_lock(conn: PgConnection, pipeline: str, wait_seconds: float = 60.0) -> None:
    """Takes the pipeline's session-level advisory lock for the driver's lifetime.

    While it is held a driver is connected, whatever its progress: a restore
    can tell "stopped" from "slow" exactly (``driver_running``), and two drivers
    of one pipeline never run at once. A killed driver's session ends with it,
    which frees the lock; the wait covers a backend still finishing the dead
    driver's last statement.

    :param conn: a connection kept open as long as the driver runs.
    :raises AlreadyRunning: the lock stayed taken for ``wait_seconds``.
    """
    previous, conn.autocommit = conn.autocommit, True
    try:
        with conn.cursor() as cur:
            # The wait is this call's own: a session's statement_timeout (the continuous engine
            # sets one) must not cut it, and both go back to the session's values afterwards.
            cur.execute("SELECT set_config('lock_timeout', %s, false), set_config('statement_timeout', '0', false)",
                        (f"{int(wait_seconds * 1000)}ms",))
            try:
                cur.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (running_lock_key(pipeline),))
            except Exception as exc:  # LockNotAvailable (55P03) after lock_timeout
                if getattr(exc, "pgcode", None) != "55P03":
                    raise
                raise AlreadyRunning(
                    f"another driver of pipeline {pipeline!r} is connected to the target database and still "
                    f"running after {wait_seconds:g}s; stop it first (one driver per pipeline)"
                ) from exc
            cur.execute("RESET lock_timeout; RESET statement_timeout")
    finally:
        conn.autocommit = previous


# The sessions holding the session-level advisory lock ``hashtextextended(%(key)s, 0)`` in
# the connected database, one ``pid`` per row. One definition for every reader (the app, the
# provider's hooks, the tests); read from pg_locks, so looking never takes the lock.
ADVISORY_LOCK_HOLDERS_SQL = sql.SQL(
    "SELECT l.pid FROM pg_locks l, (SELECT hashtextextended(%(key)s, 0) AS key) k"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid"
)


def advisory_lock_held(conn: PgConnection, key: str) -> bool:
    """Whether any session holds the advisory lock of ``key`` (see ADVISORY_LOCK_HOLDERS_SQL)."""
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT EXISTS ({})").format(ADVISORY_LOCK_HOLDERS_SQL), {"key": key})
        row = cur.fetchone()
    return bool(row and row[0])


def driver_running(conn: PgConnection, pipeline: str) -> bool:
    """Whether a driver of ``pipeline`` is connected (holds its running lock)."""
    return advisory_lock_held(conn, running_lock_key(pipeline))


def stop_requested(conn: PgConnection, meta_schema: str, pipeline: str) -> str | None:
    """Why the pipeline must not run now (its stop request), or None."""
    return StopSignal(conn, meta_schema, pipeline, 0).requested()


_UNKNOWN = object()  # a poll that could not reach the database


class StopSignal:
    """Polled by the driver's main thread between awaits.

    :param conn: an autocommit connection used only to read the control and epoch tables.
    :param run_seconds: stop after this long (0: never).
    :param epoch: the epoch this driver started at; ``fenced`` reports when it
        changed (None: never fenced).
    :param honour_requests: False for the recovery's replay run, which runs
        while the recovery itself holds the stop request.
    :param reconnect: opens a new connection when ``conn`` is lost (a PostgreSQL
        restart). None: a lost connection raises at once.
    :param outage_seconds: how long the database may stay unreachable before a
        poll raises (``reconnect.OutageTooLong``, naming the poll and the database);
        until then a poll knows nothing and answers None. Safe: a stop request
        waits in the database, and every batch checks the epoch.
    """

    def __init__(self, conn: PgConnection, meta_schema: str, pipeline: str, run_seconds: float,
                 epoch: int | None = None, honour_requests: bool = True,
                 reconnect: Callable[[], PgConnection] | None = None, outage_seconds: float = 0.0) -> None:
        self.conn = conn
        self.reconnect = reconnect
        self.outage = Outage("stop-and-fence poll", describe_connection(conn), outage_seconds)
        self.meta_schema = meta_schema
        self.pipeline = pipeline
        self.epoch = epoch
        self.honour_requests = honour_requests
        self.deadline = time.monotonic() + run_seconds if run_seconds > 0 else None
        self.query_sql = sql.SQL("SELECT stop_requested_at FROM {} WHERE pipeline = %s").format(
            meta_tables.table(meta_schema, meta_tables.CONTROL)
        )

    def fenced(self) -> str | None:
        """Why this driver no longer owns the pipeline, or None.

        Batches check the epoch themselves; this catches the idle driver (a
        processingTime run or the continuous engine with no new data), which would otherwise hold the
        running lock, and keep a successor waiting, until its next batch."""
        if self.epoch is None:
            return None
        now = self._read(lambda cur: fencing.current_epoch(cur, self.meta_schema, self.pipeline))
        if now is not _UNKNOWN and now != self.epoch:
            return (f"pipeline {self.pipeline!r} was fenced: its epoch is {now}, this driver started at "
                    f"epoch {self.epoch}")
        return None

    def requested(self) -> str | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "run_seconds elapsed"
        if not self.honour_requests:
            return None
        def read(cur: Any) -> Any:
            cur.execute(self.query_sql, (self.pipeline,))
            return cur.fetchone()

        row = self._read(read)
        if row is not _UNKNOWN and row is not None and row[0] is not None:
            return f"stop requested at {row[0].isoformat()}"
        return None

    def _read(self, read: Callable[[Any], Any]) -> Any:
        """``read(cursor)`` on the control connection, or ``_UNKNOWN`` while the database is
        unreachable: a lost connection is opened again (the next poll uses it), and the
        outage raises once it lasts more than ``outage_seconds``."""
        try:
            with self.conn.cursor() as cur:
                result = read(cur)
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
            if self.reconnect is None:
                raise
            self.outage.failed(exc)  # raises past outage_seconds
            self._reopen()
            return _UNKNOWN
        self.outage.ok()
        return result

    def _reopen(self) -> None:
        assert self.reconnect is not None
        try:
            conn = self.reconnect()
        except Exception:  # still down or starting up (the driver's connect raises TargetUnavailable):
            return  # the next poll tries again, and raises after outage_seconds
        conn.autocommit = True
        old, self.conn = self.conn, conn
        if not old.closed:
            old.close()

    @staticmethod
    def at_batch_boundary(query: Any, wait_seconds: float = 120.0) -> None:
        """Waits for the running micro-batch to finish, then stops the query.

        Stopping mid-batch would still be safe (the batch rolls back), but a
        clean boundary makes the stop quick to resume from."""
        deadline = time.monotonic() + wait_seconds
        while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.2)
        query.stop()
