"""The one meaning of "the pipeline has stopped", shared by the stop operator, its trigger and
the restore's precondition (pure: it reads a ``stream_activity`` report)."""

from __future__ import annotations

from typing import Any


def why_not_stopped(activity: dict[str, Any], quiet_seconds: float = 0.0, require_stop_request: bool = True
                    ) -> str | None:
    """Why the pipeline must be considered running, or None when it has stopped.

    Stopped means all of:

    * a stop is requested: the control row keeps a supervisor from starting the app again,
      and a running app sees it at its next batch boundary;
    * no supervisor (``StreamingPipelineOperator``) holds the pipeline's supervisor lock: a
      supervisor in its restart backoff reads the request and ends within seconds, so a
      stopped pipeline is also one no task is about to restart;
    * no driver holds the pipeline's running lock (every app holds it for as long as it is
      connected, however slow its batch, whoever started it);
    * if ``quiet_seconds`` > 0, no micro-batch finished within that long.

    :param activity: ``state.activity.stream_activity`` of the pipeline.
    :param quiet_seconds: also require this long without a finished batch.
    :param require_stop_request: False only where the caller itself holds the running lock
        and checks for a stray writer (a restore without a stop step)."""
    if require_stop_request and activity.get("stop_requested_at") is None:
        return "no stop has been requested for it (run the stop step first)"
    if activity.get("supervisor_running"):
        return "its supervisor (a StreamingPipelineOperator task) still holds the pipeline's supervisor lock"
    if activity.get("driver_running"):
        return "a driver of it is connected to the target database (it holds the pipeline's running lock)"
    since = activity.get("seconds_since")
    if since is not None and since < quiet_seconds:
        return f"it finished a micro-batch {since:.1f}s ago (less than {quiet_seconds:g}s)"
    return None


def jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """Timestamps as ISO strings, for XCom and trigger events."""
    return {k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in data.items()}
