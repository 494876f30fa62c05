"""RestoreOperator (validated, all-or-nothing restore of a snapshot) and the
recovery lock and stop-request steps around it."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.operators.snapshot import DEFAULT_STORE, PipelineOperatorMixin, timed_step
from airflow_provider_eos.recovery_lock import DEFAULT_LOCK_TTL, RecoveryLockedError, holder_of, take_lock
from airflow_provider_eos.snapshots import LATEST, SnapshotError, SnapshotManifest, SnapshotStore

__all__ = ["RecoveryLockOperator", "RecoveryLockedError", "RequestStopOperator", "RestoreOperator",
           "StreamStillRunningError", "check_stream_stopped"]


class StreamStillRunningError(AirflowException):
    """The pipeline may still be writing: restoring under it would be overwritten or interleaved."""


def check_stream_stopped(activity: dict[str, Any], quiet_seconds: float, require_stop_request: bool) -> str | None:
    """Why the stream must be considered running, or None when it is stopped.

    Stopped means: a stop was requested (the control row keeps a supervisor
    from starting it again; an app sees it at its next batch boundary) AND no
    driver holds the pipeline's running lock (a driver holds it for as long as
    it is connected, however slow its batch) AND, if ``quiet_seconds`` > 0, no
    micro-batch finished within that long (for apps older than the running lock)."""
    if require_stop_request and activity.get("stop_requested_at") is None:
        return "no stop has been requested for it (run the stop step first)"
    if activity.get("driver_running"):
        return "a driver of it is connected to the target database (it holds the pipeline's running lock)"
    since = activity.get("seconds_since")
    if since is not None and since < quiet_seconds:
        return f"it finished a micro-batch {since:.1f}s ago (less than {quiet_seconds:g}s)"
    return None


class RestoreOperator(PipelineOperatorMixin, BaseOperator):
    """
    Restores a pipeline's tables and replay point from a snapshot, all or nothing.

    1. choose the snapshot (``latest``, an id, or the newest at or before an
       ISO-8601 timestamp) and check it belongs to this pipeline's schemas;
    2. refuse while the stream may be running, while another recovery holds the
       lock, or when the meta schema is shared with other pipelines;
    3. copy the dump locally and check its SHA-256;
    4. restore it into a scratch database and compare every table's count and
       checksum with the manifest (the target is not touched until this passes);
       then roll back the pipeline's in-doubt two_phase transactions, if any
       (they hold locks and belong to the state being replaced);
    5. in ONE transaction of the target database: move the current tables aside,
       run the dump's restore script, check counts and checksums again, drop
       the old tables, commit.

    Returns a summary (XCom): snapshot id, rows restored per table, offsets, timings.

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param snapshot: ``latest``, a snapshot id or an ISO-8601 timestamp (templated).
    :param snapshot_store: local directory or object storage URL (templated).
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param quiet_seconds: also count a micro-batch finished more recently than this as running
        (0, the default: the running lock alone decides).
    :param require_stop_request: also require a stop request in the control table.
    :param allow_shared_meta: restore even if other pipelines keep offsets in the
        same meta schema (their offsets would go back to the snapshot's too).
    :param hold_lock: hold the target's recovery lock (re-entrant per DAG run, heartbeated) while restoring.
    :param release_lock: release the lock when done (standalone use; the recovery DAG releases it itself).
    :param lock_ttl: seconds without heartbeat after which a lock left by a dead run is taken over.
    :param keep_old: keep the replaced tables in the aside schema instead of dropping them.
    :param plan_only: only report the plan.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql.
    """

    template_fields: Sequence[str] = ("pipeline_config", "snapshot", "snapshot_store", "quiet_seconds", "plan_only")
    ui_color = "#fdf1e3"

    def __init__(
        self,
        *,
        pipeline_config: Any,
        snapshot: str = LATEST,
        snapshot_store: Any = DEFAULT_STORE,
        postgres_conn_id: str = "eos_postgres",
        quiet_seconds: float | str = 0.0,
        require_stop_request: bool = True,
        allow_shared_meta: bool = False,
        hold_lock: bool = True,
        release_lock: bool = False,
        lock_ttl: float = DEFAULT_LOCK_TTL,
        keep_old: bool = False,
        plan_only: Any = False,
        pg_bin_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline_config = pipeline_config
        self.snapshot = snapshot
        self.snapshot_store = snapshot_store
        self.postgres_conn_id = postgres_conn_id
        self.quiet_seconds = quiet_seconds
        self.require_stop_request = require_stop_request
        self.allow_shared_meta = allow_shared_meta
        self.hold_lock = hold_lock
        self.release_lock = release_lock
        self.lock_ttl = lock_ttl
        self.keep_old = keep_old
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    def choose(self, config: Any) -> SnapshotManifest:
        store = SnapshotStore(self.snapshot_store)
        try:
            manifest = store.select(config.pipeline, str(self.snapshot or LATEST))
        except SnapshotError as exc:
            raise AirflowException(f"pipeline {config.pipeline!r} in {store.base}: {exc}") from exc
        if (manifest.target_schema, manifest.meta_schema) != (config.target_schema, config.meta_schema):
            raise AirflowException(
                f"snapshot {manifest.snapshot_id} holds schemas {manifest.target_schema}/{manifest.meta_schema}, "
                f"the pipeline uses {config.target_schema}/{config.meta_schema}"
            )
        return manifest

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        manifest = self.choose(config)
        plan = {"snapshot": manifest.summary(), "target_database": self.hook.dbname}
        if _truthy(self.plan_only):
            self.log.info("dry run: would restore %s", plan)
            return {**plan, "dry_run": True}
        others = sorted(set(manifest.other_pipelines) | set(self._current_others(config)))
        if others and not self.allow_shared_meta:
            raise AirflowException(
                f"meta schema {config.meta_schema!r} also holds pipelines {others}: restoring it would roll their "
                "offsets back without their data. Give each pipeline its own meta schema, or set allow_shared_meta."
            )
        try:
            with self.lock_guard(config, context):
                reason = check_stream_stopped(
                    self.hook.stream_activity(config.meta_schema, config.pipeline),
                    float(self.quiet_seconds), self.require_stop_request,
                )
                if reason:
                    raise StreamStillRunningError(f"pipeline {config.pipeline!r} may still be running: {reason}")
                return {**plan, **self._restore(config, manifest)}
        finally:
            if self.hold_lock and self.release_lock:
                self.hook.release_lock(config.meta_schema, self.lock_key(config), holder_of(context))

    def _current_others(self, config: Any) -> list[str]:
        conn = self.hook.connect()
        try:
            return self.hook.other_pipelines(conn, config.meta_schema, config.pipeline)
        finally:
            conn.close()

    def _restore(self, config: Any, manifest: SnapshotManifest) -> dict[str, Any]:
        timings: dict[str, float] = {}
        clock = time.monotonic()
        store = SnapshotStore(self.snapshot_store)
        with tempfile.TemporaryDirectory(prefix="eos-restore-") as tmp:
            try:
                dump = store.fetch_dump(manifest, Path(tmp) / "dump.pgc")
            except SnapshotError as exc:
                raise AirflowException(f"{exc}; the target was not touched") from exc
            timings["fetch"] = round(time.monotonic() - clock, 3)
            # Under the lock no other restore of this target runs: its scratch leftovers are a dead run's.
            scratch = self.hook.validate_in_scratch(dump, manifest, owner=self.lock_key(config),
                                                    drop_leftovers=self.hold_lock)
            timings["scratch_restore"] = scratch["restore_seconds"]
            timings["scratch_validate"] = scratch["validate_seconds"]
            # A two_phase batch left in doubt by a dead driver holds locks the swap
            # needs, and belongs to the state being replaced: roll it back.
            rolled_back = self._roll_back_in_doubt(config)
            # Unique per attempt: a kept aside schema never blocks a rerun.
            aside = f"{config.target_schema[:40]}_old_{time.strftime('%Y%m%dt%H%M%S', time.gmtime())}"
            swap = self.hook.swap_in(dump, manifest, aside, drop_old=not self.keep_old)
            timings["swap"] = swap["swap_seconds"]
        timings["total"] = round(time.monotonic() - clock, 3)
        result = {
            "snapshot_id": manifest.snapshot_id,
            "rows_restored": manifest.total_rows,
            "tables": {t.qualified: t.rows for t in manifest.tables},
            "kafka_offsets": manifest.kafka_offsets,
            "aside_schema": swap["aside_schema"],
            "in_doubt_rolled_back": rolled_back,
            "scratch_leftovers_dropped": scratch["leftovers_dropped"],
            "timings": timings,
        }
        self.log.info("restored snapshot %s: %s", manifest.snapshot_id, result)
        return result

    def _roll_back_in_doubt(self, config: Any) -> list[str]:
        from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt

        conn = self.hook.connect()
        try:
            gids = [t["gid"] for t in resolve_in_doubt(conn, config.pipeline, "rollback")]
        finally:
            conn.close()
        if gids:
            self.log.warning("rolled back in-doubt transactions of %s before the swap: %s", config.pipeline, gids)
        return gids


class RecoveryLockOperator(PipelineOperatorMixin, BaseOperator):
    """
    Takes or releases the recovery lock of a pipeline's target: a row keyed by
    ``database/target_schema/pipeline`` in ``{meta_schema}.recovery_locks``
    holding the DAG run id (see :mod:`airflow_provider_eos.recovery_lock`). A
    row survives worker crashes and is visible to every worker (unlike a
    session advisory lock). It is re-entrant for its own run, so a rerun of a
    crashed run goes on; one whose heartbeat is older than ``lock_ttl`` is
    taken over.

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param action: ``acquire`` or ``release``.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: report who holds the lock without taking it.
    """

    template_fields: Sequence[str] = ("pipeline_config", "plan_only")

    def __init__(self, *, pipeline_config: Any, action: str = "acquire", postgres_conn_id: str = "eos_postgres",
                 lock_ttl: float = DEFAULT_LOCK_TTL, plan_only: Any = False, pg_bin_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if action not in ("acquire", "release"):
            raise ValueError("action must be 'acquire' or 'release'")
        self.pipeline_config = pipeline_config
        self.action = action
        self.postgres_conn_id = postgres_conn_id
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        key, holder = self.lock_key(config), holder_of(context)
        if _truthy(self.plan_only):
            return {"key": key, "holder": holder, "dry_run": True}
        if self.action == "release":
            return {"key": key, "released": self.hook.release_lock(config.meta_schema, key, holder)}
        return take_lock(self.hook, config.meta_schema, key, holder, float(self.lock_ttl))


class RequestStopOperator(PipelineOperatorMixin, BaseOperator):
    """
    Asks the pipeline to stop (control-table row; the app stops at the next batch
    boundary) and waits until no driver holds the pipeline's running lock
    (and, if ``quiet_seconds`` > 0, no micro-batch finished for that long).

    The recovery's variant of ``StopPipelineOperator``: it takes the pipeline
    from its config and holds the recovery lock while it waits.

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param quiet_seconds: additionally require this long without progress (default 0).
    :param timeout_seconds: give up after this long.
    :param hold_lock: hold the target's recovery lock while waiting (a recovery step).
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: report the stream's state without changing it.
    """

    template_fields: Sequence[str] = ("pipeline_config", "quiet_seconds", "plan_only")

    def __init__(self, *, pipeline_config: Any, postgres_conn_id: str = "eos_postgres",
                 quiet_seconds: float | str = 0.0, timeout_seconds: float = 600.0, hold_lock: bool = False,
                 lock_ttl: float = DEFAULT_LOCK_TTL, plan_only: Any = False, pg_bin_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_config = pipeline_config
        self.postgres_conn_id = postgres_conn_id
        self.quiet_seconds = quiet_seconds
        self.timeout_seconds = timeout_seconds
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        if _truthy(self.plan_only):
            return {"dry_run": True, **_jsonable(self.hook.stream_activity(config.meta_schema, config.pipeline))}
        with self.lock_guard(config, context):
            return self._stop(config, context)

    def _stop(self, config: Any, context: Any) -> dict[str, Any]:
        self.hook.set_stop_request(config.meta_schema, config.pipeline, True, by=holder_of(context))
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            activity = self.hook.stream_activity(config.meta_schema, config.pipeline)
            reason = check_stream_stopped(activity, float(self.quiet_seconds), True)
            if reason is None:
                return _jsonable(activity)
            if time.monotonic() > deadline:
                raise StreamStillRunningError(f"pipeline {config.pipeline!r} did not stop: {reason}")
            self.log.info("waiting for pipeline %s to stop: %s", config.pipeline, reason)
            time.sleep(1.0)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if hasattr(v, "isoformat") else v for k, v in data.items()}
