"""The sink facade: one call per micro-batch, every delivery mode behind it.

Failure transitions (what a crash at each point leaves behind, and why the
next run is still exact in ``exactly_once``):

1. before staging: nothing written; the batch is read again from the stored offsets.
2. while staging: a half-filled UNLOGGED staging table; dropped at the next start.
3. during apply, before COMMIT: the transaction rolls back; data and offsets
   are both untouched, so the batch is replayed whole.
4. after COMMIT, before Spark's checkpoint: data and offsets are committed
   together; the next run starts from the stored offsets, and any record
   below them is skipped in SQL (``skip_applied``), so nothing applies twice.
5. a retried or speculative Spark task stages a partition twice: the apply
   keeps one copy per (topic, partition, offset) (``dedupe``). The copies
   show: the staging table then holds more rows than the successful tasks
   reported (each task's COPY commits before it reports), so only a batch
   whose count matches skips the dedupe's sort.
6. a record the database rejects with a *data* error (SQLSTATE class 22 or
   23 but 23503, ``errors.classify``; fields are staged as text and cast in
   the apply, so every value's verdict is the database's and arrives here
   with its SQLSTATE): the failed attempt is counted outside the transaction
   and the batch is retried at once, in this driver. Past
   ``max_batch_attempts`` counted failures it is staged again with raw bytes
   and isolated (``_isolate``): the whole batch is tried under a savepoint,
   and a range that fails with a data error is halved until the failing
   records stand alone, so k poison records among n cost about 2k·log2(n)
   statements. Rejected records go to the dead-letter table with their
   coordinates, raw bytes, message and SQLSTATE, in the same transaction as
   the rest, and the stream moves on. A crash anywhere in this leaves the
   counted attempts behind and nothing else: the next run continues from them.
6s. a data error that isolation cannot pin on a record (a staging COPY that
   fails for a reason of no single row, an error outside the per-range
   apply): the batch fails for good with ``BatchStuck``, naming its offsets
   and the error, and its counted attempts stand, so every later run fails
   the same way at once instead of looping: an operator must look.
7. fenced: under the pipeline lock, before writing anything, the batch finds
   the pipeline's epoch changed (a newer driver, a restore, a stop for
   recovery, the fence operator) or a partition's stored ``next_offset``
   *below* the batch's start (the target was put back: applying would leave a
   gap). The transaction rolls back (two_phase: before PREPARE), nothing is
   written, no attempt is counted, and the driver exits ``EXIT_FENCED`` (3);
   a restart resumes from the database's offsets. Stored offsets *above* the
   start are not fencing: those records are skipped as in 4.
8. a transient error (connection, serialization failure, deadlock, lock or
   statement timeout, admin shutdown, out of resources: ``errors.classify``),
   on the apply connection or the guard connection (which is reopened and
   takes the running lock again; another driver holding it fails this one),
   or a foreign key whose parent row is not there yet (23503, "blocked"):
   the transaction rolls back, nothing is counted, and the driver retries the
   whole batch (staging included, on a new connection if the old one broke)
   with capped exponential backoff for ``transient_retry_seconds``; after
   that it exits 1 and a supervisor restarts it from the stored offsets. In
   two_phase, a failed COMMIT PREPARED leaves the batch prepared: the retry
   commits it first (``resolve_in_doubt``) and then applies nothing. Any
   other error (a missing table, a permission, a bug) rolls back and fails
   the run at once, uncounted: neither is the record's fault.
9. a transient (or blocked, or other) error during isolation: no record is
   quarantined for it; the whole batch rolls back (ranges already applied
   under their savepoints with it) and is handled as in 8, isolated again on
   its next attempt, since the counted failures stand.

``two_phase`` is ``exactly_once`` with the commit split in two, as in Flink's
XA sink: the writer ends with PREPARE TRANSACTION under a deterministic id
(``in_doubt.transaction_id``), the committer issues COMMIT PREPARED. One more
transition:

10. after PREPARE, before COMMIT PREPARED (in doubt): the prepared transaction
    survives the crash, holding its locks. The next start finds it by its id's
    prefix and commits it before reading the stored offsets
    (``in_doubt.resolve_in_doubt``), so the batch is applied once and the run
    continues after it.

The transitions of applying ahead (A1-A3) are in ``apply_ahead``'s docstring, those of
prepared parts (P1-P6) in ``parts``'s.

``at_least_once`` keeps none of these guards, which is what makes it the baseline
that shows duplicates. Its replay point, as ``idempotent``'s, is the offsets table
too, written right after each batch's commit in a transaction of its own
(``_store_replay_point``): a crash between the two commits replays the batch.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import errors
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import StageCount
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.committer import BatchCommitter
from spark_apps.eos_stream.sink.in_doubt import resolve_in_doubt
from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.poison_guard import PoisonGuard, batch_key
from spark_apps.eos_stream.sink.settings import SinkSettings
from spark_apps.eos_stream.sink.staging import create_stage, stage_prefix, stage_table
from spark_apps.eos_stream.sink.writer import BatchResult, BatchWriter, StagedBatch
from spark_apps.eos_stream.state import fencing


class BatchStuck(RuntimeError):
    """A batch fails with a data error that no single record of it explains
    (failure transition 6s): it will fail the same way on every attempt."""


class BatchBlocked(RuntimeError):
    """A batch waited out its retry time on a foreign key whose parent rows never came."""


def _fault_injection() -> Callable[..., None]:
    """Test-only: EOS_FAULT_POINT=before_commit|after_commit with
    EOS_FAULT_AT_BATCH=N kills this driver's whole process group (JVM and
    Python alike) with SIGKILL at that point of the N-th batch of this run. The
    line it prints names the batch's write path and its records, so a test knows
    which transitions the kill exercised. With EOS_FAULT_SKIP_EMPTY=1 it fires at
    the first batch from the N-th on that holds records instead: a continuous
    cycle that only moved past transaction markers (C5) writes nothing, so a kill
    there would leave nothing in doubt, decided or to be replayed."""
    point = os.environ.get("EOS_FAULT_POINT")
    at_batch = int(os.environ.get("EOS_FAULT_AT_BATCH", "0") or 0)
    skip_empty = os.environ.get("EOS_FAULT_SKIP_EMPTY") == "1"

    def maybe_crash(where: str, batch_number: int, path: str = "staged", records: int = 0) -> None:
        due = batch_number >= at_batch and records > 0 if skip_empty else batch_number == at_batch
        if point == where and due:
            print(f"EOS-FAULT killing the driver {where} of batch number {batch_number} ({path}) holding "
                  f"{records} records", flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)

    return maybe_crash


class BatchSink:
    """One micro-batch in, one database transaction out.

    :param settings: what the sink is set to (``SinkSettings``: the pipeline, its
        schemas, spec and mode, the epoch, the retry bounds, prepared parts).
    :param conn: driver connection used for the apply transaction.
    :param guard_conn: a second connection, autocommit, for attempt counting.
    :param reconnect: opens a new apply connection when a transient error
        broke the old one (None: the retry fails if the connection is gone).
    :param reconnect_guard: opens a new guard connection when the old one
        broke, holding the pipeline's running lock again before it returns
        (None: the retry fails if the guard connection is gone).
    :param notify: called as ``notify(event, **fields)`` for each transient
        retry (the app prints it as an ``EOS-RETRY`` line).

    ``process`` takes fill_stage, a callable(stage_name, keep_raw) that makes
    the executors COPY the batch into the staging table and returns the rows
    its successful tasks staged (a ``StageCount``, with a whole mirror's transaction
    groups), or None (Spark-specific, injected).
    """

    MAX_BACKOFF_SECONDS = 30.0

    def __init__(
        self,
        settings: SinkSettings,
        *,
        conn: PgConnection,
        guard_conn: PgConnection,
        reconnect: Callable[[], PgConnection] | None = None,
        reconnect_guard: Callable[[], PgConnection] | None = None,
        notify: Callable[..., None] | None = None,
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.spec = spec = settings.spec
        self.mode = mode = settings.mode
        self.pipeline = pipeline = settings.pipeline
        self.meta_schema = meta_schema = settings.meta_schema
        self.target_schema = target_schema = settings.target_schema
        self.prepared_parts = settings.prepared_parts
        # Parts of a batch that fell back to staging but could not be rolled back on a
        # broken connection: rolled back by the retry, before it writes (P3).
        self._abandoned_parts: list[str] = []
        self.offsets = OffsetsStore(meta_schema, pipeline)
        self.guard = PoisonGuard(guard_conn, meta_schema, pipeline, settings.max_batch_attempts)
        self.writer = BatchWriter(conn, spec, mode, self.offsets, target_schema, meta_schema, settings.epoch)
        self.committer = BatchCommitter()
        self.transient_retry_seconds = settings.transient_retry_seconds
        self._reconnect = reconnect
        self._reconnect_guard = reconnect_guard
        self._notify = notify or (lambda event, **fields: None)
        self._crash_point = _fault_injection()
        # How a retry waits (8): a driver that must end mid-batch (a SIGTERM, a stop request)
        # sets one that raises to end the wait; the failed attempt has rolled back by then.
        self.sleep: Callable[[float], Any] = time.sleep
        self._batches_this_run = 0
        # Why this driver was fenced, once a batch found out. foreachBatch runs
        # in the driver process, so run() reads it after the query has failed.
        self.fenced: str | None = None

    def process(
        self,
        batch_id: int,
        start_offsets: Mapping[TopicPartition, int],
        end_offsets: Mapping[TopicPartition, int],
        fill_stage: Callable[[str, bool], StageCount | int | None],
        staged: StagedBatch | WrittenParts | None = None,
    ) -> BatchResult:
        """Applies one micro-batch exactly once, or raises.

        :param staged: the batch already staged (``stage_name`` names its
            table) or written as prepared parts: the first attempt applies or
            decides it instead of staging; isolation and every retry stage
            again with ``fill_stage``.

        Raises ``fencing.Fenced`` (and sets ``fenced``) when this driver no
        longer owns the target; re-raises a data error after counting it, an
        "other" error at once, and a transient error once
        ``transient_retry_seconds`` of retrying it are spent."""
        self._batches_this_run += 1
        key = batch_key(start_offsets)
        deadline = time.monotonic() + self.transient_retry_seconds
        delay = 1.0
        retries = 0
        while True:
            isolate = False
            try:
                if retries:
                    self._prepare_retry()
                isolate = self.guard.should_isolate(self.guard.failed_attempts(key))
                offered, staged = staged, None  # used by the first attempt only
                result = self._attempt_offered(batch_id, start_offsets, end_offsets, fill_stage, isolate, offered)
            except fencing.Fenced as exc:
                self.fenced = str(exc)
                raise
            except Exception as exc:
                kind = errors.classify(exc)
                self._record_failure(key, kind, exc)
                if kind == "data":
                    if isolate:
                        raise self._stuck(batch_id, start_offsets, end_offsets, exc) from exc
                    # Deterministic: retried at once, isolated once the counted attempts reach the bound.
                    self._notify("retry", batch_id=batch_id, error_class=kind, sqlstate=errors.sqlstate_of(exc),
                                 message=str(exc).strip()[:500], retry_in_seconds=0)
                    continue
                if kind not in ("transient", "blocked"):
                    raise
                if time.monotonic() + delay > deadline:
                    if kind == "blocked":
                        raise self._blocked(batch_id, start_offsets, end_offsets, exc) from exc
                    raise
                retries += 1
                self._notify("retry", batch_id=batch_id, retry=retries, error_class=kind,
                             sqlstate=errors.sqlstate_of(exc), message=str(exc).strip()[:500],
                             retry_in_seconds=delay)
                self.sleep(delay)
                delay = min(delay * 2, self.MAX_BACKOFF_SECONDS)
                continue
            result.transient_retries = retries
            return result

    def _attempt_offered(
        self,
        batch_id: int,
        start_offsets: Mapping[TopicPartition, int],
        end_offsets: Mapping[TopicPartition, int],
        fill_stage: Callable[[str, bool], StageCount | int | None],
        isolate: bool,
        offered: StagedBatch | WrittenParts | None,
    ) -> BatchResult:
        """One attempt: decides the parts or applies the stage ``offered`` (first attempt only),
        else stages the batch again; an isolating attempt always stages again."""
        prefilled = None if isolate else offered
        if isinstance(offered, WrittenParts) and isolate:
            self.drop_parts(offered.prefix)  # written ahead, then not used: isolation stages
        if isinstance(prefilled, WrittenParts):
            decided = self._decide_parts(batch_id, start_offsets, end_offsets, prefilled)
            if decided is not None:
                return decided
            prefilled = None  # P2/P3: written the staged way below
        return self._attempt(batch_id, start_offsets, end_offsets, fill_stage, isolate,
                             prefilled if isinstance(prefilled, StagedBatch) else None)

    def _stuck(self, batch_id: int, start_offsets: Mapping[TopicPartition, int],
               end_offsets: Mapping[TopicPartition, int], exc: BaseException) -> BatchStuck:
        return BatchStuck(self._describe(batch_id, start_offsets, end_offsets, exc) + (
            ": it failed with a data error while its records were being isolated, so no single "
            "record explains it; it will fail the same way on every attempt"))

    def _blocked(self, batch_id: int, start_offsets: Mapping[TopicPartition, int],
                 end_offsets: Mapping[TopicPartition, int], exc: BaseException) -> BatchBlocked:
        return BatchBlocked(self._describe(batch_id, start_offsets, end_offsets, exc) + (
            f": still refused after {self.transient_retry_seconds:g}s of retries; a foreign key's "
            "parent rows must exist before the records that reference them"))

    @staticmethod
    def _describe(batch_id: int, start_offsets: Mapping[TopicPartition, int],
                  end_offsets: Mapping[TopicPartition, int], exc: BaseException) -> str:
        def start(tp: TopicPartition) -> Any:
            offset = start_offsets.get(tp)
            return "?" if offset is None else offset if offset >= 0 else "earliest"  # Kafka's -2

        ranges = ", ".join(f"{t}[{p}] {start((t, p))}..{end}" for (t, p), end in sorted(end_offsets.items()))
        code = errors.sqlstate_of(exc)
        # One line: the app's error event and the task log show the cause's first line.
        text = errors.one_line(exc, 1000)
        return (f"batch {batch_id} (offsets {ranges or 'unknown'}) failed with {type(exc).__name__}"
                f"{f' (SQLSTATE {code})' if code else ''}: {text}")

    def _record_failure(self, key: str, kind: str, exc: BaseException) -> None:
        """Counts a data failure (keeps the last error of any); an uncounted
        data failure is simply tried again (``_guard_write``)."""
        self._guard_write(lambda: self.guard.record_failure(key, f"{kind}: {type(exc).__name__}: {exc}",
                                                            counted=kind == "data"))

    def _guard_write(self, write: Callable[[], None]) -> None:
        """A write to the guard connection that a lost connection must not turn
        into a failed batch: that is weather, and the retry decides (the next
        attempt's ``failed_attempts`` meets the broken connection and reopens it)."""
        try:
            write()
        except psycopg2.Error as guard_error:
            if errors.classify(guard_error) != "transient":
                raise
            self._notify("guard_unavailable", error=str(guard_error).strip()[:500])

    def _attempt(
        self,
        batch_id: int,
        start_offsets: Mapping[TopicPartition, int],
        end_offsets: Mapping[TopicPartition, int],
        fill_stage: Callable[[str, bool], StageCount | int | None],
        record_by_record: bool,
        staged: StagedBatch | None = None,
    ) -> BatchResult:
        stage: sql.Composed | None = None
        clock = Stopwatch()
        try:
            if staged is not None:
                stage, count = stage_table(self.meta_schema, staged.name), staged.count
                clock.laps["stage"] = staged.stage_ms
            else:
                stage_name = self.stage_name(batch_id)
                stage = create_stage(self.conn, self.spec, self.meta_schema, stage_name)
                count = StageCount.of(fill_stage(stage_name, record_by_record))
                clock.lap("stage")
            prepared = self.writer.prepare(stage, batch_id, start_offsets, end_offsets, record_by_record, count)
            clock.lap("apply")
            records = prepared.applied + prepared.dead_lettered
            self._crash_point("before_commit", self._batches_this_run, records=records)
            self.committer.commit(prepared)
            clock.lap("commit")
            self._crash_point("after_commit", self._batches_this_run, records=records)
        except Exception:
            self.writer.abort()
            raise
        if not self.mode.stores_offsets:
            self._store_replay_point(end_offsets, batch_id)
        self._forget_attempts(start_offsets)
        if stage is not None:
            with self.conn.cursor() as cur:
                cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(stage))
            self.conn.commit()
        return BatchResult(batch_id, prepared.applied, prepared.dead_lettered, record_by_record, clock.laps)

    def _store_replay_point(self, end_offsets: Mapping[TopicPartition, int], batch_id: int) -> None:
        """at_least_once and idempotent: the batch's end offsets, stored right after its commit
        in a transaction of their own, under the pipeline lock and the epoch's check: the
        replay point of every engine (the Spark app, the continuous engine, the replay). A
        crash between the two commits replays the batch, as these modes allow. A transient
        failure here only leaves the replay point behind (the next batch's offsets move it
        on), so it is told, not retried."""
        try:
            with self.conn.cursor() as cur:
                self.offsets.lock(cur)
                self.writer.check_ownership(cur, {})
                self.offsets.advance(cur, end_offsets, batch_id)
            self.conn.commit()
        except Exception as exc:
            self.writer.abort()
            if errors.classify(exc) != "transient":  # Fenced among them
                raise
            self._notify("replay_point_not_stored", batch_id=batch_id, error=errors.one_line(exc))

    def parts_prefix(self, batch_id: int) -> str:
        """The id prefix of the batch's prepared parts (``parts.batch_prefix``)."""
        assert self.writer.epoch is not None, "prepared parts need an epoch"
        return parts.batch_prefix(self.pipeline, self.writer.epoch, batch_id)

    def drop_parts(self, prefix: str) -> None:
        """Rolls back a batch's undecided parts (P2, P3, A2): no decision names them, and
        none will. On a broken connection they are left for the retry to roll back."""
        if not self.prepared_parts:
            return
        try:
            parts.roll_back(self.conn, prefix)
        except psycopg2.Error:
            self._abandoned_parts.append(prefix)

    def _decide_parts(
        self,
        batch_id: int,
        start_offsets: Mapping[TopicPartition, int],
        end_offsets: Mapping[TopicPartition, int],
        written: WrittenParts,
    ) -> BatchResult | None:
        """Decides a batch written as prepared parts and commits them (P3-P5); None when
        it could not be decided and must be written the staged way (its parts rolled back)."""
        clock = Stopwatch()
        clock.laps["stage"] = written.write_ms
        clock.laps["stage_slowest_task"] = written.task_ms  # within "stage", not a phase of its own
        try:
            with self.conn.cursor() as cur:
                self.offsets.lock(cur)
                self.writer.check_ownership(cur, start_offsets)
                ahead = self.offsets.ahead_of(cur, start_offsets, end_offsets)
                if ahead:
                    raise parts.NotDecidable(f"stored offsets are past the batch's start in {', '.join(ahead)}")
                parts.decide(cur, self.spec, self.target_schema, self.meta_schema, self.pipeline, batch_id, written)
                self.offsets.advance(cur, end_offsets, batch_id)
            clock.lap("apply")
            self._crash_point("before_commit", self._batches_this_run, "prepared_parts", written.rows)
            self.conn.commit()
            clock.lap("commit")
        except fencing.Fenced:
            self.writer.abort()
            self.drop_parts(written.prefix)
            raise
        except Exception as exc:
            self.writer.abort()
            self.drop_parts(written.prefix)
            self._notify("parts_not_decided", batch_id=batch_id, error=errors.one_line(exc))
            return None
        self._crash_point("after_commit", self._batches_this_run, "prepared_parts", written.rows)
        # Decided: from here an error goes to the retry (P5), which commits the parts.
        parts.commit(self.conn, self.meta_schema, self.pipeline, written.gids)
        clock.lap("commit_parts")
        self._forget_attempts(start_offsets)
        return BatchResult(batch_id, written.rows, 0, False, clock.laps)

    def stage_name(self, batch_id: int) -> str:
        """The batch's staging table (a leftover of the same name is replaced)."""
        return f"{stage_prefix(self.pipeline)}{batch_id}"

    def _forget_attempts(self, start_offsets: Mapping[TopicPartition, int]) -> None:
        """Clears the committed batch's counted attempts. Best effort: a
        leftover count only names a batch that will never start there again."""
        self._guard_write(lambda: self.guard.finished(batch_key(start_offsets)))

    def _prepare_retry(self) -> None:
        """New connections for the ones that broke; in two_phase, this batch's own
        prepared transaction committed if COMMIT PREPARED was what failed (it
        passed the ownership check and holds the pipeline lock, so the retry
        would wait on it forever; committed, the retry's records are all below
        the stored offsets and apply nothing)."""
        if self.conn.closed:
            if self._reconnect is None:
                raise RuntimeError("the apply connection broke and there is no way to open a new one")
            self.conn = self._reconnect()
            self.writer.conn = self.conn
        if self.guard.conn.closed:
            if self._reconnect_guard is None:
                raise RuntimeError("the guard connection broke and there is no way to open a new one")
            self.guard.reopen(self._reconnect_guard())
        if self.mode.two_phase:
            resolve_in_doubt(self.conn, self.pipeline)
        if self.prepared_parts:
            # P5: a decided batch's parts are committed. The undecided ones of this epoch
            # stay: the next batch may be writing them right now.
            parts.resolve(self.conn, self.meta_schema, self.pipeline, undecided="keep")
            while self._abandoned_parts:
                parts.roll_back(self.conn, self._abandoned_parts[0])
                self._abandoned_parts.pop(0)


class Stopwatch:
    """Milliseconds per named step, each from the end of the one before."""

    def __init__(self) -> None:
        self.laps: dict[str, int] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> int:
        now = time.perf_counter()
        self.laps[name] = round((now - self._last) * 1000)
        self._last = now
        return self.laps[name]
