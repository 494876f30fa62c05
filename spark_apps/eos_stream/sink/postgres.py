"""Connections to the target database, with errors that say what to check."""

from __future__ import annotations

from typing import Any

import psycopg2
from psycopg2.extensions import connection as PgConnection


class TargetUnavailable(RuntimeError):
    """The target database cannot be reached or refused the login."""


def connect(dsn_kwargs: dict[str, Any], *, describe: str, application_name: str = "eos-stream") -> PgConnection:
    try:
        # The connection's own options may set a connect timeout; the session's name is ours.
        return psycopg2.connect(**{"connect_timeout": 10, **dsn_kwargs, "application_name": application_name})
    except psycopg2.OperationalError as exc:
        # libpq's message never contains the password; keep only its first line.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetUnavailable(
            f"cannot connect to PostgreSQL {describe}: {reason}. Check the host, port, database, "
            "user and that EOS_PG_PASSWORD holds the password."
        ) from exc
