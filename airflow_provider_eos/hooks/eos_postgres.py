"""The provider's PostgreSQL hook: its one connection factory, adapting an Airflow connection
to psycopg2 and to the streaming app's ``postgres`` section.

What the provider reads and writes in the target database lives with the table or lock that
owns it, as functions of this hook: :mod:`airflow_provider_eos.state` (offsets, progress, dead
letters, stop requests, the running and supervisor locks, the LSO watch, in-doubt prepared
transactions) and :mod:`airflow_provider_eos.recovery.lock` (the recovery lock rows)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg2
from airflow.providers.postgres.hooks.postgres import PostgresHook
from psycopg2.extensions import connection as PgConnection
from psycopg2.extras import RealDictCursor

from spark_apps.eos_stream.sink.postgres import TCP_KEEPALIVES, with_keepalives

# Extra keys of a postgres connection that are Airflow's, not libpq's.
_NON_LIBPQ_EXTRAS = frozenset(
    {"iam", "redshift", "redshift-serverless", "cursor", "cluster-identifier", "workgroup-name", "aws_conn_id",
     "azure_conn_id", "enable_log_db_messages", "sqlalchemy_scheme", "sqlalchemy_query", "sqlalchemy_options"}
)


class EosPostgresHook(PostgresHook):
    """
    Connects to the target database of the eos streaming app.

    It opens psycopg2 connections from the Airflow connection (``psycopg2.sql`` identifiers are
    used throughout; the parent hook may be on psycopg 3), and never logs the password. The
    queries on the bookkeeping tables take this hook (see the module's docstring).

    :param postgres_conn_id: The connection object to use, defaults to "eos_postgres"; its schema
        field is the database name.
    :param meta_schema: schema of the bookkeeping tables (the app's ``meta_schema``). Bound once:
        no query takes it again. Required by every query on the bookkeeping tables or the locks
        named after it; a hook built without it (for ``connect``, ``app_target`` or the in-doubt
        prepared transactions) refuses those instead of guessing a schema.
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
