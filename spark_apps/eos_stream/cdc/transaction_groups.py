"""A whole mirror's transaction groups, counted while its records are staged.

The walk (``transaction_walk``) decides over groups of a batch's candidates: per partition, kind,
transaction and table, an END alone. The stager reads every record anyway, so it counts them
there (:class:`GroupCounter`) and hands them with its staged count to the batch
(``staging.StageCount``), instead of the database counting the stage again after it is filled.
The transaction topic's records then need no stage line at all: a BEGIN tells the walk nothing,
and an END is its group (its counts and offset); only one the stager refuses is staged, to be
dead-lettered. On Spark the groups return with each task's count, from its successful attempt
only: a retried task's copies in the stage are never counted twice.

The kinds are ``transactions_sql``'s ``_KIND``, which counts the records an earlier batch held:
an END; a CHANGE (a record with a transaction, a refused one included, so that it still counts
toward its END); an UNTRACKED change (a streaming change without transaction metadata, which the
walk refuses); FREE records (snapshot reads, tombstones) tell the walk nothing and are not counted.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Mapping

from spark_apps.eos_stream.cdc.transaction_walk import Groups
from spark_apps.eos_stream.cdc.transactions import CHANGE, END, FREE, UNTRACKED

_STREAMING_OPS = frozenset(("c", "u", "d"))
# A transaction-topic record's work in a stager against a change's: read and counted, 6.3 µs,
# against 15-16 µs read, staged and COPYed (bench/cdc_throughput.py's records, with schemas). A
# Spark batch's shares are balanced by it: by records, the task that took the transaction topic
# idled while the other staged a third more changes than its part.
TRANSACTION_RECORD_WEIGHT = 0.4


def kind_of(op: str | None, refused: bool, tx: str | None) -> str:
    """A staged record's kind, as ``transactions_sql``'s ``_KIND`` gives it to a held one."""
    if tx is not None and op != END:  # nearly every record: asked first
        return CHANGE
    if op == END and not refused:
        return END
    if op in _STREAMING_OPS and not refused:
        return UNTRACKED
    return FREE


class GroupCounter:
    """The groups of the records one stager stages (one Spark task, one cycle, one replay batch),
    and how many of its records it did not stage (the transaction topic's).

    A change of a transaction, nearly every record, is appended to its lane (topic, partition
    and table): its transaction and offset, two appends. :meth:`groups` counts a lane's
    transactions and finds their first and last offsets in C (``Counter``, ``dict(zip(...))``),
    instead of a dictionary update per record under a key of its own (about 0.8 µs a change,
    offline; the lanes about 0.4 µs with their groups)."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[str, int, str | None], tuple[list[str], list[int]]] = {}
        self._counted: dict[tuple[str, int, str, str | None, str | None], list[int]] = {}
        self._ends: list[tuple] = []
        self.unstaged = 0

    def change(self, topic: str, partition: int, offset: int, tx: str, collection: str | None) -> None:
        """A staged change of transaction ``tx`` (kind ``CHANGE``), as :meth:`record` counts it."""
        lane = self._lanes.get((topic, partition, collection))
        if lane is None:
            lane = self._lanes[(topic, partition, collection)] = ([], [])
        lane[0].append(tx)
        lane[1].append(offset)

    def record(self, topic: str, partition: int, offset: int, op: str | None, refused: bool,
               tx: str | None, collection: str | None) -> None:
        """A staged record of a change topic (or a refused one of the transaction topic)."""
        kind = kind_of(op, refused, tx)
        if kind == CHANGE:
            self.change(topic, partition, offset, str(tx), collection)
            return
        if kind == FREE:
            return
        key = (topic, partition, kind, tx, collection)
        found = self._counted.get(key)
        if found is None:
            self._counted[key] = [1, offset, offset]
            return
        found[0] += 1
        if offset < found[1]:
            found[1] = offset
        elif offset > found[2]:
            found[2] = offset

    def end(self, topic: str, partition: int, offset: int, tx: str, counts_json: str) -> None:
        """An END, not staged: ``counts_json`` its events per mirrored table (``transactions.counts_json``)."""
        self._ends.append((topic, partition, END, tx, None, 1, offset, offset, counts_json, 0, 0, 0))
        self.unstaged += 1

    def skip(self) -> None:
        """A BEGIN or a tombstone of the transaction topic, not staged."""
        self.unstaged += 1

    def groups(self) -> Groups:
        """The groups counted so far (the staged ones' ``staged`` and ``staged_once`` their events)."""
        parts = [_lane_groups(*lane, txs, offsets) for lane, (txs, offsets) in self._lanes.items()]
        counted = len(self._counted)
        if counted:
            topics, partitions, kinds, txs, collections = map(list, zip(*self._counted, strict=True))
            events, firsts, lasts = map(list, zip(*self._counted.values(), strict=True))
            parts.append(Groups((topics, partitions, kinds, txs, collections, events, firsts, lasts,
                                 [None] * counted, list(events), list(events), [0] * counted)))
        return Groups.joined([*parts, Groups.of(self._ends)])


def _lane_groups(topic: str, partition: int, collection: str | None, txs: list[str], offsets: list[int]) -> Groups:
    """The groups of one lane: per transaction its events, first and last offset. A partition's
    records come in offset order, so a transaction's first offset is where it first occurs and
    its last where it last does; a lane out of order (none is expected) is counted the slow way."""
    if all(map(operator.lt, offsets, itertools.islice(offsets, 1, None))):
        events = Counter(txs)
        firsts = dict(zip(reversed(txs), reversed(offsets), strict=True))
        lasts = dict(zip(txs, offsets, strict=True))
    else:
        events, firsts, lasts = Counter(txs), {}, {}
        for tx, offset in zip(txs, offsets, strict=True):
            firsts[tx], lasts[tx] = min(firsts.get(tx, offset), offset), max(lasts.get(tx, offset), offset)
    ids = list(events)
    n = len(ids)
    counts = list(events.values())
    return Groups(([topic] * n, [partition] * n, [CHANGE] * n, ids, [collection] * n, counts,
                   list(map(firsts.__getitem__, ids)), list(map(lasts.__getitem__, ids)), [None] * n,
                   list(counts), list(counts), [0] * n))


def applicable(groups: Groups, stored: Mapping[tuple[str, int], int]) -> Groups | None:
    """The groups at or above the ``stored`` offsets (``{(topic, partition): next offset}``): an
    earlier batch applied, or holds, what lies below. None when a group straddles a stored offset:
    only the stage's records can then be counted (a batch re-read partly, by another engine)."""
    topics, partitions, _, _, _, _, firsts, lasts = groups.columns[:8]
    keep = []
    for topic, partition, first, last in zip(topics, partitions, firsts, lasts, strict=True):
        below = stored.get((topic, partition), 0)
        if first < below <= last:
            return None
        keep.append(first >= below)
    return groups if all(keep) else groups.where(keep)
