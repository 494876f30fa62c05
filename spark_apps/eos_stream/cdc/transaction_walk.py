"""The walk of whole source transactions, decided over a batch's counts (``transactions_sql``).

The database counts a batch's candidates (the stage's records and the pipeline's held ones) in
one aggregate pass, a :class:`Group` per partition, kind, transaction and table (an END a group
of its own); :func:`walk` decides over those few thousand groups what ``transactions.plan``, the
reference model, decides record by record, and returns where each partition's held records
start. Decided here rather than in SQL: the planner cannot estimate how many groups of each kind
such a pass yields, and joins planned for a handful of rows ran as nested loops over thousands
(a quarter of a second and more for a stage of 13,000 records, growing with the square of it).

- ``stop``: the first END, in the transaction topic's order, whose transaction is incomplete;
  the ENDs from it on wait, and the transactions before it are ready.
- per partition, the first event of a transaction not ready: the partition's held records start
  there.
- refused: a transaction with more events than its END counts; a ready transaction with an
  event behind a held one of its partition; a streaming change without transaction metadata.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from spark_apps.eos_stream.cdc import transactions
from spark_apps.eos_stream.cdc.transactions import CHANGE, END, UNTRACKED, TransactionError
from spark_apps.eos_stream.records.columns import Columns

Bound = tuple[str, int, int, bool]  # topic, partition, first held offset, ENDs only
NO_BOUND = 1 << 62  # the bound of a partition the walk holds nothing of: above every offset


class Group(NamedTuple):
    """Candidates of one partition, kind, transaction and table (an END alone); a tuple, made
    from the database's row at once (thousands a cycle).

    :param events: the group's distinct records (a retried task's copies counted once).
    :param first: its lowest offset; :param last: its highest.
    :param counts: an END's events per table, as staged (``transactions.counts_json``).
    :param staged: records of the stage, copies included; :param staged_once: without copies.
    :param held: records held by an earlier batch."""

    topic: str
    partition: int
    kind: str
    tx: str | None
    collection: str | None
    events: int
    first: int
    last: int
    counts: str | None = None
    staged: int = 0
    staged_once: int = 0
    held: int = 0


class Groups(Columns):
    """A batch's groups (:class:`Group` rows) as columns: tens of thousands, about three a source
    transaction of a few changes; the walk reads the columns it needs as they are."""

    __slots__ = ()
    WIDTH = len(Group._fields)

    @classmethod
    def cast(cls, counted: Columns) -> Groups:
        """Groups of a stage's count (``records.spec.StageCount``: its columns, not copied)."""
        return counted if isinstance(counted, Groups) else cls(counted.columns if len(counted) else None)

    def __iter__(self) -> Iterator[Group]:
        return map(Group._make, super().__iter__())

    def of_kind(self, kind: str) -> Groups:
        return self.at(self.indexes_of_kind(kind))

    def indexes_of_kind(self, kind: str) -> list[int]:
        """The indexes of the groups of ``kind``: a comparison a group, in a list comprehension
        (a batch has tens of thousands of groups, and the walk looks for a kind several times)."""
        return [i for i, k in enumerate(self.columns[2]) if k == kind] if self.columns else []

    def reaching(self, bound: Mapping[tuple[str, int], int], missing: int) -> Iterator[bool]:
        """For each group, whether its first record is at or above its partition's ``bound``
        (``missing`` for a partition without one)."""
        topic, partition, first = self.columns[0], self.columns[1], self.columns[6]
        return (f >= bound.get((t, p), missing) for t, p, f in zip(topic, partition, first, strict=True))

    def at_or_above(self, bound: Mapping[tuple[str, int], int], missing: int) -> Groups:
        """The groups ``reaching`` their partition's bound."""
        return self.where(self.reaching(bound, missing))


@dataclass
class Walk:
    """What the batch applies and holds: ``bounds`` for ``transactions_sql.move_statement``."""

    bounds: list[Bound]
    ready: int  # transactions applied now
    waiting: list[str] = field(default_factory=list)  # the first five ENDs waiting, in commit order
    copies: int = 0  # the stage's records staged more than once
    held_before: int = 0  # records held by earlier batches


def _seen(groups: Groups) -> dict[str, dict[str | None, int]]:
    seen: dict[str, dict[str | None, int]] = {}
    _, _, kinds, txs, collections, events = groups.columns[:6]
    for kind, tx, collection, n in zip(kinds, txs, collections, events, strict=True):
        if kind == CHANGE and tx is not None:
            per_table = seen.setdefault(tx, {})
            per_table[collection] = per_table.get(collection, 0) + n
    return seen


def _expected(counts: str | None) -> dict[str | None, int]:
    tables = json.loads(counts) if counts else {}
    return {table: n for table, n in tables.items() if n}


End = tuple[str, int, int, str, str | None]  # an END's topic, partition, offset, transaction and counts


def _ends(groups: Groups) -> list[End]:
    """The ENDs, in the transaction topic's order."""
    topics, partitions, kinds, txs, _, _, firsts, _, counts = groups.columns[:9]
    return sorted((topic, partition, first, str(tx), count) for topic, partition, kind, tx, first, count
                  in zip(topics, partitions, kinds, txs, firsts, counts, strict=True) if kind == END)


def _check_counts(ends: list[End], seen: dict[str, dict[str | None, int]]) -> list[bool]:
    """Whether each END's transaction is complete; refuses one with more events than it counts.
    An END's counts are read once per distinct text (a batch's ENDs repeat a few)."""
    read: dict[str | None, dict[str | None, int]] = {}
    complete = []
    for _, _, _, tx, counts in ends:
        expected = read.get(counts)
        if expected is None:
            expected = read[counts] = _expected(counts)
        got = seen.get(tx, {})
        if got == expected:
            complete.append(True)
            continue
        extra = sorted(str(t) for t, n in got.items() if n > expected.get(t, 0))
        if extra:
            raise TransactionError(transactions.impossible_message(tx, ", ".join(extra)))
        complete.append(False)
    return complete


def _blocking(groups: Groups, ready: set[str]) -> dict[tuple[str, int], tuple[int, str | None]]:
    """Per partition, the first offset of an event of a transaction not ready, and that transaction."""
    blocking: dict[tuple[str, int], tuple[int, str | None]] = {}
    topics, partitions, kinds, txs, _, _, firsts = groups.columns[:7]
    for topic, partition, kind, tx, first in zip(topics, partitions, kinds, txs, firsts, strict=True):
        if kind == CHANGE and tx not in ready:
            here = blocking.get((topic, partition))
            if here is None or first < here[0]:
                blocking[(topic, partition)] = (first, tx)
    return blocking


def _refuse_misordered(groups: Groups, ready: set[str], blocking: dict[tuple[str, int], tuple[int, str | None]]
                       ) -> None:
    """A ready transaction's event behind a held event of its partition: an END lost, or change
    topics out of commit order (``transactions.misordered_message``)."""
    if not blocking:
        return
    topics, partitions, kinds, txs, _, _, _, lasts = groups.columns[:8]
    floor = min(first for first, _ in blocking.values())  # no group ending at or below it is behind one
    behind = sorted((str(tx), topic, partition, last)
                    for topic, partition, kind, tx, last in zip(topics, partitions, kinds, txs, lasts, strict=True)
                    if last > floor and kind == CHANGE and tx in ready and (topic, partition) in blocking
                    and last > blocking[(topic, partition)][0])
    if behind:
        tx, topic, partition, last = behind[0]
        raise TransactionError(transactions.misordered_message(tx, (topic, partition, last),
                                                               blocking[(topic, partition)][1]))


def walk(groups: Groups) -> Walk:
    """The walk (see the module) over one batch's groups.

    :raises TransactionError: an END counting fewer events than arrived, a complete transaction
        behind a held record of its partition, or a streaming change without transaction metadata."""
    ends = _ends(groups)
    complete = _check_counts(ends, _seen(groups))
    stop = next((i for i, done in enumerate(complete) if not done), len(ends))
    ready = {tx for _, _, _, tx, _ in ends[:stop]}
    blocking = _blocking(groups, ready)
    _refuse_misordered(groups, ready, blocking)
    topics, partitions, firsts = groups.columns[0], groups.columns[1], groups.columns[6]
    untracked = sorted((topics[i], partitions[i], firsts[i]) for i in groups.indexes_of_kind(UNTRACKED))
    if untracked:
        raise TransactionError(transactions.untracked_message(untracked[0]))
    waiting_from: dict[tuple[str, int], int] = {}
    for topic, partition, first, _, _ in ends[stop:]:
        waiting_from.setdefault((topic, partition), first)
    bounds = ([(t, p, first, False) for (t, p), (first, _) in sorted(blocking.items())]
              + [(t, p, first, True) for (t, p), first in sorted(waiting_from.items())])
    staged, staged_once, held = groups.columns[9:]
    return Walk(bounds, len(ready), [tx for _, _, _, tx, _ in ends[stop:stop + 5]],
                copies=sum(staged) - sum(staged_once), held_before=sum(held))
