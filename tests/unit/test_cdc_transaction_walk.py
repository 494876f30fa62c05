"""The walk over a batch's counts (``cdc/transaction_walk.py``) against the reference model,
``transactions.plan``, on random histories: the same records held, the same transactions ready,
the same refusals. The groups are made as ``transactions_sql.count_statement`` makes them, and as
the stagers count them (``transaction_groups``)."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterable

import pytest

from spark_apps.eos_stream.cdc import transaction_groups, transactions, transactions_sql
from spark_apps.eos_stream.cdc.transaction_groups import GroupCounter
from spark_apps.eos_stream.cdc.transaction_walk import NO_BOUND, Group, Groups, walk
from spark_apps.eos_stream.cdc.transactions import CHANGE, END, FREE, Candidate, TransactionError, plan

TX = "app.transaction"
TOPICS = ("app.public.a", "app.public.b")


def groups_of(candidates: Iterable[Candidate]) -> Groups:
    """The count statement's groups: per partition, kind, transaction and table, an END alone."""
    found: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        topic, partition, offset = c.coordinate
        key = (topic, partition, c.kind, c.tx, c.collection, offset if c.kind == END else None)
        found.setdefault(key, []).append(c)
    made = []
    for (topic, partition, kind, tx, collection, _), members in found.items():
        offsets = [m.coordinate[2] for m in members]
        counts = transactions.counts_json(members[0].counts) if kind == END else None
        made.append(Group(topic, partition, kind, tx, collection, len(offsets), min(offsets), max(offsets),
                          counts, staged=len(offsets), staged_once=len(offsets)))
    return Groups.of(made)


def counted_groups(candidates: Iterable[Candidate], rng: random.Random) -> Groups:
    """The stagers' groups (``transaction_groups.GroupCounter``): the candidates staged by two
    tasks, each partition's records split between them where a random cut falls, as balanced
    shares split a range; the groups of both joined, as the driver joins its tasks' reports."""
    tasks = [GroupCounter(), GroupCounter()]
    by_partition: dict[tuple[str, int], list[Candidate]] = {}
    for c in candidates:
        by_partition.setdefault(c.coordinate[:2], []).append(c)
    op = {CHANGE: "c", transactions.UNTRACKED: "u", FREE: "r"}
    for records in by_partition.values():
        cut = rng.randint(0, len(records))
        for index, c in enumerate(records):
            task = tasks[index >= cut]
            if c.kind == END:
                task.end(*c.coordinate, str(c.tx), transactions.counts_json(c.counts))
            else:
                task.record(*c.coordinate, op[c.kind], False, c.tx, c.collection)
    return Groups.joined([tasks[0].groups(), tasks[1].groups()])


def _history(rng: random.Random, count: int, lose_ends: float) -> dict[tuple[str, int], list[Candidate]]:
    """A source's transactions in commit order over two tables of two partitions each, with
    snapshot reads between them; each END lost with probability ``lose_ends``."""
    streams: dict[tuple[str, int], list[Candidate]] = {}

    def put(topic: str, partition: int, kind: str, tx: str | None = None, collection: str | None = None,
            counts: dict[str, int] | None = None) -> None:
        stream = streams.setdefault((topic, partition), [])
        stream.append(Candidate((topic, partition, len(stream)), kind, tx, collection, counts or {}))

    for n in range(count):
        tx, counts = str(1000 + n), dict[str, int]()
        for _ in range(rng.randint(0, 6)):
            topic = rng.choice(TOPICS)
            collection = "public." + topic.rsplit(".", 1)[1]
            put(topic, rng.randint(0, 1), CHANGE, tx, collection)
            counts[collection] = counts.get(collection, 0) + 1
        if rng.random() < 0.2:
            put(rng.choice(TOPICS), rng.randint(0, 1), FREE)
        if rng.random() >= lose_ends:
            put(TX, 0, END, tx, counts=counts)
    return streams


def _read_prefixes(rng: random.Random, streams: dict[tuple[str, int], list[Candidate]]) -> list[Candidate]:
    return [c for stream in streams.values() for c in stream[:rng.randint(0, len(stream))]]


def _kind_of(refusal: TransactionError) -> str:
    return next(kind for kind in ("is complete, but", "more change events", "carries no transaction")
                if kind in str(refusal))


@pytest.mark.parametrize("counted_by", ["database", "stagers"])
@pytest.mark.parametrize("seed", range(40))
def test_the_walk_over_counts_holds_what_the_model_holds_or_refuses_where_it_refuses(
        seed: int, counted_by: str) -> None:
    rng = random.Random(seed)
    streams = _history(rng, rng.randint(1, 30), lose_ends=0.1 if seed % 2 else 0.0)
    read = _read_prefixes(rng, streams)
    groups = groups_of(read) if counted_by == "database" else counted_groups(read, rng)
    try:
        expected = plan(read)
    except TransactionError as refusal:
        with pytest.raises(TransactionError) as got:
            walk(groups)
        assert _kind_of(got.value) == _kind_of(refusal)  # which event each names may differ
        return
    decided = walk(groups)
    held = {c.coordinate for c in read if any(
        c.coordinate[:2] == (t, p) and c.coordinate[2] >= first and (not ends_only or c.kind == END)
        for t, p, first, ends_only in decided.bounds)}
    # The model holds a free record of the transaction topic (none here) and an END alike.
    assert held == expected.held
    assert decided.ready == len(set(expected.applicable))
    assert decided.waiting == expected.waiting[:5]


def test_more_events_than_the_end_counts_are_refused_naming_the_transaction_and_tables() -> None:
    read = [Candidate((TOPICS[0], 0, 0), CHANGE, "7", "public.a"),
            Candidate((TOPICS[0], 0, 1), CHANGE, "7", "public.a"),
            Candidate((TX, 0, 0), END, "7", counts={"public.a": 1})]
    with pytest.raises(TransactionError, match=r"source transaction 7: more change events of public.a than its END"):
        walk(groups_of(read))


def test_a_streaming_change_without_a_transaction_is_refused_at_its_coordinates() -> None:
    read = [Candidate((TOPICS[1], 1, 4), transactions.UNTRACKED)]
    with pytest.raises(TransactionError, match=r"app.public.b\[1\]@4 carries no transaction"):
        walk(groups_of(read))


def test_copies_and_records_held_before_are_summed_from_the_groups() -> None:
    groups = Groups.of([Group(TOPICS[0], 0, FREE, None, None, 3, 0, 2, staged=5, staged_once=3, held=1)])
    decided = walk(groups)
    assert (decided.copies, decided.held_before, decided.bounds) == (2, 1, [])


def test_the_stagers_groups_at_or_above_the_stored_offsets_stand_and_a_straddling_one_voids_the_count() -> None:
    below, at, above = (Group(TOPICS[0], 0, CHANGE, tx, "public.a", 2, first, first + 1)
                        for tx, first in (("1", 3), ("2", 5), ("3", 8)))
    stored = {(TOPICS[0], 0): 5}
    assert transaction_groups.applicable(Groups.of([below, at, above]), stored) == Groups.of([at, above])
    assert transaction_groups.applicable(Groups.of([above]), {}) == Groups.of([above])
    straddling = below._replace(last=5)  # its last record at the stored offset: not applied yet
    assert transaction_groups.applicable(Groups.of([straddling, at]), stored) is None


def test_groups_pickle_as_their_columns_and_read_back_as_rows() -> None:
    rows = [Group(TOPICS[0], 1, CHANGE, "9", "public.a", 2, 4, 6, None, 2, 2, 0),
            Group(TX, 0, END, "9", None, 1, 3, 3, '{"public.a":2}', 0, 0, 0)]
    groups = Groups.of(rows)
    assert pickle.loads(pickle.dumps(groups)) == groups and list(groups) == rows
    assert list(groups.of_kind(END)) == rows[1:] and len(Groups()) == 0
    assert list(groups.at_or_above({(TOPICS[0], 1): 5, (TX, 0): 3}, missing=0)) == rows[1:]


def test_the_move_checks_first_the_lowest_bound_a_stage_record_can_meet() -> None:
    """``stage_floor``: an ENDs-only bound counts only when the stage holds the transaction
    topic's ENDs (the stagers count them instead); no bound at all, none can be met."""
    bounds = [(TOPICS[0], 0, 70, False), (TOPICS[1], 1, 40, False), (TX, 0, 9, True)]
    ends = Groups()
    assert transactions_sql._move_params(bounds, ends, stage_holds_ends=False)["stage_floor"] == 40
    assert transactions_sql._move_params(bounds, ends, stage_holds_ends=True)["stage_floor"] == 9
    assert transactions_sql._move_params(bounds[2:], ends, stage_holds_ends=False)["stage_floor"] == NO_BOUND
