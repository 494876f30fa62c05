"""Kafka's side of the audit: its committed records, each judged by ``records.parse_record``.

The read and the judging of a set of partitions (``read_task``) run in the audit's own
process or in worker processes (``audit_readers``); a worker's partial ``KafkaSide``
covers its own partitions only, so the parent's ``merge_sides`` of all of them is the
``KafkaSide`` of one read of every partition. The rules are in ``audit.py``'s docstring.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

from spark_apps.eos_stream.audit.rules import PartitionRange, ReadProgress, keep_latest
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.parsing import RecordError, parse_record
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec

DeadLetterKey = tuple[str, int, int]
# Records fetched per consume(): one call per batch, not per record, and the deadline
# is still looked at well within a second (a batch is judged in a fraction of one).
CONSUME_BATCH = 2000


class KafkaOffsets:
    """Partition listing and earliest/LSO offsets through one admin client."""

    def __init__(self, bootstrap: str, options: dict[str, str] | None = None) -> None:
        from confluent_kafka.admin import AdminClient

        self.client_config: dict[str, str | int | float | bool] = {"bootstrap.servers": bootstrap,
                                                                   **(options or {})}
        self.admin = AdminClient(with_python_logging(self.client_config))

    def partitions(self, topics: list[str]) -> list[TopicPartition]:
        metadata = self.admin.list_topics(timeout=15)
        missing = [t for t in topics if t not in metadata.topics or metadata.topics[t].error is not None]
        if missing:
            raise RuntimeError(f"audit: Kafka topic(s) {missing} do not exist")
        return [(t, p) for t in topics for p in sorted(metadata.topics[t].partitions)]

    def offsets(self, partitions: list[TopicPartition], which: str) -> dict[TopicPartition, int]:
        """``earliest`` or ``lso`` (latest under read_committed) per partition."""
        from confluent_kafka import IsolationLevel
        from confluent_kafka import TopicPartition as KafkaTP
        from confluent_kafka.admin import OffsetSpec

        if not partitions:
            return {}
        spec = OffsetSpec.earliest() if which == "earliest" else OffsetSpec.latest()
        futures = self.admin.list_offsets({KafkaTP(t, p): spec for t, p in partitions},
                                          isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=30)
        return {(tp.topic, tp.partition): future.result().offset for tp, future in futures.items()}


def committed_records(bootstrap: str, options: dict[str, str] | None, *, starts: dict[TopicPartition, int],
                      ends: dict[TopicPartition, int], timeout: float, deadline: float
                      ) -> Iterator[tuple[str, int, int, bytes | None]]:
    """Yields (topic, partition, offset, value) of every committed record in ``[starts, ends)``
    per partition.

    :param timeout: the read's time limit in seconds, named by the AuditTimeout it raises
        past ``deadline`` (a ``time.monotonic()`` value) for the partitions that did not finish.
    """
    # One list per consume(), flattened in C: a million records are not a million generator resumes.
    return chain.from_iterable(_committed_batches(bootstrap, options, starts=starts, ends=ends, timeout=timeout,
                                                  deadline=deadline))


def _committed_batches(bootstrap: str, options: dict[str, str] | None, *, starts: dict[TopicPartition, int],
                       ends: dict[TopicPartition, int], timeout: float, deadline: float
                       ) -> Iterator[list[tuple[str, int, int, bytes | None]]]:
    """``committed_records``, one list of them per consume()."""
    from confluent_kafka import Consumer, KafkaError
    from confluent_kafka import TopicPartition as KafkaTP

    progress = ReadProgress(ends=dict(ends), starts=dict(starts), deadline=deadline)
    if progress.done:
        return
    consumer = Consumer(with_python_logging({"bootstrap.servers": bootstrap, **(options or {}), "group.id": "eos-audit",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "enable.partition.eof": True}))
    try:
        consumer.assign([KafkaTP(t, p, progress.starts.get((t, p), 0)) for t, p in sorted(progress.pending)])
        last_positions = time.monotonic()
        while not progress.done:
            progress.check_deadline(timeout)
            # Any: the stubs type a message's topic, partition and offset as optional, for errors.
            messages: list[Any] = consumer.consume(CONSUME_BATCH, 0.5)
            batch = []
            for message in messages:
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        progress.end_of_partition((str(message.topic()), int(message.partition() or 0)),
                                                  int(message.offset() or 0))
                        continue
                    raise RuntimeError(f"audit read failed: {error}")
                # A record (no error) always has its topic, partition and offset.
                topic, partition, offset = message.topic(), message.partition(), message.offset()
                if progress.record((topic, partition), offset):
                    batch.append((topic, partition, offset, message.value()))
            yield batch
            if not messages or time.monotonic() - last_positions > 2.0:
                # Markers and aborted records deliver nothing but move the position; so does a
                # partition whose records were all deleted. Only after the batch is handled: the
                # position is already past every record consume() returned, and a partition it
                # finishes takes no more records.
                waiting = sorted(progress.pending)
                for (t, p), tp in zip(waiting, consumer.position([KafkaTP(t, p) for t, p in waiting]), strict=True):
                    progress.position((t, p), tp.offset)
                last_positions = time.monotonic()
    finally:
        consumer.close()


@dataclass
class KafkaSide:
    """What Kafka holds, split at the stored offsets: index 0 is the applied
    range (below the stored offset), index 1 the tail (at or above it)."""

    aggregates: int
    committed: tuple[Counter, Counter] = field(default_factory=lambda: (Counter(), Counter()))
    valid: tuple[dict, dict] = field(default_factory=lambda: (defaultdict(set), defaultdict(set)))
    malformed: tuple[dict, dict] = field(default_factory=lambda: (defaultdict(set), defaultdict(set)))
    sums: tuple[list, list] = field(init=False)
    # per region, per aggregate: (key, (topic, partition)) -> latest column -> (position, value) of
    # the key's last record in that partition (a key spread over partitions has one per partition)
    latest: tuple[list, list] = field(init=False)
    # dead-lettered offsets Kafka still holds -> Kafka's copy of the value
    dead_seen: dict[tuple[str, int, int], bytes | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sums = tuple([defaultdict(Counter) for _ in range(self.aggregates)] for _ in range(2))  # type: ignore[assignment]
        self.latest = tuple([defaultdict(dict) for _ in range(self.aggregates)] for _ in range(2))  # type: ignore[assignment]


def _key_of(group_by: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple]:
    """A record's aggregate key: its ``group_by`` fields' values, as a tuple."""
    if len(group_by) == 1:
        (only,) = group_by
        return lambda record: (record[only],)
    return itemgetter(*group_by)  # a tuple of two or more


def judge_records(spec: PipelineSpec, aggregates: list[AggregateTarget],
                  ranges: Mapping[TopicPartition, PartitionRange], dead: Container[DeadLetterKey],
                  records: Iterable[tuple[str, int, int, bytes | None]]) -> KafkaSide:
    """Each record counted in its region, judged by ``parse_record`` (valid or malformed) and
    added to the aggregates' expected totals and latest values; a dead-lettered one is only
    kept (``dead_seen``), to be tried against the database.

    :param ranges: per partition of ``records``, Kafka's range and the stored offset.
    :param dead: the dead letters' coordinates (a set, or a mapping keyed by them)."""
    side = KafkaSide(len(aggregates))
    # Worked out once, not once per record (a million of them): the applied end per partition,
    # and per region what each aggregate adds a record to.
    applied_end = {tp: rng.applied_end for tp, rng in ranges.items()}
    adds = [[(_key_of(target.group_by), tuple(target.increments.items()), tuple(target.latest.items()),
              side.sums[region][index], side.latest[region][index])
             for index, target in enumerate(aggregates)] for region in (0, 1)]
    any_dead = bool(dead) if isinstance(dead, Sized) else True
    for topic, partition, offset, value in records:
        tp = (topic, partition)
        region = 0 if offset < applied_end[tp] else 1
        side.committed[region][tp] += 1
        if any_dead and (topic, partition, offset) in dead:
            side.dead_seen[(topic, partition, offset)] = value  # tried against the database, not judged here
            continue
        try:
            record: dict[str, Any] | None = parse_record(spec, value)
        except RecordError:
            record = None
        if record is None:
            side.malformed[region][tp].add(offset)
            continue
        side.valid[region][tp].add(offset)
        for key_of, increments, latest, sums, latests in adds[region]:
            group = key_of(record)
            if increments:
                totals = sums[group]
                for column, source in increments:
                    amount = record[source] if source else 1
                    if amount is not None:  # the apply's COALESCE(sum(...), 0): NULL adds nothing
                        totals[column] += amount
            if latest:
                held = latests[(group, tp)]
                for column, source in latest:
                    keep_latest(held, column, (partition, offset), record[source])
    return side


def merge_sides(aggregates: int, sides: Iterable[KafkaSide]) -> KafkaSide:
    """One KafkaSide from the sides of disjoint sets of partitions: counts and totals add,
    offsets unite, and each latest value is the one at the later position (``keep_latest``),
    whichever side it came from, so the merge is the side of a single read of them all."""
    merged = KafkaSide(aggregates)
    for side in sides:
        for region in (0, 1):
            merged.committed[region].update(side.committed[region])
            for mine, theirs in ((merged.valid[region], side.valid[region]),
                                 (merged.malformed[region], side.malformed[region])):
                for tp, offsets in theirs.items():
                    mine[tp] |= offsets
            for index in range(aggregates):
                for group, counter in side.sums[region][index].items():
                    merged.sums[region][index][group].update(counter)
                for group, values in side.latest[region][index].items():
                    for column, (position, value) in values.items():
                        keep_latest(merged.latest[region][index][group], column, position, value)
        merged.dead_seen.update(side.dead_seen)
    return merged


@dataclass
class ReadTask:
    """One read of Kafka's committed records in some partitions, and what judging them needs.

    :param options: librdkafka security options (secrets: never logged, never on a command line).
    :param ranges: per partition to read, Kafka's range and the stored offset.
    :param dead: the dead letters' coordinates in those partitions.
    :param timeout: the read's time limit (for the AuditTimeout's message).
    :param deadline: when it gives up, a ``time.monotonic()`` value (one clock for every
        process on the machine, so a worker process can be given it as it is).
    """

    bootstrap: str
    options: dict[str, str]
    spec: PipelineSpec
    aggregates: list[AggregateTarget]
    ranges: dict[TopicPartition, PartitionRange]
    dead: frozenset[DeadLetterKey]
    timeout: float
    deadline: float


def read_task(task: ReadTask) -> KafkaSide:
    """The task's partitions read from their earliest offset to their LSO and judged."""
    records = committed_records(task.bootstrap, task.options, starts={tp: r.earliest for tp, r in task.ranges.items()},
                                ends={tp: r.lso for tp, r in task.ranges.items()}, timeout=task.timeout,
                                deadline=task.deadline)
    return judge_records(task.spec, task.aggregates, task.ranges, task.dead, records)
