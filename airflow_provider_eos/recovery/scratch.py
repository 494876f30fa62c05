"""The proof of a dump: restored whole into a fresh scratch database, every table's count and
checksum equal to its manifest's, the scratch database dropped again. Never touches the target.

A snapshot is proven when it is taken (``dump.take_snapshot``): a dump that does not restore, or
does not hold what its manifest says, is never saved, so a bad snapshot is found on the day it
is taken, not in the middle of a recovery. The manifest records the proof (``proof_record``); a
restore trusts it (``trusted_proof``) when it proves the very dump it fetched (the SHA-256, which
``store.fetch_dump`` checks) on a server of the target's major version, and otherwise proves the
dump itself, beside its swap, as before. Either way the swap checks every count and checksum
again inside its own transaction (``swap.swap_in``): the proof says the file is sound, the swap
that the target got exactly that.

Scratch databases are named ``eos_scratch_<hash of the target's key>_<random>``. Each proof holds
a session advisory lock named after its own scratch database while it lives; a proof drops first
the scratch databases of its target whose lock is free, i.e. whose proof died (a killed worker
cannot drop its own). A live proof of the same target, a snapshot's beside a restore's, keeps its
lock and its database.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql

from airflow_provider_eos.hooks.pg_tools import tool_output_tail
from airflow_provider_eos.recovery.checksums import compare, measure
from airflow_provider_eos.recovery.manifest import SnapshotManifest

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook


class SnapshotValidationError(AirflowException):
    """Restored tables do not match the manifest (counts, checksums or missing tables)."""


def scratch_prefix(owner: str) -> str:
    """Name prefix of the scratch databases of one restore target (its lock key)."""
    return f"eos_scratch_{hashlib.sha256(owner.encode()).hexdigest()[:12]}_"


# A proof's liveness: held by its admin session for as long as its scratch database exists.
_LIVE = "SELECT pg_advisory_lock(hashtextextended(%s, 0))"
_DEAD = "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))"
_FORGET = "SELECT pg_advisory_unlock(hashtextextended(%s, 0))"


def validate_in_scratch(hook: PgToolsHook, dump_file: str | Path, manifest: SnapshotManifest,
                        owner: str) -> dict[str, Any]:
    """Restores the dump into a fresh database, compares it with the manifest and drops the
    database again.

    :param owner: the target's recovery lock key; scratch databases are named after it.
    :returns: the scratch database's name, ``restore_seconds``, ``validate_seconds``,
        ``leftovers_dropped`` (dead proofs' databases) and the server's version.
    :raises SnapshotValidationError: counts or checksums differ, or pg_restore failed.
    """
    prefix = scratch_prefix(owner)
    scratch = f"{prefix}{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    admin = hook.connect()
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(_LIVE, (scratch,))
            leftovers = _drop_dead(cur, prefix)
            cur.execute("SELECT pg_encoding_to_char(encoding), current_setting('server_version')"
                        " FROM pg_database WHERE datname = current_database()")
            encoding, version = cur.fetchone() or ("UTF8", "")
            cur.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING {}").format(
                sql.Identifier(scratch), sql.Literal(encoding)))
        try:
            conn = hook.connect(scratch)
            conn.autocommit = True
            with conn.cursor() as cur:
                for schema in sorted({t.schema for t in manifest.tables}):
                    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            conn.close()
            result = hook.run_tool("pg_restore", ["--no-owner", "--no-privileges", "--no-password",
                                                  "--exit-on-error", "--single-transaction", str(dump_file)],
                                   dbname=scratch)
            if result.returncode != 0:
                raise SnapshotValidationError(
                    f"snapshot {manifest.snapshot_id}: pg_restore into scratch database failed: "
                    f"{tool_output_tail(result.stderr)}"
                )
            restored_at = time.monotonic()
            conn = hook.connect(scratch)
            try:
                measured = measure(conn, [(t.schema, t.table) for t in manifest.tables])
            finally:
                conn.close()
            problems = compare(manifest.tables, measured)
            if problems:
                raise SnapshotValidationError(
                    f"snapshot {manifest.snapshot_id} does not match its manifest: " + "; ".join(problems)
                )
            return {"scratch_database": scratch, "restore_seconds": round(restored_at - started, 3),
                    "validate_seconds": round(time.monotonic() - restored_at, 3),
                    "leftovers_dropped": leftovers, "server_version": version,
                    "server_version_num": admin.server_version}
        finally:
            with admin.cursor() as cur:
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(scratch)))
    finally:
        admin.close()  # and with it the liveness lock


def _drop_dead(cur: Any, prefix: str) -> list[str]:
    """Drops the scratch databases under ``prefix`` whose proof is gone (its lock is free)."""
    cur.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s) ORDER BY datname", (prefix,))
    dropped = []
    for (name,) in cur.fetchall():
        cur.execute(_DEAD, (name,))
        if not (cur.fetchone() or (False,))[0]:
            continue  # a live proof (a snapshot's beside a restore's): its own to drop
        try:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            dropped.append(name)
        finally:
            cur.execute(_FORGET, (name,))
    return dropped


def proof_record(manifest: SnapshotManifest, proven: dict[str, Any]) -> dict[str, Any]:
    """What the manifest records of a passed ``validate_in_scratch`` of its dump."""
    return {"dump_sha256": manifest.dump_sha256, "server_version": proven["server_version"],
            "server_version_num": proven["server_version_num"], "restore_seconds": proven["restore_seconds"],
            "validate_seconds": proven["validate_seconds"]}


def trusted_proof(manifest: SnapshotManifest, server_version_num: int) -> str | None:
    """Why the manifest's proof stands for the restore into a server of ``server_version_num``
    (libpq's form: 150018 for 15.18),
    or None when the restore must prove the dump itself: no proof (a snapshot taken before
    proofs were recorded), a proof of another file, or of another major version (what
    ``pg_restore`` makes of a dump can change with it)."""
    proof = manifest.proof or {}
    if not proof or proof.get("dump_sha256") != manifest.dump_sha256 or not manifest.dump_sha256:
        return None
    proven_major, target_major = int(proof.get("server_version_num") or 0) // 10000, server_version_num // 10000
    if not proven_major or proven_major != target_major:
        return None
    return f"proven when taken, on PostgreSQL {proof.get('server_version')}"
