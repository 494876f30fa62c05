"""Partitions kept in step through a backlog, for a mirror of whole source transactions on the
continuous engine (``engines/continuous_read.CycleReader``).

A whole mirror applies a source transaction once its END, in the transaction topic, and all of
its changes, in the change topics, are read; whatever a cycle read beyond that is held in the
database until a later cycle completes it, and every cycle walks what is held again. Reading a
backlog, librdkafka fetches the partitions unevenly: a cycle can hold tens of thousands of the
transaction topic's small records and no change, or the changes of one partition only, and the
records held then grow to tens of thousands, walked and moved again by every cycle.

So a paced cycle takes from each partition at most its share of the records the cycle is
expected to hold, and waits (up to ``FILL_SECONDS``) for every share rather than ending on the
linger. The shares bring every partition to the same point of the source's history: each
partition's *span* is its lag when the backlog was first paced (the part of the history it
holds), and a cycle leaves every partition the same fraction of its span to read, the fraction
chosen so that the shares fill the cycle's bounds at each partition's record size (:func:`shares`). A partition that ran
ahead (read further into its span, its records held) gets nothing until the others are level
with it: shares in proportion to the lags, as Spark's source splits ``maxOffsetsPerTrigger``,
would keep it that far ahead to the end of the backlog (measured: 2,500-4,000 of one change
partition's records held in every cycle, moved into the database and back). The transaction
topic leads by a quarter of its share (``LEAD``). A cycle that can hold the whole lag is not
paced (a stream that keeps up is never slowed), and the spans are taken again at the next backlog.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from spark_apps.eos_stream.kafka.partitions import TopicPartition

# Records a partition may take beyond its share, so that rounding and a small lag never stall it.
SHARE_SLACK = 64
# The transaction topic reads this much of its share further: an END read before its changes
# waits in the database as one small record, while a change read before its END waits as a whole row.
LEAD = 1.25
# How long a paced cycle waits, after its first record, for every partition's share.
FILL_SECONDS = 1.0
# The part of a cycle's record and byte bounds its shares fill, so that it ends on its shares
# (``Pace.filled``) and not on a bound, which would cut short the last partition to deliver.
PACE_FILL = 0.9


@dataclass(frozen=True)
class CycleBounds:
    """A cycle's record and byte bounds (``max_offsets_per_trigger``, ``continuous_max_bytes``)."""

    records: int
    bytes: int

    def hold(self, counts: Mapping[TopicPartition, float], sizes: Mapping[TopicPartition, float]) -> bool:
        """Whether ``counts`` records of each partition, of its average ``sizes``, fill at most
        ``PACE_FILL`` of both bounds (a partition of unknown size counts no bytes)."""
        return (sum(counts.values()) <= PACE_FILL * self.records
                and sum(n * sizes.get(tp, 0.0) for tp, n in counts.items()) <= PACE_FILL * self.bytes)


def shares(lags: Mapping[TopicPartition, int], bounds: CycleBounds, sizes: Mapping[TopicPartition, float],
           leading: str | None = None, spans: Mapping[TopicPartition, int] | None = None
           ) -> dict[TopicPartition, int] | None:
    """Each partition's most records in a cycle (see the module), plus ``SHARE_SLACK``; None
    when the cycle's bounds hold every partition's lag (no pacing).

    :param sizes: each partition's average record bytes, as far as seen.
    :param leading: the topic whose partitions read ``LEAD`` - 1 of their part of the cycle further.
    :param spans: each partition's lag when the backlog was first paced; its lag now where none
        (the first paced cycle, a partition found since)."""
    lags = {tp: max(lag, 0) for tp, lag in lags.items()}
    if bounds.hold(lags, sizes):
        return None
    span = {tp: max((spans or {}).get(tp, lag), 0) for tp, lag in lags.items()}
    level = _level(lags, span, {}, bounds, sizes)
    if leading is not None:  # its lead: a part of what the cycle reads, in proportion to its span
        ahead, whole = (LEAD - 1) * sum(level.values()), sum(span.values()) or 1
        lead = {tp: ahead * span[tp] / whole for tp in lags if tp[0] == leading}
        level = _level(lags, span, lead, bounds, sizes)
    return {tp: math.ceil(round(n, 6)) + SHARE_SLACK for tp, n in level.items()}


def _level(lags: Mapping[TopicPartition, int], span: Mapping[TopicPartition, int],
           lead: Mapping[TopicPartition, float], bounds: CycleBounds, sizes: Mapping[TopicPartition, float]
           ) -> dict[TopicPartition, float]:
    """Each partition's records read when the cycle leaves every partition the same fraction of
    its span (less its ``lead``): the smallest fraction whose reads the bounds hold."""

    def taken(fraction: float) -> dict[TopicPartition, float]:
        return {tp: max(0.0, lag - max(0.0, fraction * span[tp] - lead.get(tp, 0.0))) for tp, lag in lags.items()}

    low, high = 0.0, max((lag / span[tp] for tp, lag in lags.items() if span[tp] > 0), default=0.0)
    for _ in range(50):  # what is taken falls as the fraction left grows: bisect to the bounds
        middle = (low + high) / 2
        low, high = (low, middle) if bounds.hold(taken(middle), sizes) else (middle, high)
    return taken(high)


class Pace:
    """One cycle's shares, and where each partition that reached its share stopped.

    :param limits: each partition's most records (``shares``); a partition without a limit is
        not paced.
    :param lags: each partition's records left when the cycle started.
    """

    def __init__(self, limits: Mapping[TopicPartition, int], lags: Mapping[TopicPartition, int]) -> None:
        self.limits = dict(limits)
        self.wanted = {tp: min(limit, max(lags.get(tp, 0), 0)) for tp, limit in limits.items()}
        self.taken: dict[TopicPartition, int] = {}
        # A partition past its share: the offset of the first record the cycle did not take,
        # where the partition's next cycle must start.
        self.stopped_at: dict[TopicPartition, int] = {}

    def take(self, tp: TopicPartition, records: int) -> int:
        """How many of the partition's next ``records`` the cycle takes; the caller then
        ``stop``s the partition at the first it did not take. Once it refused one record of a
        partition, it takes no later one (the partition's range stays whole)."""
        if tp in self.stopped_at:
            return 0
        taken = self.taken.get(tp, 0)
        limit = self.limits.get(tp)
        count = records if limit is None else max(0, min(records, limit - taken))
        if count:
            self.taken[tp] = taken + count
        return count

    def stop(self, tp: TopicPartition, offset: int) -> None:
        """The partition's first record the cycle did not take (after ``take``)."""
        self.stopped_at.setdefault(tp, offset)

    def admits(self, tp: TopicPartition, offset: int) -> bool:
        """Whether the cycle takes this one record (``take`` and ``stop`` for one)."""
        if self.take(tp, 1):
            return True
        self.stop(tp, offset)
        return False

    def filled(self) -> bool:
        """Whether every paced partition has given the cycle its share (or its whole lag): a
        paced cycle waits for that rather than ending on the linger, which a backlog's fetches,
        uneven between partitions, would cut short."""
        return all(tp in self.stopped_at or self.taken.get(tp, 0) >= wanted for tp, wanted in self.wanted.items())
