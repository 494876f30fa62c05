"""Connections to the target database, with errors that say what to check."""

from __future__ import annotations

import os
from typing import Any

import psycopg2
from psycopg2.extensions import connection as PgConnection

# TCP keepalives for every session of the app and the provider (docs/deployment.md).
# The pipeline's running, supervisor and swap locks are session advisory locks: they die
# with the session, but the server only notices a vanished client (host powered off,
# network cut) through TCP, which with the kernel's defaults takes over two hours, during
# which no driver can start and no recovery can run. Both ends probe: libpq's keywords set
# the client's socket (a client waiting on a vanished server gives up), and the same numbers
# go to the server as the session's tcp_keepalives_* settings (the startup ``options``), so
# the server probes an idle client after 30 s and drops it after 3 unanswered probes 10 s
# apart: the session, and every lock it held, is gone within about a minute. A connection's
# own keywords (Airflow connection extras, ``postgres.options``) override them.
TCP_KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}
_SERVER_SIDE = ("keepalives_idle", "keepalives_interval", "keepalives_count")


class TargetUnavailable(RuntimeError):
    """The target database cannot be reached or refused the login."""


def with_keepalives(dsn_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``dsn_kwargs`` with the TCP keepalive defaults under them (its own values win), and
    the resulting numbers as the server's ``tcp_keepalives_*`` for the session, put before
    the connection's own ``options`` (so a ``-c tcp_keepalives_idle=...`` of its own wins).
    Without ``options`` of its own, the environment's ``PGOPTIONS`` stands in for them, as
    libpq would have used it. ``keepalives=0`` turns both off. Idempotent."""
    merged = {**TCP_KEEPALIVES, **dsn_kwargs}
    # libpq reads PGOPTIONS only when no ``options`` keyword is given; setting one here must
    # not drop what the environment asked for (a deployment's lock_timeout, say).
    own = str(merged.get("options") or os.environ.get("PGOPTIONS", ""))
    if str(merged["keepalives"]) == "0" or "tcp_keepalives_idle=" in own:
        return merged
    server = " ".join(f"-c tcp_{key}={int(merged[key])}" for key in _SERVER_SIDE)
    merged["options"] = f"{server} {own}".strip()
    return merged


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
