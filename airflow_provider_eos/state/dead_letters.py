"""The records a pipeline quarantined (``<meta_schema>.dead_letters``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from airflow_provider_eos.state.meta import exists, table
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def dead_letters_since(hook: EosPostgresHook, pipeline: str, after_id: int = 0,
                       limit: int = 100) -> list[dict[str, Any]]:
    """Dead letters with ``id > after_id``, oldest first (key/value shortened to a preview).

    :param hook: built for the pipeline's meta schema.
    :param after_id: the last id already seen.
    :param limit: at most this many rows."""
    with hook.cursor() as cur:
        if not exists(cur, hook, meta_tables.DEAD_LETTERS):
            return []
        cur.execute(
            sql.SQL(
                'SELECT id, topic, partition, "offset", error, quarantined_at,'
                " convert_from(substring(key FROM 1 FOR 64), 'SQL_ASCII') AS key_preview"
                " FROM {} WHERE pipeline = %s AND id > %s ORDER BY id LIMIT %s"
            ).format(table(hook, meta_tables.DEAD_LETTERS)),
            (pipeline, int(after_id), int(limit)),
        )
        rows = [dict(row) for row in cur.fetchall()]
    for row in rows:
        row["quarantined_at"] = row["quarantined_at"].isoformat()
    return rows
