"""A restore, step by step: choose the snapshot, refuse what a restore cannot put back, prove the
dump in a scratch database, and swap it in. ``RestoreOperator`` only reads its arguments and calls
these; each step's failure transition is in ``recovery/__init__.py`` (steps 1 to 6)."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.recovery import aside, retention, scratch, swap
from airflow_provider_eos.recovery.catalog import DependentObjectsError, database_identity, dependents, other_pipelines
from airflow_provider_eos.recovery.guards import roll_back_in_doubt
from airflow_provider_eos.recovery.manifest import LATEST, SnapshotError, SnapshotManifest, identity_problem
from airflow_provider_eos.recovery.store import DUMP, SnapshotStore
from airflow_provider_eos.recovery.tables import table_changes
from airflow_provider_eos.utils.subscription import subscribed_topics

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook

log = logging.getLogger(__name__)


class TableChangesError(AirflowException):
    """The snapshot does not hold the tables the pipeline has now: a restore could not put them all back."""


def choose(hook: PgToolsHook, store: SnapshotStore, config: Any, selector: str | None,
           allow_other_database: bool = False) -> SnapshotManifest:
    """The snapshot ``selector`` names (``latest``, an id, or an ISO-8601 time), after checking it
    holds the pipeline's schemas and comes from the target database (``identity_problem``).

    :raises AirflowException: nothing matches, other schemas, or another database (unless
        ``allow_other_database``)."""
    try:
        manifest = store.select(config.pipeline, str(selector or LATEST))
    except SnapshotError as exc:
        raise AirflowException(f"pipeline {config.pipeline!r} in {store.base}: {exc}") from exc
    if (manifest.target_schema, manifest.meta_schema) != (config.target_schema, config.meta_schema):
        raise AirflowException(
            f"snapshot {manifest.snapshot_id} holds schemas {manifest.target_schema}/{manifest.meta_schema}, "
            f"the pipeline uses {config.target_schema}/{config.meta_schema}"
        )
    conn = hook.connect()
    try:
        target = database_identity(conn)
    finally:
        conn.close()
    problem = identity_problem(manifest, target)
    if problem and not allow_other_database:
        raise AirflowException(problem)
    if problem:
        log.warning("allow_other_database: %s", problem)
    elif not manifest.identity:
        log.warning("snapshot %s was written before manifests recorded their database's identity: only "
                    "its database name %r was checked against the target", manifest.snapshot_id, manifest.database)
    return manifest


def check_table_changes(hook: PgToolsHook, config: Any, manifest: SnapshotManifest,
                        allow: bool = False) -> dict[str, list[list[str]]]:
    """What the snapshot lacks or holds beyond the pipeline's tables now (``tables.table_changes``).

    :raises TableChangesError: they differ, unless ``allow``."""
    conn = hook.connect()
    try:
        changes = table_changes(hook, conn, config, manifest)
    finally:
        conn.close()
    if not any(changes.values()) or allow:
        if any(changes.values()):
            log.warning("allow_table_changes: restoring snapshot %s although %s", manifest.snapshot_id, changes)
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


def check_shared_meta(hook: PgToolsHook, config: Any, manifest: SnapshotManifest, allow: bool = False) -> None:
    """Refuses a meta schema that other pipelines keep offsets in (then or now): a restore would
    roll their offsets back without their data, unless ``allow``."""
    conn = hook.connect()
    try:
        now = other_pipelines(conn, config.meta_schema, config.pipeline)
    finally:
        conn.close()
    others = sorted(set(manifest.other_pipelines) | set(now))
    if others and not allow:
        raise AirflowException(
            f"meta schema {config.meta_schema!r} also holds pipelines {others}: restoring it would roll their "
            "offsets back without their data. Give each pipeline its own meta schema, or set allow_shared_meta."
        )


def refuse_dependents(hook: PgToolsHook, manifest: SnapshotManifest) -> None:
    """Fails fast, before the scratch restore, when objects outside the snapshot's tables depend
    on them; the swap checks again under its locks."""
    conn = hook.connect()
    try:
        found = dependents(conn, [(t.schema, t.table) for t in manifest.tables])
    finally:
        conn.close()
    if found:
        raise DependentObjectsError(
            f"objects outside the pipeline's tables depend on them: {', '.join(found)}. A swap would leave "
            "them on the old tables (and dropping those would drop them); drop or move them first, or set "
            "allow_dependents. The target was not touched.")


def _fetch_dump(store: SnapshotStore, manifest: SnapshotManifest, tmp: Path) -> Path:
    """The snapshot's dump, fetched into ``tmp``."""
    try:
        return store.fetch_dump(manifest, tmp / DUMP)
    except SnapshotError as exc:
        raise AirflowException(f"{exc}; the target was not touched") from exc


def _trusted_proof(hook: PgToolsHook, manifest: SnapshotManifest) -> str | None:
    """Why the dump needs no scratch proof on this server (None: it does; ``scratch.trusted_proof``)."""
    probe = hook.connect()
    try:
        return scratch.trusted_proof(manifest, probe.server_version)
    finally:
        probe.close()


def _aside_schema(hook: PgToolsHook, config: Any, holder: str, keep_old: bool) -> tuple[str | None, str]:
    """(the aside schema this run's earlier swap kept, or None; the aside schema of this swap).

    A rerun of a run whose swap committed: the state before the run is in that swap's aside
    schema, and must stay the one a rollback goes back to."""
    earlier = aside.kept_aside_of_run(hook, config.target_schema, config.pipeline, holder) if keep_old else None
    if earlier:
        log.warning("this run already swapped (its old state is in %s): restoring again, keeping "
                    "that aside schema", earlier)
    return earlier, earlier or aside.aside_schema_name(config.target_schema)


def _add_swap_timings(timings: dict[str, float], swapped: dict[str, Any], proven: dict[str, Any] | None) -> None:
    timings["scratch_restore"] = proven["restore_seconds"] if proven else 0.0
    timings["scratch_validate"] = proven["validate_seconds"] if proven else 0.0
    timings["swap"] = swapped["swap_seconds"]
    timings.update({f"swap_{name}": seconds for name, seconds in swapped["phases"].items()})
    # The swap's time before COMMIT waiting for the scratch's verdict, then Kafka's retention.
    timings["retention_recheck"] = round(swapped["before_commit_seconds"] - timings.get("scratch_wait", 0.0), 3)


def _restore_summary(manifest: SnapshotManifest, swapped: dict[str, Any], aside_reused: bool, report: dict[str, Any],
                     rolled_back: Any, trusted: str | None, proven: dict[str, Any] | None,
                     timings: dict[str, float]) -> dict[str, Any]:
    """The restore's XCom: what was restored, the swap's epoch and aside schema, the retention
    re-check, the in-doubt rollback, the proof and the timings."""
    return {
        "snapshot_id": manifest.snapshot_id,
        "rows_restored": manifest.total_rows,
        "tables": {t.qualified: t.rows for t in manifest.tables},
        "kafka_offsets": manifest.kafka_offsets,
        "aside_schema": swapped["aside_schema"],
        "aside_reused": aside_reused,
        "epoch": swapped["epoch"],
        "owner_warnings": swapped["warnings"],
        "retention_at_swap": {k: report.get(k) for k in ("needed", "earliest", "gaps")},
        "in_doubt_rolled_back": rolled_back,
        "proof": trusted or "proven in a scratch database beside the swap",
        "scratch_leftovers_dropped": proven["leftovers_dropped"] if proven else [],
        "timings": timings,
    }


def _before_commit(scratch_run: Future | None, kafka_config_id: str, manifest: SnapshotManifest, config: Any,
                   timings: dict[str, float], report: dict[str, Any]) -> Callable[[], None]:
    """What the swap runs inside its transaction, complete but not committed: the dump must be
    proven and Kafka must still hold everything from the snapshot's offsets. Raising rolls the
    swap back. It fills ``timings["scratch_wait"]`` and ``report`` (the retention re-check)."""

    def before_commit() -> None:
        waited = time.monotonic()
        if scratch_run is not None:
            scratch_run.result()
        timings["scratch_wait"] = round(time.monotonic() - waited, 3)
        report.update(retention.check_retention(
            kafka_config_id, manifest.offsets(), subscribed_topics(config),
            f"snapshot {manifest.snapshot_id} (re-checked at the swap)"))

    return before_commit


def restore_snapshot(hook: PgToolsHook, store: SnapshotStore, config: Any, manifest: SnapshotManifest, *,
                     holder: str, lock_key: str, kafka_config_id: str, keep_old: bool = False,
                     allow_dependents: bool = False,
                     extras: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Fetches the dump, proves it in a scratch database unless the snapshot was proven when
    taken (``scratch.trusted_proof``), rolls back the pipeline's in-doubt
    transactions and swaps it in, re-checking Kafka's retention before the swap commits. The
    caller holds the recovery lock and the running lock (``guards.holding_running_lock``).

    :param holder: the recovery's run (recorded with the epoch and in the aside record).
    :param lock_key: the target's key (``lock.target_lock_key``).
    :param kafka_config_id: the Kafka connection of the retention re-check.
    :param keep_old: keep the replaced tables in the aside schema (else dropped in the swap).
    :param allow_dependents: swap although other objects depend on the tables.
    :param extras: the pipeline's tables the snapshot lacks (``allow_table_changes``).
    :returns: the restore's summary (XCom)."""
    timings: dict[str, float] = {}
    clock = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="eos-restore-") as tmp:
        dump = _fetch_dump(store, manifest, Path(tmp))
        timings["fetch"] = round(time.monotonic() - clock, 3)
        trusted = _trusted_proof(hook, manifest)
        # An unproven dump (an old snapshot, another major version) is proven here, beside the
        # in-doubt rollback and the swap (each keeps one PostgreSQL backend busy: on 2 cores the
        # two take the time of the longer); the swap's COMMIT waits for its verdict, so the
        # target still changes only with a snapshot proven in a fresh database (failure
        # transitions 2 to 4 in recovery/__init__.py).
        with ThreadPoolExecutor(1, thread_name_prefix="eos-scratch") as scratch_pool:
            scratch_run = (None if trusted else
                           scratch_pool.submit(scratch.validate_in_scratch, hook, dump, manifest, owner=lock_key))
            try:
                rolled_back = roll_back_in_doubt(hook, config.pipeline)
                earlier, aside_schema = _aside_schema(hook, config, holder, keep_old)
                report: dict[str, Any] = {}
                before_commit = _before_commit(scratch_run, kafka_config_id, manifest, config, timings, report)
                swapped = swap.swap_in(
                    hook, dump, manifest, aside_schema, drop_old=not keep_old, before_commit=before_commit,
                    allow_dependents=allow_dependents, lock_key=lock_key, changed_by=holder,
                    reuse_aside=earlier is not None, extra_tables=extras)
            except BaseException:
                # The scratch's own failure says more than the swap's (a mismatching snapshot fails
                # both): wait for its verdict, which the pool's exit would wait for anyway.
                error = scratch_run.exception() if scratch_run is not None else None
                if error is not None:
                    raise error from None
                raise
            proven = scratch_run.result() if scratch_run is not None else None
        _add_swap_timings(timings, swapped, proven)
    timings["total"] = round(time.monotonic() - clock, 3)
    result = _restore_summary(manifest, swapped, earlier is not None, report, rolled_back, trusted, proven, timings)
    log.info("restored snapshot %s: %s", manifest.snapshot_id, result)
    return result
