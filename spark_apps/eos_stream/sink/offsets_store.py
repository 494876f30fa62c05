"""The pipeline's Kafka offsets, kept in the target database."""

from __future__ import annotations

from collections.abc import Mapping

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import cursor as PgCursor
from psycopg2.extras import execute_values

from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.state import fencing, meta_tables


class OffsetsStore:
    """Reads and advances ``next_offset`` per (pipeline, topic, partition).

    :param meta_schema: schema of the bookkeeping tables.
    :param pipeline: the pipeline's name.
    """

    def __init__(self, meta_schema: str, pipeline: str) -> None:
        self.table = meta_tables.table(meta_schema, meta_tables.OFFSETS)
        self.pipeline = pipeline

    def load(self, conn: PgConnection) -> dict[TopicPartition, int]:
        with conn.cursor() as cur:
            cur.execute(
                sql.SQL("SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s").format(
                    self.table
                ),
                (self.pipeline,),
            )
            return {(topic, partition): offset for topic, partition, offset in cur.fetchall()}

    def lock(self, cur: PgCursor) -> None:
        """Serializes all writers of this pipeline until the transaction ends.

        A zombie driver (an old attempt still running) then waits, and once it
        gets the lock its records are already below the stored offsets. The
        same lock as epoch bumps and restore swaps (``fencing.lock_pipeline``),
        so a batch's ownership check and its writes see one state."""
        fencing.lock_pipeline(cur, self.pipeline)

    def advance(self, cur: PgCursor, end_offsets: Mapping[TopicPartition, int], batch_id: int) -> None:
        """Moves stored offsets forward (never back) inside the caller's transaction."""
        if not end_offsets:
            return
        execute_values(
            cur,
            sql.SQL(
                "INSERT INTO {t} (pipeline, topic, partition, next_offset, batch_id) VALUES %s"
                " ON CONFLICT (pipeline, topic, partition) DO UPDATE SET"
                " next_offset = GREATEST({t}.next_offset, EXCLUDED.next_offset),"
                " batch_id = EXCLUDED.batch_id, updated_at = now()"
            ).format(t=self.table).as_string(cur),
            [(self.pipeline, topic, partition, offset, batch_id) for (topic, partition), offset in end_offsets.items()],
        )

    def ahead_of(self, cur: PgCursor, start_offsets: Mapping[TopicPartition, int],
                 end_offsets: Mapping[TopicPartition, int]) -> list[str]:
        """The partitions of a batch whose stored next offset is past the batch's start
        (failure transition 4: records the staged apply would skip), as ``topic[partition]``.
        A start below 0 (Kafka's "earliest") counts as 0."""
        batch = sorted(end_offsets)
        if not batch:
            return []
        cur.execute(
            sql.SQL(
                "SELECT s.topic, s.partition"
                " FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS s(topic, partition, start)"
                " JOIN {t} o ON o.pipeline = %s AND o.topic = s.topic AND o.partition = s.partition"
                " WHERE o.next_offset > GREATEST(s.start, 0) ORDER BY 1, 2"
            ).format(t=self.table),
            ([t for t, _ in batch], [p for _, p in batch], [start_offsets.get(tp, -2) for tp in batch], self.pipeline),
        )
        return [f"{topic}[{partition}]" for topic, partition in cur.fetchall()]
