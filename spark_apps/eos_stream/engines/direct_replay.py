"""The direct replay: a pipeline replayed to Kafka's last stable offsets without Spark.

    python -m spark_apps.eos_stream.engines.direct_replay --config pipeline.json

A recovery runs it in the Airflow worker's process when its ``replay_engine`` says ``direct``
(or ``auto`` finds the replay small: ``utils/replay_engine.py``).

A recovery's replay is usually small (what came after the snapshot) and
urgent, and a cold spark-submit and a cold first micro-batch cost it about
20 s before the first record moves. This replay makes the same claim as the
Spark engine (``start.claim``: in-doubt batches committed, a new epoch, the
running lock, prepared parts resolved) and writes through the same sink
(``BatchSink``: the ownership check, the data and the offsets in one
transaction, dead letters, two_phase), so every failure transition of
``sink/batch_sink.py`` holds as it is. Only the reading differs: one
``read_committed`` consumer in this process reads each range as the Spark
engine's tasks read theirs (``kafka_ranges``), and writes it as they do: as one
prepared part (``part_writer.write_part``; the replay is a driver with one
task, P1-P6) where the Spark engine would, decided and committed by the sink, and
otherwise, or when the part is refused, staged (``staging.stage_ranges``),
where the database judges each record.

It reads what the partitions held below their last stable offset when it
started (as ``availableNow`` does), in batches of at most
``max_offsets_per_trigger`` offsets shared among the partitions with records
left (``batch_ranges``), each partition's range read in turn. Memory is bounded by a consumer
fetch and a COPY chunk. Its own transitions:

R1. crash before the first batch: nothing written; the rerun claims again
    (a new epoch) and starts from the stored offsets.
R2. crash between batches: the committed batches carry their end offsets, so
    the rerun starts after them.
R3. Kafka no longer holds a record the replay needs (retention): the consumer
    reports it (``auto.offset.reset=error``), the batch rolls back, the run
    fails at once with the offset it needed (a broker error is not poison and
    is not retried: nothing is quarantined, no attempt is counted). The
    recovery's retention check refuses such a replay beforehand.
R4. a partition's records below its end do not arrive within
    ``kafka_ranges.STALL_SECONDS``: the batch fails uncommitted instead of
    storing an end offset it has not read up to.
R5. a compacted topic (``cleanup.policy`` with ``compact``): refused before the
    claim, nothing written (``preflight.refuse_compacted``).
R6. a batch written as a prepared part: the sink's P1-P6 with one task. A crash
    after PREPARE and before the decision leaves an undecided part, rolled back
    by the rerun's claim (P1); after the decision, a decided one, committed by
    it (P4). A part refused or failed is rolled back and the batch staged (P2);
    the reader of the refused range is closed at once, so the staged read of
    the same consumer starts clean.

Exit codes: ``run/entry.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from spark_apps.eos_stream import collector
from spark_apps.eos_stream.engines.shared import batch_event, write_one_part
from spark_apps.eos_stream.engines.start import EARLIEST, Driver, begin, import_in_background, open_consumer
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.kafka.ranges import OffsetRange
from spark_apps.eos_stream.records.spec import StageCount
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.part_writer import write_part
from spark_apps.eos_stream.sink.parts import WrittenParts
from spark_apps.eos_stream.sink.staging import stage_ranges


def partition_bounds(config: PipelineConfig, partitions: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
    """(earliest, last stable) offset of each partition, as read_committed consumers see them."""
    from confluent_kafka import IsolationLevel
    from confluent_kafka import TopicPartition as KafkaPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient(with_python_logging({"bootstrap.servers": config.kafka_bootstrap,
                                             **config.librdkafka_options()}))
    bounds: dict[TopicPartition, list[int]] = {tp: [0, 0] for tp in partitions}
    for index, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
        futures = admin.list_offsets({KafkaPartition(t, p): spec for t, p in partitions},
                                     isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=30)
        for kafka_partition, future in futures.items():
            bounds[(kafka_partition.topic, kafka_partition.partition)][index] = future.result().offset
    return {tp: (low, high) for tp, (low, high) in bounds.items()}


def batch_ranges(starting: dict[TopicPartition, int], bounds: dict[TopicPartition, tuple[int, int]],
                 max_offsets: int) -> Iterator[list[tuple[TopicPartition, int, int]]]:
    """Each batch's ranges, ``(partition, start, end)`` in partition order: what lies between
    the stored offsets and the last stable offsets. Every partition with offsets left has a
    range in every batch, and a batch holds at most ``max_offsets`` offsets, shared evenly among
    them (what a partition does not need goes to the others): a small replay is one
    transaction, not one per partition. A partition never applied starts at EARLIEST, as the Spark engine's first batch
    does (the ownership check sees no gap below it)."""
    start = dict(starting)
    position = {tp: bounds[tp][0] if offset == EARLIEST else offset for tp, offset in starting.items()}
    while True:
        pending = [tp for tp in sorted(starting) if position[tp] < bounds[tp][1]]
        if not pending:
            return
        # Fill the batch evenly: the partitions with the fewest offsets left take all of them, and
        # what they leave of their share goes to the others.
        budget, ends = max(max_offsets, len(pending)), {}
        for index, tp in enumerate(sorted(pending, key=lambda tp: (bounds[tp][1] - position[tp], tp))):
            take = min(bounds[tp][1] - position[tp], budget // (len(pending) - index))
            ends[tp], budget = position[tp] + take, budget - take
        batch = []
        for tp in pending:
            batch.append((tp, start[tp], ends[tp]))
            start[tp] = position[tp] = ends[tp]
        yield batch


def write_as_part(driver: Driver, sink: BatchSink, consumer: Any, batch_id: int,
                  ranges: list[OffsetRange]) -> WrittenParts | None:
    """The batch written as one prepared part, or None after rolling back whatever it left
    (P2: refused, or the read failed): then the sink stages it, and a read that failed here
    fails there the same way."""
    return write_one_part(sink, driver.spec, batch_id, lambda name: write_part(
        driver.dsn, driver.spec, driver.config.target_schema, name, consumer, ranges))


def replay(config: PipelineConfig) -> int:
    """Replays to the last stable offsets; returns the exit code (``run/entry.py``; or raises as every engine does)."""
    from confluent_kafka.admin import AdminClient

    entered = time.perf_counter()
    import_in_background("pandas")
    start = begin(config, "direct")
    spec = start.spec
    admin = AdminClient(with_python_logging({"bootstrap.servers": config.kafka_bootstrap,
                                             **config.librdkafka_options()}))
    topics = list(config.topics)
    pattern = spec.subscription(topics)
    if pattern:  # a mirror's pattern: the topics it matches now (the claim reads the same list)
        topics += preflight.matching_topics(admin.list_topics(timeout=15).topics, pattern, exclude=topics)
    preflight.refuse_compacted(admin, topics, "replay")
    start.announce(preflight_ms=round((time.perf_counter() - entered) * 1000))
    driver = start.claim()
    if driver is None:
        return 0
    # One consumer reads every batch of every partition in turn; the Spark engine's tasks have a
    # shallower prefetch, for ranges nobody reads on from.
    consumer = open_consumer(config, "eos-replay")
    # After the spec and the claim, before the first batch; in an Airflow task (the provider runs the
    # replay in the task's own process, launchers/in_process.py), for the rest of that process.
    collector.tune()
    try:
        sink = driver.sink()
        bounds = partition_bounds(config, list(driver.starting))
        for batch_id, ranges in enumerate(batch_ranges(driver.starting, bounds, config.max_offsets_per_trigger)):
            starts = {tp: start for tp, start, _ in ranges}
            ends = {tp: end for tp, _, end in ranges}
            offset_ranges = [OffsetRange(*tp, start, end) for tp, start, end in ranges]
            written = write_as_part(driver, sink, consumer, batch_id, offset_ranges) if driver.prepared_parts else None

            def fill_stage(stage_name: str, keep_raw: bool,
                           offset_ranges: list[OffsetRange] = offset_ranges) -> StageCount:
                return stage_ranges(driver.dsn, spec, config.meta_schema, stage_name, keep_raw, consumer,
                                    offset_ranges)

            result = sink.process(batch_id, starts, ends, fill_stage, staged=written)
            # since_start_ms: where the replay's time went between its batches (the claim is in the resume event)
            batch_event(batch_id, result, ends, since_start_ms=round((time.perf_counter() - entered) * 1000))
    finally:
        consumer.close()
        driver.close()
    start.finished()
    return 0


def main(argv: list[str] | None = None) -> int:
    from spark_apps.eos_stream.run import entry

    return entry.main(argv, replay)


if __name__ == "__main__":
    sys.exit(main())
