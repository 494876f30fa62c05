"""A stager's count of transaction groups (``cdc/transaction_groups.GroupCounter``) against a
count of the same records one dictionary update each: the same groups, events and first and last
offsets, whether a lane's records come in offset order (every stager's) or not, and however the
counting is interleaved with asking for the groups."""

from __future__ import annotations

import random

import pytest

from spark_apps.eos_stream.cdc.transaction_groups import GroupCounter, kind_of
from spark_apps.eos_stream.cdc.transactions import FREE
from spark_apps.eos_stream.cdc.transactions_sql import reads_below

TOPICS = ("app.public.a", "app.public.b")
Record = tuple[str, int, int, str, bool, str | None, str | None]


def reference(records: list[Record]) -> dict[tuple, tuple[int, int, int]]:
    """Per (topic, partition, kind, transaction, table): events, lowest and highest offset."""
    found: dict[tuple, tuple[int, int, int]] = {}
    for topic, partition, offset, op, refused, tx, collection in records:
        kind = kind_of(op, refused, tx)
        if kind == FREE:
            continue
        events, first, last = found.get((topic, partition, kind, tx, collection), (0, offset, offset))
        found[(topic, partition, kind, tx, collection)] = (events + 1, min(first, offset), max(last, offset))
    return found


def as_found(counter: GroupCounter) -> dict[tuple, tuple[int, int, int]]:
    found = {}
    for group in counter.groups():
        key = (group.topic, group.partition, group.kind, group.tx, group.collection)
        assert key not in found, f"group {key} made twice"
        assert group.staged == group.staged_once == group.events and group.held == 0
        found[key] = (group.events, group.first, group.last)
    return found


def history(rng: random.Random, ordered: bool) -> list[Record]:
    """Records of a few partitions: changes of interleaved transactions over two tables, some
    without a transaction, some refused, some snapshot reads; in offset order per partition, or
    shuffled."""
    records: list[Record] = []
    for topic in TOPICS:
        for partition in range(2):
            offsets = list(range(rng.randint(0, 60)))
            if not ordered:
                rng.shuffle(offsets)
            for offset in offsets:
                tx = rng.choice([None, *map(str, range(700, 706))])
                op = rng.choice("cudr")
                records.append((topic, partition, offset, op, rng.random() < 0.1, tx, rng.choice(TOPICS)[4:]))
    return records


@pytest.mark.parametrize("seed", range(200))
def test_the_lanes_count_what_one_update_a_record_counts(seed: int) -> None:
    rng = random.Random(seed)
    records = history(rng, ordered=seed % 2 == 0)
    counter = GroupCounter()
    asked_at = rng.randint(0, len(records))  # groups asked for while counting: later records still count
    for index, (topic, partition, offset, op, refused, tx, collection) in enumerate(records):
        if index == asked_at:
            counter.groups()
        if tx is not None and not refused and rng.random() < 0.5:
            counter.change(topic, partition, offset, tx, collection)  # as the flat stager counts
        else:
            counter.record(topic, partition, offset, op, refused, tx, collection)
    assert as_found(counter) == reference(records)
    assert as_found(counter) == reference(records), "asking twice gives the same groups"


@pytest.mark.parametrize(("starts", "stored", "below"), [
    ({("t", 0): 5, ("t", 1): 9}, {("t", 0): 5, ("t", 1): 9}, False),  # every batch after the one that stored
    ({("t", 0): 5}, {("t", 0): 5, ("u", 0): 3}, False),  # a partition the batch does not read
    ({("t", 0): 5, ("v", 0): 0}, {("t", 0): 5}, False),  # a partition never applied
    ({("t", 0): 4, ("t", 1): 9}, {("t", 0): 5, ("t", 1): 9}, True),  # read again from below
    ({("t", 0): -2}, {("t", 0): 5}, True),  # Kafka's earliest: where it lies is not known here
    (None, {}, True),  # starts not known
])
def test_a_batch_reads_below_the_stored_offsets_only_when_a_range_starts_below_them(
        starts: dict | None, stored: dict, below: bool) -> None:
    assert reads_below(starts, stored) is below
