"""Counts failed attempts per batch so a deterministic failure cannot loop forever.

Only data errors count (``errors.classify``: SQLSTATE class 22 or 23 but a
foreign key's 23503, or the app's own ``RecordError``): poison means the data,
never the weather. A lock
timeout, a deadlock or a lost connection is retried in the driver and never
brings a batch closer to record-by-record processing. Failures are written in
autocommit, outside the sink transaction, so a rolled-back batch's failure is
still counted. After ``max_attempts`` counted failures the batch is processed
record by record and only the records the database rejects with a data error
are quarantined.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.state import meta_tables


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

    def reopen(self, conn: PgConnection) -> None:
        """Continues on a new connection after the old one broke."""
        self.conn = conn
        self.conn.autocommit = True

    def failed_attempts(self, key: str) -> int:
        """How many attempts of the batch failed with a data error so far."""
        with self.conn.cursor() as cur:
            cur.execute(
                sql.SQL("SELECT attempts FROM {t} WHERE pipeline = %s AND batch_key = %s").format(t=self.table),
                (self.pipeline, key),
            )
            row = cur.fetchone()
        return int(row[0]) if row else 0

    def should_isolate(self, failed_before: int) -> bool:
        return failed_before >= self.max_attempts

    def record_failure(self, key: str, error: str, counted: bool) -> None:
        """Keeps the batch's last error; ``counted`` (a data error) also adds one
        failed attempt. Uncounted errors are kept only so an operator sees why
        the batch is slow, with the attempt count left as it was."""
        with self.conn.cursor() as cur:
            cur.execute(
                sql.SQL(
                    "INSERT INTO {t} (pipeline, batch_key, attempts, last_error) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (pipeline, batch_key) DO UPDATE SET attempts = {t}.attempts + EXCLUDED.attempts,"
                    " last_error = EXCLUDED.last_error, updated_at = now()"
                ).format(t=self.table),
                (self.pipeline, key, 1 if counted else 0, error[:2000]),
            )

    def finished(self, key: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(
                sql.SQL("DELETE FROM {t} WHERE pipeline = %s AND batch_key = %s").format(t=self.table),
                (self.pipeline, key),
            )
