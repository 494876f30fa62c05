"""Partitions kept in step through a backlog, for a mirror of whole source transactions on the
continuous engine (``engines/continuous_read.CycleReader``).

A whole mirror applies a source transaction once its END, in the transaction topic, and all of
its changes, in the change topics, are read; whatever a cycle read beyond that is held in the
database until a later cycle completes it, and every cycle walks what is held again. Reading a
backlog, librdkafka fetches the partitions unevenly: a cycle can hold tens of thousands of the
transaction topic's small records and no change, or the changes of one partition only, and the
records held then grow to tens of thousands, walked and moved again by every cycle.

So, as Spark's source splits ``maxOffsetsPerTrigger`` by each partition's lag, a paced cycle
takes from each partition at most its share of the records the cycle is expected to hold, in
proportion to the partition's lag when the cycle starts, and waits (up to ``FILL_SECONDS``) for
every share rather than ending on the linger. A partition that ran ahead has less lag left, so
the next cycles give it less: the partitions move through the backlog together. The
transaction topic leads a little (``LEAD``). A cycle that can hold the whole lag is not paced (a
stream that keeps up is never slowed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from spark_apps.eos_stream.kafka.partitions import TopicPartition

# Records a partition may take beyond its share, so that rounding and a small lag never stall it.
SHARE_SLACK = 64
# The transaction topic's share is this much larger: an END read before its changes waits in
# the database as one small record, while a change read before its END waits as a whole row.
LEAD = 1.25
# How long a paced cycle waits, after its first record, for every partition's share.
FILL_SECONDS = 1.0


def cycle_records(max_records: int, max_bytes: int, average_bytes: float) -> int:
    """The records a cycle is expected to hold: its record bound, or what fits in its byte
    bound at the average record size seen so far (0: none seen, so the record bound)."""
    if average_bytes <= 0:
        return max_records
    return max(1, min(max_records, int(max_bytes // average_bytes)))


def shares(lags: Mapping[TopicPartition, int], expected: int, leading: str | None = None
           ) -> dict[TopicPartition, int] | None:
    """Each partition's most records in a cycle expected to hold ``expected``: its part of
    ``expected`` in proportion to its lag, plus ``SHARE_SLACK``, and ``LEAD`` times that for the
    partitions of the topic ``leading`` (the transaction topic); None when the cycle can hold
    every partition's lag (no pacing)."""
    total = sum(lag for lag in lags.values() if lag > 0)
    if total <= expected:
        return None
    return {tp: math.ceil(expected * max(lag, 0) / total * (LEAD if tp[0] == leading else 1)) + SHARE_SLACK
            for tp, lag in lags.items()}


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

    def admits(self, tp: TopicPartition, offset: int) -> bool:
        """Whether the cycle takes this record; once it refuses one of a partition, it refuses
        every later one of it (the partition's range stays whole)."""
        if tp in self.stopped_at:
            return False
        taken = self.taken.get(tp, 0)
        limit = self.limits.get(tp)
        if limit is not None and taken >= limit:
            self.stopped_at[tp] = offset
            return False
        self.taken[tp] = taken + 1
        return True

    def filled(self) -> bool:
        """Whether every paced partition has given the cycle its share (or its whole lag): a
        paced cycle waits for that rather than ending on the linger, which a backlog's fetches,
        uneven between partitions, would cut short."""
        return all(tp in self.stopped_at or self.taken.get(tp, 0) >= wanted for tp, wanted in self.wanted.items())
