"""The driver's progress listener (``engines/spark_progress.ProgressRecorder``) against a real PostgreSQL
whose server ends the listener's session, as a restart does: the health DAG's liveness check
reads these rows, so a driver that rode out the restart must go on writing them. The listener
opens a new connection once and writes the batch's row on it; a database still down raises
(Spark logs a listener's error and goes on), and the next batch tries again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.engines.spark_progress import ProgressRecorder, RowsRead
from spark_apps.eos_stream.state import meta_tables

pytestmark = pytest.mark.integration


def _event(batch_id: int) -> Any:
    """What Spark hands ``onQueryProgress``: the fields the listener reads."""
    source = SimpleNamespace(startOffset='{"t":{"0":0}}', endOffset='{"t":{"0":10}}')
    return SimpleNamespace(progress=SimpleNamespace(batchId=batch_id, sources=[source], numInputRows=10,
                                                    durationMs={"triggerExecution": 40}))


def _batches(pg_conn: Any, schema: str) -> list[int]:
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT batch_id FROM {} WHERE pipeline = 'p' ORDER BY batch_id").format(
            meta_tables.table(schema, meta_tables.PROGRESS)))
        return [row[0] for row in cur.fetchall()]


def test_progress_rows_go_on_after_the_server_ends_the_session(stack: dict[str, str], pg_conn: Any,
                                                               meta: str) -> None:
    dsn = {"host": stack["EOS_PG_HOST"], "port": stack["EOS_PG_PORT"], "dbname": stack["EOS_PG_DB"],
           "user": stack["EOS_PG_USER"], "password": stack["EOS_PG_PASSWORD"]}
    rows_read = RowsRead()
    for batch_id in range(3):
        rows_read.record(batch_id, 10)  # as each batch's staging does, before its progress event
    recorder = ProgressRecorder(dsn, "the test's database", SimpleNamespace(pipeline="p", meta_schema=meta),
                                "run-1", rows_read)
    recorder.onQueryProgress(_event(0))
    first = recorder.conn
    with pg_conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", (first.get_backend_pid(),))
        assert cur.fetchone() == (True,)
    recorder.onQueryProgress(_event(1))
    assert first.closed and recorder.conn is not first
    recorder.onQueryProgress(_event(2))
    assert _batches(pg_conn, meta) == [0, 1, 2]
    recorder.conn.close()
