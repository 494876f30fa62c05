"""Apply-ahead: batch N is staged and applied on threads of their own while
Spark plans, checkpoints and stages the batches after it.

A micro-batch has three parts that use different machines: Spark's own
bookkeeping (the offset log, the commit log, planning the next batch, starting
its job: the driver's JVM, mostly waiting), staging (Kafka read, parse, COPY by
the executors) and the apply (one statement and a COMMIT in the driver's
database session). Run one after the other, each leaves the others' resources
idle. Here the driver's ``foreachBatch`` call only hands its batch over: a
stager thread stages it as soon as the previous batch's staging has ended, and
an applier thread applies it as soon as it is staged and the previous batch
has committed. ``foreachBatch`` returns once the previous batch's staging has
ended, so at most one batch stages while Spark prepares the next.

Batches still commit one at a time and in order: one applier thread takes
them in the order they were handed over, and once an apply has failed no later
batch applies. Only modes whose replay point is the database
(``DeliveryMode.stores_offsets``) may do this: Spark checkpoints a batch when
``foreachBatch`` returns, before it is staged or committed, and a mode that
resumes from Spark's checkpoint would lose that batch to a crash. The failure
transitions this adds are A1-A3 below; the batch's own (1-10) are in ``batch_sink``.

In ``exactly_once`` the stager first tries to write the batch as prepared
parts (``parts``): the tasks COPY straight into the target and the applier
only decides; when they cannot, it stages the batch as before.

The staging of a batch ahead of its apply is an optimisation only: if it
fails, the batch's apply stages it again itself (on a fresh read of its
offset ranges) and classifies the error there, as without apply-ahead.

Failure transitions
-------------------

In the modes that store offsets the app applies ahead (``apply_ahead``):
``foreachBatch`` only hands batch N over; a stager thread stages it once
N-1's staging has ended and an applier thread applies it once N-1 has
committed, while Spark checkpoints N and plans and hands over N+1. Three
more transitions:

A1. a crash while N applies and N+1 stages: N's transaction rolls back (as
    3) and N+1's staging table is left (as 2). The next run starts from the
    stored offsets, N's start, and drops both tables. Spark's checkpoint
    already counts N (and maybe N+1 and N+2) as done, but these modes start
    every run on a fresh checkpoint from the stored offsets, so it is never
    read.
A2. N's apply fails (after its own retries and isolation, as 6-9): no later
    batch applies (the applier skips every batch handed over after N; their
    stages are dropped at the next start), and the error is raised in the
    next ``foreachBatch`` call or at the end of the run, which fails as N's
    error says.
A3. a retry or an isolation of N stages it again: the tasks read N's offset
    ranges again as they did the first time (``kafka_ranges``: the same
    offsets, ``read_committed``: the same records). A failure to stage N
    ahead is no error of its own: N's first attempt stages it that way
    instead, and judges the failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import errors
from spark_apps.eos_stream.records.spec import StageCount
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.parts import WriteParts, WrittenParts
from spark_apps.eos_stream.sink.staging import create_stage
from spark_apps.eos_stream.sink.writer import StagedBatch

# Runs a batch's write job with the parts' id prefix; returns the tasks' part results.


class ApplyAhead:
    """Stages batches on one stager thread and applies each on one applier thread, in order.

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
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eos-stage")
        self._applier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eos-apply")
        self._staging: Future[StagedBatch | WrittenParts | None] | None = None
        self._pending: Future[None] | None = None
        self._failure: BaseException | None = None
        self._reported = False

    def stage(self, batch_id: int, fill_stage: Callable[[str, bool], StageCount | int | None],
              write_parts: WriteParts | None = None) -> StagedBatch | WrittenParts | None:
        """Writes the batch as prepared parts when ``write_parts`` is given and every task
        could, else stages it on the staging session (None: it could not; its apply will)."""
        started = time.perf_counter()
        if write_parts is not None:
            written = self._write_parts(batch_id, write_parts, started)
            if written is not None:
                return written
        name = self._sink.stage_name(batch_id)
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            create_stage(self._conn, self._sink.spec, self._sink.meta_schema, name)
            staged = StageCount.of(fill_stage(name, False))
        except Exception as exc:  # the apply stages it again and judges the error itself
            self._notify("stage_ahead_failed", batch_id=batch_id, error=errors.one_line(exc))
            if self._conn is not None and not self._conn.closed:
                self._conn.rollback()
            return None
        return StagedBatch(name, staged, round((time.perf_counter() - started) * 1000))

    def _write_parts(self, batch_id: int, write_parts: WriteParts, started: float) -> WrittenParts | None:
        """The batch written as prepared parts, or None after rolling back whatever parts
        it left (P2: the tasks refused, or the job failed): then it is staged."""
        prefix = self._sink.parts_prefix(batch_id)
        written = parts.write_batch(write_parts, self._sink.spec, prefix, batch_id, started, self._notify)
        if written is not None:
            return written
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            parts.roll_back(self._conn, prefix)
        except Exception as exc:  # the apply's retry or the next start rolls them back (P1, P3)
            self._notify("parts_not_rolled_back", batch_id=batch_id, error=errors.one_line(exc))
        return None

    def hand_over(self, batch_id: int, fill_stage: Callable[[str, bool], StageCount | int | None],
                  apply: Callable[[StagedBatch | WrittenParts | None], Any],
                  write_parts: WriteParts | None = None) -> None:
        """Queues the batch: staged after the batch before it, then ``apply(staged)``
        after that batch has committed. Returns once the previous batch's staging
        has ended; raises an earlier batch's apply error instead, if there is one."""
        self._raise_failure()
        if self._staging is not None:
            wait([self._staging])  # never fails: stage() reports its own errors
        staging = self._staging = self._stager.submit(self.stage, batch_id, fill_stage, write_parts)
        self._pending = self._applier.submit(self._apply_in_turn, staging, apply)

    def _apply_in_turn(self, staging: Future[StagedBatch | WrittenParts | None],
                       apply: Callable[[StagedBatch | WrittenParts | None], Any]) -> None:
        if self._failure is not None:
            # An earlier batch failed: no later batch may commit (A2); its parts are no one's.
            staged = staging.result()
            if isinstance(staged, WrittenParts):
                self._sink.drop_parts(staged.prefix)
            return
        try:
            apply(staging.result())
        except BaseException as exc:
            self._failure = exc

    def finish(self) -> None:
        """Waits for every batch handed over to be applied, and raises the first apply error (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            wait([pending])
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._reported:
            self._reported = True
            raise self._failure

    def close(self) -> None:
        """Lets the batches in flight end (their error was or will be reported by
        ``finish``) and closes the staging session."""
        self._stager.shutdown(wait=True)
        self._applier.shutdown(wait=True)
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
