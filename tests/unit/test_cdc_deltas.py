"""Aggregates over a change stream (spark_apps/eos_stream/cdc/deltas.py): which deltas stay equal to
GROUP BY over the source, proven over random consistent change streams and named counter-examples."""

from __future__ import annotations

import random
from decimal import Decimal

import pytest

from spark_apps.eos_stream.cdc.deltas import (
    BeforeMissing,
    ChangeAggregate,
    Totals,
    apply_deltas,
    deltas_from_changes,
    deltas_from_states,
    group_by,
)
from spark_apps.eos_stream.cdc.envelope import Change
from spark_apps.eos_stream.cdc.mirror import MirrorTarget, apply_compacted, compact

AGG = ChangeAggregate("public.orders", "totals", ("region",), {"amount": "amount"})
ORDERS = MirrorTarget("public.orders", "orders", ("id",), {"id": "bigint", "region": "text", "amount": "numeric"})


def change(op: str, id_: int, before: dict | None, after: dict | None) -> Change:
    return Change("public.orders", op, {"id": id_}, before, after)


def random_stream(rng: random.Random, source: dict[int, dict], n: int) -> list[Change]:
    """n changes a source would emit with REPLICA IDENTITY FULL, applied to ``source`` as it goes:
    inserts, updates of the amount and of the group (region), primary-key changes, deletes."""
    changes = []
    for _ in range(n):
        kind = rng.choice("iuugdk")
        if kind == "i" or not source:
            id_ = rng.randint(1, 60)
            if id_ in source:
                continue
            row = {"id": id_, "region": rng.choice("NSEW"), "amount": Decimal(rng.randint(-500, 500)) / 100}
            source[id_] = row
            changes.append(change("c", id_, None, dict(row)))
            continue
        id_ = rng.choice(sorted(source))
        old = dict(source[id_])
        if kind == "d":
            del source[id_]
            changes.append(change("d", id_, old, None))
        elif kind == "k":  # a primary-key change: Debezium's delete of the old key and create of the new
            new_id = rng.randint(61, 999)
            if new_id in source:
                continue
            del source[id_]
            source[new_id] = {**old, "id": new_id}
            changes += [change("d", id_, old, None), change("c", new_id, None, dict(source[new_id]))]
        else:
            new = {**old, "region": rng.choice("NSEW")} if kind == "g" else {**old, "amount": old["amount"] + 1}
            source[id_] = new
            changes.append(change("u", id_, old, dict(new)))
    return changes


@pytest.mark.parametrize("seed", range(25))
def test_every_change_compacted_and_state_deltas_all_equal_group_by(seed: int) -> None:
    rng = random.Random(seed)
    source: dict[int, dict] = {}
    mirror: dict[tuple, dict] = {}
    by_every: Totals = {}
    by_compacted: Totals = {}
    by_state: Totals = {}
    for _batch in range(8):
        changes = random_stream(rng, source, rng.randint(1, 40))
        by_every = apply_deltas(by_every, deltas_from_changes(AGG, changes))
        # compacted: first before, last after of each key
        first_before: dict = {}
        last_after: dict = {}
        for c in changes:
            first_before.setdefault(c.key["id"], c.before)
            last_after[c.key["id"]] = c.after
        before_rows = {(k,): v for k, v in first_before.items() if v is not None}
        by_compacted = apply_deltas(by_compacted, deltas_from_states(AGG, before_rows,
                                                                     {(k,): v for k, v in last_after.items()}))
        # state: the mirror's stored rows before and after the batch
        touched = {(c.key["id"],) for c in changes}
        stored = {k: dict(mirror[k]) for k in touched if k in mirror}
        apply_compacted(mirror, ORDERS, compact(ORDERS, [((0, i), c) for i, c in enumerate(changes)]))
        by_state = apply_deltas(by_state, deltas_from_states(AGG, stored, {k: mirror.get(k) for k in touched}))
        oracle = group_by(AGG, source.values())
        assert by_every == oracle
        assert by_compacted == oracle
        assert by_state == oracle
        assert {k[0]: v for k, v in mirror.items()} == source


def test_compacting_to_the_last_change_alone_loses_earlier_updates() -> None:
    row = {"id": 1, "region": "N", "amount": Decimal(1)}
    changes = [change("c", 1, None, row), change("u", 1, row, {**row, "amount": Decimal(2)}),
               change("u", 1, {**row, "amount": Decimal(2)}, {**row, "amount": Decimal(5)})]
    last_only = deltas_from_changes(AGG, changes[-1:])
    assert apply_deltas({}, last_only) != group_by(AGG, [{**row, "amount": Decimal(5)}])
    assert apply_deltas({}, deltas_from_changes(AGG, changes)) == {("N",): [1, Decimal(5)]}


def test_a_group_change_moves_the_row_between_groups() -> None:
    row = {"id": 1, "region": "N", "amount": Decimal(3)}
    totals = apply_deltas({}, deltas_from_changes(AGG, [change("c", 1, None, row)]))
    totals = apply_deltas(totals, deltas_from_changes(AGG, [change("u", 1, row, {**row, "region": "S"})]))
    assert totals == {("S",): [1, Decimal(3)]}  # the empty group N is gone, as in GROUP BY


def test_a_repeated_snapshot_read_is_counted_twice_from_changes_but_not_from_states() -> None:
    row = {"id": 1, "region": "N", "amount": Decimal(3)}
    reads = [change("r", 1, None, row), change("r", 1, None, row)]  # an incremental snapshot re-reads the row
    assert apply_deltas({}, deltas_from_changes(AGG, reads)) == {("N",): [2, Decimal(6)]}  # wrong
    mirror: dict = {}
    totals: dict = {}
    for read in reads:
        stored = {k: dict(v) for k, v in mirror.items()}
        apply_compacted(mirror, ORDERS, compact(ORDERS, [((0, 0), read)]))
        totals = apply_deltas(totals, deltas_from_states(AGG, stored, dict(mirror)))
    assert totals == group_by(AGG, [row]) == {("N",): [1, Decimal(3)]}


def test_changes_without_the_before_an_aggregate_needs_are_refused() -> None:
    with pytest.raises(BeforeMissing, match="REPLICA IDENTITY FULL"):
        deltas_from_changes(AGG, [change("u", 1, None, {"id": 1, "region": "N", "amount": Decimal(1)})])
    toasted = Change("public.orders", "d", {"id": 1}, {"id": 1, "region": "N"}, None,
                     before_unavailable=frozenset({"amount"}))
    with pytest.raises(BeforeMissing, match=r"lacks \['amount'\]"):
        deltas_from_changes(AGG, [toasted])
