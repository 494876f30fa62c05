"""Graceful stop: at a batch boundary, on a control-table request or a time limit."""

from __future__ import annotations

import time
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import meta_tables


class StopSignal:
    """Polled by the driver's main thread between awaits.

    :param conn: an autocommit connection used only to read the control table.
    :param run_seconds: stop after this long (0: never).
    """

    def __init__(self, conn: PgConnection, meta_schema: str, pipeline: str, run_seconds: float) -> None:
        self.conn = conn
        self.pipeline = pipeline
        self.deadline = time.monotonic() + run_seconds if run_seconds > 0 else None
        self.query_sql = sql.SQL("SELECT stop_requested_at FROM {} WHERE pipeline = %s").format(
            meta_tables.table(meta_schema, meta_tables.CONTROL)
        )

    def requested(self) -> str | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "run_seconds elapsed"
        with self.conn.cursor() as cur:
            cur.execute(self.query_sql, (self.pipeline,))
            row = cur.fetchone()
        if row is not None and row[0] is not None:
            return f"stop requested at {row[0].isoformat()}"
        return None

    @staticmethod
    def at_batch_boundary(query: Any, wait_seconds: float = 120.0) -> None:
        """Waits for the running micro-batch to finish, then stops the query.

        Stopping mid-batch would still be safe (the batch rolls back), but a
        clean boundary makes the stop quick to resume from."""
        deadline = time.monotonic() + wait_seconds
        while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.2)
        query.stop()
