"""Taking a snapshot: one consistent dump of a pipeline's tables and replay point, saved to the store.

Consistency: one REPEATABLE READ transaction exports its snapshot with ``pg_export_snapshot()``;
``pg_dump --snapshot=...`` dumps from it while the same transaction counts and checksums every
table (``recovery.checksums``) and reads the stored Kafka offsets (``recovery.catalog``). Counts,
checksums, offsets and dump are therefore one instant. The snapshot holds the target's swap lock
shared from before that transaction until the dump ends: it never sees a restore's swap half-way.

Proof: before it is saved, the dump is restored whole into a scratch database and checked against
the manifest (``recovery.scratch``); one that fails is never saved, and the manifest records the
proof, which spares a restore of it its own scratch restore. A role that may not create databases
saves its snapshots unproven (with a warning): their restore proves them.

Failure transitions: a crash before the store's ``save`` leaves a temporary file only (gone with
the worker's temp directory), and during the proof a scratch database too, which the next proof
of the target drops (its liveness lock died with the worker's session); a crash inside ``save``
leaves a snapshot directory without a manifest, which no restore selects and retention removes
(``recovery.store``); a crash after it leaves a complete snapshot. Nothing here writes to the target database.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException
from psycopg2 import errors as pg_errors
from psycopg2.extensions import connection as PgConnection

from airflow_provider_eos.hooks.pg_tools import PgToolError, tool_output_tail
from airflow_provider_eos.recovery.catalog import database_identity, other_pipelines, stored_offsets_in
from airflow_provider_eos.recovery.checksums import TableRef, measure
from airflow_provider_eos.recovery.lock import swap_lock_key
from airflow_provider_eos.recovery.manifest import SnapshotManifest, TableState, new_snapshot_id
from airflow_provider_eos.recovery.scratch import proof_record, validate_in_scratch
from airflow_provider_eos.recovery.store import DUMP, SnapshotStore, sha256_file
from airflow_provider_eos.recovery.tables import snapshot_tables
from spark_apps.eos_stream.kafka.offsets import to_nested

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook


@dataclass
class ConsistentSnapshot:
    """What the snapshot transaction saw, besides the dump file."""

    created_at: str
    database: str
    server_version: str
    tables: list[TableState]
    offsets: dict[str, dict[str, int]]
    other_pipelines: list[str]
    timings: dict[str, float]
    identity: dict[str, str]


def take_snapshot(hook: PgToolsHook, store: SnapshotStore, config: Any, lock_key: str,
                  app_version: str) -> SnapshotManifest:
    """Dumps the pipeline's tables (``recovery.tables.snapshot_tables``), proves the dump in a
    scratch database and saves the dump and its manifest into ``store`` (the manifest last: the
    commit point).

    :param hook: built for the pipeline's meta schema.
    :param config: the pipeline's config (pipeline, schemas, spec).
    :param lock_key: the target's key (``recovery.lock.target_lock_key``): the snapshot holds its
        swap lock shared, so a restore's swap of this target never runs under it.
    :param app_version: recorded in the manifest.
    :raises SnapshotValidationError: the dump does not restore into an empty database, or not
        as its manifest says; nothing is saved.
    """
    snapshot_id = new_snapshot_id()
    conn = hook.connect()
    try:
        tables, roles = snapshot_tables(hook, conn, config)
    finally:
        conn.close()
    with tempfile.TemporaryDirectory(prefix="eos-snapshot-") as tmp:
        dump_file = Path(tmp) / DUMP
        state = dump_consistent(hook, tables, roles, dump_file, pipeline=config.pipeline, lock_key=lock_key)
        manifest = SnapshotManifest(
            snapshot_id=snapshot_id,
            created_at=state.created_at,
            pipeline=config.pipeline,
            database=state.database,
            target_schema=config.target_schema,
            meta_schema=config.meta_schema,
            tables=state.tables,
            kafka_offsets=state.offsets,
            dump_bytes=dump_file.stat().st_size,
            dump_sha256=sha256_file(dump_file),
            app_version=app_version,
            server_version=state.server_version,
            other_pipelines=state.other_pipelines,
            timings=state.timings,
            identity=state.identity,
        )
        # Proven before it is saved: a snapshot that would not restore is never one to choose.
        try:
            proven = validate_in_scratch(hook, dump_file, manifest, owner=lock_key)
        except pg_errors.InsufficientPrivilege as exc:
            # A snapshot role that may read but not CREATE DATABASE: saved unproven, as before
            # proofs, and the restore (whose role swaps tables anyway) proves it itself.
            hook.log.warning("snapshot %s is saved without a proof: this role may not create the scratch "
                             "database (%s); a restore of it proves it in a scratch database itself",
                             snapshot_id, str(exc).strip().splitlines()[0])
        else:
            manifest.proof = proof_record(manifest, proven)
            manifest.timings["proof"] = round(proven["restore_seconds"] + proven["validate_seconds"], 3)
        stored_at = time.monotonic()
        store.save(manifest, dump_file)
        manifest.timings["store"] = round(time.monotonic() - stored_at, 3)
    return manifest


def _pg_dump_args(snapshot_id: str, dump_file: str | Path, tables: Sequence[TableRef]) -> list[str]:
    """pg_dump's arguments: the custom format, of ``tables`` only, as the exported snapshot sees them."""
    args = ["-Fc", "--no-password", f"--snapshot={snapshot_id}", "-f", str(dump_file)]
    for schema, table in tables:
        args += ["-t", _pattern(schema, table)]
    return args


def dump_consistent(
    hook: PgToolsHook,
    tables: Sequence[TableRef],
    roles: dict[TableRef, str],
    dump_file: str | Path,
    *,
    pipeline: str,
    lock_key: str | None = None,
    swap_wait_seconds: float = 600.0,
) -> ConsistentSnapshot:
    """One ``pg_dump -Fc`` of ``tables`` plus counts, checksums and offsets (in the hook's meta
    schema), all from the same exported snapshot.

    :param lock_key: the target's key (``target_lock_key``); the snapshot holds
        its swap lock shared, so it never sees a restore's swap half-way.
    :param swap_wait_seconds: how long to wait for a swap in progress to end.
    """
    if not tables:
        raise AirflowException("nothing to snapshot: no tables")
    timings: dict[str, float] = {}
    started = time.monotonic()
    conn = hook.connect()
    try:
        if lock_key:
            _share_swap_lock(conn, lock_key, swap_wait_seconds)
            timings["swap_lock_wait"] = round(time.monotonic() - started, 3)
        snapshot_id, now, database, server_version = _export_whole_batches(conn, hook.meta_schema)
        timings["decided_parts_wait"] = round(time.monotonic() - started, 3)
        hook.log.info("pg_dump of %d tables from snapshot %s", len(tables), snapshot_id)
        dump = hook.start_tool("pg_dump", _pg_dump_args(snapshot_id, dump_file, tables),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            # While pg_dump reads, measure the same snapshot in this transaction.
            measured = measure(conn, tables, roles)
            timings["checksums"] = round(time.monotonic() - started, 3)
            offsets = to_nested(stored_offsets_in(conn, hook.meta_schema, pipeline))
            others = other_pipelines(conn, hook.meta_schema, pipeline)
            identity = database_identity(conn)
            _, err = dump.communicate()
        finally:
            if dump.poll() is None:
                dump.kill()
                dump.wait()
        if dump.returncode != 0:
            raise PgToolError(f"pg_dump failed ({dump.returncode}): {tool_output_tail(err)}")
        timings["dump"] = round(time.monotonic() - started, 3)
        conn.rollback()
    finally:
        conn.close()
    return ConsistentSnapshot(
        created_at=now.astimezone(timezone.utc).isoformat(),
        database=database,
        server_version=server_version,
        tables=[measured[t] for t in tables],
        offsets=offsets,
        other_pipelines=others,
        timings=timings,
        identity=identity,
    )


# How long a snapshot waits for the parts of decided batches to be committed before it commits
# them itself (a live driver does within milliseconds; a dead one left them).
DECIDED_PARTS_WAIT = 2.0


def _export_whole_batches(conn: PgConnection, meta_schema: str) -> tuple:
    """Opens the snapshot's REPEATABLE READ transaction and exports its snapshot, at an instant
    when every batch it holds is whole: no decision whose prepared parts are not all committed
    yet (``sink.parts``, P4), or it would carry a batch's offsets and aggregates without its
    rows, and a restore of it would resume after rows it does not hold. Decided parts a dead
    driver left are committed here after ``DECIDED_PARTS_WAIT``: committing a decided part is
    what its driver was doing, safe at any time. Returns (snapshot id, now, database, version)."""
    from spark_apps.eos_stream.sink import parts

    conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
    deadline = time.monotonic() + DECIDED_PARTS_WAIT
    while True:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_export_snapshot(), now(), current_database(), current_setting('server_version')"
            )
            row = cur.fetchone()
            assert row is not None
            if not parts.pending_decided(cur, meta_schema):
                return row
        conn.rollback()
        if time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        conn.set_session(readonly=False)
        for pipeline in parts.pipelines_with_decided(conn, meta_schema):
            parts.resolve(conn, meta_schema, pipeline, undecided="keep")
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        deadline = time.monotonic() + DECIDED_PARTS_WAIT


def _share_swap_lock(conn: PgConnection, lock_key: str, wait_seconds: float) -> None:
    """Takes the target's swap lock shared, at session level, before any transaction.

    Taken in autocommit so that the REPEATABLE READ transaction, and the
    snapshot it exports, begin only after the lock is granted: a swap that
    was in progress has committed or rolled back by then, and none can start
    until this session ends. Inside the transaction it would be too late: the
    snapshot would already predate the swap's commit, while table names would
    resolve to the swapped-in tables, whose rows it cannot see."""
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT set_config('lock_timeout', %s, false)", (f"{int(wait_seconds * 1000)}ms",))
        try:
            cur.execute("SELECT pg_advisory_lock_shared(hashtextextended(%s, 0))", (swap_lock_key(lock_key),))
        except pg_errors.LockNotAvailable as exc:
            raise AirflowException(
                f"a restore of {lock_key} has been swapping for more than {wait_seconds:g}s; snapshot again later"
            ) from exc
        cur.execute("SELECT set_config('lock_timeout', '0', false)")
    conn.autocommit = False


def _pattern(schema: str, table: str) -> str:
    """A pg_dump -t pattern matching exactly one table (double quotes make it literal)."""
    return '"{}"."{}"'.format(schema.replace('"', '""'), table.replace('"', '""'))
