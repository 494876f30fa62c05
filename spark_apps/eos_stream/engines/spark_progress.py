"""The Spark engine's progress: one row per finished micro-batch (``shared.ProgressRows``), with
the records its tasks read (``RowsRead``), written by a listener of Spark's query progress."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import psycopg2
from pyspark.sql.streaming import StreamingQueryListener

from spark_apps.eos_stream.engines.shared import ProgressRows
from spark_apps.eos_stream.sink.postgres import connect


def _as_json(offsets: Any) -> str | None:
    """Spark reports offsets as JSON text, or None/"None" before the first batch."""
    if offsets in (None, "None", ""):
        return None
    return offsets if isinstance(offsets, str) else json.dumps(offsets)


class RowsRead:
    """The records each batch read from Kafka, by batch id: the tasks read their offset
    ranges themselves (``kafka_ranges``), so Spark's own ``numInputRows`` stays 0. A batch
    staged ahead (``apply_ahead``) may report its rows after Spark reported its progress."""

    # How long the progress listener waits for a batch's staging to end.
    WAIT_SECONDS = 120.0

    def __init__(self) -> None:
        self._rows: dict[int, int] = {}
        self._changed = threading.Condition()
        self._closed = False

    def record(self, batch_id: int, rows: int) -> None:
        """The batch's first staging counts (a retry reads the same records)."""
        with self._changed:
            self._rows.setdefault(batch_id, rows)
            self._changed.notify_all()

    def take(self, batch_id: int, timeout: float = WAIT_SECONDS) -> int | None:
        """The batch's rows once it has staged (None: it did not within ``timeout`` seconds,
        or the run ended first)."""
        with self._changed:
            self._changed.wait_for(lambda: batch_id in self._rows or self._closed, timeout)
            return self._rows.pop(batch_id, None)

    def close(self) -> None:
        """The run's batches are all staged or abandoned: nothing more is waited for."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class ProgressRecorder(StreamingQueryListener):
    """Writes each batch's StreamingQueryProgress into the progress table, with the
    records the batch read (``RowsRead``) as its input rows."""

    def __init__(self, dsn_kwargs: dict[str, Any], describe: str, config: Any, run_id: str,
                 rows_read: RowsRead) -> None:
        self.rows_read = rows_read
        self._dsn_kwargs, self._describe = dsn_kwargs, describe
        self.conn = self._connect()
        self.rows = ProgressRows(config.meta_schema, config.pipeline, run_id)

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        source = progress.sources[0] if progress.sources else None
        durations = dict(progress.durationMs or {})
        rows = self.rows_read.take(progress.batchId)
        if rows is None:
            rows = progress.numInputRows
        millis = durations.get("triggerExecution")
        self._write(self.rows.row(progress.batchId, rows, _as_json(source.startOffset) if source else None,
                                  _as_json(source.endOffset) if source else None, durations, millis))
        self.rows.announce(progress.batchId, rows, millis, source.endOffset if source else None)

    def _connect(self) -> Any:
        conn = connect(self._dsn_kwargs, describe=self._describe, application_name="eos-progress")
        conn.autocommit = True
        return conn

    def _write(self, row: tuple[Any, ...]) -> None:
        """The progress row, on a connection opened again once if the last one was lost (a
        PostgreSQL restart): the health checks read these rows, so a driver that rode out a
        restart must go on writing them. A second failure raises (Spark logs it and goes on)."""
        try:
            self.rows.write(self.conn, row)
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            with contextlib.suppress(psycopg2.Error):
                self.conn.close()
            self.conn = self._connect()
            self.rows.write(self.conn, row)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass
