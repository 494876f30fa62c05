"""Reading a batch's offset ranges (``kafka_ranges``, shared by the app's tasks and the
Spark-less replay) and the replay's cutting of batches: where a read stops, and the
transitions R3 and R4, against a scripted consumer. The real consumer and broker are in
tests/integration/test_direct_replay.py and every test that runs the app."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError, TopicPartition

from spark_apps.eos_stream.engines import direct_replay
from spark_apps.eos_stream.kafka import ranges as kafka_ranges
from spark_apps.eos_stream.kafka.ranges import EARLIEST, OffsetRange


@dataclass
class _Message:
    offset_: int
    error_: KafkaError | None = None
    partition_: int = 0

    def error(self) -> KafkaError | None:
        return self.error_

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def key(self) -> bytes | None:
        return None

    def value(self) -> bytes:
        return b"{}"


@dataclass
class _Consumer:
    """Hands out one scripted poll per ``consume``; a partition's position is the offset after
    the last record handed out, or ``skip_to`` (markers, aborted records) once the script ends."""
    polls: list[list[_Message]]
    skip_to: int | dict[int, int] | None = None
    positions: dict[int, int] = field(default_factory=dict)
    assigned: list = field(default_factory=list)
    paused: set[int] = field(default_factory=set)
    pauses: list[set[int]] = field(default_factory=list)

    def assign(self, partitions: list) -> None:
        self.assigned = partitions
        self.positions = {tp.partition: tp.offset for tp in partitions}

    def unassign(self) -> None:
        self.assigned = []

    def pause(self, partitions: list) -> None:
        self.paused |= {tp.partition for tp in partitions}
        self.pauses.append({tp.partition for tp in partitions})

    def resume(self, partitions: list) -> None:
        self.paused -= {tp.partition for tp in partitions}

    def consume(self, count: int, timeout: float) -> list[_Message]:
        messages = self.polls.pop(0) if self.polls else []
        for message in messages:
            if message.error_ is None:
                self.positions[message.partition_] = message.offset_ + 1
        if not self.polls and self.skip_to is not None:
            skips = self.skip_to if isinstance(self.skip_to, dict) else dict.fromkeys(self.positions, self.skip_to)
            for partition, offset in skips.items():
                self.positions[partition] = max(self.positions[partition], offset)
        return messages

    def position(self, partitions: list) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.positions[tp.partition]) for tp in partitions]


def test_batches_share_max_offsets_among_the_partitions_from_the_stored_offsets_or_the_log_start() -> None:
    starting = {("t", 1): 10, ("t", 0): EARLIEST, ("t", 2): 7}
    bounds = {("t", 0): (3, 8), ("t", 1): (0, 35), ("t", 2): (0, 7)}
    assert list(direct_replay.batch_ranges(starting, bounds, 10)) == [
        # never applied: from the log start, and the first start stays EARLIEST; ("t", 2) is caught up
        [(("t", 0), EARLIEST, 8), (("t", 1), 10, 15)],
        [(("t", 1), 15, 25)],  # ("t", 0) is done: ("t", 1) has the whole batch
        [(("t", 1), 25, 35)],
    ]
    # What a partition does not need of its share goes to the others.
    assert list(direct_replay.batch_ranges(starting, bounds, 12)) == [
        [(("t", 0), EARLIEST, 8), (("t", 1), 10, 17)], [(("t", 1), 17, 29)], [(("t", 1), 29, 35)]]
    three = {("u", p): 0 for p in range(3)}
    batches = list(direct_replay.batch_ranges(three, {("u", 0): (0, 2), ("u", 1): (0, 50), ("u", 2): (0, 50)}, 10))
    assert batches[0] == [(("u", 0), 0, 2), (("u", 1), 0, 4), (("u", 2), 0, 4)]
    assert [sum(end - start for _, start, end in batch) for batch in batches] == [10] * 10 + [2]
    # A replay smaller than a batch is one batch, whatever the partitions.
    assert list(direct_replay.batch_ranges(starting, bounds, 100)) == [[(("t", 0), EARLIEST, 8), (("t", 1), 10, 35)]]
    assert list(direct_replay.batch_ranges({("t", 2): 7}, bounds, 10)) == []


def _offsets(consumer: _Consumer, start: int, end: int) -> list[int]:
    chunks = kafka_ranges.read_ranges(consumer, [OffsetRange("t", 0, start, end)])
    return [m.offset() for chunk in chunks for m in chunk]


def test_a_batch_has_one_range_per_partition_with_records_to_read() -> None:
    start = {("t", 0): 5, ("t", 1): 9, ("t", 2): EARLIEST}
    end = {("t", 1): 9, ("t", 0): 8, ("t", 2): 4, ("t", 3): 0, ("t", 4): 3}
    assert kafka_ranges.offset_ranges(start, end) == [
        OffsetRange("t", 0, 5, 8),
        OffsetRange("t", 2, EARLIEST, 4),
        OffsetRange("t", 4, EARLIEST, 3),  # a partition new to the batch: from the log start
    ]  # ("t", 1) is caught up and ("t", 3) is empty: nothing to read


def test_reading_stops_at_the_end_and_past_markers() -> None:
    consumer = _Consumer([[_Message(5), _Message(6)], [_Message(8), _Message(9), _Message(10)]])
    assert _offsets(consumer, 5, 10) == [5, 6, 8, 9]  # 7 was a marker; 10 is the next batch's
    assert consumer.assigned == []  # nothing fetched past the end for a range already read


def test_records_arrive_as_arrow_batches_of_the_range() -> None:
    consumer = _Consumer([[_Message(5, partition_=3), _Message(6, partition_=3)], [_Message(8, partition_=3)]])
    batches = list(kafka_ranges.record_batches(consumer, [OffsetRange("t", 3, 5, 9)]))
    assert [b.to_pydict() for b in batches] == [
        {"topic": ["t", "t"], "partition": [3, 3], "offset": [5, 6], "key": [None, None], "value": [b"{}", b"{}"]},
        {"topic": ["t"], "partition": [3], "offset": [8], "key": [None], "value": [b"{}"]},
    ]


def test_a_task_reads_its_ranges_together_and_stops_fetching_the_finished_ones() -> None:
    # Partition 1 ends at 3 (its last records arrive first); partition 2 goes on to 6 and ends in markers.
    consumer = _Consumer([[_Message(0, partition_=1), _Message(4, partition_=2)],
                          [_Message(1, partition_=1), _Message(2, partition_=1), _Message(5, partition_=2)],
                          [_Message(3, partition_=1)]],  # past partition 1's end: fetched before its pause
                         skip_to={2: 8})
    ranges = [OffsetRange("t", 1, 0, 3), OffsetRange("t", 2, 4, 8)]
    chunks = [[(m.partition(), m.offset()) for m in chunk] for chunk in kafka_ranges.read_ranges(consumer, ranges)]
    assert chunks == [[(1, 0)], [(2, 4)], [(1, 1), (1, 2)], [(2, 5)]]  # one partition's run each
    assert consumer.pauses == [{1}]  # no fetching past partition 1's end while partition 2 is read
    assert consumer.assigned == [] and consumer.paused == set()  # resumed for this worker's next task
    assert list(kafka_ranges.read_ranges(consumer, [])) == []


def test_r4_one_partition_that_stops_moving_fails_the_read_though_another_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_ranges, "STALL_SECONDS", 0.2)
    moving = [[_Message(offset, partition_=1)] for offset in range(1000)]
    consumer = _Consumer([[_Message(0, partition_=0)], *moving])
    read = kafka_ranges.read_ranges(consumer, [OffsetRange("t", 0, 0, 5), OffsetRange("t", 1, 0, 1000)])
    with pytest.raises(RuntimeError, match=r"t\[0\]: no progress past offset 1 .* up to 5"):
        for _ in read:
            time.sleep(0.001)
    assert consumer.polls  # raised while partition 1 still moved, not once it was done


def test_a_range_ending_in_markers_ends_when_the_position_reaches_its_end() -> None:
    consumer = _Consumer([[_Message(0), _Message(1)]], skip_to=4)
    assert _offsets(consumer, 0, 4) == [0, 1]


def test_r4_a_partition_that_stops_moving_fails_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_ranges, "STALL_SECONDS", 0.2)
    consumer = _Consumer([[_Message(0)]])  # then nothing, forever
    read = kafka_ranges.read_ranges(consumer, [OffsetRange("t", 0, 0, 5)])
    assert next(read)[0].offset() == 0
    with pytest.raises(RuntimeError, match=r"t\[0\]: no progress past offset 1 .* up to 5"):
        next(read)


def test_r3_a_deleted_offset_fails_with_the_offset_it_needed() -> None:
    gone = KafkaError(KafkaError._AUTO_OFFSET_RESET, "Broker: Offset out of range")
    consumer = _Consumer([[_Message(-1, gone)]])
    with pytest.raises(RuntimeError, match=r"t\[0\]: needs offset 40 \(deleted by retention"):
        _offsets(consumer, 40, 50)


def test_other_consumer_errors_fail_with_the_offset_but_no_retention_claim() -> None:
    broken = KafkaError(KafkaError._TRANSPORT, "Broker: transport failure")
    consumer = _Consumer([[_Message(-1, broken)]])
    with pytest.raises(RuntimeError, match=r"needs offset 40 while reading up to 50: .*transport") as info:
        _offsets(consumer, 40, 50)
    assert "retention" not in str(info.value)


def _sizes(shares: list[list[OffsetRange]]) -> list[int]:
    return [sum(r.end - r.start for r in share) for share in shares]


def _covered(shares: list[list[OffsetRange]]) -> dict[tuple[str, int], list[tuple[int, int]]]:
    pieces: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for share in shares:
        assert len({(r.topic, r.partition) for r in share}) == len(share), "two ranges of one partition in a share"
        for r in share:
            pieces.setdefault((r.topic, r.partition), []).append((r.start, r.end))
    return {key: sorted(value) for key, value in pieces.items()}


def test_shares_split_a_range_so_two_partitions_and_a_transaction_topic_fill_two_tasks_alike() -> None:
    ranges = [OffsetRange("c", 0, 0, 172_000), OffsetRange("c", 1, 0, 172_000),
              OffsetRange("c.transaction", 0, 0, 133_000)]
    shares = kafka_ranges.balanced_shares(ranges, 2)
    assert _sizes(shares) == [238_500, 238_500]
    assert _covered(shares) == {("c", 0): [(0, 172_000)], ("c", 1): [(0, 66_500), (66_500, 172_000)],
                                ("c.transaction", 0): [(0, 133_000)]}


def test_shares_weigh_the_records_of_a_topic_that_costs_less_to_stage() -> None:
    # the bench's batch again, its transaction records weighing 0.4 of a change: the task with
    # the transaction topic takes fewer changes than the other, which takes 20,749 (not 25,000)
    bench = [OffsetRange("c", 0, 0, 17_915), OffsetRange("c", 1, 0, 17_915), OffsetRange("c.transaction", 0, 0, 14_170)]
    shares = kafka_ranges.balanced_shares(bench, 2, {"c.transaction": 0.4})
    assert _covered(shares) == {("c", 0): [(0, 17_915)], ("c", 1): [(0, 2_834), (2_834, 17_915)],
                                ("c.transaction", 0): [(0, 14_170)]}
    assert [len(share) for share in shares] == [2, 2]


def test_shares_never_split_into_small_pieces_nor_a_range_from_the_log_start() -> None:
    small = [OffsetRange("t", 0, 5, 8), OffsetRange("t", 1, 0, 4), OffsetRange("u", 0, 0, 3)]
    assert kafka_ranges.balanced_shares(small, 2) == [small[:2], small[2:]]
    assert kafka_ranges.balanced_shares([OffsetRange("t", 0, 0, 3_000)], 2) == [[OffsetRange("t", 0, 0, 3_000)]]
    assert kafka_ranges.balanced_shares([OffsetRange("t", 0, 0, 4_000)], 2) == [[OffsetRange("t", 0, 0, 2_000)],
                                                                               [OffsetRange("t", 0, 2_000, 4_000)]]
    # the bench's batch: two change partitions of 17,915 records and 14,170 transaction records
    bench = [OffsetRange("c", 0, 0, 17_915), OffsetRange("c", 1, 0, 17_915), OffsetRange("c.transaction", 0, 0, 14_170)]
    assert _sizes(kafka_ranges.balanced_shares(bench, 2)) == [25_000, 25_000]
    unknown = [OffsetRange("t", 0, EARLIEST, 90_000), OffsetRange("t", 1, 0, 30_000)]
    assert kafka_ranges.balanced_shares(unknown, 2) == [unknown[:1], unknown[1:]]
    assert kafka_ranges.balanced_shares([], 2) == []


def test_shares_are_at_most_the_tasks_and_cover_every_offset_once() -> None:
    ranges = [OffsetRange(f"t{i}", p, 1_000 * i, 1_000 * i + 7_000 + 3_000 * p) for i in range(7) for p in range(3)]
    for tasks in (1, 2, 3, 5):
        shares = kafka_ranges.balanced_shares(ranges, tasks)
        assert len(shares) <= tasks
        assert max(_sizes(shares)) - min(_sizes(shares)) <= 13_000  # within one unsplit range of each other
        for (topic, partition), pieces in _covered(shares).items():
            whole = next(r for r in ranges if (r.topic, r.partition) == (topic, partition))
            assert pieces[0][0] == whole.start and pieces[-1][1] == whole.end
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))


def test_a_topic_on_top_of_the_limit_adds_its_share_of_the_backlog_up_to_the_limit_again() -> None:
    limit_with = kafka_ranges.limit_with_topic_on_top
    bounds = {("c", 0): (0, 172_000), ("c", 1): (0, 172_000), ("c.transaction", 0): (0, 133_000)}
    never_applied = dict.fromkeys(bounds, EARLIEST)
    assert limit_with(50_000, "c.transaction", never_applied, bounds) == 50_000 + round(50_000 * 133_000 / 344_000)
    # from stored offsets: the lags left, not the logs
    stored = {("c", 0): 162_000, ("c", 1): 162_000, ("c.transaction", 0): 103_000}
    assert limit_with(50_000, "c.transaction", stored, bounds) == 50_000 + 50_000  # 30,000 on top of 20,000: capped
    assert limit_with(50_000, None, never_applied, bounds) == 50_000
    assert limit_with(50_000, "c.transaction", {**stored, ("c.transaction", 0): 133_000}, bounds) == 50_000
    assert limit_with(50_000, "c.transaction", {("c", 0): 172_000, ("c", 1): 172_000, ("c.transaction", 0): 0},
                      bounds) == 50_000  # no change left: nothing to share the room with
