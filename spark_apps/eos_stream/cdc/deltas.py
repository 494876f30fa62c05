"""Aggregates over a change stream: per-group sums and row counts kept equal to
``SELECT group_by, sum(...), count(*) FROM source GROUP BY group_by``.

An insert adds its row, a delete subtracts it, an update adds ``after - before``; a change
of a group column moves the row's contribution from one group to the other. Three ways to
get there, of which the mirror uses the last (docs/cdc.md, "Aggregates over a change stream"):

* ``deltas_from_changes``: every change, with Debezium's ``before``. Exact only with a
  complete ``before``, which Debezium sends only for a table with ``REPLICA IDENTITY FULL``
  (under the default identity an update has no ``before`` and a delete's ``before`` holds
  the key and NULLs, indistinguishable from NULL values). It refuses what it can see is
  missing (:class:`BeforeMissing`); it cannot see a DEFAULT-identity delete's NULLs.
  A snapshot read (``r``) of a row already counted, as an incremental or repeated snapshot
  sends, is counted twice.
* compacted changes, first ``before`` and last ``after`` of each key: the same sums as
  every change, since a consistent stream's updates telescope (each ``before`` is the
  previous ``after``). Compacting to the last change alone, with its own ``before``, is
  wrong: it drops the batch's earlier updates of the key.
* ``deltas_from_states`` (the one the mirror applies): the mirror's row of each key before
  the batch and after it, read in the batch's statement. The stored row *is* the exact
  ``before`` of the key's first change in the batch, so this is the compacted form with no
  need of Debezium's ``before``, of REPLICA IDENTITY FULL, or of TOASTed values the event
  lacks; a repeated snapshot read changes nothing, and a quarantined change moves no total,
  as it moves no row. The aggregate then equals ``GROUP BY`` over the mirror, and so over
  the source whenever the mirror equals it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from spark_apps.eos_stream.cdc.envelope import Change, EnvelopeError

Number = int | Decimal
Totals = dict[tuple, list[Number]]  # group -> [row count, *sums]


class BeforeMissing(EnvelopeError):
    """A change lacks the ``before`` values an aggregate over every change needs."""


@dataclass(frozen=True)
class ChangeAggregate:
    """Per-group totals over a mirrored table.

    :param source: the mirrored source table (``schema.table``).
    :param table: the aggregate's table; unique on ``group_by``.
    :param group_by: columns of the source row that form the group.
    :param sums: aggregate column -> source column it sums (NULL adds nothing).
    :param count_column: the aggregate column holding the group's row count; a group whose
        count reaches 0 is removed, as ``GROUP BY`` has no empty groups.
    """

    source: str
    table: str
    group_by: tuple[str, ...]
    sums: Mapping[str, str]
    count_column: str = "row_count"

    @property
    def inputs(self) -> set[str]:
        return set(self.group_by) | set(self.sums.values())


def contribution(aggregate: ChangeAggregate, row: Mapping[str, Any]) -> tuple[tuple, list[Number]]:
    """A row's group and what it adds there: [1, *its summed values, NULL as 0]."""
    group = tuple(row.get(c) for c in aggregate.group_by)
    return group, [1, *(_number(row.get(c)) for c in aggregate.sums.values())]


def _number(value: Any) -> Number:
    if value is None:
        return 0
    if isinstance(value, str):
        return Decimal(value)
    return value


def _add(into: Totals, group: tuple, values: list[Number], sign: int) -> None:
    held = into.setdefault(group, [0] * len(values))
    for i, v in enumerate(values):
        held[i] += sign * v


def deltas_from_states(aggregate: ChangeAggregate, before: Mapping[tuple, Mapping[str, Any]],
                       after: Mapping[tuple, Mapping[str, Any] | None]) -> Totals:
    """The batch's deltas from the mirror's rows of the keys it touched: ``before`` (the stored
    rows, key -> row) and ``after`` (key -> the row after the batch, None if deleted)."""
    deltas: Totals = {}
    for key in set(before) | set(after):
        if key in before:
            _add(deltas, *contribution(aggregate, before[key]), -1)
        row = after.get(key)
        if row is not None:
            _add(deltas, *contribution(aggregate, row), +1)
    return deltas


def _check_before(aggregate: ChangeAggregate, change: Change) -> Mapping[str, Any]:
    needed = aggregate.inputs
    if change.before is None:
        kind = "update" if change.op == "u" else "delete"
        raise BeforeMissing(f"{change.table}: an {kind} without 'before': aggregate {aggregate.table!r} over every "
                            f"change needs the old values of {sorted(needed)}; run ALTER TABLE {change.table} "
                            "REPLICA IDENTITY FULL on the source")
    unread = sorted(needed & (change.before_unavailable | (needed - set(change.before))))
    if unread:
        raise BeforeMissing(f"{change.table}: 'before' lacks {unread} (unchanged TOASTed or not sent), which aggregate "
                            f"{aggregate.table!r} needs; run ALTER TABLE {change.table} REPLICA IDENTITY FULL")
    return change.before


def deltas_from_changes(aggregate: ChangeAggregate, changes: Iterable[Change]) -> Totals:
    """The batch's deltas from every change and Debezium's ``before`` (see the module's note)."""
    deltas: Totals = {}
    for change in changes:
        if change.op in ("u", "d"):
            _add(deltas, *contribution(aggregate, _check_before(aggregate, change)), -1)
        if change.op != "d":
            assert change.after is not None
            if change.op == "u" and change.unchanged & aggregate.inputs:
                raise BeforeMissing(f"{change.table}: 'after' lacks {sorted(change.unchanged & aggregate.inputs)} "
                                    "(unchanged TOASTed values)")
            _add(deltas, *contribution(aggregate, change.after), +1)
    return deltas


def apply_deltas(totals: Totals, deltas: Totals) -> Totals:
    """``totals`` plus ``deltas``, without the groups left with no rows (as GROUP BY has none)."""
    out = {group: list(values) for group, values in totals.items()}
    for group, values in deltas.items():
        _add(out, group, values, +1)
    return {group: values for group, values in out.items() if values[0] != 0}


def group_by(aggregate: ChangeAggregate, rows: Iterable[Mapping[str, Any]]) -> Totals:
    """``SELECT group_by, count(*), sum(...) ... GROUP BY``: the oracle the totals must equal."""
    out: Totals = {}
    for row in rows:
        _add(out, *contribution(aggregate, row), +1)
    return out
