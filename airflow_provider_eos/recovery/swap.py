"""The swap: a snapshot put in place of the pipeline's tables in ONE transaction of the target
database (the proof in a scratch database is ``recovery.scratch``).

``swap_in`` feeds psql one transaction and decides itself how it ends: it sends ``BEGIN``, the
prelude, the dump's restore script (``pg_restore -f -``), the postlude and an ``\\echo`` marker.
Once psql echoes the marker every statement has succeeded; ``before_commit`` runs (the restore
re-checks Kafka's retention there), and only then is ``COMMIT`` sent (``ROLLBACK`` when it raised).

* prelude: the target's swap lock, exclusive (snapshots in progress end first, none starts until
  the transaction ends); the pipeline's lock and an epoch bump (a driver that still runs is fenced
  at its next batch); unless ``allow_dependents``, a check that nothing outside the pipeline's
  tables depends on them; every table's owner and ACL into a temp table; ``CREATE SCHEMA aside``,
  whose comment records the restore (pipeline, snapshot, each table and its schema: what a
  rollback needs, ``recovery.aside``); then ``ALTER TABLE .. SET SCHEMA aside`` for every table
  (indexes, constraints and owned sequences move along);
* the dump's DDL and COPY data recreate the tables;
* postlude: grants and owners back on the restored tables, every count and checksum against the
  manifest (raises on any difference), and with ``drop_old`` the drop of the aside schema.

Any error, or ``before_commit`` raising, rolls everything back: the target is never half-restored.

Failure transitions (the restore's steps 4 and 5 in ``recovery/__init__.py``): a crash before
COMMIT was sent leaves the target as it was (the server rolls back a transaction whose client went
away: old tables, old epoch, no aside schema); a crash after it leaves the new state whole, with
the old tables aside when kept.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from airflow_provider_eos.hooks.pg_tools import PgToolError, tool_output_tail
from airflow_provider_eos.recovery.aside import ASIDE_MARKER, utc_now
from airflow_provider_eos.recovery.catalog import DEPENDENTS_SQL, DependentObjectsError
from airflow_provider_eos.recovery.checksums import NORMALIZE, TableRef, checksum_statement
from airflow_provider_eos.recovery.lock import swap_lock_key, target_lock_key
from airflow_provider_eos.recovery.manifest import SnapshotManifest
from airflow_provider_eos.recovery.scratch import SnapshotValidationError

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.pg_tools import PgToolsHook


# The swap's own check, under its locks (the operator's early one may be stale).
_DEPENDENTS_CHECK = (
    "DO $eos$\nDECLARE found text;\nBEGIN\n"  # noqa: S608 -- constants only, values bound by mogrify
    "  SELECT string_agg(d.name || ' (' || d.kind || ')', ', ') INTO found FROM ("
    + DEPENDENTS_SQL
    + ") AS d(name, kind);\n  IF found IS NOT NULL THEN\n"
    "    RAISE EXCEPTION 'eos-restore: dependents: %%', found;\n  END IF;\nEND\n$eos$;"
)

# pg_restore --no-owner --no-privileges makes the restored tables ours with
# default privileges. Give back what the replaced tables had (captured in
# eos_swap_acl by the prelude): grants first, while we own the table, then the
# owner (ALTER OWNER rewrites the grantor of those grants to the new owner).
# The restore's role may only give a table to a role it is a member of.
# format() with %I / regclass output quotes the names, as psycopg2.sql would.
_REGRANT = """DO $eos$
DECLARE r record; g record; restored regclass;
BEGIN
  FOR r IN SELECT * FROM pg_temp.eos_swap_acl ORDER BY schema_name, table_name LOOP
    restored := to_regclass(format('%I.%I', r.schema_name, r.table_name));
    CONTINUE WHEN restored IS NULL;
    FOR g IN SELECT a.privilege_type, a.is_grantable, a.grantee FROM aclexplode(r.acl) AS a
             WHERE a.grantee <> r.owner ORDER BY a.grantee, a.privilege_type LOOP
      EXECUTE format('GRANT %s ON TABLE %s TO %s%s', g.privilege_type, restored,
        CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.grantee)) END,
        CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF (SELECT relowner FROM pg_class WHERE oid = restored) <> r.owner THEN
      IF pg_has_role(current_user, r.owner, 'MEMBER') AND has_schema_privilege(r.owner, r.schema_name, 'CREATE') THEN
        EXECUTE format('ALTER TABLE %s OWNER TO %I', restored, pg_get_userbyid(r.owner));
      ELSE
        RAISE WARNING 'eos-restore: % stays owned by %: this role may not give it back to %',
          restored, current_user, pg_get_userbyid(r.owner);
      END IF;
    END IF;
  END LOOP;
END
$eos$;
"""


class _Lines:
    """Drains a child's pipe in a thread (so the child never blocks on a full
    pipe), keeps its tail and notices the swap's marker lines."""

    def __init__(self, stream: Any, keep: int = 400) -> None:
        self.tail: deque[str] = deque(maxlen=keep)
        self.marked: dict[str, str] = {}
        self.marked_at: dict[str, float] = {}  # when each marker line arrived (time.monotonic())
        self.notes: list[str] = []
        self.closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                with self._cond:
                    self.tail.append(line)
                    if line.startswith("eos-swap-"):
                        self.marked[line.split(" ", 1)[0]] = line
                        self.marked_at[line.split(" ", 1)[0]] = time.monotonic()
                    elif "eos-restore:" in line:
                        self.notes.append(line)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self.closed = True
                self._cond.notify_all()

    def wait_for(self, marker: str) -> str | None:
        """The marker's line, or None when the stream ended without it."""
        with self._cond:
            self._cond.wait_for(lambda: marker in self.marked or self.closed)
            return self.marked.get(marker)

    def text(self) -> str:
        self._thread.join(timeout=5)
        with self._cond:
            return "\n".join(self.tail)

    def matching(self, needle: str) -> list[str]:
        self._thread.join(timeout=5)
        with self._cond:
            return [line for line in self.notes if needle in line]


def swap_in(hook: PgToolsHook, dump_file: str | Path, manifest: SnapshotManifest, aside_schema: str,
            drop_old: bool = True, *, before_commit: Callable[[], Any] | None = None,
            allow_dependents: bool = False, lock_key: str | None = None,
            changed_by: str = "eos-restore", reuse_aside: bool = False,
            extra_tables: Sequence[TableRef] = ()) -> dict[str, Any]:
    """Replaces the snapshot's tables in the target database in ONE transaction: the module's
    docstring says how the transaction runs and how it fails.

    :param dump_file: the snapshot's dump (``pg_dump -Fc``).
    :param manifest: its manifest; counts and checksums are checked against it.
    :param aside_schema: where the replaced tables go (``aside_schema_name``).
    :param drop_old: drop the aside schema in the same transaction.
    :param before_commit: called with the transaction complete but not committed;
        raising rolls the swap back, and the exception propagates.
    :param allow_dependents: swap even though other objects depend on the tables.
        They keep referring to the OLD tables (by OID), now in the aside schema:
        a view shows the old data, a foreign key from another table checks
        against the old table, a publication publishes the old table. Dropping
        the aside schema (``drop_old``, or ``finalize_aside``) drops such views
        and foreign keys with it (CASCADE) and takes the old tables out of the
        publications. Recreate them on the restored tables.
    :param lock_key: the target's key (``target_lock_key``); default from the manifest.
    :param changed_by: recorded with the epoch bump and in the aside record (the run).
    :param reuse_aside: ``aside_schema`` exists already and holds the state from before
        an earlier restore of the same run (whose swap committed, then the run
        failed and was rerun): drop the current tables instead of moving them, so
        the aside keeps the original state, not a copy of the snapshot.
    :param extra_tables: the pipeline's tables that are not in the snapshot (a
        target added to the spec after it was taken; ``RestoreOperator`` passes
        them only with ``allow_table_changes``). The swap leaves them in place,
        rows and all, and copies their rows into the aside schema (``eos_copy_<n>``,
        named in the record's ``extras``), so that ``rollback_swap`` gives them back
        exactly as the recovery found them; one that does not exist is recorded
        without a copy, and a rollback drops it if the recovery created it.
    :returns: ``swap_seconds``, ``before_commit_seconds``, ``aside_schema``
        (None when dropped), the new ``epoch``, ``warnings`` (owners that
        could not be given back) and ``phases``: seconds of the prelude, the
        load (the dump's script), the check (the postlude), ``before_commit``
        and the commit, as psql reached its markers.
    :raises DependentObjectsError: other objects depend on the tables.
    :raises SnapshotValidationError: the restored tables differ from the manifest.
    """
    started = time.monotonic()
    key = lock_key or target_lock_key(hook.dbname, manifest.target_schema, manifest.pipeline)
    conn = hook.connect()
    try:
        prelude = _prelude(hook, conn, manifest, aside_schema, key, changed_by, allow_dependents, reuse_aside,
                                list(extra_tables))
        postlude = _postlude(conn, manifest, aside_schema if drop_old else None)
    finally:
        conn.close()
    outcome = _psql_transaction(hook, prelude, dump_file, postlude, before_commit)
    return {"swap_seconds": round(time.monotonic() - started, 3),
            "before_commit_seconds": outcome["before_commit_seconds"],
            "aside_schema": None if drop_old else aside_schema,
            "epoch": outcome["epoch"], "warnings": outcome["warnings"], "phases": outcome["phases"]}


def _psql_transaction(hook: PgToolsHook, prelude: str, dump_file: str | Path, postlude: str,
                      before_commit: Callable[[], Any] | None) -> dict[str, Any]:
    """Feeds psql one transaction and commits it only after ``before_commit`` passed."""
    token = uuid.uuid4().hex
    ready, committed = f"eos-swap-ready-{token}", f"eos-swap-committed-{token}"
    # Where the transaction's time goes: psql echoes each marker as it reaches it.
    moved, loaded = f"eos-swap-moved-{token}", f"eos-swap-loaded-{token}"
    started = time.monotonic()
    # pg_restore only writes the script (no connection); psql runs it on the target.
    restore = hook.start_tool("pg_restore", ["--no-owner", "--no-privileges", "-f", "-", str(dump_file)],
                              connect=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    psql = hook.start_tool("psql", ["-X", "-q", "--no-password", "-v", "ON_ERROR_STOP=1", "-f", "-"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert restore.stdout is not None and restore.stderr is not None
    assert psql.stdin is not None and psql.stdout is not None and psql.stderr is not None
    out, err, restore_err = _Lines(psql.stdout), _Lines(psql.stderr), _Lines(restore.stderr)
    try:
        try:
            psql.stdin.write(("BEGIN;\n" + prelude + f"\\echo {moved}\n").encode())
            shutil.copyfileobj(restore.stdout, psql.stdin, 1 << 20)
            # :eos_epoch was set by the prelude's \gset; the marker proves every statement before it passed.
            psql.stdin.write((f"\\echo {loaded}\n" + postlude + f"\\echo {ready} :eos_epoch\n").encode())
            psql.stdin.flush()
        except BrokenPipeError:
            pass  # psql stopped at an error (ON_ERROR_STOP); its stderr says which
        restore.stdout.close()
        restore.wait()
        line = out.wait_for(ready)
        if line is None or restore.returncode != 0:
            _end_psql(psql, "ROLLBACK;\n")
            if restore.returncode != 0:
                raise PgToolError(f"pg_restore could not read the dump ({restore.returncode}): "
                                  f"{tool_output_tail(restore_err.text())}; rolled back, the target was not changed")
            raise _swap_error(err.text())
        epoch = int(line.split()[-1]) if line.split()[-1].isdigit() else None
        clock = time.monotonic()
        try:
            if before_commit is not None:
                before_commit()
        except BaseException:
            _end_psql(psql, "ROLLBACK;\n")
            raise
        waited = round(time.monotonic() - clock, 3)
        _end_psql(psql, f"COMMIT;\n\\echo {committed}\n")
        if psql.returncode != 0 or out.wait_for(committed) is None:
            raise PgToolError(f"the swap's COMMIT failed and was rolled back: {tool_output_tail(err.text())}")
        at = [started, *(out.marked_at.get(m, started) for m in (moved, loaded, ready)), clock + waited,
              out.marked_at.get(committed, started)]
        phases = {name: round(max(0.0, end - begin), 3) for name, begin, end in zip(
            ("prelude", "load", "check", "before_commit", "commit"), at, at[1:], strict=False)}
        return {"epoch": epoch, "before_commit_seconds": waited, "warnings": err.matching("eos-restore:"),
                "phases": phases}
    finally:
        for child in (psql, restore):
            if child.poll() is None:
                child.kill()  # the server rolls back the open transaction of a client that went away
                child.wait()


def _end_psql(psql: subprocess.Popen, command: str) -> None:
    assert psql.stdin is not None
    try:
        psql.stdin.write(command.encode())
        psql.stdin.close()
    except BrokenPipeError:
        pass
    psql.wait()


def _swap_error(stderr: str) -> AirflowException:
    message = tool_output_tail(stderr)
    if "eos-restore: validation failed" in message:
        return SnapshotValidationError(f"the snapshot does not match its manifest (checked in the swap, "
                                       f"rolled back): {message}")
    found = re.search(r"eos-restore: dependents: (.*)", message)
    if found:
        return DependentObjectsError(
            f"objects outside the pipeline's tables depend on them: {found.group(1).strip()}. A swap would "
            "leave them on the old tables; drop or move them first, or set allow_dependents. Rolled back.")
    return PgToolError(f"restore transaction failed and was rolled back: {message}")


def _prelude(hook: PgToolsHook, conn: PgConnection, manifest: SnapshotManifest, aside: str, lock_key: str,
             changed_by: str, allow_dependents: bool, reuse_aside: bool = False,
             extra_tables: Sequence[TableRef] = ()) -> str:
    from spark_apps.eos_stream.state import fencing, meta_tables

    schemas, tables = [t.schema for t in manifest.tables], [t.table for t in manifest.tables]
    parts = [s + ";" for s in NORMALIZE]
    with conn.cursor() as cur:
        def render(query: Any, args: Any = None) -> str:
            return cur.mogrify(query, args).decode()

        parts.append(render("SET lock_timeout = %s;", (f"{int(hook.lock_timeout * 1000)}ms",)))
        # Before any table lock: snapshots in progress finish first, and none starts until this ends.
        parts.append(render("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0)) AS swap_lock;",
                            (swap_lock_key(lock_key),)))
        # The pipeline's lock before the epoch table's: never hold a table lock while a batch ends.
        parts.append(render("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0)) AS pipeline_lock;",
                            (fencing.pipeline_lock_key(manifest.pipeline),)))
        parts += [s.as_string(conn) + ";" for s in meta_tables.epochs_ddl_statements(manifest.meta_schema)]
        parts.append(render(fencing.bump_epoch_statement(manifest.meta_schema), {
            "pipeline": manifest.pipeline, "by": changed_by,
            "reason": f"restore of snapshot {manifest.snapshot_id}"}) + " \\gset eos_")
        if not allow_dependents:
            parts.append(render(_DEPENDENTS_CHECK, {"schemas": schemas, "tables": tables}))
        parts.append(render(
            "CREATE TEMP TABLE eos_swap_acl ON COMMIT DROP AS SELECT n.nspname AS schema_name,"
            " c.relname AS table_name, c.relowner AS owner, c.relacl AS acl"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN unnest(%s::text[], %s::text[]) AS m(s, r) ON m.s = n.nspname AND m.r = c.relname"
            " WHERE c.relkind IN ('r', 'p');", (schemas, tables)))
    extras = _extras(conn, manifest, extra_tables)
    record = json.dumps({"marker": ASIDE_MARKER, "pipeline": manifest.pipeline,
                         "target_schema": manifest.target_schema, "meta_schema": manifest.meta_schema,
                         "snapshot_id": manifest.snapshot_id, "created_at": utc_now().isoformat(),
                         "run": changed_by, "tables": [[t.schema, t.table] for t in manifest.tables],
                         "extras": extras})
    statements = []
    if not reuse_aside:
        statements += [sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(aside)),
                       sql.SQL("COMMENT ON SCHEMA {} IS {}").format(sql.Identifier(aside), sql.Literal(record))]
        # Tables the snapshot does not hold stay in place through the swap; their rows as the
        # recovery found them go aside, for a rollback (a rerun keeps the first run's copies).
        statements += [sql.SQL("CREATE TABLE {}.{} AS TABLE {}.{}").format(
            sql.Identifier(aside), sql.Identifier(copy), sql.Identifier(schema), sql.Identifier(table))
            for schema, table, copy in extras if copy]
    for schema in sorted(set(schemas)):
        statements.append(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    if reuse_aside:
        # The current tables are an earlier restore's of this run (plus whatever its replay
        # wrote), not the state to keep: that is in the aside already. No CASCADE: anything
        # built on them since makes the swap fail, not vanish.
        statements.append(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.SQL(", ").join(
            sql.SQL("{}.{}").format(sql.Identifier(t.schema), sql.Identifier(t.table)) for t in manifest.tables)))
    else:
        for t in manifest.tables:
            statements.append(sql.SQL("ALTER TABLE IF EXISTS {}.{} SET SCHEMA {}").format(
                sql.Identifier(t.schema), sql.Identifier(t.table), sql.Identifier(aside)))
    parts += [s.as_string(conn) + ";" for s in statements]
    return "\n".join(parts) + "\n"


def _extras(conn: PgConnection, manifest: SnapshotManifest,
            extra_tables: Sequence[TableRef]) -> list[list[str | None]]:
    """``[schema, table, copy]`` per table outside the snapshot: ``copy`` is the name of
    its copy in the aside schema, None when the table does not exist (nothing to keep)."""
    held = {t.table for t in manifest.tables}
    extras: list[list[str | None]] = []
    with conn.cursor() as cur:
        for index, (schema, table) in enumerate(sorted(set(extra_tables))):
            copy = f"eos_copy_{index}"
            if copy in held:
                raise AirflowException(f"snapshot {manifest.snapshot_id} holds a table named {copy!r}, the name "
                                       f"the restore gives its copy of {schema}.{table}; rename that table")
            cur.execute("SELECT to_regclass(%s)", (sql.SQL("{}.{}").format(
                sql.Identifier(schema), sql.Identifier(table)).as_string(conn),))
            exists = (cur.fetchone() or (None,))[0] is not None
            extras.append([schema, table, copy if exists else None])
    conn.rollback()
    return extras


def _postlude(conn: PgConnection, manifest: SnapshotManifest, drop_schema: str | None) -> str:
    checks = []
    for t in manifest.tables:
        # EXECUTE, not SELECT INTO: PL/pgSQL runs a SELECT INTO for one row, which rules out a
        # parallel plan; a dynamic statement runs to completion, so PostgreSQL may scan a big
        # table with its parallel workers (1M rows: 3.1 s -> 1.7 s on 2 cores).
        checks.append(sql.SQL(
            "  EXECUTE {query} INTO n, s;\n"
            "  IF n::text || ':' || s <> {expected} THEN\n"
            "    problems := problems || format('%s: %s:%s, manifest %s; ', {name}, n, s, {expected});\n"
            "  END IF;\n"
        ).format(query=sql.Literal(checksum_statement(t.schema, t.table).as_string(conn)),
                 expected=sql.Literal(t.checksum), name=sql.Literal(t.qualified)))
    body = sql.SQL("").join(checks).as_string(conn)
    normalize = "".join(s + ";\n" for s in NORMALIZE)
    return (
        _REGRANT
        + normalize
        + "DO $eos$\nDECLARE n bigint; s text; problems text := '';\nBEGIN\n"
        + body
        + "  IF problems <> '' THEN\n    RAISE EXCEPTION 'eos-restore: validation failed: %', problems;\n"
        "  END IF;\nEND\n$eos$;\n"
        + (sql.SQL("DROP SCHEMA {} CASCADE;\n").format(sql.Identifier(drop_schema)).as_string(conn)
           if drop_schema else "")
    )
