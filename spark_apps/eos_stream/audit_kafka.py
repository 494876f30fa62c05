"""Kafka's side of the audit: its committed records, each judged by ``records.parse_record``.

The read and the judging of a set of partitions (``read_task``) run in the audit's own
process or in worker processes (``audit_readers``); a worker's partial ``KafkaSide``
covers its own partitions only, so the parent's ``merge_sides`` of all of them is the
``KafkaSide`` of one read of every partition. The rules are in ``audit.py``'s docstring.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_apps.eos_stream.audit_rules import PartitionRange, ReadProgress, keep_latest
from spark_apps.eos_stream.records import RecordError, parse_record
from spark_apps.eos_stream.spec import AggregateTarget, PipelineSpec

TopicPartition = tuple[str, int]
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
        self.admin = AdminClient(self.client_config)

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
    from confluent_kafka import Consumer, KafkaError
    from confluent_kafka import TopicPartition as KafkaTP

    progress = ReadProgress(ends=dict(ends), starts=dict(starts), deadline=deadline)
    if progress.done:
        return
    consumer = Consumer({"bootstrap.servers": bootstrap, **(options or {}), "group.id": "eos-audit",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest", "enable.partition.eof": True})
    try:
        consumer.assign([KafkaTP(t, p, progress.starts.get((t, p), 0)) for t, p in sorted(progress.pending)])
        last_positions = time.monotonic()
        while not progress.done:
            progress.check_deadline(timeout)
            messages = consumer.consume(CONSUME_BATCH, 0.5)
            for message in messages:
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        progress.end_of_partition((str(message.topic()), int(message.partition() or 0)),
                                                  int(message.offset() or 0))
                        continue
                    raise RuntimeError(f"audit read failed: {error}")
                topic, partition = str(message.topic()), int(message.partition() or 0)
                offset = int(message.offset() or 0)
                if progress.record((topic, partition), offset):
                    yield topic, partition, offset, message.value()
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
    # per region, per aggregate: key -> latest column -> (position, value) of its last record
    latest: tuple[list, list] = field(init=False)
    # dead-lettered offsets Kafka still holds -> Kafka's copy of the value
    dead_seen: dict[tuple[str, int, int], bytes | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sums = tuple([defaultdict(Counter) for _ in range(self.aggregates)] for _ in range(2))  # type: ignore[assignment]
        self.latest = tuple([defaultdict(dict) for _ in range(self.aggregates)] for _ in range(2))  # type: ignore[assignment]


def judge_records(spec: PipelineSpec, aggregates: list[AggregateTarget],
                  ranges: Mapping[TopicPartition, PartitionRange], dead: Container[DeadLetterKey],
                  records: Iterable[tuple[str, int, int, bytes | None]]) -> KafkaSide:
    """Each record counted in its region, judged by ``parse_record`` (valid or malformed) and
    added to the aggregates' expected totals and latest values; a dead-lettered one is only
    kept (``dead_seen``), to be tried against the database.

    :param ranges: per partition of ``records``, Kafka's range and the stored offset.
    :param dead: the dead letters' coordinates (a set, or a mapping keyed by them)."""
    side = KafkaSide(len(aggregates))
    # A property worked out once per partition, not once per record.
    applied_end = {tp: rng.applied_end for tp, rng in ranges.items()}
    for topic, partition, offset, value in records:
        tp, key = (topic, partition), (topic, partition, offset)
        region = 0 if offset < applied_end[tp] else 1
        side.committed[region][tp] += 1
        if key in dead:
            side.dead_seen[key] = value  # tried against the database, not judged here
            continue
        try:
            record: dict[str, Any] | None = parse_record(spec, value)
        except RecordError:
            record = None
        if record is None:
            side.malformed[region][tp].add(offset)
            continue
        side.valid[region][tp].add(offset)
        for index, target in enumerate(aggregates):
            group = tuple(record[k] for k in target.group_by)
            for column, source in target.increments.items():
                amount = record[source] if source else 1
                if amount is not None:  # the apply's COALESCE(sum(...), 0): NULL adds nothing
                    side.sums[region][index][group][column] += amount
            for column, source in target.latest.items():
                keep_latest(side.latest[region][index][group], column, (partition, offset), record[source])
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
