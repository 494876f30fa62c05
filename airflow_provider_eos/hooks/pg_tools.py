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

Secrets never go on a command line: pg_dump, pg_restore and psql get
``PGPASSWORD`` in their environment only, and ``sslpassword`` in a private
service file named by ``PGSERVICEFILE`` (``PgToolsHook.tool_env``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException
from psycopg2 import errors as pg_errors
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import make_dsn

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.utils import provider_config
from airflow_provider_eos.utils.snapshot_store import SnapshotManifest, TableState

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


class DependentObjectsError(AirflowException):
    """Objects outside the pipeline's own tables depend on them: a swap would leave them behind."""


class AsideSchemaError(AirflowException):
    """The named aside schema is not one a restore of this target made, or holds no restore record."""


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


def scratch_prefix(owner: str) -> str:
    """Name prefix of the scratch databases of one restore target (its lock key)."""
    return f"eos_scratch_{hashlib.sha256(owner.encode()).hexdigest()[:12]}_"


def target_lock_key(dbname: str, target_schema: str, pipeline: str) -> str:
    """The key of one restore target: recovery lock row, scratch names and swap lock derive from it."""
    return f"{dbname}/{target_schema}/{pipeline}"


def swap_lock_key(target_key: str) -> str:
    """Advisory lock key: snapshots take it shared (session), a swap exclusively (transaction)."""
    return "eos:swap:" + target_key


ASIDE_MARKER = "eos-restore"
_ASIDE_TIME = "%Y%m%dt%H%M%S"


def aside_schema_name(target_schema: str, at: datetime | None = None) -> str:
    """Where a swap moves the replaced tables: unique per second, so a kept one never blocks a rerun."""
    return f"{target_schema[:40]}_old_{(at or utc_now()).strftime(_ASIDE_TIME)}"


def aside_pattern(target_schema: str) -> re.Pattern[str]:
    """Exactly the names ``aside_schema_name`` makes for this target (group 1: the time)."""
    return re.compile(re.escape(target_schema[:40]) + r"_old_(\d{8}t\d{6})")


def aside_created(target_schema: str, name: str) -> datetime | None:
    """When a restore made this aside schema, or None when the name is not one of this target's."""
    match = aside_pattern(target_schema).fullmatch(name)
    if not match:
        return None
    return datetime.strptime(match.group(1), _ASIDE_TIME).replace(tzinfo=timezone.utc)


# Objects that depend (pg_depend) on the given tables or their row types and are
# not the tables' own indexes, constraints, owned sequences, toast tables,
# triggers, policies, rules, defaults, statistics or types. One row each:
# (name, kind). Binds %(schemas)s and %(tables)s (parallel text arrays).
_DEPENDENTS_SQL = """
WITH t AS (
  SELECT c.oid, c.reltype FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN unnest(%(schemas)s::text[], %(tables)s::text[]) AS m(s, r) ON m.s = n.nspname AND m.r = c.relname
  WHERE c.relkind IN ('r', 'p')
), refs AS (
  SELECT 'pg_class'::regclass AS cls, oid FROM t UNION ALL SELECT 'pg_type'::regclass, reltype FROM t
), d AS (
  SELECT DISTINCT dep.classid, dep.objid FROM pg_depend dep JOIN refs ON dep.refclassid = refs.cls
  AND dep.refobjid = refs.oid WHERE dep.deptype <> 'p'
), described AS (
  SELECT CASE d.classid
    WHEN 'pg_rewrite'::regclass THEN (
      SELECT CASE WHEN r.ev_class IN (SELECT oid FROM t) THEN NULL ELSE ARRAY[r.ev_class::regclass::text,
        CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' ELSE 'rule ' || r.rulename END] END
      FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class WHERE r.oid = d.objid)
    WHEN 'pg_constraint'::regclass THEN (
      SELECT CASE WHEN k.conrelid IN (SELECT oid FROM t) THEN NULL
        WHEN k.conrelid <> 0 THEN ARRAY[k.conrelid::regclass::text,
          CASE k.contype WHEN 'f' THEN 'foreign key ' ELSE 'constraint ' END || k.conname]
        ELSE ARRAY[k.contypid::regtype::text, 'domain constraint ' || k.conname] END
      FROM pg_constraint k WHERE k.oid = d.objid)
    WHEN 'pg_class'::regclass THEN (
      SELECT CASE WHEN c.oid IN (SELECT oid FROM t) OR c.relkind IN ('i', 'I', 't', 'S') THEN NULL
        ELSE ARRAY[c.oid::regclass::text, CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view'
          WHEN 'r' THEN 'table (inherits or partition)' WHEN 'p' THEN 'partitioned table' ELSE 'relation' END] END
      FROM pg_class c WHERE c.oid = d.objid)
    WHEN 'pg_type'::regclass THEN (
      SELECT CASE WHEN y.typrelid IN (SELECT oid FROM t) OR y.typelem IN (SELECT reltype FROM t) THEN NULL
        ELSE ARRAY[y.oid::regtype::text, 'type'] END FROM pg_type y WHERE y.oid = d.objid)
    WHEN 'pg_trigger'::regclass THEN (
      SELECT CASE WHEN g.tgrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[g.tgrelid::regclass::text, 'trigger ' || g.tgname] END FROM pg_trigger g WHERE g.oid = d.objid)
    WHEN 'pg_policy'::regclass THEN (
      SELECT CASE WHEN p.polrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[p.polrelid::regclass::text, 'policy ' || p.polname] END FROM pg_policy p WHERE p.oid = d.objid)
    WHEN 'pg_attrdef'::regclass THEN (
      SELECT CASE WHEN a.adrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[a.adrelid::regclass::text, 'column default'] END FROM pg_attrdef a WHERE a.oid = d.objid)
    WHEN 'pg_statistic_ext'::regclass THEN (
      SELECT CASE WHEN x.stxrelid IN (SELECT oid FROM t) THEN NULL
        ELSE ARRAY[x.stxrelid::regclass::text, 'statistics ' || x.stxname] END
      FROM pg_statistic_ext x WHERE x.oid = d.objid)
    WHEN 'pg_publication_rel'::regclass THEN (
      SELECT ARRAY[quote_ident(p.pubname), 'publication'] FROM pg_publication_rel pr
      JOIN pg_publication p ON p.oid = pr.prpubid WHERE pr.oid = d.objid)
    ELSE (SELECT ARRAY[coalesce(o.identity, '?'), coalesce(o.type, '?')]
          FROM pg_identify_object(d.classid, d.objid, 0) o)
  END AS what FROM d
)
SELECT DISTINCT what[1], what[2] FROM described WHERE what IS NOT NULL ORDER BY 1, 2
"""

# The swap's own check, under its locks (the operator's early one may be stale).
_DEPENDENTS_CHECK = (
    "DO $eos$\nDECLARE found text;\nBEGIN\n"  # noqa: S608 -- constants only, values bound by mogrify
    "  SELECT string_agg(d.name || ' (' || d.kind || ')', ', ') INTO found FROM ("
    + _DEPENDENTS_SQL
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


class PgToolsHook(EosPostgresHook):
    """
    Snapshots and restores a pipeline's tables with the PostgreSQL client tools, over the
    bookkeeping hook's connections (:class:`~airflow_provider_eos.hooks.eos_postgres.EosPostgresHook`).

    :param postgres_conn_id: The connection object to use, defaults to "postgres_default"
        (its schema field is the database).
    :param pg_bin_dir: directory holding pg_dump, pg_restore and psql (their
        major version must be >= the server's); default: ``[eos] pg_bin_dir``, else ``PATH``.
    :param lock_timeout: seconds a restore waits for table locks before giving up.
    """

    hook_name = "EOS PostgreSQL tools (pg_dump, pg_restore, psql)"
    # Its psycopg2 sessions and the client tools it runs, as before the two hooks shared a factory.
    application_name = "eos-snapshot"

    def __init__(self, *args: Any, pg_bin_dir: str | None = None, lock_timeout: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pg_bin_dir = pg_bin_dir or provider_config.pg_bin_dir() or ""
        self.lock_timeout = lock_timeout

    def tool_env(self) -> dict[str, str]:
        """Environment for the client tools: the password travels here, never in argv;
        other libpq secrets (``sslpassword``) through a private service file it names."""
        env = dict(os.environ)
        password = self.app_password()
        if password:
            env["PGPASSWORD"] = password
        service_file = self._secret_service_file()
        if service_file:
            env["PGSERVICEFILE"] = service_file
        return env

    def _secrets(self) -> dict[str, Any]:
        """libpq secrets of the connection other than the password (``sslpassword``)."""
        from spark_apps.eos_stream.config import SECRET_LIBPQ_OPTIONS

        params = self.libpq_params()
        return {key: params[key] for key in sorted(SECRET_LIBPQ_OPTIONS - {"password"}) if key in params}

    def _secret_service_file(self) -> str | None:
        """A libpq service file (mode 0600, in a 0700 directory of its own) holding the
        connection's non-password secrets as service ``eos``, for the client tools.
        libpq has no environment variable for ``sslpassword``, and a conninfo on the
        command line is readable by every local user (``/proc/<pid>/cmdline``), so the
        tools get ``service=eos`` there and ``PGSERVICEFILE`` in their environment.
        Removed when the hook is garbage collected or the process exits."""
        secrets = self._secrets()
        if not secrets:
            return None
        if "service" in self.libpq_params():
            raise PgToolError(f"connection {self.get_conn_id()!r} sets both 'service' and {sorted(secrets)}: the "
                              "client tools get those secrets through a service file of their own; move them "
                              "into your service file, or drop 'service' from the connection's extra")
        cached = getattr(self, "_service_dir", None)
        if cached is None:
            cached = tempfile.TemporaryDirectory(prefix="eos-pgservice-")  # 0700
            self._service_dir = cached
        path = Path(cached.name) / "pg_service.conf"
        lines = ["[eos]"] + [f"{key}={value}" for key, value in secrets.items()]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write("\n".join(lines) + "\n")
        return str(path)

    def tool(self, name: str) -> str:
        if self.pg_bin_dir:
            return str(Path(self.pg_bin_dir) / name)
        found = shutil.which(name)
        if not found:
            raise PgToolError(f"{name} not found on PATH; set pg_bin_dir or [eos] pg_bin_dir")
        return found

    def _conn_args(self, dbname: str | None = None) -> list[str]:
        """``-d <conninfo>``: every libpq keyword of the connection (sslmode, sslrootcert, ...)
        reaches the client tools exactly as it reaches psycopg2. Never a secret: the password
        goes in ``PGPASSWORD``, ``sslpassword`` in the service file of ``tool_env``."""
        from spark_apps.eos_stream.config import SECRET_LIBPQ_OPTIONS

        params = {key: value for key, value in self.libpq_params(dbname).items() if key not in SECRET_LIBPQ_OPTIONS}
        if self._secrets():
            params["service"] = "eos"
        return ["-d", make_dsn(**params)]

    @staticmethod
    def normalize(cur: Any) -> None:
        for statement in _NORMALIZE:
            cur.execute(statement)

    # ------------------------------------------------------------------ reading state
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

    def stored_offsets_in(self, conn: PgConnection, meta_schema: str, pipeline: str) -> dict[str, dict[str, int]]:
        """The pipeline's stored offsets as ``conn``'s transaction sees them (a snapshot's replay point)."""
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

    @staticmethod
    def database_identity(conn: PgConnection) -> dict[str, str]:
        """Which database ``conn`` is on: its name and OID, and the cluster's
        ``system_identifier`` (set by initdb, kept by physical replicas and
        backups). Recorded in every manifest; a restore refuses a manifest whose
        identity is not the target's (``snapshot_store.identity_problem``). A role
        that may not call ``pg_control_system()`` records no system identifier."""
        with conn.cursor() as cur:
            cur.execute("SELECT current_database(), oid::text FROM pg_database WHERE datname = current_database()")
            row = cur.fetchone()
            assert row is not None
            identity = {"database": str(row[0]), "database_oid": str(row[1])}
            cur.execute("SAVEPOINT eos_identity")
            try:
                cur.execute("SELECT system_identifier::text FROM pg_control_system()")
                found = cur.fetchone()
                if found and found[0]:
                    identity["system_identifier"] = str(found[0])
                cur.execute("RELEASE SAVEPOINT eos_identity")
            except pg_errors.InsufficientPrivilege:
                cur.execute("ROLLBACK TO SAVEPOINT eos_identity")
        return identity

    # ------------------------------------------------------------------ snapshot
    def dump_consistent(
        self,
        tables: Sequence[TableRef],
        roles: dict[TableRef, str],
        dump_file: str | Path,
        *,
        meta_schema: str,
        pipeline: str,
        lock_key: str | None = None,
        swap_wait_seconds: float = 600.0,
    ) -> ConsistentSnapshot:
        """One ``pg_dump -Fc`` of ``tables`` plus counts, checksums and offsets, all
        from the same exported snapshot.

        :param lock_key: the target's key (``target_lock_key``); the snapshot holds
            its swap lock shared, so it never sees a restore's swap half-way.
        :param swap_wait_seconds: how long to wait for a swap in progress to end.
        """
        if not tables:
            raise AirflowException("nothing to snapshot: no tables")
        timings: dict[str, float] = {}
        started = time.monotonic()
        conn = self.connect()
        try:
            if lock_key:
                self._share_swap_lock(conn, lock_key, swap_wait_seconds)
                timings["swap_lock_wait"] = round(time.monotonic() - started, 3)
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
                offsets = self.stored_offsets_in(conn, meta_schema, pipeline)
                others = self.other_pipelines(conn, meta_schema, pipeline)
                identity = self.database_identity(conn)
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
            identity=identity,
        )

    @staticmethod
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

    # ------------------------------------------------------------------ dependents
    def dependents(self, conn: PgConnection, tables: Iterable[TableRef]) -> list[str]:
        """``schema.name (kind)`` of every object outside ``tables`` that depends on
        one of them (views, foreign keys from other tables, publications, ...)."""
        refs = list(tables)
        with conn.cursor() as cur:
            cur.execute(_DEPENDENTS_SQL, {"schemas": [s for s, _ in refs], "tables": [t for _, t in refs]})
            return [f"{name} ({kind})" for name, kind in cur.fetchall()]

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
                drop_old: bool = True, *, before_commit: Callable[[], Any] | None = None,
                allow_dependents: bool = False, lock_key: str | None = None,
                changed_by: str = "eos-restore", reuse_aside: bool = False,
                extra_tables: Sequence[TableRef] = ()) -> dict[str, Any]:
        """Replaces the snapshot's tables in the target database in ONE transaction.

        psql runs the transaction, Python decides how it ends: it sends ``BEGIN``,
        the prelude, the dump's restore script (``pg_restore -f -``), the postlude
        and an ``\\echo`` marker. Once psql echoes the marker every statement has
        succeeded; ``before_commit`` runs (the restore re-checks Kafka retention
        there), and only then is ``COMMIT`` sent (``ROLLBACK`` when it raised).

        * prelude: the target's swap lock, exclusive (snapshots in progress end
          first, none starts until the transaction ends); the pipeline's lock and
          an epoch bump (a driver that still runs is fenced at its next batch);
          unless ``allow_dependents``, a check that nothing outside the pipeline's
          tables depends on them; every table's owner and ACL into a temp table;
          ``CREATE SCHEMA aside``, whose comment records the restore (pipeline,
          snapshot, each table and its schema: what a rollback needs); then
          ``ALTER TABLE .. SET SCHEMA aside`` for every table (indexes,
          constraints and owned sequences move along);
        * the dump's DDL and COPY data recreate the tables;
        * postlude: grants and owners back on the restored tables, every count
          and checksum against the manifest (raises on any difference), and with
          ``drop_old`` the drop of the aside schema.

        Any error, or ``before_commit`` raising, rolls everything back: the target
        is never half-restored. A crash before COMMIT was sent leaves the old state
        (the server rolls back a transaction whose client went away).

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
            (None when dropped), the new ``epoch`` and ``warnings`` (owners that
            could not be given back).
        :raises DependentObjectsError: other objects depend on the tables.
        :raises SnapshotValidationError: the restored tables differ from the manifest.
        """
        started = time.monotonic()
        key = lock_key or target_lock_key(self.dbname, manifest.target_schema, manifest.pipeline)
        conn = self.connect()
        try:
            prelude = self._prelude(conn, manifest, aside_schema, key, changed_by, allow_dependents, reuse_aside,
                                    list(extra_tables))
            postlude = self._postlude(conn, manifest, aside_schema if drop_old else None)
        finally:
            conn.close()
        outcome = self._psql_transaction(prelude, dump_file, postlude, before_commit)
        return {"swap_seconds": round(time.monotonic() - started, 3),
                "before_commit_seconds": outcome["before_commit_seconds"],
                "aside_schema": None if drop_old else aside_schema,
                "epoch": outcome["epoch"], "warnings": outcome["warnings"]}

    def _psql_transaction(self, prelude: str, dump_file: str | Path, postlude: str,
                          before_commit: Callable[[], Any] | None) -> dict[str, Any]:
        """Feeds psql one transaction and commits it only after ``before_commit`` passed."""
        token = uuid.uuid4().hex
        ready, committed = f"eos-swap-ready-{token}", f"eos-swap-committed-{token}"
        restore = subprocess.Popen(
            [self.tool("pg_restore"), "--no-owner", "--no-privileges", "-f", "-", str(dump_file)],
            env=self.tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        psql = subprocess.Popen(
            [self.tool("psql"), *self._conn_args(), "-X", "-q", "--no-password", "-v", "ON_ERROR_STOP=1", "-f", "-"],
            env=self.tool_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        assert restore.stdout is not None and restore.stderr is not None
        assert psql.stdin is not None and psql.stdout is not None and psql.stderr is not None
        out, err, restore_err = _Lines(psql.stdout), _Lines(psql.stderr), _Lines(restore.stderr)
        try:
            try:
                psql.stdin.write(("BEGIN;\n" + prelude).encode())
                shutil.copyfileobj(restore.stdout, psql.stdin, 1 << 20)
                # :eos_epoch was set by the prelude's \gset; the marker proves every statement before it passed.
                psql.stdin.write((postlude + f"\\echo {ready} :eos_epoch\n").encode())
                psql.stdin.flush()
            except BrokenPipeError:
                pass  # psql stopped at an error (ON_ERROR_STOP); its stderr says which
            restore.stdout.close()
            restore.wait()
            line = out.wait_for(ready)
            if line is None or restore.returncode != 0:
                self._end_psql(psql, "ROLLBACK;\n")
                if restore.returncode != 0:
                    raise PgToolError(f"pg_restore could not read the dump ({restore.returncode}): "
                                      f"{_tail(restore_err.text())}; rolled back, the target was not changed")
                raise self._swap_error(err.text())
            epoch = int(line.split()[-1]) if line.split()[-1].isdigit() else None
            clock = time.monotonic()
            try:
                if before_commit is not None:
                    before_commit()
            except BaseException:
                self._end_psql(psql, "ROLLBACK;\n")
                raise
            waited = round(time.monotonic() - clock, 3)
            self._end_psql(psql, f"COMMIT;\n\\echo {committed}\n")
            if psql.returncode != 0 or out.wait_for(committed) is None:
                raise PgToolError(f"the swap's COMMIT failed and was rolled back: {_tail(err.text())}")
            return {"epoch": epoch, "before_commit_seconds": waited, "warnings": err.matching("eos-restore:")}
        finally:
            for child in (psql, restore):
                if child.poll() is None:
                    child.kill()  # the server rolls back the open transaction of a client that went away
                    child.wait()

    @staticmethod
    def _end_psql(psql: subprocess.Popen, command: str) -> None:
        assert psql.stdin is not None
        try:
            psql.stdin.write(command.encode())
            psql.stdin.close()
        except BrokenPipeError:
            pass
        psql.wait()

    @staticmethod
    def _swap_error(stderr: str) -> AirflowException:
        message = _tail(stderr)
        if "eos-restore: validation failed" in message:
            return SnapshotValidationError(f"restored tables do not match the manifest, rolled back: {message}")
        found = re.search(r"eos-restore: dependents: (.*)", message)
        if found:
            return DependentObjectsError(
                f"objects outside the pipeline's tables depend on them: {found.group(1).strip()}. A swap would "
                "leave them on the old tables; drop or move them first, or set allow_dependents. Rolled back.")
        return PgToolError(f"restore transaction failed and was rolled back: {message}")

    def _prelude(self, conn: PgConnection, manifest: SnapshotManifest, aside: str, lock_key: str,
                 changed_by: str, allow_dependents: bool, reuse_aside: bool = False,
                 extra_tables: Sequence[TableRef] = ()) -> str:
        from spark_apps.eos_stream import fencing, meta_tables

        schemas, tables = [t.schema for t in manifest.tables], [t.table for t in manifest.tables]
        parts = [s + ";" for s in _NORMALIZE]
        with conn.cursor() as cur:
            def render(query: Any, args: Any = None) -> str:
                return cur.mogrify(query, args).decode()

            parts.append(render("SET lock_timeout = %s;", (f"{int(self.lock_timeout * 1000)}ms",)))
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
        extras = self._extras(conn, manifest, extra_tables)
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

    def _extras(self, conn: PgConnection, manifest: SnapshotManifest,
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
            _REGRANT
            + normalize
            + "DO $eos$\nDECLARE n bigint; s text; problems text := '';\nBEGIN\n"
            + body
            + "  IF problems <> '' THEN\n    RAISE EXCEPTION 'eos-restore: validation failed: %', problems;\n"
            "  END IF;\nEND\n$eos$;\n"
            + (sql.SQL("DROP SCHEMA {} CASCADE;\n").format(sql.Identifier(drop_schema)).as_string(conn)
               if drop_schema else "")
        )

    # ------------------------------------------------------------------ after a swap: finalize or roll back
    def aside_record(self, conn: PgConnection, aside: str) -> dict[str, Any] | None:
        """The restore record in an aside schema's comment: None when the schema does
        not exist, ``{}`` when it has no record (a schema of an older version)."""
        with conn.cursor() as cur:
            cur.execute("SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %s", (aside,))
            row = cur.fetchone()
        if row is None:
            return None
        try:
            data = json.loads(row[0] or "")
        except ValueError:
            return {}
        return data if isinstance(data, dict) and data.get("marker") == ASIDE_MARKER else {}

    def _own_aside(self, conn: PgConnection, aside: str, target_schema: str, pipeline: str) -> dict[str, Any] | None:
        """The aside's record, after checking it is one a restore of this target made
        (its name, and its record when it has one): nothing else is ever dropped."""
        if aside_created(target_schema, aside) is None:
            raise AsideSchemaError(f"{aside!r} is not an aside schema of a restore of {target_schema!r} "
                                   f"(expected {target_schema[:40]}_old_<yyyymmddThhmmss>)")
        record = self.aside_record(conn, aside)
        if record and (record.get("target_schema"), record.get("pipeline")) != (target_schema, pipeline):
            raise AsideSchemaError(f"aside schema {aside!r} holds a restore of {record.get('target_schema')!r} "
                                   f"pipeline {record.get('pipeline')!r}, not of {target_schema!r} {pipeline!r}")
        return record

    def kept_aside_of_run(self, target_schema: str, pipeline: str, run: str) -> str | None:
        """The aside schema an earlier restore of ``run`` kept and nobody rolled back or
        dropped yet (the oldest, should there be several): the state before that run."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s) ORDER BY 1",
                            (f"{target_schema[:40]}_old_",))
                names = [r[0] for r in cur.fetchall() if aside_created(target_schema, r[0])]
            for name in names:
                record = self.aside_record(conn, name) or {}
                if (record.get("run"), record.get("target_schema"), record.get("pipeline")) == (
                        run, target_schema, pipeline) and not record.get("rolled_back_at"):
                    return name
            return None
        finally:
            conn.close()

    def finalize_aside(self, aside: str, target_schema: str, pipeline: str,
                       allow_dependents: bool = False) -> dict[str, Any]:
        """Drops a restore's aside schema (the old tables) once the recovery succeeded.

        Idempotent: a schema that is gone was finalized already.

        :raises DependentObjectsError: objects outside the aside schema depend on its
            tables (views or foreign keys left on the old tables by an
            ``allow_dependents`` restore); CASCADE would drop them. Set ``allow_dependents``.
        """
        conn = self.connect()
        try:
            record = self._own_aside(conn, aside, target_schema, pipeline)
            if record is None:
                return {"aside_schema": aside, "dropped": False, "reason": "does not exist (finalized already)"}
            found = self.dependents(conn, [(aside, t) for t in self.list_tables(conn, aside)])
            if found and not allow_dependents:
                raise DependentObjectsError(
                    f"objects outside {aside!r} depend on its old tables: {', '.join(found)}; dropping it would "
                    "drop them too (CASCADE). Recreate them on the restored tables, or set allow_dependents.")
            with conn.cursor() as cur:
                cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(self.lock_timeout * 1000)}ms",))
                cur.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(aside)))
            conn.commit()
            return {"aside_schema": aside, "dropped": True, "dependents_dropped": found}
        finally:
            conn.close()

    def sweep_asides(self, target_schema: str, pipeline: str, older_than_days: float,
                     keep: Iterable[str] = ()) -> dict[str, list[str]]:
        """Drops this target's aside schemas older than ``older_than_days`` (by the time
        in their name). Only names ``aside_schema_name`` makes for this target, and
        whose record (if any) names this target; one with outside dependents is kept."""
        cutoff = utc_now().timestamp() - older_than_days * 86400
        swept: dict[str, list[str]] = {"dropped": [], "kept_with_dependents": []}
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s) ORDER BY 1",
                            (f"{target_schema[:40]}_old_",))
                names = [r[0] for r in cur.fetchall()]
            conn.rollback()
        finally:
            conn.close()
        for name in names:
            created = aside_created(target_schema, name)
            if name in set(keep) or created is None or created.timestamp() >= cutoff:
                continue
            try:
                result = self.finalize_aside(name, target_schema, pipeline)
            except DependentObjectsError:
                swept["kept_with_dependents"].append(name)
                continue
            except AsideSchemaError:
                continue  # another target's schema with a name like ours
            if result["dropped"]:
                swept["dropped"].append(name)
        return swept

    def rollback_swap(self, aside: str, target_schema: str, pipeline: str, *, lock_key: str | None = None,
                      changed_by: str = "eos-rollback") -> dict[str, Any]:
        """Puts the state a restore replaced back, in ONE transaction.

        Under the swap lock and the pipeline's lock, with an epoch bump: the
        restored tables are dropped and the aside tables (the old state, with
        their owners, grants, indexes and sequences) moved back to the schemas
        the aside record names. The emptied aside schema stays, its record marked
        ``rolled_back_at``, so that a rerun knows it is done (finalize or the
        retention sweep drops it).

        :raises AsideSchemaError: the schema is gone (finalized: nothing to go back
            to), is not this target's, or has no restore record.
        """
        from spark_apps.eos_stream import fencing, meta_tables

        key = lock_key or target_lock_key(self.dbname, target_schema, pipeline)
        conn = self.connect()
        try:
            record = self._own_aside(conn, aside, target_schema, pipeline)
            if record is None:
                raise AsideSchemaError(f"aside schema {aside!r} does not exist: the old state was dropped "
                                       "(finalized or never kept); there is nothing to roll back to")
            if not record:
                raise AsideSchemaError(f"aside schema {aside!r} has no restore record (made by an older "
                                       "version): move its tables back by hand")
            if record.get("rolled_back_at"):
                return {"aside_schema": aside, "rolled_back": False,
                        "already_rolled_back_at": record["rolled_back_at"]}
            meta_schema = str(record["meta_schema"])
            with conn.cursor() as cur:
                cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(self.lock_timeout * 1000)}ms",))
                cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (swap_lock_key(key),))
                fencing.lock_pipeline(cur, pipeline)
                for statement in meta_tables.epochs_ddl_statements(meta_schema):
                    cur.execute(statement)
                cur.execute(fencing.bump_epoch_statement(meta_schema), {
                    "pipeline": pipeline, "by": changed_by, "reason": f"rollback of restore {aside}"})
                epoch = int((cur.fetchone() or (0,))[0])
                kept = set(self.list_tables(conn, aside))
                tables = [(str(s), str(t)) for s, t in record["tables"]]
                cur.execute("SELECT s, t FROM unnest(%s::text[], %s::text[]) AS m(s, t)"
                            " WHERE to_regclass(format('%%I.%%I', s, t)) IS NOT NULL",
                            ([s for s, _ in tables], [t for _, t in tables]))
                restored = [(r[0], r[1]) for r in cur.fetchall()]
                if restored:
                    # One statement, no CASCADE: foreign keys among them go together, anything
                    # else built on the restored tables since makes the rollback fail, not vanish.
                    cur.execute(sql.SQL("DROP TABLE {}").format(sql.SQL(", ").join(
                        sql.SQL("{}.{}").format(sql.Identifier(s), sql.Identifier(t)) for s, t in restored)))
                moved = []
                for schema, table in tables:
                    if table in kept:
                        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
                        cur.execute(sql.SQL("ALTER TABLE {}.{} SET SCHEMA {}").format(
                            sql.Identifier(aside), sql.Identifier(table), sql.Identifier(schema)))
                        moved.append(f"{schema}.{table}")
                refilled = self._put_extras_back(cur, aside, record.get("extras") or [], kept)
                done = {**record, "rolled_back_at": utc_now().isoformat(), "rollback_epoch": epoch}
                cur.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
                    sql.Identifier(aside), sql.Literal(json.dumps(done))))
            conn.commit()
            return {"aside_schema": aside, "rolled_back": True, "epoch": epoch,
                    "snapshot_id": record.get("snapshot_id"),
                    "restored_dropped": [f"{s}.{t}" for s, t in restored], "moved_back": moved,
                    "refilled": refilled, "left_in_aside": sorted(set(self.list_tables(conn, aside)))}
        finally:
            conn.close()


    @staticmethod
    def _put_extras_back(cur: Any, aside: str, extras: list[Any], kept: set[str]) -> list[str]:
        """The rollback's part for tables the snapshot did not hold (the swap's ``extras``):
        each gets back exactly the rows its copy in the aside schema kept (TRUNCATE, no
        CASCADE, then the copy's rows; generated columns are computed again, identity
        values kept), so whatever the replay wrote into it is gone. A table that did not
        exist at the swap is dropped again (no CASCADE). Returns what it did, one line each."""
        done = []
        for schema, table, copy in extras:
            target = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))
            if not copy:
                cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(target))
                done.append(f"{schema}.{table}: dropped (it did not exist before the restore)")
                continue
            if copy not in kept:
                raise AsideSchemaError(f"the copy {aside}.{copy} of {schema}.{table} is missing from the aside "
                                       "schema: its rows from before the restore cannot be put back")
            cur.execute("SELECT to_regclass(%s)", (target.as_string(cur),))
            if (cur.fetchone() or (None,))[0] is None:
                # Dropped since the restore: the copy (rows only, no indexes) takes its place.
                cur.execute(sql.SQL("ALTER TABLE {}.{} SET SCHEMA {}").format(
                    sql.Identifier(aside), sql.Identifier(copy), sql.Identifier(schema)))
                cur.execute(sql.SQL("ALTER TABLE {}.{} RENAME TO {}").format(
                    sql.Identifier(schema), sql.Identifier(copy), sql.Identifier(table)))
                done.append(f"{schema}.{table}: recreated from its copy (it had been dropped)")
                continue
            cur.execute("SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0"
                        " AND NOT attisdropped AND attgenerated = '' ORDER BY attnum", (target.as_string(cur),))
            columns = sql.SQL(", ").join(sql.Identifier(r[0]) for r in cur.fetchall())
            cur.execute(sql.SQL("TRUNCATE {}").format(target))
            cur.execute(sql.SQL("INSERT INTO {} ({}) OVERRIDING SYSTEM VALUE SELECT {} FROM {}.{}").format(
                target, columns, columns, sql.Identifier(aside), sql.Identifier(copy)))
            rows = cur.rowcount
            cur.execute(sql.SQL("DROP TABLE {}.{}").format(sql.Identifier(aside), sql.Identifier(copy)))
            done.append(f"{schema}.{table}: {rows} rows back from before the restore")
        return done


def _pattern(schema: str, table: str) -> str:
    """A pg_dump -t pattern matching exactly one table (double quotes make it literal)."""
    return '"{}"."{}"'.format(schema.replace('"', '""'), table.replace('"', '""'))


def _tail(text: str | None, limit: int = 1500) -> str:
    text = (text or "").strip()
    return text[-limit:] if text else "(no output)"


def utc_now() -> datetime:
    return datetime.now(timezone.utc)
