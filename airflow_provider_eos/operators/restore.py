"""RestoreOperator (validated, all-or-nothing restore of a snapshot), the steps
after it (FinalizeRestoreOperator, RollbackRestoreOperator), and the recovery
lock, stop-request and fence steps around it.

What a restore holds while it works, outermost first: the target's recovery
lock row (one recovery at a time, survives worker crashes); the pipeline's
running lock, a session advisory lock on a connection kept open for the whole
restore (no driver runs, none can start; released when that connection
closes, so also when the worker dies); and, inside the swap transaction only,
the target's swap lock (exclusive; snapshots take it shared) and the
pipeline's transaction lock, under which the epoch is bumped.

Failure transitions (what a crash at each point leaves behind, and why a rerun
is still correct; "rerun" is the same DAG run's task cleared or retried, which
re-enters the recovery lock):

1. before the swap (choosing, refusals: a store root others may write to, a
   manifest of another database, tables that differ from the snapshot's,
   dependents; running lock, fetch, SHA-256 check):
   nothing in the target changed. A dead worker's running lock and session
   die with its connection. Rerun: starts over.
2. during the scratch validation: a scratch database ``eos_scratch_<hash of
   the target key>_<random>`` may be left. Rerun: under the recovery lock no
   other restore of this target runs, so it drops them first.
3. while rolling back in-doubt two_phase transactions: each ROLLBACK PREPARED
   is its own commit; some may be left. Rerun: rolls back the rest (they
   belong to the state being replaced either way).
4. inside the swap transaction, before COMMIT was sent (prelude, restore
   script, postlude, the retention re-check): psql's stdin closes with the
   worker, psql exits, and the server rolls back a transaction whose client
   went away: old tables, old epoch, no aside schema. A retention gap or a
   validation error ends here on purpose (ROLLBACK). Rerun: restores again.
5. COMMIT sent, its outcome unknown to the worker: either the old state (as
   in 4) or the new one (snapshot in place, epoch bumped, old tables in the
   aside schema with ``keep_old``, else dropped in the same transaction).
   Rerun: restores the same snapshot again, which ends in the same state. With
   ``keep_old`` it finds the aside schema its own run kept (the record in the
   schema's comment names the run) and reuses it: the current tables are
   dropped instead of moved, so that aside schema still holds the state from
   before the run, not a copy of the snapshot, and the XCom names it again.
6. after COMMIT, before the XCom is written: as the committed case of 5.
7. finalize, before its DROP SCHEMA commits: the aside schema is intact.
   Rerun: drops it; after the commit a rerun finds it gone and reports that.
8. rollback, before its transaction commits: nothing changed (one
   transaction: drop the restored tables, move the aside tables back, refill
   the tables the snapshot lacked from their copies (``allow_table_changes``),
   bump the epoch, mark the aside record ``rolled_back_at``). After the commit a
   rerun reads the mark and returns at once, instead of dropping the tables it
   had just put back. A rollback after finalize fails: the old state is gone.

While the stream is stopped for recovery a supervisor cannot slip a driver in:
the stop request stays set, a driver starting meanwhile waits for the running
lock the restore holds (then exits 1), and a driver that somehow still writes
is fenced by the epoch bumps of the stop step and of the swap.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.pg_tools import DependentObjectsError, aside_schema_name
from airflow_provider_eos.hooks.recovery_lock import DEFAULT_LOCK_TTL, RecoveryLockedError, take_lock
from airflow_provider_eos.operators.base import KafkaOffsetsMixin, PipelineOperatorMixin, holder_of, timed_step
from airflow_provider_eos.recovery.guards import DEFAULT_FENCE_WAIT, StreamStillRunningError, bump_epoch, commit_orphans
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.snapshot_store import LATEST, SnapshotError, SnapshotManifest, identity_problem
from airflow_provider_eos.utils.stream_stopped import jsonable, why_not_stopped

__all__ = ["DependentObjectsError", "FenceOperator", "FinalizeRestoreOperator", "RecoveryLockOperator",
           "RecoveryLockedError", "RestoreOperator", "RollbackRestoreOperator", "TableChangesError"]


class TableChangesError(AirflowException):
    """The snapshot does not hold the tables the pipeline has now: a restore could not put them all back."""


@contextmanager
def holding_running_lock(op: PipelineOperatorMixin, pipeline: str) -> Iterator[None]:
    """Holds the pipeline's running lock (the one every driver holds for its
    lifetime) while a recovery step changes the target: no driver can start
    meanwhile. Taking it, not probing it, closes the gap between "no driver
    runs" and the change."""
    conn = op.hook.try_running_lock(pipeline)
    if conn is None:
        raise StreamStillRunningError(
            f"pipeline {pipeline!r} may still be running: a driver of it is connected to the target database "
            "(it holds the pipeline's running lock)")
    try:
        yield
    finally:
        conn.close()  # releases the lock


def roll_back_in_doubt(op: Any, config: Any) -> list[str]:
    """Rolls back the pipeline's two_phase transactions a dead driver left in doubt:
    they hold locks the swap needs, and belong to the state being replaced."""
    from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt

    conn = op.hook.connect()
    try:
        gids = [t["gid"] for t in resolve_in_doubt(conn, config.pipeline, "rollback")]
    finally:
        conn.close()
    if gids:
        op.log.warning("rolled back in-doubt transactions of %s: %s", config.pipeline, gids)
    return gids


def _aside_from(op: Any, context: Any) -> str | None:
    """The aside schema: the templated param, else the restore task's XCom."""
    if op.aside_schema:
        return str(op.aside_schema)
    if op.restore_task_id and context and context.get("ti") is not None:
        restored = context["ti"].xcom_pull(task_ids=op.restore_task_id) or {}
        return restored.get("aside_schema") or None
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
    6. in ONE transaction of the target database (``PgToolsHook.swap_in``):
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

    Returns a summary (XCom): snapshot id, rows restored per table, offsets,
    ``aside_schema`` (None when dropped), the new ``epoch``, the retention
    re-check, timings.

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param snapshot: ``latest``, a snapshot id or an ISO-8601 timestamp (templated).
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
        pipeline_config: Any,
        snapshot: str = LATEST,
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
        store = self.resolve_store()
        try:
            manifest = store.select(config.pipeline, str(self.snapshot or LATEST))
        except SnapshotError as exc:
            raise AirflowException(f"pipeline {config.pipeline!r} in {store.base}: {exc}") from exc
        if (manifest.target_schema, manifest.meta_schema) != (config.target_schema, config.meta_schema):
            raise AirflowException(
                f"snapshot {manifest.snapshot_id} holds schemas {manifest.target_schema}/{manifest.meta_schema}, "
                f"the pipeline uses {config.target_schema}/{config.meta_schema}"
            )
        conn = self.hook.connect()
        try:
            target = self.hook.database_identity(conn)
        finally:
            conn.close()
        problem = identity_problem(manifest, target)
        if problem and not self.allow_other_database:
            raise AirflowException(problem)
        if problem:
            self.log.warning("allow_other_database: %s", problem)
        elif not manifest.identity:
            self.log.warning("snapshot %s was written before manifests recorded their database's identity: only "
                             "its database name %r was checked against the target", manifest.snapshot_id,
                             manifest.database)
        return manifest

    def table_changes(self, config: Any, manifest: SnapshotManifest) -> dict[str, list[list[str]]]:
        """What the snapshot lacks or holds beyond the pipeline's tables now; raises unless
        ``allow_table_changes``. See ``recovery.tables.table_changes``."""
        from airflow_provider_eos.recovery.tables import table_changes

        conn = self.hook.connect()
        try:
            changes = table_changes(self.hook, conn, config, manifest)
        finally:
            conn.close()
        if not any(changes.values()) or as_bool(self.allow_table_changes):
            if any(changes.values()):
                self.log.warning("allow_table_changes: restoring snapshot %s although %s", manifest.snapshot_id,
                                 changes)
            return changes
        missing, dropped = (", ".join(f"{schema}.{table}" for schema, table in changes[key])
                            for key in ("not_in_snapshot", "not_in_spec"))
        lines = []
        if missing:
            lines.append(f"not in the snapshot: {missing} (they would keep their rows while the offsets go back, "
                         "and keep the replay's writes through a rollback)")
        if dropped:
            lines.append(f"in the snapshot but no longer targets of the spec: {dropped} (they would come back "
                         "with the snapshot's rows)")
        raise TableChangesError(
            f"snapshot {manifest.snapshot_id} ({manifest.created_at}) does not hold the tables pipeline "
            f"{config.pipeline!r} has now; " + "; ".join(lines) + ". A restore puts back only what the snapshot "
            "holds. Take a new snapshot and restore that, or set allow_table_changes: tables the snapshot lacks "
            "then keep their rows through the restore, and a rollback gives them back exactly.")

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        manifest = self.choose(config)
        changes = self.table_changes(config, manifest)
        plan = {"snapshot": manifest.summary(), "target_database": self.hook.dbname, "table_changes": changes}
        if as_bool(self.plan_only):
            self.log.info("dry run: would restore %s", plan)
            return {**plan, "dry_run": True}
        others = sorted(set(manifest.other_pipelines) | set(self._current_others(config)))
        if others and not self.allow_shared_meta:
            raise AirflowException(
                f"meta schema {config.meta_schema!r} also holds pipelines {others}: restoring it would roll their "
                "offsets back without their data. Give each pipeline its own meta schema, or set allow_shared_meta."
            )
        try:
            with self.lock_guard(config, context), holding_running_lock(self, config.pipeline):
                activity = self.hook.stream_activity(config.meta_schema, config.pipeline)
                activity["driver_running"] = False  # the running lock is ours: no driver holds it
                reason = why_not_stopped(activity, float(self.quiet_seconds), self.require_stop_request)
                if reason:
                    raise StreamStillRunningError(f"pipeline {config.pipeline!r} may still be running: {reason}")
                self._refuse_dependents(manifest)
                extras = [(str(schema), str(table)) for schema, table in changes["not_in_snapshot"]]
                return {**plan, **self._restore(config, manifest, holder_of(context), extras)}
        finally:
            if self.hold_lock and self.release_lock:
                self.hook.release_lock(config.meta_schema, self.lock_key(config), holder_of(context))

    def _current_others(self, config: Any) -> list[str]:
        conn = self.hook.connect()
        try:
            return self.hook.other_pipelines(conn, config.meta_schema, config.pipeline)
        finally:
            conn.close()

    def _refuse_dependents(self, manifest: SnapshotManifest) -> None:
        """Fails fast, before the scratch restore; the swap checks again under its locks."""
        if self.allow_dependents:
            return
        conn = self.hook.connect()
        try:
            found = self.hook.dependents(conn, [(t.schema, t.table) for t in manifest.tables])
        finally:
            conn.close()
        if found:
            raise DependentObjectsError(
                f"objects outside the pipeline's tables depend on them: {', '.join(found)}. A swap would leave "
                "them on the old tables (and dropping those would drop them); drop or move them first, or set "
                "allow_dependents. The target was not touched.")

    def before_commit(self, config: Any, manifest: SnapshotManifest, report: dict[str, Any]) -> None:
        """Runs inside the swap, complete but not committed: Kafka must still hold
        everything from the snapshot's offsets. Raising rolls the swap back."""
        report.update(self.check_retention(manifest.offsets(), list(config.topics),
                                           f"snapshot {manifest.snapshot_id} (re-checked at the swap)"))

    def _restore(self, config: Any, manifest: SnapshotManifest, holder: str,
                 extras: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
        timings: dict[str, float] = {}
        clock = time.monotonic()
        store = self.resolve_store()
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
            rolled_back = roll_back_in_doubt(self, config)
            # A rerun of a run whose swap committed: the state before the run is in that
            # swap's aside schema, and must stay the one a rollback goes back to.
            earlier = self.hook.kept_aside_of_run(config.target_schema, config.pipeline, holder) \
                if self.keep_old else None
            if earlier:
                self.log.warning("this run already swapped (its old state is in %s): restoring again, "
                                 "keeping that aside schema", earlier)
            aside = earlier or aside_schema_name(config.target_schema)
            retention: dict[str, Any] = {}
            swap = self.hook.swap_in(
                dump, manifest, aside, drop_old=not self.keep_old,
                before_commit=lambda: self.before_commit(config, manifest, retention),
                allow_dependents=self.allow_dependents, lock_key=self.lock_key(config), changed_by=holder,
                reuse_aside=earlier is not None, extra_tables=extras)
            timings["swap"] = swap["swap_seconds"]
            timings["retention_recheck"] = swap["before_commit_seconds"]
        timings["total"] = round(time.monotonic() - clock, 3)
        result = {
            "snapshot_id": manifest.snapshot_id,
            "rows_restored": manifest.total_rows,
            "tables": {t.qualified: t.rows for t in manifest.tables},
            "kafka_offsets": manifest.kafka_offsets,
            "aside_schema": swap["aside_schema"],
            "aside_reused": earlier is not None,
            "epoch": swap["epoch"],
            "owner_warnings": swap["warnings"],
            "retention_at_swap": {k: retention.get(k) for k in ("needed", "earliest", "gaps")},
            "in_doubt_rolled_back": rolled_back,
            "scratch_leftovers_dropped": scratch["leftovers_dropped"],
            "timings": timings,
        }
        self.log.info("restored snapshot %s: %s", manifest.snapshot_id, result)
        return result


class RecoveryLockOperator(PipelineOperatorMixin, BaseOperator):
    """
    Takes or releases the recovery lock of a pipeline's target: a row keyed by
    ``database/target_schema/pipeline`` in ``{meta_schema}.recovery_locks``
    holding the DAG run id (see :mod:`airflow_provider_eos.hooks.recovery_lock`). A
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
        if as_bool(self.plan_only):
            return {"key": key, "holder": holder, "dry_run": True}
        if self.action == "release":
            return {"key": key, "released": self.hook.release_lock(config.meta_schema, key, holder)}
        return take_lock(self.hook, config.meta_schema, key, holder, float(self.lock_ttl))


class FenceOperator(PipelineOperatorMixin, BaseOperator):
    """
    Fences a pipeline by hand: bumps its epoch, so every running driver of it
    writes nothing more (its next batch rolls back and it exits 3, "fenced"; an
    idle one notices within its stop poll). With ``request_stop`` it first sets
    the stop request, so the supervisor does not start a new driver either;
    without it, a supervised stream restarts from the database's offsets.

    Returns the new ``epoch`` and whether a stop was requested (XCom).

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param request_stop: also set the stop request (before the bump).
    :param reason: recorded with the epoch (``pipeline_epochs.reason``).
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param hold_lock: hold the target's recovery lock while fencing.
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: report the stream's state without changing it.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (unused; for the shared hook).
    :param wait_seconds: how long the bump waits for the pipeline's lock (a batch in flight)
        before failing with who holds it; a two_phase batch a dead driver left in doubt,
        which would hold it forever, is committed first (``stop.commit_orphans``).
    """

    template_fields: Sequence[str] = ("pipeline_config", "reason", "plan_only")

    def __init__(self, *, pipeline_config: Any, request_stop: bool = False, reason: str = "manual fence",
                 postgres_conn_id: str = "eos_postgres", hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, wait_seconds: float = DEFAULT_FENCE_WAIT,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait_seconds = float(wait_seconds)
        self.pipeline_config = pipeline_config
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
            return {"dry_run": True, **jsonable(self.hook.stream_activity(config.meta_schema, config.pipeline))}
        with self.lock_guard(config, context):
            if self.request_stop:
                self.hook.set_stop_request(config.meta_schema, config.pipeline, True, by=holder_of(context))
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

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param aside_schema: the aside schema, from the restore's XCom ``aside_schema`` (templated).
    :param restore_task_id: instead of ``aside_schema``: the restore task whose XCom names it.
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

    template_fields: Sequence[str] = ("pipeline_config", "aside_schema", "retention_days", "plan_only")

    def __init__(self, *, pipeline_config: Any, aside_schema: str | None = None, restore_task_id: str | None = None,
                 retention_days: float | str | None = None, allow_dependents: bool = False,
                 postgres_conn_id: str = "eos_postgres", hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_config = pipeline_config
        self.aside_schema = aside_schema
        self.restore_task_id = restore_task_id
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
        aside = _aside_from(self, context)
        if as_bool(self.plan_only):
            return {"dry_run": True, "aside_schema": aside, "retention_days": self.retention_days}
        result: dict[str, Any] = {"aside_schema": aside, "dropped": False}
        with self.lock_guard(config, context):
            if aside:
                result = self.hook.finalize_aside(aside, config.target_schema, config.pipeline,
                                                  allow_dependents=self.allow_dependents)
            else:
                result["reason"] = "the restore kept no old state (keep_old=False, or it did not swap)"
            if self.retention_days not in (None, ""):
                result["swept"] = self.hook.sweep_asides(config.target_schema, config.pipeline,
                                                         float(self.retention_days), keep=[aside] if aside else [])
        self.log.info("finalized restore of %s: %s", config.pipeline, result)
        return result


class RollbackRestoreOperator(PipelineOperatorMixin, BaseOperator):
    """
    Puts back the state a restore replaced, for a recovery whose replay or audit
    failed. In ONE transaction (``PgToolsHook.rollback_swap``): the restored
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

    :param pipeline_config: the pipeline's config, dict or JSON file path (templated).
    :param aside_schema: the aside schema, from the restore's XCom ``aside_schema`` (templated).
    :param restore_task_id: instead of ``aside_schema``: the restore task whose XCom names it.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param hold_lock: hold the target's recovery lock while rolling back.
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: only report what would be rolled back.
    :param pg_bin_dir: directory of pg_dump/pg_restore/psql (unused; for the shared hook).
    """

    template_fields: Sequence[str] = ("pipeline_config", "aside_schema", "plan_only")
    ui_color = "#f9d9d9"

    def __init__(self, *, pipeline_config: Any, aside_schema: str | None = None, restore_task_id: str | None = None,
                 postgres_conn_id: str = "eos_postgres", hold_lock: bool = False, lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_config = pipeline_config
        self.aside_schema = aside_schema
        self.restore_task_id = restore_task_id
        self.postgres_conn_id = postgres_conn_id
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir

    @timed_step
    def execute(self, context: Any) -> dict[str, Any]:
        config = self.load_config()
        aside = _aside_from(self, context)
        if not aside:
            raise AirflowException(f"pipeline {config.pipeline!r}: no aside schema to roll back to (the restore "
                                   "did not keep the old state: keep_old=False, or it did not swap)")
        if as_bool(self.plan_only):
            return {"dry_run": True, "aside_schema": aside}
        with self.lock_guard(config, context), holding_running_lock(self, config.pipeline):
            in_doubt = roll_back_in_doubt(self, config)
            result = self.hook.rollback_swap(aside, config.target_schema, config.pipeline,
                                             lock_key=self.lock_key(config), changed_by=holder_of(context))
        self.log.warning("rolled back the restore of %s: %s", config.pipeline, result)
        return {**result, "in_doubt_rolled_back": in_doubt}


