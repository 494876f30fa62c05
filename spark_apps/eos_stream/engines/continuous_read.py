"""How the continuous engine reads a cycle from Kafka (``engines/continuous.py``): one ``read_committed``
consumer assigned to every partition of the pipeline, polled until the cycle holds
``max_offsets_per_trigger`` records, or ``continuous_max_bytes`` of keys and values, or
``continuous_linger_ms`` passed since its first record. The cycle's end in each partition is
the consumer's position there.

The consumer's errors: an end of partition is no error; an error librdkafka calls retriable,
or one of the connection's (``_WEATHER``: the broker down, restarting or moving a leader), is
waited out while librdkafka reconnects, for at most ``transient_retry_seconds`` in a row
(``reconnect.Outage``, step ``kafka read``); any other error (a lost offset, a denied access, a
fatal one) fails the run before the cycle commits.

Every poll of the engine reads the topics' partitions (``refresh``): a partition added to a
topic is held back until the topic's other partitions are committed up to their last stable
offsets of that moment, then assigned from its earliest offset (C12 of ``engines/continuous.py``).

A mirror of whole source transactions paces its cycles through a backlog (``cycle_pace``): each
partition gives a cycle its share, the partitions kept level in the source's history, the
transaction topic leading, and the cycle waits for those shares rather than ending on the linger;
what a partition fetched past its share is carried to the next cycle (C14).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from spark_apps.eos_stream.engines import cycle_pace
from spark_apps.eos_stream.engines.cycle_pace import Pace
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.kafka.offsets import to_json as offsets_to_json
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.kafka.ranges import EARLIEST
from spark_apps.eos_stream.state.reconnect import Outage

# librdkafka's offset of a partition the consumer has handed nothing out of yet.
_NO_POSITION = -1001
# librdkafka hands out at most this many messages per consume() call (it refuses more).
_MAX_CONSUME = 100_000
# The longest one poll waits while no record has come: a cycle's first record waits at most
# this long in librdkafka's queue before the linger starts.
_IDLE_POLL_SECONDS = 0.005
# How long the probe of a Kafka outage (a metadata request) waits for a broker.
_PROBE_SECONDS = 2.0


def _weather_codes() -> frozenset[int]:
    """librdkafka's codes of a broker that is down, restarting or handing a partition over:
    a consumer reconnects and fetches again by itself (not all of them flagged retriable)."""
    from confluent_kafka import KafkaError as E

    return frozenset({E._TRANSPORT, E._ALL_BROKERS_DOWN, E._RESOLVE, E._TIMED_OUT, E._WAIT_COORD,
                      E.NETWORK_EXCEPTION, E.REQUEST_TIMED_OUT, E.LEADER_NOT_AVAILABLE,
                      E.NOT_LEADER_FOR_PARTITION, E.BROKER_NOT_AVAILABLE, E.REPLICA_NOT_AVAILABLE,
                      E.COORDINATOR_NOT_AVAILABLE, E.NOT_COORDINATOR, E.COORDINATOR_LOAD_IN_PROGRESS})


def kafka_error_kind(error: Any) -> str:
    """``skip`` (an end of partition), ``transient`` (waited out) or ``fatal`` (fails the run)
    for a ``KafkaError`` the consumer handed out."""
    from confluent_kafka import KafkaError

    if error.code() == KafkaError._PARTITION_EOF:
        return "skip"
    if error.fatal():
        return "fatal"
    return "transient" if error.retriable() or error.code() in _weather_codes() else "fatal"


def record_bytes(message: Any) -> int:
    """What a record's key and value weigh in a cycle's byte bound."""
    return len(message.key() or b"") + len(message.value() or b"")


def poll_count(records_left: int, bytes_left: int, largest: int) -> int:
    """How many records one poll may ask for: no more than the records left, librdkafka's
    limit, and what fits in the bytes left at the largest record the reader has seen
    (``largest``; 0: none yet, so one record), but at least one. A cycle passes its byte bound by
    at most the last poll's records, which were each thought to fit. A poll takes whatever
    arrives until its count or its timeout, so the estimate must not be a cycle's own: one that
    began with a tombstone would think a thousand records of 1 MB fit in 8 MiB."""
    fits = bytes_left // largest if largest > 0 else 1
    return max(1, min(records_left, _MAX_CONSUME, fits))


@dataclass
class Cycle:
    """What one cycle read: its records in poll order, and each moved partition's range."""

    messages: list[Any]
    starts: dict[TopicPartition, int]
    ends: dict[TopicPartition, int]
    bytes: int = 0

    def batches(self, as_messages: bool = False) -> Iterator[Any]:
        """The records in chunks of at most one COPY chunk each: Arrow batches, or
        ``kafka_ranges.MessageChunk`` (``as_messages``: a mirror's, which reads each record itself)."""
        for first in range(0, len(self.messages), kafka_ranges.CHUNK_RECORDS):
            chunk = self.messages[first:first + kafka_ranges.CHUNK_RECORDS]
            yield kafka_ranges.MessageChunk(chunk) if as_messages else kafka_ranges.message_batch(chunk)


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


class CycleReader:
    """Reads cycles on ``consumer`` from ``current`` (each partition's next offset, or
    EARLIEST), which the caller moves on as it hands each cycle over to be committed (C13: before
    the commit itself; ``refresh`` is called only once every cycle handed over has committed).

    :param max_records: a cycle's record bound (``max_offsets_per_trigger``).
    :param max_bytes: a cycle's bound on its records' keys and values (``continuous_max_bytes``).
    :param linger: seconds a cycle goes on polling after its first record.
    :param outage_seconds: how long Kafka's transient errors may go on in a row.
    """

    def __init__(self, consumer: Any, current: dict[TopicPartition, int], bootstrap: str, *, max_records: int,
                 max_bytes: int, linger: float, outage_seconds: float, lead_topic: str | None = None) -> None:
        self.consumer, self.current = consumer, current
        self.max_records, self.max_bytes, self.linger = max_records, max_bytes, linger
        # A whole mirror's cycles take each partition's share of a backlog (``cycle_pace``), its
        # transaction topic (``lead_topic``) leading; the records a cycle refused are carried, in
        # order, to the next (its range ends at the first of them), their partition's fetches
        # paused while they reach ``carry_bytes``.
        self.lead_topic = lead_topic
        self.sizes: dict[TopicPartition, float] = {}  # each partition's average record bytes in its last cycle
        # This cycle's reads of each partition: [its last record's offset + 1, bytes, records].
        self.reads: dict[TopicPartition, list[int]] = {}
        self.spans: dict[TopicPartition, int] = {}  # each partition's lag when the backlog was first paced
        self.carried: dict[TopicPartition, list[Any]] = {}
        self.carried_bytes: dict[TopicPartition, int] = {}
        self.paused: dict[TopicPartition, int] = {}  # paused partitions: the offset to fetch from
        # A partition's carried records past this many bytes pause its fetches (a fetch's worth).
        self.carry_bytes = min(1 << 20, max_bytes)
        self.outage = Outage("kafka read", f"Kafka {bootstrap}", outage_seconds)
        # Partitions found while running, held back until their topic's others caught up: the
        # last stable offsets each of those must be committed up to.
        self.held: dict[TopicPartition, dict[TopicPartition, int]] = {}
        # The largest key and value the reader has read, for the size of its polls (poll_count).
        self.largest = 0

    def assign(self) -> None:
        from confluent_kafka import TopicPartition as KafkaPartition

        # EARLIEST is librdkafka's OFFSET_BEGINNING too.
        self.consumer.assign([KafkaPartition(t, p, offset) for (t, p), offset in sorted(self.current.items())])

    def read(self, idle_seconds: float) -> Cycle:
        """Polls until the record or byte bound, or the linger after the first record, or
        ``idle_seconds`` without any record; the ranges are the positions reached."""
        from confluent_kafka import TopicPartition as KafkaPartition

        messages: list[Any] = []
        pace = self._pace() if self.lead_topic is not None else None
        self.reads = {}
        size = self._take_carried(pace, messages)
        idle_until, deadline = time.monotonic() + max(idle_seconds, 0), None
        while len(messages) < self.max_records and size < self.max_bytes:
            polled_at = time.monotonic()
            limit = deadline if deadline is not None else min(idle_until, polled_at + _IDLE_POLL_SECONDS)
            count = poll_count(self.max_records - len(messages), self.max_bytes - size, self.largest)
            size += self._offer_polled(self.consumer.consume(count, timeout=max(limit - polled_at, 0)), pace, messages)
            if messages:
                self.outage.ok()
                if deadline is None:  # the poll that found the first record counts
                    deadline = polled_at + (self.linger if pace is None else cycle_pace.FILL_SECONDS)
            now = time.monotonic()
            if (deadline is not None and now >= deadline) or (deadline is None and now >= idle_until):
                break
            if pace is not None and pace.filled():
                break
        partitions = [KafkaPartition(t, p) for t, p in sorted(self.current)]
        positions = {(tp.topic, tp.partition): tp.offset for tp in self.consumer.position(partitions)}
        if self.lead_topic is not None:
            self.sizes.update({tp: total / count for tp, (_, total, count) in self.reads.items()})
            # A partition sought back to fetch on reports no position until it fetches: the
            # records it gave (those carried to this cycle) end its range then.
            positions.update({tp: max(end, positions.get(tp, end)) for tp, (end, _, _) in self.reads.items()})
            positions.update({tp: carried[0].offset() for tp, carried in self.carried.items()})
            self._fetch_carried_partitions()
        starts, ends = moved_ranges(self.current, positions)
        check_messages(messages, starts, ends)
        return Cycle(messages, starts, ends, size)

    def _pace(self) -> Pace | None:
        """This cycle's shares of the backlog (``cycle_pace``); None when it can hold it all."""
        from confluent_kafka import TopicPartition as KafkaPartition

        lags = {}
        for tp, start in self.current.items():
            low, high = self.consumer.get_watermark_offsets(KafkaPartition(*tp), cached=True)
            if high < 0:  # nothing fetched yet: ask the broker
                low, high = self.consumer.get_watermark_offsets(KafkaPartition(*tp), timeout=_PROBE_SECONDS)
            lags[tp] = high - (low if start == EARLIEST else start)
        bounds = cycle_pace.CycleBounds(self.max_records, self.max_bytes)
        limits = cycle_pace.shares(lags, bounds, self.sizes, self.lead_topic, self.spans)
        if limits is None:
            self.spans = {}  # caught up: the next backlog's spans are its own
            return None
        self.spans.update({tp: lag for tp, lag in lags.items() if self.spans.get(tp, 0) <= 0})
        return Pace(limits, lags)

    def _take_carried(self, pace: Pace | None, messages: list[Any]) -> int:
        """Offers the records earlier cycles refused, in order, before any new one, and lets the
        partitions they no longer fill fetch; returns the bytes of those taken."""
        carried, self.carried, self.carried_bytes = self.carried, {}, {}
        size = sum(self._offer_run(tp, records, pace, messages) for tp, records in carried.items())
        self._fetch_carried_partitions()
        return size

    def _fetch_carried_partitions(self) -> None:
        """Pauses the fetches of a partition whose carried records reach ``carry_bytes`` and
        resumes the others', so that they fetch on while the cycle commits: what is carried stays
        bounded, and the next cycle need not wait for a partition's first fetch."""
        from confluent_kafka import TopicPartition as KafkaPartition

        full = {tp for tp, size in self.carried_bytes.items() if size >= self.carry_bytes}
        for tp in sorted(set(self.paused) - full):
            # Sought to where it stopped: a resumed partition's fetches start at once (librdkafka
            # otherwise waits out a fetch backoff), and the records carried are not fetched again.
            self.consumer.resume([KafkaPartition(*tp)])
            self.consumer.seek(KafkaPartition(*tp, self.paused.pop(tp)))
        for tp in sorted(full - set(self.paused)):
            self.consumer.pause([KafkaPartition(*tp)])
            self.paused[tp] = self.carried[tp][-1].offset() + 1

    def _offer_polled(self, polled: list[Any], pace: Pace | None, messages: list[Any]) -> int:
        """Offers a poll's records in order (``_offer_runs``) and hands each error on, where it
        came; returns the bytes taken."""
        size, start = 0, 0
        for index, message in enumerate(polled):
            if message.error() is not None:
                size += self._offer_runs(polled[start:index], pace, messages)
                self._on_error(message)
                start = index + 1
        return size + self._offer_runs(polled[start:] if start else polled, pace, messages)

    def _offer_runs(self, records: list[Any], pace: Pace | None, messages: list[Any]) -> int:
        """Offers ``records`` a run of one partition's at a time (``_offer_run``): a paced cycle's
        bookkeeping record by record was a fifth of a whole mirror's continuous engine."""
        if not records:
            return 0
        size, first = 0, 0
        topic, partition = records[0].topic(), records[0].partition()
        for index in range(1, len(records)):
            message = records[index]
            if message.partition() != partition or message.topic() != topic:
                size += self._offer_run((topic, partition), records[first:index], pace, messages)
                topic, partition, first = message.topic(), message.partition(), index
        return size + self._offer_run((topic, partition), records[first:] if first else records, pace, messages)

    def _offer_run(self, tp: TopicPartition, run: list[Any], pace: Pace | None, messages: list[Any]) -> int:
        """Takes ``run`` (records of partition ``tp``, in order) into the cycle (returns their
        bytes) up to the partition's share in a paced cycle; carries the rest to the next cycle,
        in order, and all of them when the partition already has records carried."""
        carrying = tp in self.carried
        taken = 0 if carrying else len(run) if pace is None else pace.take(tp, len(run))
        weight = 0
        if taken:
            took = run if taken == len(run) else run[:taken]
            messages.extend(took)
            weights = list(map(record_bytes, took))
            weight = sum(weights)
            self.largest = max(self.largest, max(weights))
            if self.lead_topic is not None:
                read = self.reads.get(tp)
                end = took[-1].offset() + 1
                if read is None:
                    self.reads[tp] = [end, weight, taken]
                else:
                    read[0], read[1], read[2] = end, read[1] + weight, read[2] + taken
        if taken < len(run):
            if pace is not None and not carrying:
                pace.stop(tp, run[taken].offset())
            self._carry(tp, run[taken:])
        return weight

    def _carry(self, tp: TopicPartition, rest: list[Any]) -> None:
        """Carries ``rest`` to the next cycle after the partition's records carried before, and
        pauses the partition's fetches once its carried records reach ``carry_bytes``."""
        carried = self.carried.setdefault(tp, [])
        offsets = [m.offset() for m in carried[-1:] + rest]
        if not all(map(operator.lt, offsets, offsets[1:])):
            last, offset = next((a, b) for a, b in pairwise(offsets) if a >= b)
            raise RuntimeError(f"{tp[0]}[{tp[1]}]: the consumer went back to offset {offset} after "
                               f"{last}: refusing a cycle that would repeat records")
        carried += rest
        self.carried_bytes[tp] = self.carried_bytes.get(tp, 0) + sum(map(record_bytes, rest))
        if tp not in self.paused and self.carried_bytes[tp] >= self.carry_bytes:
            from confluent_kafka import TopicPartition as KafkaPartition

            self.consumer.pause([KafkaPartition(*tp)])
        if tp in self.paused or self.carried_bytes[tp] >= self.carry_bytes:
            self.paused[tp] = rest[-1].offset() + 1

    def _on_error(self, message: Any) -> None:
        from confluent_kafka import KafkaException

        error = message.error()
        kind = kafka_error_kind(error)
        if kind == "skip":
            return
        failure = RuntimeError(f"{message.topic()}[{message.partition()}]: the consumer failed at offset "
                               f"{message.offset()}: {error.str()}")
        failure.__cause__ = KafkaException(error)
        if kind == "fatal":
            raise failure
        if self.outage.since is None:
            emit("kafka_unavailable", error=error.str(), code=error.name())
        self.outage.failed(failure)  # raises past the bound

    def refresh(self, topics: list[str]) -> None:
        """Every poll: the partitions of ``topics`` from a broker. An answer ends a Kafka outage,
        none counts as one more failure. A partition found is held back until every partition
        of its topic is committed up to its last stable offset at the time (``caught_up``),
        then assigned from its earliest offset; its offsets are stored with the first cycle
        that reads it (its start EARLIEST, as the claim starts a partition never applied)."""
        from confluent_kafka import KafkaException

        found: set[TopicPartition] = set()
        try:
            for topic in topics:
                described = self.consumer.list_topics(topic, timeout=_PROBE_SECONDS).topics.get(topic)
                if described is not None and described.error is None:
                    found.update((topic, p) for p in described.partitions)
        except KafkaException as exc:
            self.outage.failed(exc)  # raises past the bound
            return
        if self.outage.since is not None:
            emit("kafka_available", after_seconds=round(time.monotonic() - self.outage.since, 1))
            self.outage.ok()
        for tp in new_partitions(set(self.current) | set(self.held), found):
            self.held[tp] = self._stable_ends([old for old in self.current if old[0] == tp[0]])
            emit("partition_found", topic=tp[0], partition=tp[1], after=offsets_to_json(self.held[tp]))
        self._assign_caught_up()

    def _stable_ends(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        from confluent_kafka import TopicPartition as KafkaPartition

        # A read_committed consumer's high watermark is the last stable offset.
        return {tp: self.consumer.get_watermark_offsets(KafkaPartition(*tp), timeout=_PROBE_SECONDS)[1]
                for tp in partitions}

    def _assign_caught_up(self) -> None:
        from confluent_kafka import TopicPartition as KafkaPartition

        ready = sorted(tp for tp, ends in self.held.items() if caught_up(self.current, ends))
        for tp in ready:
            del self.held[tp]
            self.current[tp] = EARLIEST
        if ready:
            self.consumer.incremental_assign([KafkaPartition(t, p, EARLIEST) for t, p in ready])
            emit("partitions_assigned", partitions=[f"{t}[{p}]" for t, p in ready])


def new_partitions(known: set[TopicPartition], found: set[TopicPartition]) -> list[TopicPartition]:
    """The partitions a refresh found that the engine neither reads nor holds back, in order."""
    return sorted(found - known)


def caught_up(current: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> bool:
    """Whether every partition of ``ends`` is committed up to its end there (a partition never
    applied, EARLIEST, counts as 0): a topic's new partition is read only then, so each key's
    records written before the topic grew are applied before those it wrote after, to a new
    partition (per-key order across a grow, docs/ordering.md)."""
    return all(max(current.get(tp, EARLIEST), 0) >= end for tp, end in ends.items())


def is_kafka_weather(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``KafkaException`` of an error ``kafka_error_kind`` waits out."""
    from confluent_kafka import KafkaError, KafkaException

    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(error, KafkaError) and kafka_error_kind(error) == "transient"
