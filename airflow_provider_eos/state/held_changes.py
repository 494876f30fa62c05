"""The changes a whole-transactions mirror holds back (``<meta_schema>.held_changes``): the events of
source transactions whose ``END`` or other events have not arrived yet (docs/cdc.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from airflow_provider_eos.state.meta import exists, table
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def held_transactions(hook: EosPostgresHook, pipeline: str, older_than_seconds: float = 0,
                      limit: int = 20) -> list[dict[str, Any]]:
    """The source transactions the pipeline has held longer than ``older_than_seconds``, the longest
    held first: each with its records held, the topics they came from and the seconds since the
    first was held. A record held without a transaction id (a record behind a held one in its
    partition) counts under its own coordinates.

    :param hook: built for the pipeline's meta schema.
    :param limit: at most this many transactions."""
    with hook.cursor() as cur:
        if not exists(cur, hook, meta_tables.HELD_CHANGES):
            return []
        cur.execute(
            sql.SQL(
                "SELECT coalesce(_tx, _topic || '[' || _partition || ']@' || _offset) AS transaction,"
                " count(*) AS records, string_agg(DISTINCT _topic, ', ') AS topics,"
                " extract(epoch FROM now() - min(held_at))::float AS held_seconds"
                " FROM {} WHERE pipeline = %s GROUP BY 1"
                " HAVING extract(epoch FROM now() - min(held_at)) > %s"
                " ORDER BY held_seconds DESC LIMIT %s"
            ).format(table(hook, meta_tables.HELD_CHANGES)),
            (pipeline, float(older_than_seconds), int(limit)),
        )
        return [dict(row) for row in cur.fetchall()]
