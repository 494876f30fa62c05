"""The offsets a pipeline has applied (``<meta_schema>.kafka_offsets``): the next offset per
partition that its target holds, written by the app in the same transaction as the rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg2 import sql

from airflow_provider_eos.state.meta import exists, table
from spark_apps.eos_stream.state import meta_tables

if TYPE_CHECKING:
    from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook

TopicPartitionKey = tuple[str, int]


def committed_offsets(hook: EosPostgresHook, pipeline: str) -> list[dict[str, Any]]:
    """The pipeline's offsets rows (topic, partition, next_offset, batch_id): what its target holds.

    :param hook: built for the pipeline's meta schema.
    :return: one row per partition, ordered; empty before the pipeline's first batch."""
    with hook.cursor() as cur:
        if not exists(cur, hook, meta_tables.OFFSETS):
            return []
        cur.execute(
            sql.SQL("SELECT topic, partition, next_offset, batch_id FROM {} WHERE pipeline = %s"
                    " ORDER BY topic, partition").format(table(hook, meta_tables.OFFSETS)),
            (pipeline,),
        )
        return [dict(row) for row in cur.fetchall()]


def stored_offsets(hook: EosPostgresHook, pipeline: str) -> dict[TopicPartitionKey, int]:
    """``next_offset`` per (topic, partition) the pipeline has applied (empty before its first batch)."""
    return {(row["topic"], int(row["partition"])): int(row["next_offset"])
            for row in committed_offsets(hook, pipeline)}
