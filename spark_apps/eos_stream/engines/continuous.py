"""The continuous engine: a pipeline's records committed to the target tens of milliseconds
after Kafka commits them, without Spark.

    python -m spark_apps.eos_stream.engines.continuous --config pipeline.json   # engine: continuous

A Spark micro-batch costs about half a second of planning, offset and commit logs and job
scheduling however few records it holds (``python -m bench.latency``); this engine has none of
it. It claims the pipeline as the Spark engine and the direct replay do (``start.claim``: in-doubt
batches committed, a new epoch, the running lock, prepared parts resolved) and then loops over
*cycles*. A cycle is one ``read_committed`` consumer, assigned to every partition of the
pipeline at the stored offsets (and to new partitions as they appear, C12), polled until it has
``max_offsets_per_trigger`` records or ``continuous_max_bytes`` of keys and values, or
``continuous_linger_ms`` have passed since its first record (``continuous_read``); the cycle's
end in each partition is the consumer's position there (past every record it handed out, and past the transaction
markers and aborted records it skipped: never past a record it has not handed out, never past
the last stable offset, which a read_committed fetch does not cross), or the first record a
paced cycle carried to the next (C14). The records polled are
the batch: written as one prepared part, or staged from memory (every retry and an isolation
stage the same records again, without reading Kafka twice), and committed through the same
``BatchSink.process`` as every other engine (the ownership check, the data and the offsets in
one transaction, dead letters, two_phase). Every failure transition of ``sink/batch_sink.py``
(1-10) and of prepared parts (P1-P6) holds as it is. A reader of the target sees one
transaction per cycle, covering all partitions, as with a Spark micro-batch.

One process, no executors. Its cycles overlap (C13): while cycle N commits in the database,
N+1 is staged on a thread and N+2 is read, so one core parses and COPYs while PostgreSQL
applies (docs/latency.md). Its memory is bounded by ``continuous_max_bytes`` five times:
librdkafka's prefetch queue (``consumer_settings``), the cycle being read, the one being staged
(and its Arrow copy while it is written) and the one committing (kept for its retries).

Every session the engine opens runs with ``lock_timeout`` and ``statement_timeout``
(``LOCK_TIMEOUT``, ``STATEMENT_TIMEOUT``; a connection's own ``options`` win), so a lock held on
a target or a hung statement ends in an error the sink retries (8) instead of blocking a cycle,
a stop and a fence without bound. A lost session, a timeout or an unreachable broker is
weather, waited out with backoff (``state/reconnect``: 0.5 s doubling to 5 s) for at most
``transient_retry_seconds`` in a row; past that bound the run fails with ``OutageTooLong``, whose
message names the step, the database or brokers and the cause (exit 1: a supervisor restarts it).

Its own transitions:

C1. crash before the first cycle commits: nothing written; the rerun claims again (a new
    epoch) and starts from the stored offsets.
C2. crash while a cycle is read, staged or written as a part: the sink's 1-3 and P1, P2 (an
    undecided part is rolled back by the rerun's claim); the rerun reads the cycle's records
    again from the stored offsets, and its cycles need not end where the lost one did.
C3. crash after a cycle's commit: its end offsets are stored with its rows (4); the rerun
    starts after them. A decided part not yet committed is committed by the claim (P4).
C4. a cycle ends on a transaction marker or inside aborted records: the end is the position
    the consumer reached, which the stored offset then holds; the next cycle starts there,
    and records below it were either committed in this cycle or were never data.
C5. a cycle that only moved past markers or aborted records (no record to write) is committed
    only when the stream has been idle for ``stop_poll_seconds`` or stops: the stored offsets
    then reach the last stable offset without a database transaction per marker.
C6. Kafka no longer holds the offset to read (retention), or the consumer reports an error
    that is neither retriable nor a lost connection (``continuous_read``): the run fails (exit
    1, or 4 for lost data found by the claim) before the cycle commits; the supervisor restarts
    it from the stored offsets.
C7. a stop request, ``run_seconds`` or a changed epoch is looked for between cycles, at least
    every ``stop_poll_seconds``, and at every wait of a cycle's retries: a stop between cycles
    ends the run after the cycle in flight commits, a stop seen in a retry's wait ends it with
    that cycle uncommitted (exit 0 either way); a changed epoch fails it (exit 3) without
    writing. A cycle that commits under a newer epoch is refused by the sink's ownership check
    (7) in any case.
C8. at_least_once and idempotent: the cycle's end offsets are stored in the offsets table right
    after its commit, in a transaction of their own (``BatchSink``, as for every engine: one
    replay point whichever engine ran before); a crash between the two commits replays the
    cycle (duplicates in at_least_once; upserts in idempotent).
C9. SIGTERM (a supervisor's kill, a pod's eviction): a cycle committing normally commits, then
    the engine exits 143 within ``stop_poll_seconds``. A cycle waiting to retry (8) is abandoned
    at once, uncommitted. Not 0: whoever sent it did not ask the pipeline to stop, so a
    supervisor restarts it (a stop request is C7). A SIGKILL is C2 or C3.
C10. a session lost (a terminated backend, a PostgreSQL restart) or a statement timed out: the
    claim is tried again whole, on new sessions, after closing its own (its running lock with
    them); a cycle's session, guard session, staging session (``staging.StageSessions``: kept
    between cycles, closed by a COPY that fails) or part session is opened again by the sink's
    retry (8, P2), the guard taking the running lock again and the retry checking the epoch again;
    the stop-and-fence poll and the progress row reopen theirs at the next poll (a row not
    written is summed into the next). Bound: ``transient_retry_seconds`` in a row, then exit 1.
C11. the brokers unreachable (killed, restarting, a leader moving): the consumer keeps
    reconnecting and the engine keeps polling; an outage of more than
    ``transient_retry_seconds`` without a record or a metadata answer fails the run (exit 1).
C12. partitions added to a topic while it runs: every poll reads the topics' partitions; a new
    one is held back until every other partition of its topic is committed up to the last
    stable offset it had when the new one was found, then read from its earliest offset, its
    offsets stored with the first cycle that reads it. A crash before that cycle commits stores
    nothing of it: the rerun's claim finds it and starts it at its earliest offset too. Per-key
    order across the grow: a key's records written before the grow are applied before the ones
    it writes after to a new partition (unless a producer with metadata older than the grow
    still writes the key to its old partition after the engine found the new one).

C13. cycles applied ahead (``sink/apply_ahead``: every mode here stores its offsets in the
    database, so the transitions A1-A3 hold as they are): cycle N is handed over, staged on a
    stager thread once N-1's staging has ended and committed on an applier thread once N-1 has
    committed, while the loop reads N+1 from N's end. Commits stay one at a time and in
    order; once one fails no later one commits, and the failure is raised in the loop at the
    next hand-over or before the loop looks around. Everything between cycles (C5's idle
    commit aside, the progress row, the running lock, new partitions, the stop and the epoch)
    happens only after every cycle handed over has committed. A crash with N committing and N+1
    staged is A1: the rerun starts from N's start. A cycle written as a prepared part (P1-P6)
    is not applied ahead: its part is written and decided in the loop, as before.
C14. a whole mirror's cycles through a backlog are paced (``cycle_pace``): the records a
    partition gives past its share are carried, in order, to the next cycle, and its range ends
    at the first of them; its fetches pause while they reach a fetch's worth. A carried record
    is in no committed range: a crash loses it with the cycle, and the rerun reads it again from
    the stored offsets. If the consumer hands out a record of a partition at or below the last
    one carried, the run fails (exit 1) before that cycle commits.
C15. a whole mirror's cycles applied ahead hold their incomplete source transactions in memory
    (``cycle_hold``, H1-H5): a cycle stages what applies and stores each partition's first record
    not applied; the next cycle walks the held records with its own. Held too long or past
    ``continuous_max_bytes``, they go to ``held_changes`` (H3), and an idle stream commits an
    empty cycle to move them there.

Bounds on ending: a SIGTERM or a stop request ends the run within ``stop_poll_seconds`` between
cycles; mid-cycle within the statement in flight (at most ``LOCK_TIMEOUT`` waiting for a lock,
``STATEMENT_TIMEOUT`` running, 10 s connecting) plus 0.05 s. A fence waits on the engine's
pipeline lock at most as long.

Exit codes: ``run/entry.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from spark_apps.eos_stream import collector, errors
from spark_apps.eos_stream.cdc.transactions_sql import holds_records
from spark_apps.eos_stream.engines.continuous_progress import Progress
from spark_apps.eos_stream.engines.continuous_read import Cycle, CycleReader, is_kafka_weather
from spark_apps.eos_stream.engines.continuous_waits import EXIT_TERMINATED, TERMINATED, Interrupted, Waits
from spark_apps.eos_stream.engines.cycle_hold import CyclePlan, TransactionHolds
from spark_apps.eos_stream.engines.shared import batch_event, poll_stop, write_one_part
from spark_apps.eos_stream.engines.start import EARLIEST, Driver, Start, begin, import_in_background, open_consumer
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.records.spec import StageCount
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink.apply_ahead import ApplyAhead
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.part_writer import write_part_batches
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.postgres import connect
from spark_apps.eos_stream.sink.staging import StageSessions, reads_messages, stage_batches
from spark_apps.eos_stream.sink.writer import StagedBatch
from spark_apps.eos_stream.state import reconnect

# Every session's lock and statement timeouts: a cycle's statements take milliseconds, a cycle's
# COPY of ``continuous_max_bytes`` a few seconds. Short enough that a SIGTERM's 5 s before the
# hook's SIGKILL covers a lock wait.
LOCK_TIMEOUT, STATEMENT_TIMEOUT = "3s", "30s"
def with_session_timeouts(config: PipelineConfig) -> PipelineConfig:
    """``config`` with ``LOCK_TIMEOUT`` and ``STATEMENT_TIMEOUT`` in its sessions' startup
    options, before the connection's own ``options`` (or ``PGOPTIONS``), which win."""
    own = str(config.postgres.options.get("options") or os.environ.get("PGOPTIONS", ""))
    options = f"-c lock_timeout={LOCK_TIMEOUT} -c statement_timeout={STATEMENT_TIMEOUT} {own}".strip()
    return replace(config, postgres=replace(config.postgres, options={**config.postgres.options, "options": options}))


class ContinuousRun:
    """One run of the engine: claim, then cycles until stopped, fenced or failed."""

    def __init__(self, config: PipelineConfig, driver: Driver, consumer: Any, waits: Waits) -> None:
        self.config, self.driver, self.consumer, self.waits = config, driver, consumer, waits
        self.where = f"PostgreSQL {config.postgres.describe()}"
        self.sink: BatchSink = driver.sink()
        # C9, C10: a retry's wait ends on a SIGTERM or a stop, and comes often (the records wait).
        self.sink.sleep = waits.pause
        self.sink.MAX_BACKOFF_SECONDS = reconnect.MAX_BACKOFF_SECONDS
        # Each partition's stored offset after the last commit; the reader's ``current`` runs ahead
        # of it by the cycles handed over and not yet committed (C13).
        self.committed = dict(driver.starting)
        self.batch_id = 0
        mirror = driver.spec.mirror
        self.reader = CycleReader(consumer, dict(driver.starting), config.kafka_bootstrap,
                                  max_records=config.max_offsets_per_trigger, max_bytes=config.continuous_max_bytes,
                                  linger=config.continuous_linger_ms / 1000,
                                  outage_seconds=config.transient_retry_seconds,
                                  lead_topic=None if mirror is None else mirror.transaction_topic())
        self.progress = Progress(config, driver.run_id)
        self.guard_outage = reconnect.Outage("running lock", self.where, config.transient_retry_seconds)
        self._part_conn: Any = None
        self.stage_sessions = StageSessions(lambda: connect(driver.dsn, describe=config.postgres.describe(),
                                                            application_name="eos-stage"))
        # C13: staged ahead on threads unless each cycle is written as a prepared part.
        self.ahead = None if driver.prepared_parts else ApplyAhead(self.sink, driver.connect, notify=emit)
        # C15: a whole mirror applied ahead holds its incomplete transactions in memory.
        self.holds: TransactionHolds | None = None
        if mirror is not None and mirror.transaction_topic() is not None and self.ahead is not None:
            self.holds = TransactionHolds(mirror, config.continuous_max_bytes, self.held_in_database, emit)
        self.stop = driver.stop_signal()
        waits.stop = self.stop

    def run(self) -> str:
        """Cycles until a stop (returned: why) or an error (raised)."""
        self.reader.assign()
        looked_at = time.monotonic()
        while True:
            cycle = self.reader.read(self.config.stop_poll_seconds - (time.monotonic() - looked_at))
            if cycle.messages:
                self.commit(cycle)
            if time.monotonic() - looked_at < self.config.stop_poll_seconds:
                continue  # a cycle past markers only is carried by the next one's range (C5)
            if not cycle.messages and (cycle.ends or (self.holds is not None and self.holds.overdue())):
                self.commit(cycle)  # C5: idle, past markers only; C15: records held too long
            self.drain()
            looked_at = time.monotonic()
            reason = self.look_around()
            if reason:
                last = self.reader.read(0)
                if last.ends:
                    self.commit(last)
                self.drain()
                self.record_progress()
                return reason

    def look_around(self) -> str | None:
        """Between cycles (C7, C9-C11): the progress row, a Kafka outage's probe, the epoch and
        the stop; why the run must stop, or None. Raises ``Fenced``."""
        self.record_progress()
        self.keep_running_lock()
        self.reader.refresh(list(self.config.topics))
        reason = poll_stop(self.stop)
        return TERMINATED if self.waits.terminated else reason

    def keep_running_lock(self) -> None:
        """C10: the guard session holds the running lock, and a lost one is noticed only when used:
        it is looked at every poll and opened again (the lock taken again: another driver that
        took it meanwhile fails this one, ``AlreadyRunning``), so the lock is never missing for
        longer than a poll while the database is up."""
        import psycopg2

        guard = self.sink.guard
        try:
            with guard.conn.cursor() as cur:
                cur.execute("SELECT 1")
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
            self.guard_outage.failed(exc)  # raises past the bound
            try:
                guard.reopen(self.driver.reconnect_guard())
            except Exception as again:
                if errors.classify(again) != "transient":
                    raise
            return
        self.guard_outage.ok()

    def record_progress(self) -> None:
        """The progress row, on the poll's session; a lost session leaves the cycles to the next
        row, and the poll opens a new one (C10)."""
        import psycopg2

        try:
            self.progress.record(self.stop.conn)
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
            emit("progress_not_recorded", error=errors.one_line(exc))

    def commit(self, cycle: Cycle) -> None:
        """Hands the cycle over to be committed: applied ahead (C13) or at once, its records and end
        offsets in one transaction (``BatchSink.process``). The next cycle reads on from its end."""
        driver, batch_id, started = self.driver, self.batch_id, round(time.time(), 3)
        self.batch_id += 1
        self.reader.current.update(cycle.ends)
        plan = None if self.holds is None else self.holds.plan(cycle.messages, cycle.starts, cycle.ends)

        def fill_stage(stage_name: str, keep_raw: bool) -> StageCount:
            if plan is not None:
                return plan.stage(lambda chunks, after: self.stage_sessions.copy(
                    driver.spec, self.config.meta_schema, stage_name, chunks, after), keep_raw)
            return stage_batches(driver.dsn, driver.spec, self.config.meta_schema, stage_name, keep_raw,
                                 cycle.batches(as_messages=reads_messages(driver.spec)), self.stage_sessions)

        def apply(staged: StagedBatch | WrittenParts | None) -> None:
            try:
                self.apply(batch_id, cycle, fill_stage, staged, started, plan)
            except BaseException:
                if self.holds is not None:
                    self.holds.failed.set()
                raise
            finally:
                if plan is not None:
                    plan.committed.set()

        if self.ahead is not None:
            self.ahead.hand_over(batch_id, fill_stage, apply)
        else:
            apply(self.write_as_part(batch_id, cycle) if driver.prepared_parts and cycle.messages else None)

    def apply(self, batch_id: int, cycle: Cycle, fill_stage: Callable[[str, bool], StageCount],
              staged: StagedBatch | WrittenParts | None, started: float, plan: CyclePlan | None = None) -> None:
        """Commits one cycle (on the applier thread when applying ahead) and tells of it: its range
        as read, or as its plan moved it (C15)."""
        planned = None if plan is None else plan.result()
        starts, ends = (cycle.starts, cycle.ends) if planned is None else (planned.starts, planned.ends)
        try:
            result = self.sink.process(batch_id, starts, ends, fill_stage, staged=staged)
        except Exception as exc:
            if errors.classify(exc) == "transient" and not isinstance(exc, reconnect.OutageTooLong):
                # 8's retries are spent: the error names the step and where
                raise reconnect.OutageTooLong("cycle commit", self.where, self.config.transient_retry_seconds,
                                              exc) from exc
            raise
        self.progress.add(batch_id, starts, ends, result.applied)
        self.committed.update(ends)
        # The end offsets: every partition's stored offset after this cycle, as a Spark batch's.
        batch_event(batch_id, result, {tp: o for tp, o in self.committed.items() if o != EARLIEST},
                    records=len(cycle.messages), bytes=cycle.bytes, started_at=started,
                    committed_at=round(time.time(), 3))

    def held_in_database(self) -> bool:
        """Whether ``held_changes`` holds records of the pipeline (C15)."""
        config = self.config
        return bool(self.stage_sessions.query(
            lambda cur: holds_records(cur, config.meta_schema, config.pipeline)))

    def drain(self) -> None:
        """Waits until every cycle handed over has committed; raises the first one's failure."""
        if self.ahead is not None:
            self.ahead.finish()

    def write_as_part(self, batch_id: int, cycle: Cycle) -> WrittenParts | None:
        """The cycle written as one prepared part, or None after rolling back what it left (P2)."""
        driver = self.driver
        try:
            # Refused or failed (P2): the write may have ended inside its transaction, which closing
            # the session rolls back; the next part starts on a new one.
            return write_one_part(self.sink, driver.spec, batch_id, lambda name: write_part_batches(
                driver.dsn, driver.spec, self.config.target_schema, name, cycle.batches(), self.part_connection()),
                on_failed=self.close_part_connection)
        except BaseException:
            self.close_part_connection()  # it may be inside a part: the next one starts on a new session
            raise

    def part_connection(self) -> Any:
        """The session every cycle's part is written on: a new session costs a backend start and
        authentication, 44-225 ms each under a load average of 40 on the 2-core machine, more than
        the rest of a cycle. A session that broke is replaced at the next cycle (C10)."""
        if self._part_conn is None or self._part_conn.closed:
            self._part_conn = connect(self.driver.dsn, describe=self.config.postgres.describe(),
                                      application_name="eos-part")
        return self._part_conn

    def close(self) -> None:
        """Lets the cycles handed over end (their failure is ``drain``'s to raise) and closes the
        sessions the run opened beside the driver's."""
        if self.ahead is not None:
            self.ahead.close()
        self.stage_sessions.close()
        self.close_part_connection()

    def close_part_connection(self) -> None:
        if self._part_conn is not None and not self._part_conn.closed:
            self._part_conn.close()
        self._part_conn = None


def open_cycle_consumer(config: PipelineConfig) -> Any:
    """The engine's consumer (``start.open_consumer``), fetching ahead no more than a cycle's byte
    bound, so that librdkafka's queue is bounded with the cycle."""
    return open_consumer(config, "eos-continuous", **{
        "queued.max.messages.kbytes": max(1, config.continuous_max_bytes // 1024),
        "max.partition.fetch.bytes": min(1 << 20, config.continuous_max_bytes)})


def _transient(exc: BaseException) -> bool:
    """Weather a claim waits out (C10, C11): the database's, or Kafka's."""
    return (errors.classify(exc) == "transient" or isinstance(exc, preflight.KafkaUnavailable)
            or is_kafka_weather(exc))


def claim_through_outages(start: Start, waits: Waits) -> Driver | None:
    """C1, C10: the compaction check and the claim, tried again whole after a transient failure
    (a failed claim closes its sessions) for at most ``transient_retry_seconds`` in a row."""
    from confluent_kafka.admin import AdminClient

    config = start.config

    def attempt() -> Driver | None:
        admin = AdminClient(with_python_logging({"bootstrap.servers": config.kafka_bootstrap,
                                                 **config.librdkafka_options()}))
        preflight.refuse_compacted(admin, list(config.topics), "continuous")
        return start.claim()

    def told(exc: BaseException, wait: float) -> None:
        emit("retry", step="claim", error_class="transient", message=errors.one_line(exc), retry_in_seconds=wait)

    return reconnect.call_through("claim", f"PostgreSQL {config.postgres.describe()} or Kafka {config.kafka_bootstrap}",
                                  config.transient_retry_seconds, attempt, transient=_transient, sleep=waits.pause,
                                  on_retry=told)


# The interpreter lock's switch interval (Python's default 5 ms). The reader's polls release the
# lock and want it back as soon as librdkafka returns, while a stager making lines holds it; each
# of the reader's many returns waited up to the interval.
SWITCH_SECONDS = 0.001


def tune_the_interpreter() -> None:
    """Tunes the collector (``collector.tune``: after what the process made before its first
    cycle, the modules and the definition) and sets ``SWITCH_SECONDS``."""
    import sys

    collector.tune()
    sys.setswitchinterval(SWITCH_SECONDS)


def run_continuous(config: PipelineConfig) -> int:
    """Runs the engine until stopped; returns the exit code (``run/entry.py``; or raises as every engine does)."""
    import_in_background("pandas")  # pyarrow's first array from Python objects imports it: not in a cycle
    config = with_session_timeouts(config)
    start = begin(config, "continuous")
    start.announce()
    waits = Waits(config.stop_poll_seconds)
    signal.signal(signal.SIGTERM, waits.on_sigterm)
    try:
        driver = claim_through_outages(start, waits)
        if driver is None:
            return 0
        consumer = open_cycle_consumer(config)
        try:
            engine = ContinuousRun(config, driver, consumer, waits)
            tune_the_interpreter()
            try:
                reason = engine.run()
            finally:
                engine.close()
        finally:
            consumer.close()
            driver.close()
    except Interrupted as interrupted:
        reason = interrupted.reason
        emit("stopped", reason=reason, cycle_abandoned=True)
    else:
        emit("stopped", reason=reason)
    start.finished()
    return EXIT_TERMINATED if waits.terminated else 0


def main(argv: list[str] | None = None) -> int:
    from spark_apps.eos_stream.run import entry

    return entry.main(argv, run_continuous)


if __name__ == "__main__":
    sys.exit(main())
