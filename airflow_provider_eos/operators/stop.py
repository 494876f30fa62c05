"""Graceful stop of a running pipeline through its control row."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


class StopPipelineOperator(BaseOperator):
    """
    Asks a running pipeline to stop at its next batch boundary and waits until it has stopped.

    The request sets ``stop_requested_at`` in ``<meta_schema>.stream_control``; the app polls it,
    stops the query between two batches and exits 0, and its
    :class:`~airflow_provider_eos.operators.stream.StreamingPipelineOperator` then ends with
    status ``stopped``. "Stopped" is observed through the database, so it works across hosts:
    the stream operator holds a PostgreSQL advisory lock (the pipeline's supervisor lock) for
    as long as it supervises the app, and releases it only after spark-submit has exited. This
    operator waits until no session holds that lock. A supervisor in its restart backoff
    (its app crashed) sees the request within a few seconds and ends without restarting.

    A hard stop is not done here: if the pipeline has not stopped within ``timeout`` (a batch
    that takes longer, a hung driver), the task fails saying so; mark the stream task failed
    (UI, API or ``airflow tasks state``): its ``on_kill`` kills the spark-submit process group.
    Exactly-once delivery makes that safe: an interrupted batch rolls back and is replayed.

    :param pipeline: pipeline name.
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables.
    :param wait: wait for the stop (default); False only writes the request.
    :param stop_timeout: seconds to wait for the stop.
    :param poll_interval: seconds between checks.
    :param requested_by: recorded with the request (default: ``airflow:<dag_id>.<task_id>``).
    :return: (XCom) ``{"pipeline", "requested_at", "stopped", "was_running", "waited_s", "last_progress"}``
    """

    template_fields: Sequence[str] = ("pipeline", "postgres_conn_id", "meta_schema", "requested_by")
    ui_color = "#ffe8e8"

    def __init__(self, *, pipeline: str, postgres_conn_id: str = "eos_postgres", meta_schema: str = "eos",
                 wait: bool = True, stop_timeout: float = 600, poll_interval: float = 2.0,
                 requested_by: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.wait = wait
        self.stop_timeout = stop_timeout
        self.poll_interval = poll_interval
        self.requested_by = requested_by

    def execute(self, context: Any) -> dict[str, Any]:
        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        by = self.requested_by or f"airflow:{self.dag_id}.{self.task_id}"
        requested_at = hook.set_stop_request(self.meta_schema, self.pipeline, True, by=by)
        self.log.info("Stop of pipeline %r requested at %s by %s", self.pipeline, requested_at, by)
        result: dict[str, Any] = {"pipeline": self.pipeline, "requested_at": requested_at, "stopped": None,
                                  "was_running": None, "waited_s": 0.0, "last_progress": None}
        if not self.wait:
            return result
        started = time.monotonic()
        def running() -> bool:
            return hook.supervisor_running(self.pipeline) or hook.driver_running(self.pipeline)

        result["was_running"] = running()
        if not result["was_running"]:
            self.log.info("No driver or supervisor of %r is running now: nothing to wait for", self.pipeline)
        while running():
            waited = time.monotonic() - started
            if waited >= float(self.stop_timeout):
                progress = hook.latest_progress(self.pipeline)
                raise AirflowException(
                    f"pipeline {self.pipeline!r} is still running {waited:.0f}s after the stop request "
                    f"(last progress: {_describe(progress)}). It stops only between two batches; for a hard "
                    "stop mark its StreamingPipelineOperator task failed, whose on_kill kills spark-submit."
                )
            time.sleep(float(self.poll_interval))
        result.update(stopped=True, waited_s=round(time.monotonic() - started, 1),
                      last_progress=hook.latest_progress(self.pipeline))
        self.log.info("Pipeline %r stopped after %.1fs; last progress: %s", self.pipeline, result["waited_s"],
                      _describe(result["last_progress"]))
        return result


def _describe(progress: dict[str, Any] | None) -> str:
    if not progress:
        return "none"
    return f"batch {progress['batch_id']} of run {progress['run_id']} at {progress['recorded_at']}"
