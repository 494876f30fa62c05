"""The one stop of a pipeline: its stop request, an optional fence, and a deferred wait until
it has stopped (``utils.stream_stopped.why_not_stopped``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.operators.base import (
    DEFAULT_DEFER_AFTER,
    PipelineOperatorMixin,
    default_deferrable,
    holder_of,
    poll_before_defer,
    timed_step,
)
from airflow_provider_eos.recovery.guards import DEFAULT_FENCE_WAIT, StreamStillRunningError, bump_epoch, commit_orphans
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL, take_lock
from airflow_provider_eos.state.activity import stream_activity
from airflow_provider_eos.state.stop_requests import set_stop_request
from airflow_provider_eos.triggers.stream_stopped import StreamStoppedTrigger
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.stream_stopped import jsonable, why_not_stopped

HARD_STOP_HINT = ("It stops only between two batches; for a hard stop mark its StreamingPipelineOperator task "
                  "failed, whose on_kill kills spark-submit.")


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

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param fence: also bump the pipeline's epoch after the request (a recovery step).
    :param quiet_seconds: also require this long without a finished batch (templated).
    :param wait: wait for the stop (default); False only writes the request.
    :param timeout_seconds: fail when it has not stopped after this long.
    :param poll_interval: seconds between checks.
    :param deferrable: wait in the triggerer rather than in a worker slot; default: ``[operators]
        default_deferrable``.
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

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 postgres_conn_id: str = "eos_postgres", fence: bool = False,
                 quiet_seconds: float | str = 0.0, wait: bool = True, timeout_seconds: float = 600.0,
                 poll_interval: float = 2.0, deferrable: bool = default_deferrable(),
                 defer_after: float = DEFAULT_DEFER_AFTER,
                 hold_lock: bool = False, fence_wait_seconds: float = DEFAULT_FENCE_WAIT,
                 lock_ttl: float = DEFAULT_LOCK_TTL, plan_only: Any = False, pg_bin_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fence_wait_seconds = float(fence_wait_seconds)
        if hold_lock and timeout_seconds >= lock_ttl:
            raise ValueError(f"timeout_seconds ({timeout_seconds:g}) must be shorter than lock_ttl ({lock_ttl:g})")
        self.take_definition(definition, pipeline_config)
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
            return {"dry_run": True, **jsonable(stream_activity(self.hook, config.pipeline))}
        holder, step_started = holder_of(context), time.time()
        with self.lock_guard(config, context):
            requested_at = set_stop_request(self.hook, config.pipeline, True, by=holder)
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
        activity = jsonable(stream_activity(self.hook, config.pipeline))
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
            take_lock(self.hook, self.lock_key(config), holder_of(context), float(self.lock_ttl))
        waited = round(time.time() - step_started, 1) if step_started else None
        self.log.info("%s (%ss after the request)", message, waited)
        return {**request, **(event.get("report") or {}).get("activity", {}), "stopped": True, "waited_s": waited,
                "step_seconds": waited}
