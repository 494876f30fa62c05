"""Apply-ahead: batch N is applied on a thread of its own while Spark reads
and stages batch N+1.

A micro-batch has two halves that use different machines: staging (Kafka
read, parse, COPY by the executors) and the apply (one statement and a
COMMIT in the driver's database session). Run one after the other, each
half leaves the other's resources idle. Here the driver's ``foreachBatch``
call stages its batch, waits for the previous batch's apply to end (raising
its error, if any, after that batch's own retries), hands its own apply to
the applier thread and returns, so Spark starts the next batch at once.

Batches still commit one at a time and in order: an apply starts only after
the previous one has committed. Only modes whose replay point is the
database (``DeliveryMode.stores_offsets``) may do this: Spark checkpoints a
batch when ``foreachBatch`` returns, before its apply commits, and a mode
that resumes from Spark's checkpoint would lose that batch to a crash. The
failure transitions this adds are in ``batch_sink`` (A1-A3).

The staging of a batch ahead of its apply is an optimisation only: if it
fails, the batch's apply stages it again itself (on a fresh read of its
offset range) and classifies the error there, as without apply-ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.sink.batch_sink import BatchSink, StagedBatch
from spark_apps.eos_stream.sink.staging import create_stage


class ApplyAhead:
    """Stages batches ahead and applies each on one applier thread, in order.

    :param sink: the pipeline's sink; only the applier thread calls its ``process``.
    :param connect: opens the staging session (the sink's own connection is the
        applier's, in the middle of a transaction, while the next batch stages).
    :param notify: called as ``notify(event, **fields)`` when staging ahead failed.
    """

    def __init__(self, sink: BatchSink, connect: Callable[[], PgConnection],
                 notify: Callable[..., None] | None = None) -> None:
        self._sink = sink
        self._connect = connect
        self._notify = notify or (lambda event, **fields: None)
        self._conn: PgConnection | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eos-apply")
        self._pending: Future[Any] | None = None

    def stage(self, batch_id: int, fill_stage: Callable[[str, bool], int | None]) -> StagedBatch | None:
        """Stages the batch on the staging session (None: it could not; its apply will)."""
        started = time.perf_counter()
        name = self._sink.stage_name(batch_id)
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            create_stage(self._conn, self._sink.spec, self._sink.meta_schema, name)
            rows = fill_stage(name, False)
        except Exception as exc:  # the apply stages it again and judges the error itself
            self._notify("stage_ahead_failed", batch_id=batch_id, error=" ".join(str(exc).split())[:500])
            if self._conn is not None and not self._conn.closed:
                self._conn.rollback()
            return None
        return StagedBatch(name, rows, round((time.perf_counter() - started) * 1000))

    def submit(self, apply: Callable[[], Any]) -> None:
        """Waits for the previous apply (raising its error), then starts ``apply``."""
        self.finish()
        self._pending = self._executor.submit(apply)

    def finish(self) -> None:
        """Waits for the apply in flight, if any, and raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Lets an apply in flight end (its error was or will be reported by
        ``finish``) and closes the staging session."""
        self._executor.shutdown(wait=True)
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
