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
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from spark_apps.eos_stream.cdc import transactions
from spark_apps.eos_stream.cdc.transactions import CHANGE, END, UNTRACKED, TransactionError

Bound = tuple[str, int, int, bool]  # topic, partition, first held offset, ENDs only


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


@dataclass
class Walk:
    """What the batch applies and holds: ``bounds`` for ``transactions_sql.move_statement``."""

    bounds: list[Bound]
    ready: int  # transactions applied now
    waiting: list[str] = field(default_factory=list)  # the first five ENDs waiting, in commit order
    copies: int = 0  # the stage's records staged more than once
    held_before: int = 0  # records held by earlier batches


def _seen(groups: Iterable[Group]) -> dict[str, dict[str | None, int]]:
    seen: dict[str, dict[str | None, int]] = {}
    for g in groups:
        if g.kind == CHANGE and g.tx is not None:
            per_table = seen.setdefault(g.tx, {})
            per_table[g.collection] = per_table.get(g.collection, 0) + g.events
    return seen


def _expected(counts: str | None) -> dict[str | None, int]:
    tables = json.loads(counts) if counts else {}
    return {table: n for table, n in tables.items() if n}


def _check_counts(ends: list[Group], seen: dict[str, dict[str | None, int]]) -> list[bool]:
    """Whether each END's transaction is complete; refuses one with more events than it counts.
    An END's counts are read once per distinct text (a batch's ENDs repeat a few)."""
    read: dict[str | None, dict[str | None, int]] = {}
    complete = []
    for end in ends:
        expected = read.get(end.counts)
        if expected is None:
            expected = read[end.counts] = _expected(end.counts)
        got = seen.get(str(end.tx), {})
        if got == expected:
            complete.append(True)
            continue
        extra = sorted(str(t) for t, n in got.items() if n > expected.get(t, 0))
        if extra:
            raise TransactionError(transactions.impossible_message(end.tx, ", ".join(extra)))
        complete.append(False)
    return complete


def _refuse_misordered(changes: list[Group], ready: set[str], blocking: dict[tuple[str, int], Group]) -> None:
    """A ready transaction's event behind a held event of its partition: an END lost, or change
    topics out of commit order (``transactions.misordered_message``)."""
    if not blocking:
        return
    behind = sorted((g for g in changes if g.tx in ready and (g.topic, g.partition) in blocking
                     and g.last > blocking[(g.topic, g.partition)].first),
                    key=lambda g: (str(g.tx), g.topic, g.partition, g.last))
    if behind:
        g = behind[0]
        earlier = blocking[(g.topic, g.partition)].tx
        raise TransactionError(transactions.misordered_message(g.tx, (g.topic, g.partition, g.last), earlier))


def walk(groups: list[Group]) -> Walk:
    """The walk (see the module) over one batch's groups.

    :raises TransactionError: an END counting fewer events than arrived, a complete transaction
        behind a held record of its partition, or a streaming change without transaction metadata."""
    ends = sorted((g for g in groups if g.kind == END), key=attrgetter("topic", "partition", "first"))
    changes = [g for g in groups if g.kind == CHANGE]
    complete = _check_counts(ends, _seen(groups))
    stop = next((i for i, done in enumerate(complete) if not done), len(ends))
    ready = {str(e.tx) for e in ends[:stop]}
    blocking: dict[tuple[str, int], Group] = {}
    for g in changes:
        here = blocking.get((g.topic, g.partition))
        if g.tx not in ready and (here is None or g.first < here.first):
            blocking[(g.topic, g.partition)] = g
    _refuse_misordered(changes, ready, blocking)
    untracked = sorted((g.topic, g.partition, g.first) for g in groups if g.kind == UNTRACKED)
    if untracked:
        raise TransactionError(transactions.untracked_message(untracked[0]))
    waiting_from: dict[tuple[str, int], int] = {}
    for e in ends[stop:]:
        waiting_from.setdefault((e.topic, e.partition), e.first)
    bounds = ([(t, p, g.first, False) for (t, p), g in sorted(blocking.items())]
              + [(t, p, first, True) for (t, p), first in sorted(waiting_from.items())])
    return Walk(bounds, len(ready), [str(e.tx) for e in ends[stop:stop + 5]],
                copies=sum(map(attrgetter("staged"), groups)) - sum(map(attrgetter("staged_once"), groups)),
                held_before=sum(map(attrgetter("held"), groups)))
