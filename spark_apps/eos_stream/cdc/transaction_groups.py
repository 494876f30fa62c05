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
    and how many of its records it did not stage (the transaction topic's)."""

    def __init__(self) -> None:
        self._counted: dict[tuple[str, int, str, str | None, str | None], list[int]] = {}
        self._ends: list[tuple] = []
        self.unstaged = 0

    def record(self, topic: str, partition: int, offset: int, op: str | None, refused: bool,
               tx: str | None, collection: str | None) -> None:
        """A staged record of a change topic (or a refused one of the transaction topic)."""
        kind = kind_of(op, refused, tx)
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
        counted = len(self._counted)
        if not counted:
            return Groups.of(self._ends)
        topics, partitions, kinds, txs, collections = map(list, zip(*self._counted, strict=True))
        events, firsts, lasts = map(list, zip(*self._counted.values(), strict=True))
        made = Groups((topics, partitions, kinds, txs, collections, events, firsts, lasts, [None] * counted,
                       list(events), list(events), [0] * counted))
        return Groups.joined([made, Groups.of(self._ends)])


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
