"""The provider's PostgreSQL hook: its one connection factory, and the pipelines' bookkeeping
(offsets, progress, dead letters, stop requests, the running, supervisor and recovery locks,
the health check's LSO watch) and the database's in-doubt prepared transactions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg2
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection
from psycopg2.extras import RealDictCursor

from airflow_provider_eos.utils.lso_watch import StoredPartition
from spark_apps.eos_stream.kafka.partitions import TopicPartition as TopicPartitionKey
from spark_apps.eos_stream.sink.postgres import TCP_KEEPALIVES, with_keepalives
from spark_apps.eos_stream.state import meta_tables

# Extra keys of a postgres connection that are Airflow's, not libpq's.
_NON_LIBPQ_EXTRAS = frozenset(
    {"iam", "redshift", "redshift-serverless", "cursor", "cluster-identifier", "workgroup-name", "aws_conn_id",
     "azure_conn_id", "enable_log_db_messages", "sqlalchemy_scheme", "sqlalchemy_query", "sqlalchemy_options"}
)


def supervisor_lock_key(meta_schema: str, pipeline: str) -> str:
    """The advisory lock a StreamingPipelineOperator holds while it supervises the pipeline."""
    return f"eos-supervisor:{meta_schema}:{pipeline}"


# The recovery locks' table, in each pipeline's meta schema (see recovery/lock.py).
LOCK_TABLE = "recovery_locks"


def lock_table(meta_schema: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(meta_schema), sql.Identifier(LOCK_TABLE))


class EosPostgresHook(PostgresHook):
    """
    Reads and writes the bookkeeping tables of the eos streaming app in the target database.

    It opens psycopg2 connections from the Airflow connection (``psycopg2.sql`` identifiers are
    used throughout; the parent hook may be on psycopg 3), and never logs the password.

    :param postgres_conn_id: The connection object to use, defaults to "eos_postgres"; its schema
        field is the database name.
    :param meta_schema: schema of the bookkeeping tables (the app's ``meta_schema``). Bound once:
        no method takes it again. Required for every method that reads or writes the bookkeeping
        tables or the locks named after it; a hook built without it (for ``connect``,
        ``app_target`` or ``prepared_transactions``) refuses those instead of guessing a schema.
    """

    default_conn_name = "eos_postgres"
    hook_name = "EOS Postgres"
    # What its sessions are called in pg_stat_activity (a subclass names its own).
    application_name = "airflow-eos"

    def __init__(self, *args: Any, meta_schema: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("postgres_conn_id", self.default_conn_name)
        super().__init__(*args, **kwargs)
        self._meta_schema = meta_schema

    @property
    def meta_schema(self) -> str:
        """The pipeline's bookkeeping schema this hook was built for.

        :raises ValueError: it was built without one (no silent default: a wrong schema would
            read another pipeline's bookkeeping, or none, without an error)."""
        if not self._meta_schema:
            raise ValueError(f"{type(self).__name__} of connection {self.get_conn_id()!r} was built without a "
                             "meta_schema: pass the pipeline's meta_schema when building it")
        return self._meta_schema

    # ------------------------------------------------------------------ connections
    # The one connection factory of the provider's PostgreSQL hooks (PgToolsHook builds on it).
    def libpq_params(self, dbname: str | None = None, include_password: bool = False) -> dict[str, Any]:
        """libpq keyword arguments from the Airflow connection, its libpq extras (sslmode, ...)
        included; the password only when asked for, for a connection of this process."""
        conn = self.get_connection(self.get_conn_id())
        if not conn.host:
            # No silent default host: the target must be named in the connection.
            raise ValueError(f"connection {self.get_conn_id()!r} has no host")
        params: dict[str, Any] = {
            "host": conn.host,
            "port": int(conn.port or 5432),
            "dbname": dbname or self.database or conn.schema or "postgres",
            "user": conn.login or "postgres",
        }
        if include_password and conn.password:
            params["password"] = conn.password
        for key, value in (conn.extra_dejson or {}).items():
            if key not in _NON_LIBPQ_EXTRAS and not key.startswith("sqlalchemy"):
                params[key] = value
        params.setdefault("application_name", self.application_name)
        params.setdefault("connect_timeout", 10)
        # Under the extras: a vanished worker's session, and its advisory locks, end within
        # about a minute (sink/postgres.py, docs/deployment.md); the connection's own win.
        return with_keepalives(params)

    @property
    def dbname(self) -> str:
        return str(self.libpq_params()["dbname"])

    def app_target(self) -> dict[str, Any]:
        """The app config's ``postgres`` section: host, port, dbname, user and the connection's
        other libpq keywords (sslmode, ...) as ``options``; never the password.

        :raises ValueError: when the connection carries ``sslpassword``, which has no safe way
            to the app's executors (it would have to sit in the config file).
        """
        params = self.libpq_params()
        if "sslpassword" in params:
            raise ValueError(f"connection {self.get_conn_id()!r}: sslpassword is not supported for the "
                             "streaming app; use an unencrypted client key file readable by the job only")
        named = ("host", "port", "dbname", "user")
        extras = self.get_connection(self.get_conn_id()).extra_dejson or {}
        # The app names its own sessions and sets its own connect timeout and keepalives
        # (PostgresTarget.dsn_kwargs); only what the connection sets itself goes along.
        options = {key: value for key, value in params.items()
                   if key not in named and key not in ("application_name", "connect_timeout")
                   and (key not in (*TCP_KEEPALIVES, "options") or key in extras)}
        if "options" in extras:
            options["options"] = extras["options"]
        return {**{key: params[key] for key in named}, "options": options}

    def app_password(self) -> str | None:
        """The password, for the app's ``EOS_PG_PASSWORD`` environment variable only."""
        return self.get_connection(self.get_conn_id()).password or None

    def connect(self, dbname: str | None = None, application_name: str | None = None,
                autocommit: bool = False) -> PgConnection:
        """A psycopg2 connection (psycopg2's default: statements run in a transaction until commit)."""
        params = self.libpq_params(dbname, include_password=True)
        if application_name:
            params["application_name"] = application_name
        conn = psycopg2.connect(**params)
        conn.autocommit = autocommit
        return conn

    @contextlib.contextmanager
    def cursor(self) -> Iterator[RealDictCursor]:
        conn = self.connect(autocommit=True)
        try:
            with conn.cursor(cursor_factory=RealDictCursor) as cur:
                yield cur
        finally:
            conn.close()

    def _table(self, name: str) -> sql.Composed:
        return meta_tables.table(self.meta_schema, name)

    def _exists(self, cur: Any, name: str) -> bool:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL AS present",
                    (sql.SQL("{}.{}").format(sql.Identifier(self.meta_schema), sql.Identifier(name))
                     .as_string(cur),))
        return bool(cur.fetchone()["present"])

    def ensure_meta_tables(self) -> None:
        """Creates the bookkeeping tables if missing (the app does the same at start)."""
        with self.cursor() as cur:
            for statement in meta_tables.ddl_statements(self.meta_schema):
                cur.execute(statement)

    # ------------------------------------------------------------------ reads
    def stored_offsets(self, pipeline: str) -> dict[TopicPartitionKey, int]:
        """``next_offset`` per (topic, partition) the pipeline has applied (empty before its first batch)."""
        return {(row["topic"], int(row["partition"])): int(row["next_offset"])
                for row in self.committed_offsets(pipeline)}

    def committed_offsets(self, pipeline: str) -> list[dict[str, Any]]:
        """The pipeline's offsets rows (topic, partition, next_offset, batch_id): what its target holds."""
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.OFFSETS):
                return []
            cur.execute(
                sql.SQL("SELECT topic, partition, next_offset, batch_id FROM {} WHERE pipeline = %s"
                        " ORDER BY topic, partition").format(self._table(meta_tables.OFFSETS)),
                (pipeline,),
            )
            return [dict(row) for row in cur.fetchall()]

    def latest_progress(self, pipeline: str) -> dict[str, Any] | None:
        """The newest progress row, with ``age_seconds`` measured by the database clock."""
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.PROGRESS):
                return None
            cur.execute(
                sql.SQL(
                    "SELECT run_id, batch_id, input_rows, start_offsets, end_offsets, batch_duration_ms,"
                    " recorded_at, EXTRACT(EPOCH FROM (now() - recorded_at))::float8 AS age_seconds"
                    " FROM {} WHERE pipeline = %s ORDER BY recorded_at DESC, batch_id DESC LIMIT 1"
                ).format(self._table(meta_tables.PROGRESS)),
                (pipeline,),
            )
            row = cur.fetchone()
        if row is None:
            return None
        out = dict(row)
        out["recorded_at"] = out["recorded_at"].isoformat()
        return out

    def progress_since(self, pipeline: str, since: Any) -> int:
        """Number of progress rows recorded after ``since`` (a timestamp)."""
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.PROGRESS):
                return 0
            cur.execute(
                sql.SQL("SELECT count(*) AS n FROM {} WHERE pipeline = %s AND recorded_at > %s").format(
                    self._table(meta_tables.PROGRESS)),
                (pipeline, since),
            )
            return int(cur.fetchone()["n"])

    def dead_letters_since(self, pipeline: str, after_id: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """Dead letters with ``id > after_id``, oldest first (key/value shortened to a preview)."""
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.DEAD_LETTERS):
                return []
            cur.execute(
                sql.SQL(
                    'SELECT id, topic, partition, "offset", error, quarantined_at,'
                    " convert_from(substring(key FROM 1 FOR 64), 'SQL_ASCII') AS key_preview"
                    " FROM {} WHERE pipeline = %s AND id > %s ORDER BY id LIMIT %s"
                ).format(self._table(meta_tables.DEAD_LETTERS)),
                (pipeline, int(after_id), int(limit)),
            )
            rows = [dict(row) for row in cur.fetchall()]
        for row in rows:
            row["quarantined_at"] = row["quarantined_at"].isoformat()
        return rows

    def max_dead_letter_id(self, pipeline: str) -> int:
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.DEAD_LETTERS):
                return 0
            cur.execute(
                sql.SQL("SELECT coalesce(max(id), 0) AS id FROM {} WHERE pipeline = %s").format(
                    self._table(meta_tables.DEAD_LETTERS)),
                (pipeline,),
            )
            return int(cur.fetchone()["id"])

    def prepared_transactions(self, older_than_seconds: float = 0, all_databases: bool = False
                              ) -> list[dict[str, Any]]:
        """In-doubt two-phase transactions (``pg_prepared_xacts``) older than ``older_than_seconds``.

        They hold their locks until someone runs COMMIT/ROLLBACK PREPARED.

        :param all_databases: include other databases of the cluster (default: the connection's).
        """
        with self.cursor() as cur:
            cur.execute(
                "SELECT gid, prepared, owner, database,"
                " EXTRACT(EPOCH FROM (now() - prepared))::float8 AS age_seconds"
                " FROM pg_prepared_xacts"
                " WHERE prepared < now() - make_interval(secs => %s)"
                " AND (%s OR database = current_database()) ORDER BY prepared",
                (float(older_than_seconds), bool(all_databases)),
            )
            rows = [dict(row) for row in cur.fetchall()]
        for row in rows:
            row["prepared"] = row["prepared"].isoformat()
        return rows

    # ------------------------------------------------------------------ stop requests
    # ------------------------------------------------------------------ stream state, stop requests, recovery locks
    def list_tables(self, conn: PgConnection, schema: str) -> list[str]:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY 1",
                (schema,),
            )
            return [r[0] for r in cur.fetchall()]

    def try_running_lock(self, pipeline: str) -> PgConnection | None:
        """The pipeline's running lock on a connection of its own, or None when a
        driver holds it. While the connection stays open no driver can start (a
        starting driver waits for the lock, then exits); closing it releases it."""
        from spark_apps.eos_stream.state.control import running_lock_key

        conn = self.connect(application_name="eos-recovery")
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (running_lock_key(pipeline),))
                got = bool((cur.fetchone() or (False,))[0])
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            return None
        return conn

    def stream_activity(self, pipeline: str) -> dict[str, Any]:
        """Whether a driver of the pipeline is connected (its running lock), whether a
        supervisor (StreamingPipelineOperator) holds it, when it last recorded progress and
        whether a stop is requested."""
        from spark_apps.eos_stream.state.control import advisory_lock_held, driver_running

        meta_schema = self.meta_schema
        conn = self.connect()
        try:
            running = driver_running(conn, pipeline)
            with conn.cursor() as cur:
                result: dict[str, Any] = {"driver_running": running, "last_progress_at": None,
                                          "supervisor_running": advisory_lock_held(
                                              conn, supervisor_lock_key(meta_schema, pipeline)),
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

    def set_stop_request(self, pipeline: str, requested: bool, by: str = "eos-recovery") -> str | None:
        """Sets (the app stops at its next batch boundary, a supervisor does not restart it) or
        clears (before a launch: an old request would stop the new run at once) the pipeline's
        stop request in the control table. Returns the request's time (ISO), None when cleared."""
        meta_schema = self.meta_schema
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                for statement in meta_tables.ddl_statements(meta_schema):
                    cur.execute(statement)
                cur.execute(
                    sql.SQL("INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, {}, %s)"
                            " ON CONFLICT (pipeline) DO UPDATE SET stop_requested_at = EXCLUDED.stop_requested_at,"
                            " requested_by = EXCLUDED.requested_by RETURNING stop_requested_at").format(
                        meta_tables.table(meta_schema, meta_tables.CONTROL),
                        sql.SQL("now()" if requested else "NULL")),
                    (pipeline, by),
                )
                at = (cur.fetchone() or (None,))[0]
            conn.commit()
            return at.isoformat() if at else None
        finally:
            conn.close()

    def acquire_lock(self, key: str, holder: str, ttl_seconds: float) -> dict[str, Any]:
        """Takes the recovery lock row for ``key``, or refreshes it for its holder.

        Re-entrant: the same holder (a DAG run id) gets it again, so a cleared or
        rerun task of that run goes on. A row whose heartbeat is older than
        ``ttl_seconds`` belonged to a run that died without its teardown, and is
        taken over. Returns ``acquired`` and the holder row; ``taken_over_from``
        names the dead holder when there was one."""
        meta_schema = self.meta_schema
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                table = lock_table(meta_schema)
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

    def heartbeat_lock(self, key: str, holder: str) -> bool:
        """Marks the holder alive; False when the lock is no longer its own."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("UPDATE {} SET heartbeat_at = now() WHERE lock_key = %s AND holder = %s")
                            .format(lock_table(self.meta_schema)), (key, holder))
                alive = cur.rowcount > 0
            conn.commit()
            return alive
        finally:
            conn.close()

    def release_lock(self, key: str, holder: str) -> bool:
        meta_schema = self.meta_schema
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT to_regclass(%s)", (f'"{meta_schema}"."{LOCK_TABLE}"',))
                if (cur.fetchone() or (None,))[0] is None:
                    return False
                cur.execute(sql.SQL("DELETE FROM {} WHERE lock_key = %s AND holder = %s").format(
                    lock_table(meta_schema)), (key, holder))
                released = cur.rowcount > 0
            conn.commit()
            return released
        finally:
            conn.close()


    def stop_requested_at(self, pipeline: str) -> str | None:
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.CONTROL):
                return None
            cur.execute(
                sql.SQL("SELECT stop_requested_at FROM {} WHERE pipeline = %s").format(
                    self._table(meta_tables.CONTROL)),
                (pipeline,),
            )
            row = cur.fetchone()
        return row["stop_requested_at"].isoformat() if row and row["stop_requested_at"] else None

    # ------------------------------------------------------------------ supervisor lock
    # A session-level advisory lock held by the StreamingPipelineOperator while it
    # supervises a pipeline: it keeps two supervisors off one pipeline, and lets a
    # StopPipelineOperator on another host see when the supervisor has ended.
    # Key: hashtextextended(supervisor_lock_key(meta_schema, pipeline), 0).

    def acquire_supervisor_lock(self, pipeline: str) -> PgConnection | None:
        """Takes the pipeline's supervisor lock; returns the connection that holds it (close it to
        release), or None when another session holds it."""
        conn = self.connect(autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                            (supervisor_lock_key(self.meta_schema, pipeline),))
                row = cur.fetchone()
        except Exception:
            conn.close()
            raise
        if row is None or not row[0]:
            conn.close()
            return None
        return conn

    def supervisor_running(self, pipeline: str) -> bool:
        """Whether some session holds the pipeline's supervisor lock (as seen in pg_locks)."""
        return self._advisory_lock_held(supervisor_lock_key(self.meta_schema, pipeline))

    def driver_running(self, pipeline: str) -> bool:
        """Whether a driver of the pipeline is connected: every app holds its running
        lock for its lifetime, whoever started it (see ``spark_apps.eos_stream.state.control``)."""
        from spark_apps.eos_stream.state.control import running_lock_key

        return self._advisory_lock_held(running_lock_key(pipeline))

    def running_lock_holder(self, pipeline: str) -> dict[str, Any] | None:
        """Who holds the pipeline's running lock: the backend's ``pid``, ``application_name``,
        ``client_addr``, ``client_port``, ``backend_start`` and ``age_seconds``; None when no
        driver is connected. For logs: the backend pid is the database's, not the driver's."""
        from spark_apps.eos_stream.state.control import ADVISORY_LOCK_HOLDERS_SQL, running_lock_key

        with self.cursor() as cur:
            cur.execute(
                sql.SQL(
                    "SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr, a.client_port,"
                    " a.backend_start, EXTRACT(EPOCH FROM (now() - a.backend_start))::float8 AS age_seconds"
                    " FROM pg_stat_activity a WHERE a.pid IN ({}) LIMIT 1"
                ).format(ADVISORY_LOCK_HOLDERS_SQL),
                {"key": running_lock_key(pipeline)},
            )
            row = cur.fetchone()
        if row is None:
            return None
        out = dict(row)
        out["backend_start"] = out["backend_start"].isoformat() if out["backend_start"] else None
        return out

    def recovery_hold(self, pipeline: str, target_schema: str, ttl_seconds: float) -> dict[str, Any] | None:
        """The live recovery of the pipeline's target, or None.

        A recovery holds its row ``<database>/<target_schema>/<pipeline>`` in
        ``<meta_schema>.recovery_locks`` (see ``airflow_provider_eos.recovery.lock``) and
        heartbeats it; a row whose heartbeat is older than ``ttl_seconds`` belongs to a
        dead run and holds nothing. Returns ``holder``, ``acquired_at``, ``heartbeat_at``
        and ``heartbeat_age_seconds`` (database clock)."""
        with self.cursor() as cur:
            if not self._exists(cur, LOCK_TABLE):
                return None
            cur.execute(
                sql.SQL(
                    "SELECT holder, acquired_at, heartbeat_at,"
                    " EXTRACT(EPOCH FROM (now() - heartbeat_at))::float8 AS heartbeat_age_seconds"
                    " FROM {} WHERE lock_key = current_database() || '/' || %s || '/' || %s"
                    " AND heartbeat_at >= now() - make_interval(secs => %s)"
                ).format(self._table(LOCK_TABLE)),
                (target_schema, pipeline, float(ttl_seconds)),
            )
            row = cur.fetchone()
        if row is None:
            return None
        out = dict(row)
        for key in ("acquired_at", "heartbeat_at"):
            out[key] = out[key].isoformat()
        return out

    # ------------------------------------------------------------------ health check's LSO watch
    # Ages, not times, cross this boundary: load_lso_watch returns for how long each partition has
    # been stuck as the database's clock sees it, and save_lso_watch writes now() - age, so the
    # stored times are on the database's clock whatever the clocks of the workers are.
    def _ensure_lso_watch(self, cur: Any) -> None:
        for statement in meta_tables.lso_watch_ddl_statements(self.meta_schema):
            cur.execute(statement)

    def load_lso_watch(self, pipeline: str) -> list[StoredPartition]:
        """The partitions the pipeline's last health check left stuck, aged by the database's clock."""
        with self.cursor() as cur:
            self._ensure_lso_watch(cur)
            cur.execute(
                sql.SQL(
                    "SELECT topic, partition, high_watermark, lso, "
                    "greatest(0, extract(epoch FROM now() - stuck_since))::float8 AS stuck_for "
                    "FROM {} WHERE pipeline = %s ORDER BY topic, partition"
                ).format(self._table(meta_tables.LSO_WATCH)),
                (pipeline,),
            )
            return [
                StoredPartition(r["topic"], int(r["partition"]), int(r["high_watermark"]), int(r["lso"]),
                                float(r["stuck_for"]))
                for r in cur.fetchall()
            ]

    def save_lso_watch(self, pipeline: str, rows: Sequence[StoredPartition]) -> None:
        """Replace the pipeline's rows with ``rows`` in one transaction (partitions left out are cleared).
        A row whose LSO is unchanged keeps its stored ``stuck_since``: the same stuck episode, and
        no drift from going through ages run after run."""
        table = self._table(meta_tables.LSO_WATCH)
        conn = self.connect()
        try:
            with conn, conn.cursor() as cur:
                self._ensure_lso_watch(cur)
                cur.execute(
                    sql.SQL(
                        "DELETE FROM {} WHERE pipeline = %s AND (topic, partition) NOT IN "
                        "(SELECT * FROM unnest(%s::text[], %s::integer[]))"
                    ).format(table),
                    (pipeline, [r.topic for r in rows], [r.partition for r in rows]),
                )
                for r in rows:
                    cur.execute(
                        sql.SQL(
                            "INSERT INTO {t} AS w (pipeline, topic, partition, lso, high_watermark, stuck_since, "
                            "last_seen) VALUES (%s, %s, %s, %s, %s, now() - make_interval(secs => %s), now()) "
                            "ON CONFLICT (pipeline, topic, partition) DO UPDATE SET "
                            "stuck_since = CASE WHEN w.lso = EXCLUDED.lso "
                            "AND w.high_watermark <= EXCLUDED.high_watermark "
                            "THEN w.stuck_since ELSE EXCLUDED.stuck_since END, "
                            "lso = EXCLUDED.lso, high_watermark = EXCLUDED.high_watermark, last_seen = now()"
                        ).format(t=table),
                        (pipeline, r.topic, r.partition, r.last_stable, r.high_watermark, float(r.stuck_for)),
                    )
        finally:
            conn.close()

    def _advisory_lock_held(self, key: str) -> bool:
        from spark_apps.eos_stream.state.control import advisory_lock_held

        conn = self.connect(autocommit=True)
        try:
            return advisory_lock_held(conn, key)
        finally:
            conn.close()
