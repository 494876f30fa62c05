"""The continuous engine's paced cycles (a whole mirror's, ``engines/cycle_pace``) on a real broker:
a backlog of large change records beside a transaction topic of small ones. Paced, the
partitions move through the backlog together, what a partition fetched past its share is carried
to the next cycle, and every record is read exactly once, in order. Unpaced, the same reader lets the partitions drift
apart, which is what pacing is for."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Consumer, Producer

from spark_apps.eos_stream.engines.continuous_read import CycleReader
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.kafka.ranges import EARLIEST
from tests.helpers.kafka import create_topic, delete_topics

CHANGES_PER_PARTITION, TRANSACTION_RECORDS = 3_000, 6_000
MAX_BYTES = 1 << 20


def _produce(bootstrap: str, changes: str, transactions: str) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for offset in range(TRANSACTION_RECORDS):  # the small records first, as a connector's metadata may be
        producer.produce(transactions, key=b"t", value=b'{"status":"END","n":%d}' % offset, partition=0)
    for _offset in range(CHANGES_PER_PARTITION):
        for partition in (0, 1):
            producer.produce(changes, key=b"k", value=b"x" * 2_000, partition=partition)
    producer.flush(30)


def _read_all(bootstrap: str, partitions: list[TopicPartition], paced: bool) -> tuple[dict, list[float], int]:
    """Every record's offset per partition, the largest gap between partitions' progress (as a
    fraction of their backlog) at any cycle's end, and how many times a cycle carried a partition's
    records to the next."""
    settings = kafka_ranges.consumer_settings(bootstrap, {}, "eos-pace-test", prefetch_records=100_000)
    consumer = Consumer({**settings, "queued.max.messages.kbytes": MAX_BYTES // 1024,
                         "max.partition.fetch.bytes": MAX_BYTES})
    totals = {tp: TRANSACTION_RECORDS if tp[1] == 0 and tp[0].endswith("tx") else CHANGES_PER_PARTITION
              for tp in partitions}
    reader = CycleReader(consumer, dict.fromkeys(partitions, EARLIEST), bootstrap, max_records=2_000,
                         max_bytes=MAX_BYTES, linger=0.05, outage_seconds=30,
                         lead_topic=partitions[-1][0] if paced else None)
    reader.assign()
    offsets: dict[TopicPartition, list[int]] = {tp: [] for tp in partitions}
    gaps, carried = [], 0
    try:
        while sum(len(v) for v in offsets.values()) < sum(totals.values()):
            cycle = reader.read(5.0)
            assert cycle.messages, "a cycle read nothing with records left"
            for message in cycle.messages:
                offsets[(message.topic(), message.partition())].append(message.offset())
            carried += len(reader.carried)
            reader.current.update(cycle.ends)
            done = [len(offsets[tp]) / totals[tp] for tp in partitions]
            gaps.append(max(done) - min(done))
    finally:
        consumer.close()
    return offsets, gaps, carried


@pytest.fixture
def topics(kafka_bootstrap: str, unique_name: str) -> Any:
    changes, transactions = f"pace{unique_name}.public.t", f"pace{unique_name}.tx"
    create_topic(kafka_bootstrap, changes, partitions=2)
    create_topic(kafka_bootstrap, transactions, partitions=1)
    _produce(kafka_bootstrap, changes, transactions)
    yield [(changes, 0), (changes, 1), (transactions, 0)]
    delete_topics(kafka_bootstrap, changes, transactions)


def test_paced_cycles_keep_partitions_in_step_and_read_every_record_once(kafka_bootstrap: str, topics: Any) -> None:
    offsets, gaps, carried = _read_all(kafka_bootstrap, topics, paced=True)
    for tp, read in offsets.items():
        total = TRANSACTION_RECORDS if tp[0].endswith("tx") else CHANGES_PER_PARTITION
        assert read == list(range(total)), f"{tp}: not every record once, in order"
    assert carried > 0, "no cycle carried records to the next: the test did not exercise it"
    assert max(gaps[:-1] or [0]) < 0.2, gaps  # in step until the last cycle (measured: at most 0.12)

    _offsets, unpaced_gaps, unpaced_carried = _read_all(kafka_bootstrap, topics, paced=False)
    assert unpaced_carried == 0 and max(unpaced_gaps) > 0.6, unpaced_gaps  # what pacing prevents
