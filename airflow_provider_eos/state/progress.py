"""The app's progress rows (``<meta_schema>.stream_progress``): one per batch, written with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from airflow_provider_eos.state.meta import exists, table
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook


def latest_progress(hook: EosPostgresHook, pipeline: str) -> dict[str, Any] | None:
    """The newest progress row, with ``age_seconds`` measured by the database clock.

    :param hook: built for the pipeline's meta schema.
    :return: the row (``recorded_at`` in ISO form), or None before the first batch."""
    with hook.cursor() as cur:
        if not exists(cur, hook, meta_tables.PROGRESS):
            return None
        cur.execute(
            sql.SQL(
                "SELECT run_id, batch_id, input_rows, start_offsets, end_offsets, batch_duration_ms,"
                " recorded_at, EXTRACT(EPOCH FROM (now() - recorded_at))::float8 AS age_seconds"
                " FROM {} WHERE pipeline = %s ORDER BY recorded_at DESC, batch_id DESC LIMIT 1"
            ).format(table(hook, meta_tables.PROGRESS)),
            (pipeline,),
        )
        row = cur.fetchone()
    if row is None:
        return None
    out = dict(row)
    out["recorded_at"] = out["recorded_at"].isoformat()
    return out
