"""Counts attempts per batch so a deterministic failure cannot loop forever.

Attempts are written in autocommit, outside the sink transaction: when a
poisoned batch rolls back, its attempt is still counted. After
``max_attempts`` failures the batch is processed record by record and the
records the database rejects are quarantined.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import meta_tables

TopicPartition = tuple[str, int]


def batch_key(start_offsets: Mapping[TopicPartition, int]) -> str:
    """A stable name for "the batch that starts at these offsets"."""
    canonical = json.dumps(sorted([t, p, o] for (t, p), o in start_offsets.items()))
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


class PoisonGuard:
    def __init__(self, conn: PgConnection, meta_schema: str, pipeline: str, max_attempts: int) -> None:
        # A connection of its own, in autocommit, so counts survive rollbacks.
        self.conn = conn
        self.conn.autocommit = True
        self.table = meta_tables.table(meta_schema, meta_tables.BATCH_ATTEMPTS)
        self.pipeline = pipeline
        self.max_attempts = max_attempts

    def begin_attempt(self, key: str) -> int:
        """Records one more attempt; returns how many attempts failed before it."""
        with self.conn.cursor() as cur:
            cur.execute(
                sql.SQL(
                    "INSERT INTO {t} (pipeline, batch_key, attempts) VALUES (%s, %s, 1)"
                    " ON CONFLICT (pipeline, batch_key) DO UPDATE SET attempts = {t}.attempts + 1,"
                    " updated_at = now() RETURNING attempts"
                ).format(t=self.table),
                (self.pipeline, key),
            )
            row = cur.fetchone()
            assert row is not None
            return int(row[0]) - 1

    def should_isolate(self, failed_before: int) -> bool:
        return failed_before >= self.max_attempts

    def record_failure(self, key: str, error: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(
                sql.SQL("UPDATE {t} SET last_error = %s WHERE pipeline = %s AND batch_key = %s").format(
                    t=self.table
                ),
                (error[:2000], self.pipeline, key),
            )

    def finished(self, key: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(
                sql.SQL("DELETE FROM {t} WHERE pipeline = %s AND batch_key = %s").format(t=self.table),
                (self.pipeline, key),
            )
