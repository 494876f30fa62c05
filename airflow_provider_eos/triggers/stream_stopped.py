"""The deferred wait for a pipeline to stop (see ``utils.stream_stopped.why_not_stopped``)."""

from __future__ import annotations

from typing import Any

from airflow_provider_eos.triggers.stream_progress import PollingTrigger
from airflow_provider_eos.utils.stream_stopped import jsonable, why_not_stopped


class StreamStoppedTrigger(PollingTrigger):
    """
    Fires ``ok`` once the pipeline has stopped, ``timeout`` (with what still runs) after
    ``timeout_seconds``, ``error`` when the database cannot be read or a recovery lock it
    keeps alive was taken over.

    A recovery step holds the target's recovery lock while it waits. Deferred, the step has
    no worker to heartbeat it, so the trigger does: given ``lock``, each poll refreshes the
    lock's heartbeat and fails if the lock is no longer this run's.

    :param pipeline: pipeline name.
    :param meta_schema: schema of the bookkeeping tables.
    :param postgres_conn_id: target database connection.
    :param quiet_seconds: also require this long without a finished batch.
    :param poke_interval: seconds between checks.
    :param timeout_seconds: fire ``timeout`` after this long.
    :param lock: ``{"key", "holder"}`` of the recovery lock to keep alive, or None.
    """

    def __init__(self, pipeline: str, meta_schema: str, postgres_conn_id: str, quiet_seconds: float = 0.0,
                 poke_interval: float = 2.0, timeout_seconds: float = 600.0,
                 lock: dict[str, str] | None = None) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.meta_schema = meta_schema
        self.postgres_conn_id = postgres_conn_id
        self.quiet_seconds = float(quiet_seconds)
        self.poke_interval = float(poke_interval)
        self.timeout_seconds = float(timeout_seconds)
        self.lock = dict(lock) if lock else None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "pipeline": self.pipeline, "meta_schema": self.meta_schema, "postgres_conn_id": self.postgres_conn_id,
            "quiet_seconds": self.quiet_seconds, "poke_interval": self.poke_interval,
            "timeout_seconds": self.timeout_seconds, "lock": self.lock,
        })

    def check(self) -> dict[str, Any]:
        from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
        from airflow_provider_eos.recovery.lock import RecoveryLockedError, heartbeat_lock
        from airflow_provider_eos.state.activity import stream_activity

        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        if self.lock and not heartbeat_lock(hook, self.lock["key"], self.lock["holder"]):
            raise RecoveryLockedError(
                f"recovery lock {self.lock['key']} was taken over by another run while this step waited")
        activity = jsonable(stream_activity(hook, self.pipeline))
        reason = why_not_stopped(activity, self.quiet_seconds)
        return {"ok": reason is None, "activity": activity,
                "message": f"pipeline {self.pipeline!r} has stopped" if reason is None
                else f"pipeline {self.pipeline!r} is still running: {reason}"}
