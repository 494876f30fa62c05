"""A continuous cycle's reader offers a poll's records a run of one partition's at a time
(``CycleReader._offer_runs``). Against the reference, record by record (``offer_one``, the
rule those runs keep): on random polls and paces, the same records taken in the same order, the
same carried and paused, the same shares taken, the same reads, and the same refusal of a
consumer that went back."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from spark_apps.eos_stream.engines.continuous_read import CycleReader, record_bytes
from spark_apps.eos_stream.engines.cycle_pace import Pace
from tests.helpers.kafka import ConsumedMessage

PARTITIONS = (("app.public.t", 0), ("app.public.t", 1), ("app.transaction", 0))


def _message(tp: tuple[str, int], offset: int, value: bytes) -> ConsumedMessage:
    return ConsumedMessage((*tp, offset, b"k", value))


@dataclass
class Consumer:
    paused: list[Any] = field(default_factory=list)

    resumed: list[Any] = field(default_factory=list)

    def pause(self, partitions: list[Any]) -> None:
        self.paused += [(p.topic, p.partition) for p in partitions]

    def resume(self, partitions: list[Any]) -> None:
        self.resumed += [(p.topic, p.partition) for p in partitions]

    def seek(self, partition: Any) -> None:
        self.resumed.append((partition.topic, partition.partition, partition.offset))


def offer_one(reader: CycleReader, message: Any, pace: Pace | None, messages: list[Any]) -> int:
    """The reference: one record taken, up to its partition's share, or carried."""
    tp, offset = (message.topic(), message.partition()), message.offset()
    carried = reader.carried.get(tp)
    if carried is not None and offset <= carried[-1].offset():
        raise RuntimeError(f"{tp}: the consumer went back to offset {offset}")
    if carried is None and (pace is None or pace.admits(tp, offset)):
        messages.append(message)
        weight = record_bytes(message)
        reader.largest = max(reader.largest, weight)
        read = reader.reads.setdefault(tp, [0, 0, 0])
        read[0], read[1], read[2] = offset + 1, read[1] + weight, read[2] + 1
        return weight
    reader.carried.setdefault(tp, []).append(message)
    reader.carried_bytes[tp] = reader.carried_bytes.get(tp, 0) + record_bytes(message)
    if tp in reader.paused:
        reader.paused[tp] = offset + 1
    elif reader.carried_bytes[tp] >= reader.carry_bytes:
        reader.consumer.pause([_Partition(*tp)])
        reader.paused[tp] = offset + 1
    return 0


@dataclass(frozen=True)
class _Partition:
    topic: str
    partition: int


def _reader() -> CycleReader:
    reader = CycleReader(Consumer(), {}, "kafka:9092", max_records=10_000, max_bytes=10_000, linger=0.0,
                         outage_seconds=1.0, lead_topic="app.transaction")
    reader.carry_bytes = 300
    return reader


def _polls(rng: random.Random) -> list[list[ConsumedMessage]]:
    """Polls of runs of each partition's records, in offset order within a partition."""
    next_offset = dict.fromkeys(PARTITIONS, 0)
    polls = []
    for _ in range(rng.randint(1, 6)):
        poll = []
        for _ in range(rng.randint(0, 5)):
            tp = rng.choice(PARTITIONS)
            for _ in range(rng.randint(1, 8)):
                poll.append(_message(tp, next_offset[tp], b"v" * rng.randint(0, 60)))
                next_offset[tp] += 1
        polls.append(poll)
    return polls


def _pace(rng: random.Random) -> Pace | None:
    if rng.random() < 0.2:
        return None
    limits = {tp: rng.randint(0, 20) for tp in PARTITIONS if rng.random() < 0.8}
    return Pace(limits, {tp: 50 for tp in PARTITIONS})


def _state(reader: CycleReader, pace: Pace | None, messages: list[Any]) -> tuple:
    stops = None if pace is None else (pace.taken, pace.stopped_at)
    return (messages, reader.carried, reader.carried_bytes, reader.paused, reader.reads, reader.largest,
            reader.consumer.paused, reader.consumer.resumed, stops)


@pytest.mark.parametrize("seed", range(300))
def test_runs_are_offered_as_the_records_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    polls = _polls(rng)
    by_runs, one_by_one = _reader(), _reader()
    half = rng.randint(0, len(polls))
    for cycle in range(2):  # the second cycle takes what the first carried first
        pace_seed = rng.random()
        paces = (_pace(random.Random(pace_seed)), _pace(random.Random(pace_seed)))
        taken: tuple[list[Any], list[Any]] = ([], [])
        sizes = [0, 0]
        if cycle:
            sizes[0] = by_runs._take_carried(paces[0], taken[0])
            carried, one_by_one.carried, one_by_one.carried_bytes = one_by_one.carried, {}, {}
            sizes[1] = sum(offer_one(one_by_one, m, paces[1], taken[1]) for ms in carried.values() for m in ms)
            one_by_one._fetch_carried_partitions()
        for poll in polls[half:] if cycle else polls[:half]:
            sizes[0] += by_runs._offer_polled(poll, paces[0], taken[0])
            sizes[1] += sum(offer_one(one_by_one, m, paces[1], taken[1]) for m in poll)
        assert sizes[0] == sizes[1]
        assert _state(by_runs, paces[0], taken[0]) == _state(one_by_one, paces[1], taken[1])


def test_a_consumer_that_went_back_behind_a_carried_record_is_refused() -> None:
    reader = _reader()
    pace = Pace({PARTITIONS[0]: 1}, {PARTITIONS[0]: 5})
    reader._offer_polled([_message(PARTITIONS[0], offset, b"v") for offset in (0, 1, 2)], pace, [])
    with pytest.raises(RuntimeError, match=r"went back to offset 2 after 2"):
        reader._offer_polled([_message(PARTITIONS[0], 2, b"v")], pace, [])
    with pytest.raises(RuntimeError, match=r"went back to offset 3 after 4"):
        reader._offer_polled([_message(PARTITIONS[0], 4, b"v"), _message(PARTITIONS[0], 3, b"v")], pace, [])


def test_a_partition_pauses_once_its_carried_records_reach_carry_bytes_and_fetches_on_from_the_last() -> None:
    reader, tp = _reader(), PARTITIONS[2]  # carry_bytes 300: three records of 100 bytes
    pace = Pace({tp: 0}, {tp: 5})
    reader._offer_polled([_message(tp, offset, b"v" * 99) for offset in (0, 1)], pace, [])
    assert not reader.paused and pace.stopped_at == {tp: 0}
    reader._offer_polled([_message(tp, 2, b"v" * 99)], pace, [])
    assert reader.paused == {tp: 3} and reader.consumer.paused == [tp] and reader.carried_bytes == {tp: 300}
    reader._offer_polled([_message(tp, 3, b"v" * 99)], pace, [])  # fetched before the pause took
    assert reader.paused == {tp: 4} and reader.consumer.paused == [tp]
