"""RestoreOperator (validated, all-or-nothing restore of a snapshot), the steps
after it (FinalizeRestoreOperator, RollbackRestoreOperator), and the recovery
lock and fence steps around it. Thin: the protocol, and what a crash at each of
its steps leaves behind, is in ``airflow_provider_eos/recovery/`` (the table of
failure transitions heads ``recovery/__init__.py``).

What a restore holds while it works, outermost first: the target's recovery
lock row (one recovery at a time, survives worker crashes); the pipeline's
running lock, a session advisory lock on a connection kept open for the whole
restore (no driver runs, none can start; released when that connection
closes, so also when the worker dies); and, inside the swap transaction only,
the target's swap lock (exclusive; snapshots take it shared) and the
pipeline's transaction lock, under which the epoch is bumped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.operators.base import KafkaOffsetsMixin, PipelineOperatorMixin, holder_of, timed_step
from airflow_provider_eos.recovery import aside, restore
from airflow_provider_eos.recovery.catalog import DependentObjectsError
from airflow_provider_eos.recovery.contracts import ChosenSnapshot, Restored
from airflow_provider_eos.recovery.guards import (
    DEFAULT_FENCE_WAIT,
    StreamStillRunningError,
    bump_epoch,
    commit_orphans,
    holding_running_lock,
    roll_back_in_doubt,
)
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL, RecoveryLockedError, release_lock, take_lock
from airflow_provider_eos.recovery.manifest import LATEST
from airflow_provider_eos.recovery.restore import TableChangesError
from airflow_provider_eos.recovery.store import SnapshotStore
from airflow_provider_eos.state.activity import stream_activity
from airflow_provider_eos.state.stop_requests import set_stop_request
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.stream_stopped import jsonable, why_not_stopped

__all__ = ["DependentObjectsError", "FenceOperator", "FinalizeRestoreOperator", "RecoveryLockOperator",
           "RecoveryLockedError", "RestoreOperator", "RollbackRestoreOperator", "TableChangesError"]


def _aside_from(op: Any) -> str | None:
    """The aside schema: the templated param, else the one the restore handed over."""
    if op.aside_schema:
        return str(op.aside_schema)
    if op.restored:
        return Restored.from_xcom(op.restored).aside_schema
    return None


class RestoreOperator(KafkaOffsetsMixin, BaseOperator):
    """
    Restores a pipeline's tables and replay point from a snapshot, all or nothing.

    1. choose the snapshot (``latest``, an id, or the newest at or before an
       ISO-8601 timestamp) and check it belongs to this pipeline's schemas;
    2. refuse while another recovery holds the lock, when the meta schema is
       shared with other pipelines, or when objects outside the pipeline's tables
       depend on them (unless ``allow_dependents``);
    3. take the pipeline's **running lock** and hold it to the end: a driver that
       holds it means the stream runs (refused), and no driver can start while
       the restore works (a starting driver waits 60 s for it, then exits 1);
    4. copy the dump locally and check its SHA-256;
    5. restore it into a scratch database and compare every table's count and
       checksum with the manifest (the target is not touched until this passes);
       then roll back the pipeline's in-doubt two_phase transactions, if any
       (they hold locks and belong to the state being replaced);
    6. in ONE transaction of the target database (``recovery.swap.swap_in``):
       take the swap lock (no snapshot runs meanwhile), bump the pipeline's
       epoch (a driver that somehow still runs is fenced at its next batch),
       move the current tables aside, run the dump's restore script, give the
       tables their owners and grants back, check counts and checksums again;
       then, with the transaction complete but not committed, check that Kafka
       still holds everything from the snapshot's offsets (a retention gap
       rolls the swap back: the target is untouched), and commit. Without
       ``keep_old`` the old tables are dropped in the same transaction; with it
       they stay in the aside schema until ``FinalizeRestoreOperator`` (after
       replay and audit passed) or ``RollbackRestoreOperator`` (they failed).

    Returns ``contracts.Restored`` (XCom): snapshot id, ``aside_schema`` (None when
    dropped), the new ``epoch``, rows restored, and in its details rows per table,
    offsets, the retention re-check and timings. With ``plan_only`` and a selector it
    returns the ``contracts.ChosenSnapshot`` it chose (the recovery's choosing step).

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param snapshot: ``latest``, a snapshot id or an ISO-8601 timestamp (templated); or the snapshot an
        earlier step chose (``contracts.ChosenSnapshot``'s XCom, e.g. the choosing task's ``.output``),
        restored from the store it was chosen from without choosing again.
    :param snapshot_store: local directory or object storage URL (templated); default: the deployment's
        ``[eos] snapshot_store``, read at execute time.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param quiet_seconds: also count a micro-batch finished more recently than this as running
        (0, the default: the running lock alone decides).
    :param require_stop_request: also require a stop request in the control table.
    :param allow_shared_meta: restore even if other pipelines keep offsets in the
        same meta schema (their offsets would go back to the snapshot's too).
    :param hold_lock: hold the target's recovery lock (re-entrant per DAG run, heartbeated) while restoring.
    :param release_lock: release the lock when done (standalone use; the recovery DAG releases it itself).
    :param lock_ttl: seconds without heartbeat after which a lock left by a dead run is taken over.
    :param keep_old: keep the replaced tables in the aside schema (named in the XCom's
        ``aside_schema``) instead of dropping them with the swap. Default False for a
        standalone restore, whose success is the swap; the recovery DAG sets it and
        finalizes or rolls back after replay and audit.
    :param kafka_config_id: the Kafka connection for the retention re-check at the swap,
        default "kafka_default".
    :param allow_dependents: restore even though views, foreign keys, publications or
        other objects outside the pipeline's tables depend on them. They stay on the
        OLD tables (by OID, now in the aside schema): views show the old data, foreign
        keys check against the old table, publications publish the old table; dropping
        the aside schema (the swap without ``keep_old``, or finalize) drops such views
        and foreign keys and takes the old tables out of the publications.
    :param allow_table_changes: restore even though the pipeline's tables differ from the
        snapshot's (a target added to the spec after it, one it no longer writes, a new
        bookkeeping table). Without it the restore refuses, listing them
        (``TableChangesError``). With it, tables the snapshot lacks keep their rows through
        the restore (while the offsets go back, so the replay applies those events to them
        again) and their rows are copied aside, so that a rollback gives them back exactly.
    :param allow_other_database: restore a snapshot whose recorded database identity
        (name, OID, cluster ``system_identifier``) is not the target's, e.g. the same
        database after ``pg_upgrade`` or a move to a new cluster. Never needed otherwise.
    :param plan_only: only report the plan.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql.
    """

    template_fields: Sequence[str] = ("pipeline_config", "snapshot", "snapshot_store", "quiet_seconds",
                                      "allow_table_changes", "plan_only")
    ui_color = "#fdf1e3"

    def __init__(
        self,
        *,
        definition: Any = None, pipeline_config: Any = None,
        snapshot: Any = LATEST,
        snapshot_store: Any = None,
        postgres_conn_id: str = "eos_postgres",
        quiet_seconds: float | str = 0.0,
        require_stop_request: bool = True,
        allow_shared_meta: bool = False,
        hold_lock: bool = True,
        release_lock: bool = False,
        lock_ttl: float = DEFAULT_LOCK_TTL,
        keep_old: bool = False,
        kafka_config_id: str = "kafka_default",
        allow_dependents: bool = False,
        allow_table_changes: Any = False,
        allow_other_database: bool = False,
        plan_only: Any = False,
        pg_bin_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.kafka_config_id = kafka_config_id
        self.allow_dependents = allow_dependents
        self.allow_table_changes = allow_table_changes
        self.allow_other_database = allow_other_database
        self.take_definition(definition, pipeline_config)
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

    def chosen(self, config: Any) -> ChosenSnapshot:
        """The snapshot to restore: the one an earlier step chose (``snapshot`` is its XCom), or the
        one ``snapshot`` names, chosen now from the store."""
        if isinstance(self.snapshot, Mapping):
            return ChosenSnapshot.from_xcom(self.snapshot)
        store = self.resolve_store()
        manifest = restore.choose(self.hook, store, config, self.snapshot, self.allow_other_database)
        changes = restore.check_table_changes(self.hook, config, manifest, as_bool(self.allow_table_changes))
        return ChosenSnapshot(store=str(store.base), manifest=manifest, target_database=self.hook.dbname,
                              table_changes=changes, dry_run=as_bool(self.plan_only))

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        chosen = self.chosen(config)
        if as_bool(self.plan_only):
            self.log.info("dry run: would restore %s", chosen.manifest.summary())
            if isinstance(self.snapshot, Mapping):
                return Restored(chosen.snapshot_id, dry_run=True,
                                details={"snapshot": chosen.manifest.summary()}).to_xcom()
            return chosen.to_xcom()
        manifest, store = chosen.manifest, SnapshotStore(chosen.store)
        # Checked again under this step's own view: a target may have been added since the choice.
        changes = restore.check_table_changes(self.hook, config, manifest, as_bool(self.allow_table_changes))
        restore.check_shared_meta(self.hook, config, manifest, self.allow_shared_meta)
        try:
            with self.lock_guard(config, context), holding_running_lock(self.hook, config.pipeline):
                activity = stream_activity(self.hook, config.pipeline)
                activity["driver_running"] = False  # the running lock is ours: no driver holds it
                reason = why_not_stopped(activity, float(self.quiet_seconds), self.require_stop_request)
                if reason:
                    raise StreamStillRunningError(f"pipeline {config.pipeline!r} may still be running: {reason}")
                if not self.allow_dependents:
                    restore.refuse_dependents(self.hook, manifest)
                extras = [(str(schema), str(table)) for schema, table in changes["not_in_snapshot"]]
                report = restore.restore_snapshot(
                    self.hook, store, config, manifest, holder=holder_of(context),
                    lock_key=self.lock_key(config), kafka_config_id=self.kafka_config_id, keep_old=self.keep_old,
                    allow_dependents=self.allow_dependents, extras=extras)
                return Restored(manifest.snapshot_id, aside_schema=report.pop("aside_schema"),
                                epoch=report.pop("epoch"), rows_restored=report.pop("rows_restored"),
                                details={**report, "target_database": chosen.target_database,
                                         "table_changes": changes}).to_xcom()
        finally:
            if self.hold_lock and self.release_lock:
                release_lock(self.hook, self.lock_key(config), holder_of(context))


class RecoveryLockOperator(PipelineOperatorMixin, BaseOperator):
    """
    Takes or releases the recovery lock of a pipeline's target: a row keyed by
    ``database/target_schema/pipeline`` in ``{meta_schema}.recovery_locks``
    holding the DAG run id (see :mod:`airflow_provider_eos.recovery.lock`). A
    row survives worker crashes and is visible to every worker (unlike a
    session advisory lock). It is re-entrant for its own run, so a rerun of a
    crashed run goes on; one whose heartbeat is older than ``lock_ttl`` is
    taken over.

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param action: ``acquire`` or ``release``.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: report who holds the lock without taking it.
    """

    template_fields: Sequence[str] = ("pipeline_config", "plan_only")

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 action: str = "acquire", postgres_conn_id: str = "eos_postgres",
                 lock_ttl: float = DEFAULT_LOCK_TTL, plan_only: Any = False, pg_bin_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if action not in ("acquire", "release"):
            raise ValueError("action must be 'acquire' or 'release'")
        self.take_definition(definition, pipeline_config)
        self.action = action
        self.postgres_conn_id = postgres_conn_id
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        key, holder = self.lock_key(config), holder_of(context)
        if as_bool(self.plan_only):
            return {"key": key, "holder": holder, "dry_run": True}
        if self.action == "release":
            return {"key": key, "released": release_lock(self.hook, key, holder)}
        return take_lock(self.hook, key, holder, float(self.lock_ttl))


class FenceOperator(PipelineOperatorMixin, BaseOperator):
    """
    Fences a pipeline by hand: bumps its epoch, so every running driver of it
    writes nothing more (its next batch rolls back and it exits 3, "fenced"; an
    idle one notices within its stop poll). With ``request_stop`` it first sets
    the stop request, so the supervisor does not start a new driver either;
    without it, a supervised stream restarts from the database's offsets.

    Returns the new ``epoch`` and whether a stop was requested (XCom).

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param request_stop: also set the stop request (before the bump).
    :param reason: recorded with the epoch (``pipeline_epochs.reason``).
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param hold_lock: hold the target's recovery lock while fencing.
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: report the stream's state without changing it.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (unused; for the shared hook).
    :param wait_seconds: how long the bump waits for the pipeline's lock (a batch in flight)
        before failing with who holds it; a two_phase batch a dead driver left in doubt,
        which would hold it forever, is committed first (``recovery.guards.commit_orphans``).
    """

    template_fields: Sequence[str] = ("pipeline_config", "reason", "plan_only")

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 request_stop: bool = False, reason: str = "manual fence",
                 postgres_conn_id: str = "eos_postgres", hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, wait_seconds: float = DEFAULT_FENCE_WAIT,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait_seconds = float(wait_seconds)
        self.take_definition(definition, pipeline_config)
        self.request_stop = request_stop
        self.reason = reason
        self.postgres_conn_id = postgres_conn_id
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        if as_bool(self.plan_only):
            return {"dry_run": True, **jsonable(stream_activity(self.hook, config.pipeline))}
        with self.lock_guard(config, context):
            if self.request_stop:
                set_stop_request(self.hook, config.pipeline, True, by=holder_of(context))
            in_doubt = commit_orphans(self.hook, config)
            epoch = bump_epoch(self.hook, config, holder_of(context), str(self.reason), self.wait_seconds, self.log)
        self.log.info("pipeline %s fenced: epoch %d%s", config.pipeline, epoch,
                      " (stop requested)" if self.request_stop else "")
        return {"pipeline": config.pipeline, "epoch": epoch, "stop_requested": bool(self.request_stop),
                "in_doubt_committed": in_doubt}


class FinalizeRestoreOperator(PipelineOperatorMixin, BaseOperator):
    """
    Drops a restore's aside schema (the replaced tables) once the recovery
    succeeded: after replay and audit passed. Until then the old state stays,
    so ``RollbackRestoreOperator`` can put it back. Idempotent: a schema that is
    gone was finalized already. Only a schema named like this target's aside
    schemas (``<target_schema>_old_<yyyymmddThhmmss>``) whose restore record
    names this pipeline is ever dropped.

    Returns what was dropped (XCom).

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param aside_schema: the aside schema to act on (templated).
    :param restored: instead of ``aside_schema``: the restore's output (``contracts.Restored``, its XCom
        or the restore task's ``.output``), which names it.
    :param retention_days: also drop this target's aside schemas older than this many days
        (left by recoveries that failed and were never rolled back or finalized); None: keep them.
    :param allow_dependents: drop even though objects outside the aside schema depend on its
        tables (views and foreign keys left on the old tables by an ``allow_dependents``
        restore): they are dropped with it (CASCADE).
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param hold_lock: hold the target's recovery lock while dropping.
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: only report what would be dropped.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (unused; for the shared hook).
    """

    template_fields: Sequence[str] = ("pipeline_config", "aside_schema", "restored", "retention_days", "plan_only")

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 aside_schema: str | None = None, restored: Any = None,
                 retention_days: float | str | None = None, allow_dependents: bool = False,
                 postgres_conn_id: str = "eos_postgres", hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.take_definition(definition, pipeline_config)
        self.aside_schema = aside_schema
        self.restored = restored
        self.retention_days = retention_days
        self.allow_dependents = allow_dependents
        self.postgres_conn_id = postgres_conn_id
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        kept = _aside_from(self)
        if as_bool(self.plan_only):
            return {"dry_run": True, "aside_schema": kept, "retention_days": self.retention_days}
        result: dict[str, Any] = {"aside_schema": kept, "dropped": False}
        with self.lock_guard(config, context):
            if kept:
                result = aside.finalize_aside(self.hook, kept, config.target_schema, config.pipeline,
                                               allow_dependents=self.allow_dependents)
            else:
                result["reason"] = "the restore kept no old state (keep_old=False, or it did not swap)"
            if self.retention_days not in (None, ""):
                result["swept"] = aside.sweep_asides(self.hook, config.target_schema, config.pipeline,
                                                      float(self.retention_days), keep=[kept] if kept else [])
        self.log.info("finalized restore of %s: %s", config.pipeline, result)
        return result


class RollbackRestoreOperator(PipelineOperatorMixin, BaseOperator):
    """
    Puts back the state a restore replaced, for a recovery whose replay or audit
    failed. In ONE transaction (``recovery.aside.rollback_swap``): the restored
    tables are dropped, the aside tables moved back to the schemas the restore
    recorded (they keep their owners, grants, indexes and sequences: they are the
    same tables), and the epoch bumped. The data and the Kafka offsets come back
    together, exactly as before the restore. The aside schema stays, empty and
    marked rolled back, so a rerun returns at once; finalize or the retention
    sweep drops it.

    Holds the pipeline's running lock like the restore (refused while a driver
    runs, e.g. a replay that is still going) and rolls back the pipeline's
    in-doubt two_phase transactions first (a crashed replay's). The stop
    request stays set: the pipeline stays stopped until someone resumes it.

    Returns what it did (XCom): ``restored_dropped``, ``moved_back``, ``epoch``.

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param aside_schema: the aside schema to act on (templated).
    :param restored: instead of ``aside_schema``: the restore's output (``contracts.Restored``, its XCom
        or the restore task's ``.output``), which names it.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param hold_lock: hold the target's recovery lock while rolling back.
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: only report what would be rolled back.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (unused; for the shared hook).
    """

    template_fields: Sequence[str] = ("pipeline_config", "aside_schema", "restored", "plan_only")
    ui_color = "#f9d9d9"

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 aside_schema: str | None = None, restored: Any = None,
                 postgres_conn_id: str = "eos_postgres", hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.take_definition(definition, pipeline_config)
        self.aside_schema = aside_schema
        self.restored = restored
        self.postgres_conn_id = postgres_conn_id
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        kept = _aside_from(self)
        if not kept:
            raise AirflowException(f"pipeline {config.pipeline!r}: no aside schema to roll back to (the restore "
                                   "did not keep the old state: keep_old=False, or it did not swap)")
        if as_bool(self.plan_only):
            return {"dry_run": True, "aside_schema": kept}
        with self.lock_guard(config, context), holding_running_lock(self.hook, config.pipeline):
            in_doubt = roll_back_in_doubt(self.hook, config.pipeline)
            result = aside.rollback_swap(self.hook, kept, config.target_schema, config.pipeline,
                                         lock_key=self.lock_key(config), changed_by=holder_of(context))
        self.log.warning("rolled back the restore of %s: %s", config.pipeline, result)
        return {**result, "in_doubt_rolled_back": in_doubt}


