"""The database's in-doubt two-phase transactions (``pg_prepared_xacts``): they hold their locks
until someone runs COMMIT/ROLLBACK PREPARED."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def prepared_transactions(hook: EosPostgresHook, older_than_seconds: float = 0,
                          all_databases: bool = False) -> list[dict[str, Any]]:
    """In-doubt two-phase transactions older than ``older_than_seconds``, oldest first.

    :param hook: any hook of the database (no meta schema needed).
    :param older_than_seconds: only those prepared longer ago than this.
    :param all_databases: include other databases of the cluster (default: the connection's)."""
    with hook.cursor() as cur:
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
