"""The PostgreSQL client tools for pipeline snapshots and restores, over a PostgresHook connection.

An adapter only: it finds pg_dump, pg_restore and psql, connects them with every libpq keyword of
the Airflow connection, and runs them. The recovery protocol built on it (the consistent dump,
the scratch validation, the swap, the aside schema's finalize and rollback) is in
``airflow_provider_eos/recovery/``, in functions that take this hook.

Secrets never go on a command line: pg_dump, pg_restore and psql get
``PGPASSWORD`` in their environment only, and ``sslpassword`` in a private
service file named by ``PGSERVICEFILE`` (``PgToolsHook.tool_env``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowException
from psycopg2.extensions import make_dsn

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.utils import provider_config


class PgToolError(AirflowException):
    """pg_dump, pg_restore or psql failed; the message carries its stderr tail."""


# Guards each hook's service file (``PgToolsHook._secret_service_file``) across threads.
_SERVICE_FILE_LOCK = threading.Lock()


class PgToolsHook(EosPostgresHook):
    """
    The PostgreSQL client tools (pg_dump, pg_restore, psql) over the bookkeeping hook's
    connections (:class:`~airflow_provider_eos.hooks.eos_postgres.EosPostgresHook`): where the
    tools are, how they connect (the connection's libpq keywords) and how they get the secrets
    (never on a command line). What a snapshot and a restore do with them is
    ``airflow_provider_eos.recovery``'s; its functions take this hook.

    :param postgres_conn_id: The connection object to use, defaults to "postgres_default"
        (its schema field is the database).
    :param pg_bin_dir: directory holding pg_dump, pg_restore and psql (their
        major version must be >= the server's); default: ``[eos] pg_bin_dir``, else ``PATH``.
    :param lock_timeout: seconds a restore waits for table locks before giving up.
    :param meta_schema: the pipeline's bookkeeping schema (see ``EosPostgresHook``).
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
        from spark_apps.eos_stream.run.config import SECRET_LIBPQ_OPTIONS

        params = self.libpq_params()
        return {key: params[key] for key in sorted(SECRET_LIBPQ_OPTIONS - {"password"}) if key in params}

    def _secret_service_file(self) -> str | None:
        """A libpq service file (mode 0600, in a 0700 directory of its own) holding the
        connection's non-password secrets as service ``eos``, for the client tools.
        libpq has no environment variable for ``sslpassword``, and a conninfo on the
        command line is readable by every local user (``/proc/<pid>/cmdline``), so the
        tools get ``service=eos`` there and ``PGSERVICEFILE`` in their environment.
        Removed when the hook is garbage collected or the process exits.

        One file per hook, made once under a lock: a restore runs its scratch validation and
        its swap in two threads of one hook, and a second directory made beside the first would
        drop the first (and the file a running tool reads) when its object is collected. A
        changed content is written beside the file and renamed over it, so a tool never reads
        a half-written one."""
        secrets = self._secrets()
        if not secrets:
            return None
        if "service" in self.libpq_params():
            raise PgToolError(f"connection {self.get_conn_id()!r} sets both 'service' and {sorted(secrets)}: the "
                              "client tools get those secrets through a service file of their own; move them "
                              "into your service file, or drop 'service' from the connection's extra")
        content = "\n".join(["[eos]"] + [f"{key}={value}" for key, value in secrets.items()]) + "\n"
        with _SERVICE_FILE_LOCK:
            directory = getattr(self, "_service_dir", None)
            if directory is None:
                directory = tempfile.TemporaryDirectory(prefix="eos-pgservice-")  # 0700
                self._service_dir = directory
            path = Path(directory.name) / "pg_service.conf"
            if getattr(self, "_service_content", None) != content:
                staged = path.with_suffix(".new")
                fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as out:
                    os.fchmod(out.fileno(), 0o600)
                    out.write(content)
                os.replace(staged, path)
                self._service_content = content
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
        from spark_apps.eos_stream.run.config import SECRET_LIBPQ_OPTIONS

        params = {key: value for key, value in self.libpq_params(dbname).items() if key not in SECRET_LIBPQ_OPTIONS}
        if self._secrets():
            params["service"] = "eos"
        return ["-d", make_dsn(**params)]

    def start_tool(self, name: str, args: Sequence[str], *, dbname: str | None = None, connect: bool = True,
                   **kwargs: Any) -> subprocess.Popen:
        """Starts client tool ``name`` with ``args``: connected (``-d <conninfo>`` of the connection,
        or of its ``dbname``) unless ``connect`` is False, its secrets in the environment only."""
        command = [self.tool(name), *(self._conn_args(dbname) if connect else []), *args]
        return subprocess.Popen(command, env=self.tool_env(), **kwargs)

    def run_tool(self, name: str, args: Sequence[str], *, dbname: str | None = None) -> subprocess.CompletedProcess:
        """Runs client tool ``name`` connected to the database (or ``dbname``) and waits; output captured."""
        command = [self.tool(name), *self._conn_args(dbname), *args]
        return subprocess.run(command, env=self.tool_env(), capture_output=True, text=True)


def tool_output_tail(text: str | None, limit: int = 1500) -> str:
    """The end of a client tool's output, for an error message."""
    text = (text or "").strip()
    return text[-limit:] if text else "(no output)"
