"""The Spark-less replay's reading logic: which batches it cuts, where it
stops, and its transitions R3 and R4 (``direct_replay``), against a scripted
consumer. The real consumer and broker are in tests/integration/test_direct_replay.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError, TopicPartition

from spark_apps.eos_stream import direct_replay
from spark_apps.eos_stream.driver import EARLIEST


@dataclass
class _Message:
    offset_: int
    error_: KafkaError | None = None

    def error(self) -> KafkaError | None:
        return self.error_

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self.offset_

    def key(self) -> bytes | None:
        return None

    def value(self) -> bytes:
        return b"{}"


@dataclass
class _Consumer:
    """Hands out one scripted poll per ``consume``; its position is the offset
    after the last record handed out, or ``skip_to`` (markers, aborted records)."""
    polls: list[list[_Message]]
    skip_to: int | None = None
    position_: int = 0
    assigned: list = field(default_factory=list)

    def assign(self, partitions: list) -> None:
        self.assigned = partitions
        self.position_ = partitions[0].offset

    def consume(self, count: int, timeout: float) -> list[_Message]:
        messages = self.polls.pop(0) if self.polls else []
        for message in messages:
            if message.error_ is None:
                self.position_ = message.offset_ + 1
        if not self.polls and self.skip_to is not None:
            self.position_ = max(self.position_, self.skip_to)
        return messages

    def position(self, partitions: list) -> list[TopicPartition]:
        return [TopicPartition(partitions[0].topic, partitions[0].partition, self.position_)]


def test_batches_cut_every_max_offsets_from_the_stored_offsets_or_the_log_start() -> None:
    starting = {("t", 1): 10, ("t", 0): EARLIEST, ("t", 2): 7}
    bounds = {("t", 0): (3, 8), ("t", 1): (0, 35), ("t", 2): (0, 7)}
    assert list(direct_replay.batch_ranges(starting, bounds, 10)) == [
        (("t", 0), EARLIEST, 8),  # never applied: from the log start, and the first start stays EARLIEST
        (("t", 1), 10, 20), (("t", 1), 20, 30), (("t", 1), 30, 35),
    ]  # ("t", 2) is caught up: no batch


def test_reading_stops_at_the_end_and_past_markers() -> None:
    consumer = _Consumer([[_Message(5), _Message(6)], [_Message(8), _Message(9), _Message(10)]])
    read = list(direct_replay.read_range(consumer, ("t", 0), 5, 10))
    assert [record[2] for record in read] == [5, 6, 8, 9]  # 7 was a marker; 10 is the next batch's


def test_a_range_ending_in_markers_ends_when_the_position_reaches_its_end() -> None:
    consumer = _Consumer([[_Message(0), _Message(1)]], skip_to=4)
    assert [record[2] for record in direct_replay.read_range(consumer, ("t", 0), 0, 4)] == [0, 1]


def test_r4_a_partition_that_stops_moving_fails_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_replay, "STALL_SECONDS", 0.2)
    consumer = _Consumer([[_Message(0)]])  # then nothing, forever
    read = direct_replay.read_range(consumer, ("t", 0), 0, 5)
    assert next(read)[2] == 0
    with pytest.raises(RuntimeError, match=r"t\[0\]: no progress past offset 1 .* up to 5"):
        next(read)


def test_r3_a_deleted_offset_fails_with_the_offset_it_needed() -> None:
    gone = KafkaError(KafkaError._AUTO_OFFSET_RESET, "Broker: Offset out of range")
    consumer = _Consumer([[_Message(-1, gone)]])
    with pytest.raises(RuntimeError, match=r"t\[0\]: replay needs offset 40 \(deleted by retention"):
        list(direct_replay.read_range(consumer, ("t", 0), 40, 50))


def test_other_consumer_errors_fail_with_the_offset_but_no_retention_claim() -> None:
    broken = KafkaError(KafkaError._TRANSPORT, "Broker: transport failure")
    consumer = _Consumer([[_Message(-1, broken)]])
    with pytest.raises(RuntimeError, match=r"replay needs offset 40 while replaying up to 50: .*transport") as info:
        list(direct_replay.read_range(consumer, ("t", 0), 40, 50))
    assert "retention" not in str(info.value)
