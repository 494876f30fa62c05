"""Per-key deltas of the aggregate targets, summed where the records are
(a Spark task) instead of in the database's batch transaction.

A task that writes its records straight into the row target (``sink.part_writer``)
sends the driver, per aggregate target, one delta per key: each increment's sum
(``count(*)`` for an increment without a field) and the latest columns' values
of the key's last record, with that record's (partition, offset). The driver
merges the tasks' deltas (sums add, the later position wins) and upserts a few
hundred rows where the staged path groups the whole batch.

They mean what the staged apply computes (``apply_sql._aggregate_from_records``):
a NULL adds nothing (``COALESCE(sum(...), 0)``), a count counts every record,
and a latest value is the one at the highest (partition, offset), NULL
included. Sums are exact: Arrow adds the int64 values as 38-digit decimals,
and the merge adds Python ints. ``tests/integration/test_prepared_parts.py``
holds them to the apply's SQL over the same records, NULLs and sums past 64
bits included.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from spark_apps.eos_stream.records.spec import AggregateTarget

# Per aggregate target: key (a tuple of the group_by values) -> [position, *increments, *latest values],
# where position is the (partition, offset) of the key's last record.
Deltas = list[dict[tuple, list]]

_LAST = "last"


def empty(targets: Iterable[AggregateTarget]) -> Deltas:
    return [{} for _ in targets]


def add_table(deltas: Deltas, targets: list[AggregateTarget], table: Any) -> None:
    """Adds the records of ``table`` (``_partition``, ``_offset`` and the typed fields,
    one row per valid record, in offset order within each partition) to ``deltas``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not table.num_rows:
        return
    last = pc.ScalarAggregateOptions(skip_nulls=False)  # a NULL latest value is the value
    for index, target in enumerate(targets):
        work = table
        aggregations: list[tuple] = [("_partition", _LAST, last), ("_offset", _LAST, last)]
        for column, source in target.increments.items():
            if source is None:
                aggregations.append(([], "count_all"))
            else:
                exact = f"_sum_{column}"
                work = work.append_column(exact, pc.cast(work.column(source), pa.decimal128(38, 0)))
                aggregations.append((exact, "sum"))
        aggregations += [(source, _LAST, last) for source in target.latest.values()]
        # use_threads=False keeps the input order, so "last" is the last record of each key.
        grouped = work.group_by(list(target.group_by), use_threads=False).aggregate(aggregations)
        # Arrow puts the keys first, then one column per aggregation, in order (by position:
        # two count increments would share a name).
        width = len(target.group_by)
        keys = [grouped.column(i).to_pylist() for i in range(width)]
        values = [grouped.column(width + i).to_pylist() for i in range(len(aggregations))]
        into = deltas[index]
        sums = len(target.increments)
        for row, key in enumerate(zip(*keys, strict=True)):
            partition, offset, *rest = (column[row] for column in values)
            _merge_one(into, key, [(partition, offset), *[int(v or 0) for v in rest[:sums]], *rest[sums:]], sums)


def _merge_one(into: dict[tuple, list], key: tuple, delta: list, sums: int) -> None:
    held = into.get(key)
    if held is None:
        into[key] = delta
        return
    for i in range(1, 1 + sums):
        held[i] += delta[i]
    if tuple(delta[0]) > tuple(held[0]):
        held[0] = delta[0]
        held[1 + sums:] = delta[1 + sums:]


def merge(into: Deltas, more: Deltas, targets: list[AggregateTarget]) -> None:
    """Adds ``more`` (another task's deltas of the same batch) to ``into``."""
    for index, target in enumerate(targets):
        sums = len(target.increments)
        for key, delta in more[index].items():
            _merge_one(into[index], tuple(key), list(delta), sums)


def to_wire(deltas: Deltas) -> list[list[list]]:
    """Deltas as plain lists (a key tuple is no JSON object key), for a task's result."""
    return [[[list(key), [list(delta[0]), *delta[1:]]] for key, delta in target.items()] for target in deltas]


def from_wire(wire: list[list[list]]) -> Deltas:
    return [{tuple(key): [tuple(delta[0]), *delta[1:]] for key, delta in target} for target in wire]


def recordset_json(target: AggregateTarget, deltas: dict[tuple, list]) -> str:
    """One target's deltas as the JSON array ``apply_sql.aggregate_deltas_statement`` reads,
    one object per key, its members named after the target's key and value columns."""
    rows = []
    for key, (_position, *values) in deltas.items():
        rows.append({**dict(zip(target.group_by, key, strict=True)),
                     **dict(zip(target.columns, values, strict=True))})
    return json.dumps(rows, separators=(",", ":"))
