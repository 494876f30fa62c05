"""A PostgreSQL hook for the streaming app's bookkeeping tables (offsets, progress,
dead letters, stop requests) and the database's in-doubt prepared transactions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg2
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg2 import sql
from psycopg2.extras import RealDictCursor

from spark_apps.eos_stream import meta_tables

TopicPartitionKey = tuple[str, int]

# Extra keys of a postgres connection that are Airflow's, not libpq's.
_NON_LIBPQ_EXTRAS = frozenset(
    {"iam", "redshift", "redshift-serverless", "cursor", "cluster-identifier", "workgroup-name", "aws_conn_id",
     "azure_conn_id", "enable_log_db_messages", "sqlalchemy_scheme", "sqlalchemy_query", "sqlalchemy_options"}
)
_DEFAULT_APPLICATION_NAME = "airflow-eos"
# The recovery lock table (airflow_provider_eos.hooks.snapshot.LOCK_TABLE; not imported, that
# module pulls in the snapshot machinery).
_RECOVERY_LOCKS = "recovery_locks"


class EosPostgresHook(PostgresHook):
    """
    Reads and writes the bookkeeping tables of the eos streaming app in the target database.

    It opens psycopg2 connections from the Airflow connection (``psycopg2.sql`` identifiers are
    used throughout; the parent hook may be on psycopg 3), and never logs the password.

    :param postgres_conn_id: The connection object to use, defaults to "eos_postgres"; its schema
        field is the database name.
    :param meta_schema: schema of the bookkeeping tables (the app's ``meta_schema``).
    """

    default_conn_name = "eos_postgres"
    hook_name = "EOS Postgres"

    def __init__(self, *args: Any, meta_schema: str = meta_tables.DEFAULT_SCHEMA, **kwargs: Any) -> None:
        kwargs.setdefault("postgres_conn_id", self.default_conn_name)
        super().__init__(*args, **kwargs)
        self.meta_schema = meta_schema

    # ------------------------------------------------------------------ connections
    def connection_params(self, include_password: bool = True) -> dict[str, Any]:
        """libpq keyword arguments from the Airflow connection (extras such as sslmode included)."""
        conn = self.get_connection(self.get_conn_id())
        params: dict[str, Any] = {
            "host": conn.host or "127.0.0.1",
            "port": int(conn.port or 5432),
            "dbname": self.database or conn.schema or "postgres",
            "user": conn.login or "postgres",
        }
        if include_password and conn.password:
            params["password"] = conn.password
        for key, value in (conn.extra_dejson or {}).items():
            if key not in _NON_LIBPQ_EXTRAS and not key.startswith("sqlalchemy"):
                params[key] = value
        params.setdefault("application_name", _DEFAULT_APPLICATION_NAME)
        params.setdefault("connect_timeout", 10)
        return params

    def app_target(self) -> dict[str, Any]:
        """The app config's ``postgres`` section (host, port, dbname, user; never the password)."""
        params = self.connection_params(include_password=False)
        return {key: params[key] for key in ("host", "port", "dbname", "user")}

    def app_password(self) -> str | None:
        """The password, for the app's ``EOS_PG_PASSWORD`` environment variable only."""
        return self.get_connection(self.get_conn_id()).password or None

    def connect(self, autocommit: bool = True) -> psycopg2.extensions.connection:
        conn = psycopg2.connect(**self.connection_params())
        conn.autocommit = autocommit
        return conn

    @contextlib.contextmanager
    def cursor(self) -> Iterator[RealDictCursor]:
        conn = self.connect()
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
        with self.cursor() as cur:
            if not self._exists(cur, meta_tables.OFFSETS):
                return {}
            cur.execute(
                sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s").format(
                    self._table(meta_tables.OFFSETS)),
                (pipeline,),
            )
            return {(row["topic"], int(row["partition"])): int(row["next_offset"]) for row in cur.fetchall()}

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
    def request_stop(self, pipeline: str, requested_by: str) -> str:
        """Asks the running app to stop at the next batch boundary; returns the request time (ISO)."""
        self.ensure_meta_tables()
        with self.cursor() as cur:
            cur.execute(
                sql.SQL(
                    "INSERT INTO {} (pipeline, stop_requested_at, requested_by) VALUES (%s, now(), %s)"
                    " ON CONFLICT (pipeline) DO UPDATE SET stop_requested_at = EXCLUDED.stop_requested_at,"
                    " requested_by = EXCLUDED.requested_by RETURNING stop_requested_at"
                ).format(self._table(meta_tables.CONTROL)),
                (pipeline, requested_by),
            )
            return cur.fetchone()["stop_requested_at"].isoformat()

    def clear_stop(self, pipeline: str) -> None:
        """Clears a stop request (before a launch: an old request would stop the new run at once)."""
        self.ensure_meta_tables()
        with self.cursor() as cur:
            cur.execute(
                sql.SQL("UPDATE {} SET stop_requested_at = NULL WHERE pipeline = %s").format(
                    self._table(meta_tables.CONTROL)),
                (pipeline,),
            )

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
    # Key: hashtextextended('eos-supervisor:<meta_schema>:<pipeline>', 0).

    def acquire_supervisor_lock(self, pipeline: str) -> psycopg2.extensions.connection | None:
        """Takes the pipeline's supervisor lock; returns the connection that holds it (close it to
        release), or None when another session holds it."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_try_advisory_lock(hashtextextended('eos-supervisor:' || %s || ':' || %s, 0))",
                            (self.meta_schema, pipeline))
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
        return self._advisory_lock_held(f"eos-supervisor:{self.meta_schema}:{pipeline}")

    def driver_running(self, pipeline: str) -> bool:
        """Whether a driver of the pipeline is connected: every app holds its running
        lock for its lifetime, whoever started it (see ``spark_apps.eos_stream.control``)."""
        from spark_apps.eos_stream.control import running_lock_key

        return self._advisory_lock_held(running_lock_key(pipeline))

    def running_lock_holder(self, pipeline: str) -> dict[str, Any] | None:
        """Who holds the pipeline's running lock: the backend's ``pid``, ``application_name``,
        ``client_addr``, ``client_port``, ``backend_start`` and ``age_seconds``; None when no
        driver is connected. For logs: the backend pid is the database's, not the driver's."""
        from spark_apps.eos_stream.control import ADVISORY_LOCK_HOLDERS_SQL, running_lock_key

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
        ``<meta_schema>.recovery_locks`` (see ``airflow_provider_eos.recovery_lock``) and
        heartbeats it; a row whose heartbeat is older than ``ttl_seconds`` belongs to a
        dead run and holds nothing. Returns ``holder``, ``acquired_at``, ``heartbeat_at``
        and ``heartbeat_age_seconds`` (database clock)."""
        with self.cursor() as cur:
            if not self._exists(cur, _RECOVERY_LOCKS):
                return None
            cur.execute(
                sql.SQL(
                    "SELECT holder, acquired_at, heartbeat_at,"
                    " EXTRACT(EPOCH FROM (now() - heartbeat_at))::float8 AS heartbeat_age_seconds"
                    " FROM {} WHERE lock_key = current_database() || '/' || %s || '/' || %s"
                    " AND heartbeat_at >= now() - make_interval(secs => %s)"
                ).format(self._table(_RECOVERY_LOCKS)),
                (target_schema, pipeline, float(ttl_seconds)),
            )
            row = cur.fetchone()
        if row is None:
            return None
        out = dict(row)
        for key in ("acquired_at", "heartbeat_at"):
            out[key] = out[key].isoformat()
        return out

    def _advisory_lock_held(self, key: str) -> bool:
        from spark_apps.eos_stream.control import advisory_lock_held

        conn = self.connect()
        try:
            return advisory_lock_held(conn, key)
        finally:
            conn.close()
