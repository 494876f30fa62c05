"""The one stop of a pipeline: its stop request, an optional fence, and a deferred wait until
it has stopped (``utils.stream_stopped.why_not_stopped``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.recovery_lock import DEFAULT_LOCK_TTL, take_lock
from airflow_provider_eos.operators.base import (
    DEFAULT_DEFER_AFTER,
    PipelineOperatorMixin,
    holder_of,
    poll_before_defer,
    timed_step,
)
from airflow_provider_eos.triggers.stream_stopped import StreamStoppedTrigger
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.stream_stopped import jsonable, why_not_stopped

HARD_STOP_HINT = ("It stops only between two batches; for a hard stop mark its StreamingPipelineOperator task "
                  "failed, whose on_kill kills spark-submit.")


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
    about to do (a restarted driver does the same, ``driver.claim``), so the target stays
    exact. Only while holding the running lock (no driver runs, none can start
    meanwhile): a live driver's prepared batch is its own to commit a moment later."""
    from spark_apps.eos_stream.sink.in_doubt import find_in_doubt, resolve_in_doubt

    probe = hook.connect()
    try:
        if not find_in_doubt(probe, config.pipeline):
            return []
    finally:
        probe.close()
    running = hook.try_running_lock(config.pipeline)
    if running is None:
        return []  # a live driver: its batch is in flight, not in doubt
    try:
        conn = hook.connect()
        try:
            return [t["gid"] for t in resolve_in_doubt(conn, config.pipeline, "commit")]
        finally:
            conn.close()
    finally:
        running.close()


def pipeline_lock_holders(hook: Any, pipeline: str) -> list[str]:
    """Who holds the pipeline's lock now, one line each (for an error message)."""
    from spark_apps.eos_stream import fencing

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

    from spark_apps.eos_stream import fencing

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


class StopPipelineOperator(PipelineOperatorMixin, BaseOperator):
    """
    Stops a pipeline and waits until it has stopped.

    It sets the stop request in ``<meta_schema>.stream_control``: the app stops its query
    between two batches and exits 0, and its
    :class:`~airflow_provider_eos.operators.stream.StreamingPipelineOperator` ends with status
    ``stopped`` (one in its restart backoff ends within seconds, without restarting). With
    ``fence`` it then bumps the pipeline's epoch, so a driver between two stop polls cannot
    write one more batch (the recovery's stop). Stopped is observed through the database, so
    it works across hosts: see :func:`~airflow_provider_eos.utils.stream_stopped.why_not_stopped`.

    The wait defers to :class:`~airflow_provider_eos.triggers.stream_stopped.StreamStoppedTrigger`
    (no worker slot while a batch finishes); with ``hold_lock`` the trigger keeps the
    recovery lock's heartbeat, and the step fails if another run took the lock over. A stop
    usually lands within seconds, so the task first polls for ``defer_after`` seconds in the
    worker and defers only a longer wait (``base.poll_before_defer``, shared by every deferrable
    step: a trigger that fires within seconds of the deferral meets apache/airflow#72716).

    A hard stop is not done here: if the pipeline has not stopped within ``timeout_seconds``
    (a batch that takes longer, a hung driver), the task fails saying what still runs. Mark the
    stream task failed (UI, API or ``airflow tasks state``): its ``on_kill`` kills the
    spark-submit process group. Exactly-once delivery makes that safe: an interrupted batch
    rolls back and is replayed.

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param fence: also bump the pipeline's epoch after the request (a recovery step).
    :param quiet_seconds: also require this long without a finished batch (templated).
    :param wait: wait for the stop (default); False only writes the request.
    :param timeout_seconds: fail when it has not stopped after this long.
    :param poll_interval: seconds between checks.
    :param deferrable: wait in the triggerer (default) rather than in a worker slot.
    :param defer_after: seconds to poll in the worker before deferring (0: defer at once).
    :param hold_lock: hold the target's recovery lock (a recovery step).
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param fence_wait_seconds: with ``fence``, how long the epoch bump waits for the pipeline's
        lock (a batch in flight) before failing with who holds it. A two_phase batch left in
        doubt by a dead driver, which would hold it forever, is committed first.
    :param plan_only: report the stream's state without changing it (templated).
    :return: (XCom) the request (``requested_at``, ``epoch``, ``in_doubt_committed``); after a
        wait also the last ``stream_activity``, ``stopped: true`` and ``waited_s``.
    """

    template_fields: Sequence[str] = ("pipeline_config", "quiet_seconds", "plan_only")
    ui_color = "#ffe8e8"

    def __init__(self, *, pipeline_config: Any, postgres_conn_id: str = "eos_postgres", fence: bool = False,
                 quiet_seconds: float | str = 0.0, wait: bool = True, timeout_seconds: float = 600.0,
                 poll_interval: float = 2.0, deferrable: bool = True,
                 defer_after: float = DEFAULT_DEFER_AFTER,
                 hold_lock: bool = False, fence_wait_seconds: float = DEFAULT_FENCE_WAIT,
                 lock_ttl: float = DEFAULT_LOCK_TTL, plan_only: Any = False, pg_bin_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fence_wait_seconds = float(fence_wait_seconds)
        if hold_lock and timeout_seconds >= lock_ttl:
            raise ValueError(f"timeout_seconds ({timeout_seconds:g}) must be shorter than lock_ttl ({lock_ttl:g})")
        self.pipeline_config = pipeline_config
        self.postgres_conn_id = postgres_conn_id
        self.fence = fence
        self.quiet_seconds = quiet_seconds
        self.wait = wait
        self.timeout_seconds = float(timeout_seconds)
        self.poll_interval = float(poll_interval)
        self.deferrable = deferrable
        self.defer_after = float(defer_after)
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        if as_bool(self.plan_only):
            return {"dry_run": True, **jsonable(self.hook.stream_activity(config.meta_schema, config.pipeline))}
        holder, step_started = holder_of(context), time.time()
        with self.lock_guard(config, context):
            requested_at = self.hook.set_stop_request(config.meta_schema, config.pipeline, True, by=holder)
            # A driver between two stop polls would otherwise write one more batch; fenced, it cannot.
            in_doubt = commit_orphans(self.hook, config) if self.fence else []
            if in_doubt:
                self.log.warning("committed the in-doubt two_phase batches of %s a dead driver left: %s",
                                 config.pipeline, in_doubt)
            epoch = bump_epoch(self.hook, config, holder, "stop", self.fence_wait_seconds, self.log) \
                if self.fence else None
            self.log.info("Stop of pipeline %r requested at %s by %s%s", config.pipeline, requested_at, holder,
                          f", epoch bumped to {epoch}" if epoch is not None else "")
            request = {"pipeline": config.pipeline, "requested_at": requested_at, "epoch": epoch,
                       "in_doubt_committed": in_doubt}
            if not self.wait:
                return request
            started = time.monotonic()
            in_worker = min(self.defer_after, self.timeout_seconds) if self.deferrable else self.timeout_seconds
            (activity, reason), _stopped = poll_before_defer(lambda: self._check(config), lambda r: r[1] is None,
                                                             in_worker, self.poll_interval)
            if reason is None:
                return {**request, **activity, "stopped": True, "waited_s": round(time.monotonic() - started, 1)}
            if not self.deferrable or in_worker >= self.timeout_seconds:
                raise StreamStillRunningError(
                    f"pipeline {config.pipeline!r} did not stop within {self.timeout_seconds:g}s: {reason}. "
                    + HARD_STOP_HINT)
            remaining = self.timeout_seconds - (time.monotonic() - started)
        self.log.info("Waiting in the triggerer for pipeline %r to stop: %s", config.pipeline, reason)
        lock = {"key": self.lock_key(config), "holder": holder} if self.hold_lock else None
        trigger = StreamStoppedTrigger(
            pipeline=config.pipeline, meta_schema=config.meta_schema, postgres_conn_id=self.postgres_conn_id,
            quiet_seconds=float(self.quiet_seconds), poke_interval=self.poll_interval,
            timeout_seconds=max(remaining, self.poll_interval), lock=lock,
        )
        # The trigger fires "timeout" with what still runs; Airflow's deferral timeout is a backstop.
        self.defer(trigger=trigger, method_name="execute_complete",
                   kwargs={"request": request, "step_started": step_started},
                   timeout=timedelta(seconds=self.timeout_seconds + max(60.0, 2 * self.poll_interval)))

    def _check(self, config: Any) -> tuple[dict[str, Any], str | None]:
        """One check in the worker (inside the lock guard's heartbeat): the activity and why the
        pipeline has not stopped (None: it has)."""
        activity = jsonable(self.hook.stream_activity(config.meta_schema, config.pipeline))
        reason = why_not_stopped(activity, float(self.quiet_seconds))
        if reason is not None:
            self.log.info("waiting for pipeline %s to stop: %s", config.pipeline, reason)
        return activity, reason

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None, request: dict[str, Any] | None = None,
                         step_started: float | None = None) -> dict[str, Any]:
        request = request or {}
        if not event:
            raise AirflowException("the stop trigger ended without an event")
        status, message = event.get("status"), event.get("message")
        if status == "timeout":
            raise StreamStillRunningError(f"{message} after {self.timeout_seconds:g}s. " + HARD_STOP_HINT)
        if status != "ok":
            raise AirflowException(f"waiting for the stop failed: {message}")
        if self.hold_lock:  # re-entrant for this run; refuses if another run took the lock over
            config = self.load_config()
            take_lock(self.hook, config.meta_schema, self.lock_key(config), holder_of(context), float(self.lock_ttl))
        waited = round(time.time() - step_started, 1) if step_started else None
        self.log.info("%s (%ss after the request)", message, waited)
        return {**request, **(event.get("report") or {}).get("activity", {}), "stopped": True, "waited_s": waited,
                "step_seconds": waited}
