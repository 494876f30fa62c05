"""A batch's Kafka offset ranges, read with ``read_committed`` where they are staged.

A micro-batch is one offset range per partition. Spark's Kafka source plans
them (triggers, ``maxOffsetsPerTrigger``, its offset log, the ranges' ends at
the last stable offset); whoever stages the batch reads them: each Spark task
its share of the ranges, all of them at once (``app.py``), or the Spark-less
replay every range of a batch (``direct_replay.py``). Both read with a librdkafka consumer of their own and
hand the records on as Arrow batches of (topic, partition, offset, key, value),
at most ``CHUNK_RECORDS`` at a time and at most ``READ_AHEAD_BYTES`` plus ``FETCH_BYTES`` of
keys and values, so memory is bounded by a chunk, in records and in bytes.

Why the executors read Kafka themselves instead of through Spark's source:
Spark's read turns every record into a Spark row and then into Arrow for the
Python worker that parses and COPYs it, a JVM hop that cost more CPU per
record than the parse and both PostgreSQL writes together
(``docs/benchmarks.md``, "Executors read their ranges"). A consumer in the
Python worker hands librdkafka's buffers to Arrow directly.

The read of a range ends when the consumer's position (which moves past
transaction markers and aborted records) reaches the range's end, so a range
ending at the last stable offset, on a marker no consumer ever receives, ends
too. Its failures:

* Kafka no longer holds an offset the range needs (retention): the consumer
  reports it (``auto.offset.reset=error``) and the read raises, naming it,
  as Spark's source does with ``failOnDataLoss``.
* the position does not move for ``STALL_SECONDS``: the read raises instead
  of staging a batch short of the end it will store.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.partitions import TopicPartition

# Kafka's "earliest" (librdkafka's OFFSET_BEGINNING and Spark's -2), for a partition never applied.
EARLIEST = -2
STALL_SECONDS = 60.0
# Records per Arrow batch handed on: one COPY chunk, and a bound on a reader's memory.
CHUNK_RECORDS = 10_000
# consume() returns when it has CHUNK_RECORDS or when this expires. A range ends at a
# partition's last stable offset, usually on a transaction marker the consumer never hands
# out, so the call that moves past the marker always waits it out: it must be short.
_CONSUME_TIMEOUT = 0.01
# The broker holds a fetch that found nothing new for up to fetch.wait.max.ms (500 by
# default); a read of a bounded range never needs that long poll.
_FETCH_WAIT_MAX_MS = 10
# librdkafka fetches ahead until this many records wait in its queue (100,000 by default): a
# range ends mid-log when maxOffsetsPerTrigger cuts it, and what is fetched past its end is
# thrown away. Two chunks keep a reader fed.
_PREFETCH_RECORDS = 2 * CHUNK_RECORDS
# The byte bound of a reader (its records held, whatever their size): librdkafka queues at most
# READ_AHEAD_BYTES ahead (queued.max.messages.kbytes; its own default) and a fetch response brings
# at most FETCH_BYTES more (fetch.max.bytes), so a chunk handed on, which is what the queue held
# and what arrived in the poll's 10 ms, holds about their sum at most. Change records of about
# 1 MB then make chunks of some 70 records, not CHUNK_RECORDS (10 GB); records of 4.6 kB still
# fill a chunk.
READ_AHEAD_BYTES = 64 * 1024 * 1024
FETCH_BYTES = 16 * 1024 * 1024
# Once that many records wait, librdkafka postpones the partition's next fetch by this long
# (1,000 ms by default): with a queue of two chunks a reader drained it and then waited most
# of that second, so reading 100k records of ~150 bytes took 2.1 s; with 10 ms, 0.19 s
# (librdkafka 2.16, one partition, the local broker).
FETCH_QUEUE_BACKOFF_MS = 10


@dataclass(frozen=True)
class OffsetRange:
    """The records of one partition from ``start`` (EARLIEST: the log's start) up to ``end``, excluded."""

    topic: str
    partition: int
    start: int
    end: int


def offset_ranges(start: Mapping[TopicPartition, int], end: Mapping[TopicPartition, int]) -> list[OffsetRange]:
    """The ranges of a batch that ends at ``end`` and starts at ``start`` (a partition missing
    from ``start`` starts at EARLIEST), in partition order; partitions with nothing to read left out."""
    ranges = []
    for (topic, partition), stop in sorted(end.items()):
        first = start.get((topic, partition), EARLIEST)
        if stop > 0 and (first == EARLIEST or first < stop):
            ranges.append(OffsetRange(topic, partition, first, stop))
    return ranges


# A range is split between two tasks only where both pieces hold at least this many records:
# a piece costs its task an assignment and the wait past its end, milliseconds, while a batch of
# two change partitions and a transaction topic left one task 14,000 records more than the other
# when pieces had to hold a chunk (10,000).
MIN_PIECE_RECORDS = 2_000


def balanced_shares(ranges: list[OffsetRange], tasks: int,
                    weights: Mapping[str, float] | None = None) -> list[list[OffsetRange]]:
    """``ranges`` as at most ``tasks`` shares of about equal work, a range split at an offset
    where one share fills up, so the slowest task reads no more than its part of the batch. A
    batch of whole transactions reads its change partitions and the transaction topic's one
    partition: three ranges on two task slots, whole, left one task a partition and the other
    a partition and the transaction topic. The pieces of a range go to consecutive shares, so a
    share never holds two ranges of one partition (``read_ranges``). A range from ``EARLIEST``
    has no known size (the log's start is the broker's) and is never split; its end stands for
    its size. ``weights``: a record's work, per topic, against 1 for the others' (a whole
    mirror's transaction topic: its records are counted, not staged)."""
    def size(r: OffsetRange) -> int:
        return round((r.end - (0 if r.start == EARLIEST else r.start)) * (weights or {}).get(r.topic, 1.0))

    tasks = max(1, tasks)
    left = sum(map(size, ranges))  # records not yet in a share
    shares: list[list[OffsetRange]] = [[]]
    target, filled = -(-left // tasks), 0

    def next_share() -> None:  # its target: what is left, over the shares left (an overfull one evens out)
        nonlocal target, filled
        shares.append([])
        target, filled = -(-left // (tasks - len(shares) + 1)), 0

    for r in ranges:
        while True:
            more = len(shares) < tasks  # another share may start
            room = target - filled
            records = round(room / (weights or {}).get(r.topic, 1.0))  # the room in the range's records
            if more and r.start != EARLIEST and MIN_PIECE_RECORDS <= records <= r.end - r.start - MIN_PIECE_RECORDS:
                shares[-1].append(OffsetRange(r.topic, r.partition, r.start, r.start + records))
                r = OffsetRange(r.topic, r.partition, r.start + records, r.end)
                left -= room
                next_share()
                continue
            if more and shares[-1] and room < size(r) / 2:  # it fits the next share better than this one
                next_share()
            shares[-1].append(r)
            filled += size(r)
            left -= size(r)
            break
    return [share for share in shares if share]


def limit_with_topic_on_top(limit: int, topic: str | None, starting: Mapping[tuple[str, int], int],
                            bounds: Mapping[tuple[str, int], tuple[int, int]]) -> int:
    """A batch's offsets limit (Spark's ``maxOffsetsPerTrigger``, which counts every subscribed
    partition's records) such that about ``limit`` of them are the other topics', ``topic``'s
    records coming on top in their share of the backlog at ``starting`` (``EARLIEST``: the log
    start of ``bounds``, each partition's (log start, high watermark)). At most twice ``limit``:
    the share is an estimate, and a batch stays bounded whatever the backlog holds."""
    if topic is None:
        return limit
    lags = {"on_top": 0, "others": 0}
    for tp, (log_start, end) in bounds.items():
        start = starting.get(tp, EARLIEST)
        lags["on_top" if tp[0] == topic else "others"] += max(0, end - (log_start if start == EARLIEST else start))
    if not lags["others"] or not lags["on_top"]:
        return limit
    return limit + min(limit, round(limit * lags["on_top"] / lags["others"]))


def consumer_settings(bootstrap: str, security: Mapping[str, str], group: str,
                      prefetch_records: int = _PREFETCH_RECORDS) -> dict[str, Any]:
    """A range reader's librdkafka settings. ``security``: the connection's options in
    librdkafka's names (``PipelineConfig.librdkafka_options``); they travel to executors inside
    the task's closure, never on a command line. ``prefetch_records``: how far librdkafka
    fetches ahead; a reader that reads on from one range to the next wants it deeper."""
    return {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
            "isolation.level": "read_committed", "auto.offset.reset": "error",
            "fetch.wait.max.ms": _FETCH_WAIT_MAX_MS, "queued.min.messages": prefetch_records,
            "queued.max.messages.kbytes": READ_AHEAD_BYTES // 1024, "fetch.max.bytes": FETCH_BYTES,
            "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS, **security}


# One consumer per Python worker process and settings: Spark reuses its Python workers across
# tasks, and a consumer's connection and metadata cost tens of milliseconds per task.
_WORKER_CONSUMERS: dict[str, Any] = {}


def worker_consumer(settings: Mapping[str, Any]) -> Any:
    """This process's consumer for ``settings``, made on first use."""
    from confluent_kafka import Consumer

    key = json.dumps(settings, sort_keys=True)
    consumer = _WORKER_CONSUMERS.get(key)
    if consumer is None:
        consumer = _WORKER_CONSUMERS[key] = Consumer(with_python_logging(settings))
    return consumer


def drop_worker_consumer(settings: Mapping[str, Any]) -> None:
    """Closes and forgets this process's consumer for ``settings`` (after a failed read)."""
    consumer = _WORKER_CONSUMERS.pop(json.dumps(settings, sort_keys=True), None)
    if consumer is not None:
        consumer.close()


def read_ranges(consumer: Any, ranges: Iterable[OffsetRange]) -> Generator[list[Any], None, None]:
    """The committed records of ``ranges`` (one per partition), as lists of confluent-kafka
    messages of one partition each, at most ``CHUNK_RECORDS``, in offset order; the partitions'
    lists interleaved as their fetches arrive.

    Every range is assigned at once, so one fetch request serves all their partitions: a task
    reading the ranges of twenty change topics one after the other paid an assignment, a fetch
    round trip and the wait past the final marker twenty times."""
    from confluent_kafka import KafkaException
    from confluent_kafka import TopicPartition as KafkaPartition

    share = list(ranges)
    if not share:
        return
    if len({(r.topic, r.partition) for r in share}) < len(share):
        raise ValueError(f"two ranges of one partition cannot be read together: {share}")
    assigned = [KafkaPartition(r.topic, r.partition, r.start) for r in share]
    consumer.assign(assigned)
    try:
        yield from _chunks(consumer, share)
    finally:
        # Stops its prefetch past the ranges' ends; a consumer too broken for that is dropped anyway.
        # The pauses of finished ranges are lifted first: this worker's consumer reads other
        # ranges of these partitions in later tasks.
        with contextlib.suppress(KafkaException):
            if len(share) > 1:
                consumer.resume(assigned)
            consumer.unassign()


class _Progress:
    """Where each unfinished range of a read is, and when it last moved (R4)."""

    def __init__(self, ranges: list[OffsetRange]) -> None:
        self.pending = {(r.topic, r.partition): r for r in ranges}
        self.position = {(r.topic, r.partition): r.start for r in ranges}
        self.moved_at = dict.fromkeys(self.pending, time.monotonic())

    def advance(self, consumer: Any) -> list[OffsetRange]:
        """Reads the consumer's positions; returns the ranges they finished (and forgets them)."""
        from confluent_kafka import TopicPartition as KafkaPartition

        finished = []
        for tp in consumer.position([KafkaPartition(t, p) for t, p in self.pending]):
            key = (tp.topic, tp.partition)
            if tp.offset > self.position[key]:
                self.position[key], self.moved_at[key] = tp.offset, time.monotonic()
            if self.position[key] >= self.pending[key].end:
                finished.append(self.pending.pop(key))
        return finished

    def stalled(self) -> RuntimeError | None:
        """R4: the first unfinished range whose position has not moved for ``STALL_SECONDS``."""
        now = time.monotonic()
        for key, r in sorted(self.pending.items()):
            if now - self.moved_at[key] > STALL_SECONDS:
                return RuntimeError(f"{r.topic}[{r.partition}]: no progress past offset {self.position[key]} "
                                    f"in {STALL_SECONDS:.0f}s while reading up to {r.end}")
        return None


def _chunks(consumer: Any, ranges: list[OffsetRange]) -> Iterator[list[Any]]:
    from confluent_kafka import TopicPartition as KafkaPartition

    progress = _Progress(ranges)
    while progress.pending:
        # One list per partition: each chunk handed on is one partition's run, in offset order.
        chunks: dict[tuple[str, int], list[Any]] = {}
        for message in consumer.consume(CHUNK_RECORDS, timeout=_CONSUME_TIMEOUT):
            key = (message.topic(), message.partition())
            if message.error() is not None:
                _raise_read_error(message, progress)
                continue
            r = progress.pending.get(key)
            if r is not None and message.offset() < r.end:
                chunks.setdefault(key, []).append(message)
        yield from chunks.values()
        finished = progress.advance(consumer)
        if finished and progress.pending:
            # No fetching past a finished range's end while the others are read.
            consumer.pause([KafkaPartition(r.topic, r.partition) for r in finished])
        if progress.pending and (stall := progress.stalled()) is not None:
            raise stall


def _raise_read_error(message: Any, progress: _Progress) -> None:
    """R3 (an offset deleted by retention) and any other consumer error, naming the partition
    and the offset it needed; a partition's end-of-log notice is not an error."""
    from confluent_kafka import KafkaError, KafkaException

    error = message.error()
    if error.code() == KafkaError._PARTITION_EOF:
        return
    key = (message.topic(), message.partition())
    r = progress.pending.get(key) or min(progress.pending.values(), key=lambda r: (r.topic, r.partition))
    gone = " (deleted by retention: the log starts above it)" if error.code() == KafkaError._AUTO_OFFSET_RESET else ""
    raise RuntimeError(f"{r.topic}[{r.partition}]: needs offset {progress.position[(r.topic, r.partition)]}{gone} "
                       f"while reading up to {r.end}: {error.str()}") from KafkaException(error)


class MessageChunk:
    """Up to ``CHUNK_RECORDS`` confluent-kafka messages handed on as they are. A mirror stages
    each record's bytes itself (``cdc.pipeline``): an Arrow batch of them, and Python bytes back
    from it, would copy every record twice more (profiled on 57,000 change records of about
    4.6 kB: as much CPU as librdkafka's ``consume`` of them)."""

    __slots__ = ("messages",)

    def __init__(self, messages: list[Any]) -> None:
        self.messages = messages

    @property
    def num_rows(self) -> int:
        return len(self.messages)

    def records(self) -> Iterator[tuple[str, int, int, bytes | None, bytes | None]]:
        """(topic, partition, offset, key, value) of each message, in order."""
        return ((m.topic(), m.partition(), m.offset(), m.key(), m.value()) for m in self.messages)


def message_chunks(consumer: Any, ranges: Iterable[OffsetRange]) -> Generator[MessageChunk, None, None]:
    """The committed records of ``ranges`` as :class:`MessageChunk` (``read_ranges``)."""
    reader = read_ranges(consumer, ranges)
    try:
        for chunk in reader:
            yield MessageChunk(chunk)
    finally:
        reader.close()


def record_batches(consumer: Any, ranges: Iterable[OffsetRange]) -> Generator[Any, None, None]:
    """The committed records of ``ranges`` as Arrow record batches of (topic, partition, offset,
    key, value), read together (``read_ranges``)."""
    for chunk in read_ranges(consumer, ranges):
        yield message_batch(chunk, chunk[0].topic(), chunk[0].partition())


def message_batch(messages: list[Any], topic: str | None = None, partition: int | None = None) -> Any:
    """confluent-kafka messages as one Arrow record batch of (topic, partition, offset, key,
    value), in the order given: all of ``topic`` and ``partition`` when given (a range's), else
    each message's own."""
    import pyarrow as pa

    size = len(messages)
    return pa.record_batch([
        pa.array([topic] * size if topic is not None else [m.topic() for m in messages], pa.string()),
        pa.array([partition] * size if partition is not None else [m.partition() for m in messages], pa.int32()),
        pa.array([m.offset() for m in messages], pa.int64()),
        pa.array([m.key() for m in messages], pa.binary()),
        pa.array([m.value() for m in messages], pa.binary()),
    ], names=["topic", "partition", "offset", "key", "value"])
