"""pg_dump / pg_restore mechanics for pipeline snapshots, over a PostgresHook connection.

Consistency: one REPEATABLE READ transaction exports its snapshot with
``pg_export_snapshot()``; ``pg_dump --snapshot=...`` dumps from it while the
same transaction counts and checksums every table and reads the stored Kafka
offsets. Counts, checksums, offsets and dump are therefore one instant.

Checksum of a table: ``count(*)`` and the sum, as numeric, of the first 64 bits
of ``md5(row::text)`` over all rows. It is independent of row order (no sort,
constant memory, so it scales to large tables), a duplicated or lost row
changes it, and any changed value changes the row's md5. Row text depends on
session settings, so every session that computes one first sets TimeZone,
DateStyle, IntervalStyle, bytea_output and extra_float_digits (``_NORMALIZE``).

Passwords never go on a command line: pg_dump, pg_restore and psql get
``PGPASSWORD`` in their environment only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg2
from airflow.providers.postgres.hooks.postgres import PostgresHook
from airflow.sdk.exceptions import AirflowException
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from airflow_provider_eos.snapshots import SnapshotManifest, TableState

_NORMALIZE = (
    "SET TIME ZONE 'UTC'",
    "SET DateStyle = 'ISO, YMD'",
    "SET IntervalStyle = 'postgres'",
    "SET bytea_output = 'hex'",
    "SET extra_float_digits = 3",
)
# Per-row 64-bit hash, summed as numeric: order-independent and exact.
_CHECKSUM_COLUMNS = "count(*), coalesce(sum(('x' || substr(md5(t::text), 1, 16))::bit(64)::bigint::numeric), 0)::text"
_CHECKSUM_SQL = "SELECT " + _CHECKSUM_COLUMNS + " FROM {table} AS t"  # noqa: S608 -- {table} is an Identifier
TableRef = tuple[str, str]


class SnapshotValidationError(AirflowException):
    """Restored tables do not match the manifest (counts, checksums or missing tables)."""


class PgToolError(AirflowException):
    """pg_dump, pg_restore or psql failed; the message carries its stderr tail."""


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


def scratch_prefix(owner: str) -> str:
    """Name prefix of the scratch databases of one restore target (its lock key)."""
    return f"eos_scratch_{hashlib.sha256(owner.encode()).hexdigest()[:12]}_"


def checksum_statement(schema: str, table: str) -> sql.Composed:
    return sql.SQL(_CHECKSUM_SQL).format(table=sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table)))


def _checksum(count: Any, total: Any) -> str:
    return f"{int(count)}:{total}"


def compare(expected: Iterable[TableState], actual: dict[TableRef, TableState]) -> list[str]:
    """Differences between manifest tables and measured ones, one line each."""
    problems = []
    for state in expected:
        got = actual.get((state.schema, state.table))
        if got is None:
            problems.append(f"{state.qualified}: missing")
        elif got.rows != state.rows:
            problems.append(f"{state.qualified}: {got.rows} rows, manifest says {state.rows}")
        elif got.checksum != state.checksum:
            problems.append(f"{state.qualified}: checksum {got.checksum} != manifest {state.checksum}")
    return problems


class SnapshotHook(PostgresHook):
    """
    Snapshots and restores a pipeline's tables with the PostgreSQL client tools.

    :param postgres_conn_id: The connection object to use, defaults to "postgres_default"
        (its schema field is the database).
    :param pg_bin_dir: directory holding pg_dump, pg_restore and psql (their
        major version must be >= the server's); default: ``EOS_PG_BIN_DIR`` or ``PATH``.
    :param lock_timeout: seconds a restore waits for table locks before giving up.
    """

    conn_name_attr = "postgres_conn_id"
    hook_name = "EOS snapshot (PostgreSQL)"

    def __init__(self, *args: Any, pg_bin_dir: str | None = None, lock_timeout: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pg_bin_dir = pg_bin_dir or os.environ.get("EOS_PG_BIN_DIR") or ""
        self.lock_timeout = lock_timeout

    # ------------------------------------------------------------------ connections
    def libpq_params(self, dbname: str | None = None) -> dict[str, Any]:
        conn = self.connection
        if not conn.host:
            # No silent default host: the target must be named in the connection.
            raise ValueError(f"connection {getattr(self, self.conn_name_attr)!r} has no host")
        params: dict[str, Any] = {
            "host": conn.host,
            "port": int(conn.port or 5432),
            "user": conn.login,
            "dbname": dbname or self.database or conn.schema or "postgres",
        }
        sslmode = conn.extra_dejson.get("sslmode")
        if sslmode:
            params["sslmode"] = sslmode
        return params

    @property
    def dbname(self) -> str:
        return str(self.libpq_params()["dbname"])

    def connect(self, dbname: str | None = None, application_name: str = "eos-snapshot") -> PgConnection:
        password = self.connection.password
        return psycopg2.connect(
            connect_timeout=10,
            application_name=application_name,
            **self.libpq_params(dbname),
            **({"password": password} if password else {}),
        )

    def tool_env(self) -> dict[str, str]:
        """Environment for the client tools: the password travels here, never in argv."""
        env = dict(os.environ)
        password = self.connection.password
        if password:
            env["PGPASSWORD"] = password
        env["PGCONNECT_TIMEOUT"] = "10"
        env["PGAPPNAME"] = "eos-snapshot"
        return env

    def tool(self, name: str) -> str:
        if self.pg_bin_dir:
            return str(Path(self.pg_bin_dir) / name)
        found = shutil.which(name)
        if not found:
            raise PgToolError(f"{name} not found on PATH; set pg_bin_dir or EOS_PG_BIN_DIR")
        return found

    def _conn_args(self, dbname: str | None = None) -> list[str]:
        p = self.libpq_params(dbname)
        return ["-h", str(p["host"]), "-p", str(p["port"]), "-U", str(p["user"]), "-d", str(p["dbname"])]

    @staticmethod
    def normalize(cur: Any) -> None:
        for statement in _NORMALIZE:
            cur.execute(statement)

    # ------------------------------------------------------------------ reading state
    def list_tables(self, conn: PgConnection, schema: str) -> list[str]:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY 1",
                (schema,),
            )
            return [r[0] for r in cur.fetchall()]

    def measure(self, conn: PgConnection, tables: Iterable[TableRef], roles: dict[TableRef, str] | None = None
                ) -> dict[TableRef, TableState]:
        """Row count and checksum of each table, in ``conn``'s current transaction."""
        out: dict[TableRef, TableState] = {}
        with conn.cursor() as cur:
            self.normalize(cur)
            for schema, table in tables:
                cur.execute(checksum_statement(schema, table))
                row = cur.fetchone()
                assert row is not None
                out[(schema, table)] = TableState(
                    schema, table, int(row[0]), _checksum(*row), (roles or {}).get((schema, table), "target")
                )
        return out

    def stored_offsets(self, conn: PgConnection, meta_schema: str, pipeline: str) -> dict[str, dict[str, int]]:
        from spark_apps.eos_stream import meta_tables

        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{meta_tables.OFFSETS}"',))
            row = cur.fetchone()
            if row is None or row[0] is None:
                return {}
            cur.execute(
                sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s ORDER BY 1, 2").format(
                    meta_tables.table(meta_schema, meta_tables.OFFSETS)
                ),
                (pipeline,),
            )
            out: dict[str, dict[str, int]] = {}
            for topic, partition, offset in cur.fetchall():
                out.setdefault(topic, {})[str(partition)] = int(offset)
            return out

    def other_pipelines(self, conn: PgConnection, meta_schema: str, pipeline: str) -> list[str]:
        """Other pipelines with offsets in the same meta schema (a restore would roll them back)."""
        from spark_apps.eos_stream import meta_tables

        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{meta_tables.OFFSETS}"',))
            row = cur.fetchone()
            if row is None or row[0] is None:
                return []
            cur.execute(
                sql.SQL("SELECT DISTINCT pipeline FROM {} WHERE pipeline <> %s ORDER BY 1").format(
                    meta_tables.table(meta_schema, meta_tables.OFFSETS)
                ),
                (pipeline,),
            )
            return [r[0] for r in cur.fetchall()]

    # ------------------------------------------------------------------ snapshot
    def dump_consistent(
        self,
        tables: Sequence[TableRef],
        roles: dict[TableRef, str],
        dump_file: str | Path,
        *,
        meta_schema: str,
        pipeline: str,
    ) -> ConsistentSnapshot:
        """One ``pg_dump -Fc`` of ``tables`` plus counts, checksums and offsets, all
        from the same exported snapshot."""
        if not tables:
            raise AirflowException("nothing to snapshot: no tables")
        timings: dict[str, float] = {}
        started = time.monotonic()
        conn = self.connect()
        try:
            conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT pg_export_snapshot(), now(), current_database(), current_setting('server_version')"
                )
                row = cur.fetchone()
                assert row is not None
                snapshot_id, now, database, server_version = row
            command = [self.tool("pg_dump"), *self._conn_args(), "-Fc", "--no-password",
                       f"--snapshot={snapshot_id}", "-f", str(dump_file)]
            for schema, table in tables:
                command += ["-t", _pattern(schema, table)]
            self.log.info("pg_dump of %d tables from snapshot %s", len(tables), snapshot_id)
            dump = subprocess.Popen(command, env=self.tool_env(), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            try:
                # While pg_dump reads, measure the same snapshot in this transaction.
                measured = self.measure(conn, tables, roles)
                timings["checksums"] = round(time.monotonic() - started, 3)
                offsets = self.stored_offsets(conn, meta_schema, pipeline)
                others = self.other_pipelines(conn, meta_schema, pipeline)
                _, err = dump.communicate()
            finally:
                if dump.poll() is None:
                    dump.kill()
                    dump.wait()
            if dump.returncode != 0:
                raise PgToolError(f"pg_dump failed ({dump.returncode}): {_tail(err)}")
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
        )

    # ------------------------------------------------------------------ restore
    def validate_in_scratch(self, dump_file: str | Path, manifest: SnapshotManifest, owner: str,
                            drop_leftovers: bool = False) -> dict[str, Any]:
        """Restores the dump into a fresh database, compares it with the manifest and
        drops the database again. Never touches the target database.

        :param owner: the target's recovery lock key; scratch databases are named after it.
        :param drop_leftovers: first drop scratch databases of the same owner that a
            crashed restore left behind (only safe while holding the owner's recovery lock).
        :raises SnapshotValidationError: counts or checksums differ, or pg_restore failed.
        """
        prefix = scratch_prefix(owner)
        scratch = f"{prefix}{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        admin = self.connect()
        admin.autocommit = True
        leftovers: list[str] = []
        try:
            with admin.cursor() as cur:
                if drop_leftovers:
                    cur.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,))
                    leftovers = sorted(row[0] for row in cur.fetchall())
                    for name in leftovers:
                        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
                cur.execute("SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()")
                row = cur.fetchone()
                encoding = row[0] if row else "UTF8"
                cur.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING {}").format(
                    sql.Identifier(scratch), sql.Literal(encoding)))
            try:
                conn = self.connect(scratch)
                conn.autocommit = True
                with conn.cursor() as cur:
                    for schema in sorted({t.schema for t in manifest.tables}):
                        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
                conn.close()
                result = subprocess.run(
                    [self.tool("pg_restore"), *self._conn_args(scratch), "--no-owner", "--no-privileges",
                     "--no-password", "--exit-on-error", "--single-transaction", str(dump_file)],
                    env=self.tool_env(), capture_output=True, text=True,
                )
                if result.returncode != 0:
                    raise SnapshotValidationError(
                        f"snapshot {manifest.snapshot_id}: pg_restore into scratch database failed: "
                        f"{_tail(result.stderr)}"
                    )
                restored_at = time.monotonic()
                conn = self.connect(scratch)
                try:
                    measured = self.measure(conn, [(t.schema, t.table) for t in manifest.tables])
                finally:
                    conn.close()
                problems = compare(manifest.tables, measured)
                if problems:
                    raise SnapshotValidationError(
                        f"snapshot {manifest.snapshot_id} does not match its manifest: " + "; ".join(problems)
                    )
                return {"scratch_database": scratch, "restore_seconds": round(restored_at - started, 3),
                        "validate_seconds": round(time.monotonic() - restored_at, 3),
                        "leftovers_dropped": leftovers}
            finally:
                with admin.cursor() as cur:
                    cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(scratch)))
        finally:
            admin.close()

    def swap_in(self, dump_file: str | Path, manifest: SnapshotManifest, aside_schema: str,
                drop_old: bool = True) -> dict[str, Any]:
        """Replaces the snapshot's tables in the target database in ONE transaction.

        ``psql --single-transaction`` runs: move every existing table of the
        snapshot into ``aside_schema`` (``ALTER TABLE .. SET SCHEMA`` takes its
        indexes, constraints and owned sequences along), the dump's restore
        script (``pg_restore -f -``), a check of every restored table's count
        and checksum against the manifest that raises on any difference, and
        (``drop_old``) the drop of the aside schema. Any error rolls everything
        back: the target is never half-restored, the old tables are kept until
        the swap succeeds, and a crash at any point leaves either the old state
        or the new one, nothing in between and nothing behind.
        """
        started = time.monotonic()
        conn = self.connect()
        try:
            prelude = self._prelude(conn, manifest, aside_schema)
            postlude = self._postlude(conn, manifest, aside_schema if drop_old else None)
        finally:
            conn.close()
        with tempfile.TemporaryDirectory(prefix="eos-swap-") as tmp:
            pre, post = Path(tmp, "prelude.sql"), Path(tmp, "postlude.sql")
            pre.write_text(prelude)
            post.write_text(postlude)
            restore = subprocess.Popen(
                [self.tool("pg_restore"), "--no-owner", "--no-privileges", "-f", "-", str(dump_file)],
                env=self.tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            assert restore.stdout is not None
            try:
                psql = subprocess.run(
                    [self.tool("psql"), *self._conn_args(), "-X", "-q", "--no-password", "-v", "ON_ERROR_STOP=1",
                     "--single-transaction", "-f", str(pre), "-f", "-", "-f", str(post)],
                    env=self.tool_env(), stdin=restore.stdout, capture_output=True, text=True,
                )
            finally:
                restore.stdout.close()
                restore_err = restore.stderr.read().decode(errors="replace") if restore.stderr else ""
                restore.wait()
        if restore.returncode != 0:
            raise PgToolError(f"pg_restore could not read the dump ({restore.returncode}): {_tail(restore_err)}; "
                              "the target database was not changed")
        if psql.returncode != 0:
            message = _tail(psql.stderr)
            if "eos-restore: validation failed" in message:
                raise SnapshotValidationError(f"restored tables do not match the manifest, rolled back: {message}")
            raise PgToolError(f"restore transaction failed and was rolled back: {message}")
        return {"swap_seconds": round(time.monotonic() - started, 3),
                "aside_schema": None if drop_old else aside_schema}

    def _prelude(self, conn: PgConnection, manifest: SnapshotManifest, aside: str) -> str:
        statements = [sql.SQL(s) for s in _NORMALIZE]
        statements.append(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{int(self.lock_timeout * 1000)}ms")))
        statements.append(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(aside)))
        for schema in sorted({t.schema for t in manifest.tables}):
            statements.append(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        for t in manifest.tables:
            statements.append(sql.SQL("ALTER TABLE IF EXISTS {}.{} SET SCHEMA {}").format(
                sql.Identifier(t.schema), sql.Identifier(t.table), sql.Identifier(aside)))
        return "".join(s.as_string(conn) + ";\n" for s in statements)

    def _postlude(self, conn: PgConnection, manifest: SnapshotManifest, drop_schema: str | None) -> str:
        checks = []
        for t in manifest.tables:
            checks.append(sql.SQL(
                "  SELECT " + _CHECKSUM_COLUMNS + " INTO n, s FROM {table} AS t;\n"  # noqa: S608 -- composed Identifier
                "  IF n::text || ':' || s <> {expected} THEN\n"
                "    problems := problems || format('%s: %s:%s, manifest %s; ', {name}, n, s, {expected});\n"
                "  END IF;\n"
            ).format(table=sql.SQL("{}.{}").format(sql.Identifier(t.schema), sql.Identifier(t.table)),
                     expected=sql.Literal(t.checksum), name=sql.Literal(t.qualified)))
        body = sql.SQL("").join(checks).as_string(conn)
        normalize = "".join(s + ";\n" for s in _NORMALIZE)
        return (
            normalize
            + "DO $eos$\nDECLARE n bigint; s text; problems text := '';\nBEGIN\n"
            + body
            + "  IF problems <> '' THEN\n    RAISE EXCEPTION 'eos-restore: validation failed: %', problems;\n"
            "  END IF;\nEND\n$eos$;\n"
            + (sql.SQL("DROP SCHEMA {} CASCADE;\n").format(sql.Identifier(drop_schema)).as_string(conn)
               if drop_schema else "")
        )

    # ------------------------------------------------------------------ stream state and locks
    def stream_activity(self, meta_schema: str, pipeline: str) -> dict[str, Any]:
        """Whether a driver of the pipeline is connected (its running lock), when
        it last recorded progress and whether a stop is requested."""
        from spark_apps.eos_stream import meta_tables
        from spark_apps.eos_stream.control import driver_running

        conn = self.connect()
        try:
            running = driver_running(conn, pipeline)
            with conn.cursor() as cur:
                result: dict[str, Any] = {"driver_running": running, "last_progress_at": None,
                                          "stop_requested_at": None, "seconds_since": None}
                cur.execute("SELECT to_regclass(%s), to_regclass(%s), now()", (
                    f'"{meta_schema}"."{meta_tables.PROGRESS}"', f'"{meta_schema}"."{meta_tables.CONTROL}"'))
                row = cur.fetchone()
                assert row is not None
                progress, control, now = row
                if progress is not None:
                    cur.execute(sql.SQL("SELECT max(recorded_at) FROM {} WHERE pipeline = %s").format(
                        meta_tables.table(meta_schema, meta_tables.PROGRESS)), (pipeline,))
                    last = (cur.fetchone() or (None,))[0]
                    result["last_progress_at"] = last
                    result["seconds_since"] = (now - last).total_seconds() if last else None
                if control is not None:
                    cur.execute(sql.SQL("SELECT stop_requested_at FROM {} WHERE pipeline = %s").format(
                        meta_tables.table(meta_schema, meta_tables.CONTROL)), (pipeline,))
                    result["stop_requested_at"] = (cur.fetchone() or (None,))[0]
            conn.rollback()
            return result
        finally:
            conn.close()

    def set_stop_request(self, meta_schema: str, pipeline: str, requested: bool, by: str = "eos-recovery") -> None:
        """Sets or clears the pipeline's stop request in the control table."""
        from spark_apps.eos_stream import meta_tables

        conn = self.connect()
        try:
            with conn.cursor() as cur:
                for statement in meta_tables.ddl_statements(meta_schema):
                    cur.execute(statement)
                cur.execute(
                    sql.SQL("INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, {}, %s)"
                            " ON CONFLICT (pipeline) DO UPDATE SET stop_requested_at = EXCLUDED.stop_requested_at,"
                            " requested_by = EXCLUDED.requested_by").format(
                        meta_tables.table(meta_schema, meta_tables.CONTROL),
                        sql.SQL("now()" if requested else "NULL")),
                    (pipeline, by),
                )
            conn.commit()
        finally:
            conn.close()

    def acquire_lock(self, meta_schema: str, key: str, holder: str, ttl_seconds: float) -> dict[str, Any]:
        """Takes the recovery lock row for ``key``, or refreshes it for its holder.

        Re-entrant: the same holder (a DAG run id) gets it again, so a cleared or
        rerun task of that run goes on. A row whose heartbeat is older than
        ``ttl_seconds`` belonged to a run that died without its teardown, and is
        taken over. Returns ``acquired`` and the holder row; ``taken_over_from``
        names the dead holder when there was one."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                table = _lock_table(meta_schema)
                cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(meta_schema)))
                cur.execute(sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (lock_key text PRIMARY KEY, holder text NOT NULL,"
                    " acquired_at timestamptz NOT NULL DEFAULT now(),"
                    " heartbeat_at timestamptz NOT NULL DEFAULT now())").format(table))
                # Tables made before heartbeats existed.
                cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS heartbeat_at timestamptz"
                                    " NOT NULL DEFAULT now()").format(table))
                cur.execute(sql.SQL("SELECT holder FROM {} WHERE lock_key = %s FOR UPDATE").format(table), (key,))
                previous = (cur.fetchone() or (None,))[0]
                cur.execute(sql.SQL(
                    "INSERT INTO {t} (lock_key, holder) VALUES (%s, %s) ON CONFLICT (lock_key) DO UPDATE"
                    " SET holder = EXCLUDED.holder, heartbeat_at = now(),"
                    " acquired_at = CASE WHEN {t}.holder = EXCLUDED.holder THEN {t}.acquired_at ELSE now() END"
                    " WHERE {t}.holder = EXCLUDED.holder OR {t}.heartbeat_at < now() - make_interval(secs => %s)"
                    " RETURNING holder").format(t=table), (key, holder, ttl_seconds))
                won = cur.fetchone() is not None
                cur.execute(sql.SQL("SELECT holder, acquired_at, heartbeat_at FROM {} WHERE lock_key = %s")
                            .format(table), (key,))
                row = cur.fetchone()
            conn.commit()
        finally:
            conn.close()
        return {"acquired": won, "key": key, "holder": row[0] if row else None,
                "acquired_at": row[1].isoformat() if row else None,
                "heartbeat_at": row[2].isoformat() if row else None,
                "taken_over_from": previous if won and previous not in (None, holder) else None}

    def heartbeat_lock(self, meta_schema: str, key: str, holder: str) -> bool:
        """Marks the holder alive; False when the lock is no longer its own."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("UPDATE {} SET heartbeat_at = now() WHERE lock_key = %s AND holder = %s")
                            .format(_lock_table(meta_schema)), (key, holder))
                alive = cur.rowcount > 0
            conn.commit()
            return alive
        finally:
            conn.close()

    def release_lock(self, meta_schema: str, key: str, holder: str) -> bool:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{LOCK_TABLE}"',))
                if (cur.fetchone() or (None,))[0] is None:
                    return False
                cur.execute(sql.SQL("DELETE FROM {} WHERE lock_key = %s AND holder = %s").format(
                    _lock_table(meta_schema)), (key, holder))
                released = cur.rowcount > 0
            conn.commit()
            return released
        finally:
            conn.close()


LOCK_TABLE = "recovery_locks"


def _lock_table(meta_schema: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(meta_schema), sql.Identifier(LOCK_TABLE))


def _pattern(schema: str, table: str) -> str:
    """A pg_dump -t pattern matching exactly one table (double quotes make it literal)."""
    return '"{}"."{}"'.format(schema.replace('"', '""'), table.replace('"', '""'))


def _tail(text: str | None, limit: int = 1500) -> str:
    text = (text or "").strip()
    return text[-limit:] if text else "(no output)"


def utc_now() -> datetime:
    return datetime.now(timezone.utc)
