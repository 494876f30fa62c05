"""The health check's LSO watch (``<meta_schema>.lso_watch``): the partitions its last run left
stuck, and since when.

Ages, not times, cross this boundary: :func:`load_lso_watch` returns for how long each partition
has been stuck as the database's clock sees it, and :func:`save_lso_watch` writes ``now() - age``,
so the stored times are on the database's clock whatever the clocks of the workers are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from airflow_provider_eos.state.meta import table
from airflow_provider_eos.utils.lso_watch import StoredPartition
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook

_UPSERT = (
    "INSERT INTO {t} AS w (pipeline, topic, partition, lso, high_watermark, stuck_since, "
    "last_seen) VALUES (%s, %s, %s, %s, %s, now() - make_interval(secs => %s), now()) "
    "ON CONFLICT (pipeline, topic, partition) DO UPDATE SET "
    "stuck_since = CASE WHEN w.lso = EXCLUDED.lso "
    "AND w.high_watermark <= EXCLUDED.high_watermark "
    "THEN w.stuck_since ELSE EXCLUDED.stuck_since END, "
    "lso = EXCLUDED.lso, high_watermark = EXCLUDED.high_watermark, last_seen = now()"
)


def _ensure_table(hook: EosPostgresHook, cur: Any) -> None:
    for statement in meta_tables.lso_watch_ddl_statements(hook.meta_schema):
        cur.execute(statement)


def load_lso_watch(hook: EosPostgresHook, pipeline: str) -> list[StoredPartition]:
    """The partitions the pipeline's last health check left stuck, aged by the database's clock."""
    with hook.cursor() as cur:
        _ensure_table(hook, cur)
        cur.execute(
            sql.SQL(
                "SELECT topic, partition, high_watermark, lso, "
                "greatest(0, extract(epoch FROM now() - stuck_since))::float8 AS stuck_for "
                "FROM {} WHERE pipeline = %s ORDER BY topic, partition"
            ).format(table(hook, meta_tables.LSO_WATCH)),
            (pipeline,),
        )
        return [
            StoredPartition(r["topic"], int(r["partition"]), int(r["high_watermark"]), int(r["lso"]),
                            float(r["stuck_for"]))
            for r in cur.fetchall()
        ]


def save_lso_watch(hook: EosPostgresHook, pipeline: str, rows: Sequence[StoredPartition]) -> None:
    """Replaces the pipeline's rows with ``rows`` in one transaction (partitions left out are
    cleared). A row whose LSO is unchanged keeps its stored ``stuck_since``: the same stuck
    episode, and no drift from going through ages run after run."""
    watch = table(hook, meta_tables.LSO_WATCH)
    conn = hook.connect()
    try:
        with conn, conn.cursor() as cur:
            _ensure_table(hook, cur)
            cur.execute(
                sql.SQL(
                    "DELETE FROM {} WHERE pipeline = %s AND (topic, partition) NOT IN "
                    "(SELECT * FROM unnest(%s::text[], %s::integer[]))"
                ).format(watch),
                (pipeline, [r.topic for r in rows], [r.partition for r in rows]),
            )
            for r in rows:
                cur.execute(sql.SQL(_UPSERT).format(t=watch),
                            (pipeline, r.topic, r.partition, r.last_stable, r.high_watermark, float(r.stuck_for)))
    finally:
        conn.close()
