"""Connections to the target database, with errors that say what to check."""

from __future__ import annotations

from typing import Any

import psycopg2
from psycopg2.extensions import connection as PgConnection

# TCP keepalives for every session of the app and the provider (docs/deployment.md).
# The pipeline's running, supervisor and swap locks are session advisory locks: they die
# with the session, but the server only notices a vanished client (host powered off,
# network cut) through TCP. With the kernel's defaults that takes over two hours, during
# which no driver can start and no recovery can run. With these, the server's socket
# probes an idle peer after 30 s and gives up after 3 unanswered probes 10 s apart:
# the session, and every lock it held, is gone within about a minute. libpq sets them on
# the client side (a vanished server is noticed by a waiting client just as fast); a
# connection's own options (Airflow connection extras, ``postgres.options``) override them.
TCP_KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


class TargetUnavailable(RuntimeError):
    """The target database cannot be reached or refused the login."""


def with_keepalives(dsn_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``dsn_kwargs`` with the TCP keepalive defaults under them (its own values win)."""
    return {**TCP_KEEPALIVES, **dsn_kwargs}


def connect(dsn_kwargs: dict[str, Any], *, describe: str, application_name: str = "eos-stream") -> PgConnection:
    try:
        # The connection's own options may set a connect timeout or keepalives; the session's name is ours.
        return psycopg2.connect(**{"connect_timeout": 10, **with_keepalives(dsn_kwargs),
                                   "application_name": application_name})
    except psycopg2.OperationalError as exc:
        # libpq's message never contains the password; keep only its first line.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetUnavailable(
            f"cannot connect to PostgreSQL {describe}: {reason}. Check the host, port, database, "
            "user and that EOS_PG_PASSWORD holds the password."
        ) from exc
