"""The continuous engine: a pipeline's records committed to the target tens of milliseconds
after Kafka commits them, without Spark.

    python -m spark_apps.eos_stream.run.continuous --config pipeline.json   # engine: continuous

A Spark micro-batch costs about half a second of planning, offset and commit logs and job
scheduling however few records it holds (``python -m bench.latency``); this engine has none of
it. It claims the pipeline as the Spark app and the Spark-less replay do (``driver.claim``: in-doubt
batches committed, a new epoch, the running lock, prepared parts resolved) and then loops over
*cycles*. A cycle is one ``read_committed`` consumer, assigned to every partition of the
pipeline at the stored offsets, polled until it has ``max_offsets_per_trigger`` records or
``continuous_linger_ms`` have passed since its first record; the cycle's end in each partition
is the consumer's position there (past every record it handed out, and past the transaction
markers and aborted records it skipped: never past a record it has not handed out, never past
the last stable offset, which a read_committed fetch does not cross). The records polled are
the batch: written as one prepared part, or staged from memory (every retry and an isolation
stage the same records again, without reading Kafka twice), and committed through the same
``BatchSink.process`` as every other engine (the ownership check, the data and the offsets in
one transaction, dead letters, two_phase). Every failure transition of ``sink/batch_sink.py``
(1-10) and of prepared parts (P1-P6) holds as it is. A reader of the target sees one
transaction per cycle, covering all partitions, as with a Spark micro-batch.

One process, no executors: its throughput is what one core parses and COPYs (docs/latency.md).

at_least_once and idempotent store no offsets with the rows; in them the engine commits the
consumer group's offsets (group ``eos-continuous-<pipeline>``) after the database's commit and
starts from them, the classic at-least-once sink: a crash between the two commits replays the
cycle.

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
C6. Kafka no longer holds the offset to read (retention) or the consumer reports any other
    error: the run fails (exit 1, or 4 for lost data found by the claim) before the cycle
    commits; the supervisor restarts it from the stored offsets.
C7. a stop request, ``run_seconds`` or a changed epoch is looked for between cycles, at least
    every ``stop_poll_seconds``: a stop ends the run after the cycle in flight commits (exit
    0), a changed epoch fails it (exit 3) without writing; a cycle that commits under a newer
    epoch is refused by the sink's ownership check (7) in any case.
C8. at_least_once and idempotent: a crash after the database's commit and before the consumer
    group's commit replays the cycle (duplicates in at_least_once; upserts in idempotent).
C9. SIGTERM (a supervisor's kill, a pod's eviction): the cycle in flight commits, then the
    engine exits 143 within ``stop_poll_seconds``. Not 0: whoever sent it did not ask the pipeline
    to stop, so a supervisor restarts it (a stop request is C7). A SIGKILL is C2 or C3.

Exit codes are the app's (``app.main``).
"""

from __future__ import annotations

import json
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.offsets import to_json as offsets_to_json
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.run.driver import EARLIEST, Driver, claim, import_in_background
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.part_writer import write_part_batches
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.staging import stage_batches
from spark_apps.eos_stream.state import fencing, meta_tables
from spark_apps.eos_stream.state.control import StopSignal

# librdkafka's offset of a partition the consumer has handed nothing out of yet.
_NO_POSITION = -1001
# librdkafka hands out at most this many messages per consume() call (it refuses more).
_MAX_CONSUME = 100_000
# The longest one poll waits while no record has come: a cycle's first record waits at most
# this long in librdkafka's queue before the linger starts.
_IDLE_POLL_SECONDS = 0.005
# C9: the stop reason a SIGTERM gives, and the exit code it ends with (128 + SIGTERM, as a shell
# reports a process the signal ended).
TERMINATED = "SIGTERM: ended after the cycle in flight"
EXIT_TERMINATED = 128 + signal.SIGTERM


@dataclass
class Cycle:
    """What one cycle read: its records in poll order, and each moved partition's range."""

    messages: list[Any]
    starts: dict[TopicPartition, int]
    ends: dict[TopicPartition, int]

    def batches(self) -> Iterator[Any]:
        """The records as Arrow batches of at most one COPY chunk each."""
        for first in range(0, len(self.messages), kafka_ranges.CHUNK_RECORDS):
            yield kafka_ranges.message_batch(self.messages[first:first + kafka_ranges.CHUNK_RECORDS])


def moved_ranges(current: dict[TopicPartition, int], positions: dict[TopicPartition, int]
                 ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    """(starts, ends) of the partitions whose position moved past where the cycle started
    (``current``: a stored offset, or EARLIEST for a partition never applied)."""
    starts, ends = {}, {}
    for tp, position in positions.items():
        start = current[tp]
        if position == _NO_POSITION or position < 0:
            continue
        if start == EARLIEST or position > start:
            starts[tp], ends[tp] = start, position
        elif position < start:
            raise RuntimeError(f"{tp[0]}[{tp[1]}]: the consumer's position {position} is below the cycle's start "
                               f"{start}")
    return starts, ends


def check_messages(messages: list[Any], starts: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> None:
    """Every record polled lies in its partition's range: a cycle never stores an offset
    below a record it writes, nor writes a record twice."""
    for m in messages:
        tp = (m.topic(), m.partition())
        start = starts.get(tp)
        if start is None or m.offset() >= ends[tp] or (start != EARLIEST and m.offset() < start):
            raise RuntimeError(f"{tp[0]}[{tp[1]}] offset {m.offset()} lies outside the cycle's range "
                               f"{start}..{ends.get(tp)}")


class Progress:
    """The progress table's rows (``stream_progress``, as the Spark app writes one per batch): one
    per ``stop_poll_seconds`` at most, summing the cycles committed since the last, so sensors and
    health read a continuous pipeline as they read a Spark one without a row per cycle."""

    def __init__(self, config: PipelineConfig, run_id: str) -> None:
        self.pipeline, self.run_id = config.pipeline, run_id
        self.insert = sql.SQL(
            "INSERT INTO {} (pipeline, run_id, batch_id, input_rows, start_offsets, end_offsets,"
            " durations_ms, batch_duration_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT DO NOTHING").format(meta_tables.table(config.meta_schema, meta_tables.PROGRESS))
        self._reset()

    def _reset(self) -> None:
        self.cycles, self.rows, self.last_batch = 0, 0, -1
        self.starts: dict[TopicPartition, int] = {}
        self.ends: dict[TopicPartition, int] = {}
        self.since = time.monotonic()

    def add(self, batch_id: int, cycle: Cycle, rows: int) -> None:
        self.cycles, self.rows, self.last_batch = self.cycles + 1, self.rows + rows, batch_id
        self.starts = {**cycle.starts, **self.starts}  # each partition's first start
        self.ends.update(cycle.ends)

    def record(self, conn: Any) -> None:
        """Writes the row of the cycles since the last (none: nothing) and its EOS-PROGRESS line."""
        if not self.cycles:
            return
        millis = round((time.monotonic() - self.since) * 1000)
        with conn.cursor() as cur:
            cur.execute(self.insert, (self.pipeline, self.run_id, self.last_batch, self.rows,
                                      offsets_to_json(self.starts), offsets_to_json(self.ends),
                                      json.dumps({"cycles": self.cycles, "triggerExecution": millis}), millis))
        emit("progress", batch_id=self.last_batch, input_rows=self.rows, cycles=self.cycles,
             rows_per_second=round(self.rows * 1000 / millis, 1) if millis else 0.0,
             end_offsets=offsets_to_json(self.ends))
        self._reset()


class ContinuousRun:
    """One run of the engine: claim, then cycles until stopped, fenced or failed."""

    def __init__(self, config: PipelineConfig, driver: Driver, consumer: Any) -> None:
        self.config, self.driver, self.consumer = config, driver, consumer
        self.sink: BatchSink = driver.sink()
        self.group_offsets = not driver.mode.stores_offsets  # C8: the consumer group is the replay point
        self.current = dict(driver.starting)
        self.batch_id = 0
        self.linger = config.continuous_linger_ms / 1000
        self.progress = Progress(config, driver.run_id)
        self._part_conn: Any = None
        self.stop = StopSignal(driver.control_conn, config.meta_schema, config.pipeline, config.run_seconds,
                               epoch=driver.epoch, honour_requests=not config.ignore_stop_request)
        self.terminated = False  # C9: set by the SIGTERM handler, read between cycles

    def assign(self) -> None:
        from confluent_kafka import TopicPartition as KafkaPartition

        # EARLIEST is librdkafka's OFFSET_BEGINNING too.
        self.consumer.assign([KafkaPartition(t, p, offset) for (t, p), offset in sorted(self.current.items())])

    def run(self) -> str:
        """Cycles until a stop (returned: why) or an error (raised)."""
        self.assign()
        looked_at = time.monotonic()
        while True:
            cycle = self.read_cycle(self.config.stop_poll_seconds - (time.monotonic() - looked_at))
            if cycle.messages:
                self.commit(cycle)
            if time.monotonic() - looked_at < self.config.stop_poll_seconds:
                continue  # a cycle past markers only is carried by the next one's range (C5)
            if cycle.ends and not cycle.messages:
                self.commit(cycle)  # C5: idle, past markers only
            looked_at = time.monotonic()
            self.progress.record(self.driver.control_conn)
            fenced = self.stop.fenced()
            if fenced:
                raise fencing.Fenced(fenced)
            reason = TERMINATED if self.terminated else self.stop.requested()
            if reason:
                last = self.read_cycle(0)
                if last.ends:
                    self.commit(last)
                self.progress.record(self.driver.control_conn)
                return reason

    def read_cycle(self, idle_seconds: float) -> Cycle:
        """Polls until ``max_offsets_per_trigger`` records, or the linger after the first
        record, or ``idle_seconds`` without any record; the ranges are the positions reached."""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka import TopicPartition as KafkaPartition

        wanted = self.config.max_offsets_per_trigger
        messages: list[Any] = []
        now = time.monotonic()
        idle_until, deadline = now + max(idle_seconds, 0), None
        while len(messages) < wanted:
            polled_at = time.monotonic()
            limit = deadline if deadline is not None else min(idle_until, polled_at + _IDLE_POLL_SECONDS)
            batch = min(wanted - len(messages), _MAX_CONSUME)
            for message in self.consumer.consume(batch, timeout=max(limit - polled_at, 0)):
                error = message.error()
                if error is None:
                    messages.append(message)
                elif error.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"{message.topic()}[{message.partition()}]: the consumer failed at offset "
                                       f"{message.offset()}: {error.str()}") from KafkaException(error)
            if messages and deadline is None:
                deadline = polled_at + self.linger  # the poll that found the first record counts
            now = time.monotonic()
            if (deadline is not None and now >= deadline) or (deadline is None and now >= idle_until):
                break
        partitions = [KafkaPartition(t, p) for t, p in sorted(self.current)]
        positions = {(tp.topic, tp.partition): tp.offset for tp in self.consumer.position(partitions)}
        starts, ends = moved_ranges(self.current, positions)
        check_messages(messages, starts, ends)
        return Cycle(messages, starts, ends)

    def commit(self, cycle: Cycle) -> None:
        """The cycle's records and end offsets in one transaction (``BatchSink.process``)."""
        driver, config, batch_id = self.driver, self.config, self.batch_id
        started = time.time()
        written = self.write_as_part(cycle) if driver.prepared_parts and cycle.messages else None

        def fill_stage(stage_name: str, keep_raw: bool) -> int:
            return stage_batches(driver.dsn, driver.spec, config.meta_schema, stage_name, keep_raw, cycle.batches())

        result = self.sink.process(batch_id, cycle.starts, cycle.ends, fill_stage, staged=written)
        if self.group_offsets:
            self.commit_group_offsets(cycle.ends)
        self.progress.add(batch_id, cycle, result.applied)
        self.current.update(cycle.ends)
        self.batch_id += 1
        emit("batch", batch_id=batch_id, applied=result.applied, dead_lettered=result.dead_lettered,
             record_by_record=result.record_by_record, timings_ms=result.timings_ms, records=len(cycle.messages),
             transient_retries=result.transient_retries,
             # every partition's stored offset after this cycle, as a Spark batch's end offsets
             end_offsets=offsets_to_json({tp: o for tp, o in self.current.items() if o != EARLIEST}),
             started_at=round(started, 3), committed_at=round(time.time(), 3))

    def write_as_part(self, cycle: Cycle) -> WrittenParts | None:
        """The cycle written as one prepared part, or None after rolling back what it left (P2)."""
        driver, sink = self.driver, self.sink
        prefix = sink.parts_prefix(self.batch_id)
        try:
            written = parts.write_batch(
                lambda prefix: [write_part_batches(driver.dsn, driver.spec, self.config.target_schema,
                                                   f"{prefix}0:0", cycle.batches(), self.part_connection())],
                driver.spec, prefix, self.batch_id, time.perf_counter(), emit)
        except BaseException:
            self.close_part_connection()  # it may be inside a part: the next one starts on a new session
            raise
        if written is None:
            # Refused or failed (P2): the write may have ended inside its transaction, which closing
            # the session rolls back; the next part starts on a new one.
            self.close_part_connection()
            sink.drop_parts(prefix)
        return written

    def part_connection(self) -> Any:
        """The session every cycle's part is written on: a new session costs a backend start and
        authentication, 44-225 ms each under a load average of 40 on the 2-core machine, more than
        the rest of a cycle. A session that broke is replaced at the next cycle."""
        import psycopg2

        if self._part_conn is None or self._part_conn.closed:
            self._part_conn = psycopg2.connect(**{**self.driver.dsn, "application_name": "eos-part"})
        return self._part_conn

    def close_part_connection(self) -> None:
        if self._part_conn is not None and not self._part_conn.closed:
            self._part_conn.close()
        self._part_conn = None

    def commit_group_offsets(self, ends: dict[TopicPartition, int]) -> None:
        from confluent_kafka import TopicPartition as KafkaPartition

        self.consumer.commit(offsets=[KafkaPartition(t, p, end) for (t, p), end in sorted(ends.items())],
                             asynchronous=False)


def group_starting(consumer: Any, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
    """C8: where at_least_once and idempotent resume: the consumer group's committed offsets
    (EARLIEST where it committed none)."""
    from confluent_kafka import TopicPartition as KafkaPartition

    committed = consumer.committed([KafkaPartition(t, p) for t, p in partitions], timeout=30)
    return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else EARLIEST for tp in committed}


def run_continuous(config: PipelineConfig) -> int:
    """Runs the engine until stopped; returns the app's exit code (or raises as the app does)."""
    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient

    import_in_background("pandas")  # pyarrow's first array from Python objects imports it: not in a cycle
    spec = load_spec(config.spec)
    mode = preflight.delivery_mode(config, spec)
    preflight.refuse_compacted(AdminClient(with_python_logging({"bootstrap.servers": config.kafka_bootstrap,
                                            **config.librdkafka_options()})), list(config.topics), "continuous")
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-continuous-" + uuid.uuid4().hex[:6]
    emit("start", pipeline=config.pipeline, run_id=run_id, config=config.redacted(), engine="continuous")
    driver = claim(config, spec, mode, run_id)
    if driver is None:
        return 0
    consumer = Consumer(with_python_logging(kafka_ranges.consumer_settings(
        config.kafka_bootstrap, config.librdkafka_options(), f"eos-continuous-{config.pipeline}",
        prefetch_records=100_000)))
    try:
        if not mode.stores_offsets:
            driver.starting = group_starting(consumer, sorted(driver.starting))
        engine = ContinuousRun(config, driver, consumer)
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(engine, "terminated", True))
        try:
            reason = engine.run()
        finally:
            engine.close_part_connection()
    finally:
        consumer.close()
        driver.close()
    emit("stopped", reason=reason)
    emit("finished", pipeline=config.pipeline, run_id=run_id, engine="continuous")
    return EXIT_TERMINATED if reason == TERMINATED else 0


def main(argv: list[str] | None = None) -> int:
    from spark_apps.eos_stream.run import entry

    return entry.main(argv, run_continuous)


if __name__ == "__main__":
    sys.exit(main())
