"""The continuous engine's plan of a whole mirror's cycles (``engines/cycle_hold.py``), on the
records Debezium's connector writes (``bench/cdc_changes``) cut into cycles at random: every change
applied once, each source transaction in one cycle with its END, in each partition's order, and
each cycle's stored offsets at the first record it did not apply. The plans are made as a run
makes them: by the staging, which COPYs every line and then removes what is held, or by the
apply when that staging failed. Kafka messages are stand-ins here (pure logic); the engine's
runs against the real stack are in ``tests/integration/test_cdc_whole_transactions.py``."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg2 import sql

from bench.cdc_changes import COLUMNS, ChangeStream
from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.eos_stream.cdc.transactions import TransactionError
from spark_apps.eos_stream.engines import cycle_hold
from spark_apps.eos_stream.engines.cycle_hold import CyclePlan, TransactionHolds
from tests.helpers.kafka import ConsumedMessage as Message

PREFIX = "app"
TX_TOPIC = f"{PREFIX}.transaction"


def _mirror() -> Any:
    section = {"topic_prefix": PREFIX, "transactions": "whole",
               "tables": [{"source": "public.t00", "key": ["id"], "columns": dict(COLUMNS)}]}
    return mirror_spec(section).mirror


def _logs(changes: int, seed: int) -> dict[tuple[str, int], list[Message]]:
    """The connector's records in commit order: the change topic's over two partitions (by key),
    the transaction topic's in one."""
    logs: dict[tuple[str, int], list[Message]] = {}
    stream = ChangeStream(1, changes, prefix=PREFIX, seed=seed, transaction_metadata=True, transaction_changes=12)
    for topic, key, value in stream.records():
        partition = 0 if topic == TX_TOPIC else zlib.crc32(key) % 2
        log = logs.setdefault((topic, partition), [])
        log.append(Message((topic, partition, len(log), key, value)))
    return logs


def _cycles(logs: dict[tuple[str, int], list[Message]], rng: random.Random) -> Iterator[tuple[list, dict, dict]]:
    """(messages, starts, ends) of cycles that read each partition on by a random count, the
    transaction topic sometimes behind the changes and sometimes ahead, until every log is read."""
    read = dict.fromkeys(logs, 0)
    while any(read[tp] < len(log) for tp, log in logs.items()):
        messages, starts, ends = [], {}, {}
        for tp, log in logs.items():
            step = rng.choice((0, 3, 17, 60, 200))
            if read[tp] < len(log) and step:
                starts[tp], ends[tp] = read[tp], min(len(log), read[tp] + step)
                messages += log[read[tp]:ends[tp]]
                read[tp] = ends[tp]
        rng.shuffle(messages)  # interleaved across partitions, in order within each
        messages.sort(key=lambda m: (m.topic(), m.partition(), m.offset()))
        yield messages, starts, ends


def _coordinates(lines: list[str]) -> list[tuple[str, int, int]]:
    return [(t, int(p), int(o)) for t, p, o, _ in (line.split("\t", 3) for line in lines)]


class FakeCursor:
    """What the staging's ``after`` runs on: the removal of the held records, done on ``staged``."""

    def __init__(self, staged: list[str]) -> None:
        self.staged = staged

    def execute(self, statement: Any, params: tuple) -> None:
        bound = {(t, p): first for t, p, first in zip(*params, strict=True)}
        self.staged[:] = [line for line, (t, p, o) in zip(self.staged, _coordinates(self.staged), strict=True)
                          if o < bound.get((t, p), 1 << 62)]


def _stage(plan: CyclePlan, fail_copy: bool) -> list[str] | None:
    """The plan's first staging: the lines its COPY took, less what ``after`` removed; None
    when the COPY fails halfway (the apply then plans)."""
    staged: list[str] = []

    def copy(chunks: Iterator[bytes], after: Callable[[Any, Any], None] | None) -> None:
        for chunk in chunks:
            staged.extend(chunk.decode().splitlines(keepends=True))
            if fail_copy:
                raise ConnectionError("the staging session was lost")
        if after is not None:
            after(FakeCursor(staged), sql.Identifier("stage"))

    try:
        plan.stage(copy, keep_raw=False)
    except ConnectionError:
        return None
    return staged


@pytest.mark.parametrize("seed", range(12))
def test_cycles_apply_each_change_once_in_whole_transactions_and_store_the_first_not_applied(seed: int) -> None:
    rng = random.Random(seed)
    logs = _logs(400, seed)
    holds = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=lambda: False,
                             notify=lambda event, **fields: None)
    applied_at: dict[tuple[str, int, int], int] = {}
    stored: dict[tuple[str, int], int] = {}
    for index, (messages, starts, ends) in enumerate(_cycles(logs, rng)):
        plan = holds.plan(messages, starts, ends)
        staged = _stage(plan, fail_copy=rng.random() < 0.2)
        planned = plan.result()
        assert planned.groups is None  # walked here, nothing for the database
        applied = [record[:3] for record in planned.records if record[0] != TX_TOPIC]  # ENDs counted, not staged
        assert planned.count.rows == len(applied)
        if staged is not None:
            assert _coordinates(staged) == applied
        assert {tp: stored[tp] for tp in planned.starts if tp in stored} == {
            tp: o for tp, o in planned.starts.items() if tp in stored}  # each range starts at its stored offset
        for coordinate in applied:
            assert coordinate not in applied_at, f"{coordinate} applied twice"
            applied_at[coordinate] = index
        stored.update(planned.ends)
        plan.committed.set()
        _check_stored(logs, stored, applied_at)
    _check_whole(logs, applied_at)
    assert not holds.held.groups and stored == {tp: len(log) for tp, log in logs.items()}


REFUSED = b"not a transaction record"


def _with_refused_transaction_records(logs: dict[tuple[str, int], list[Message]], rng: random.Random
                                      ) -> set[tuple[str, int, int]]:
    """Records of the transaction topic no stager can read, put at random places in its log."""
    values = [m.record[3:] for m in logs[(TX_TOPIC, 0)]]
    for _ in range(6):
        values.insert(rng.randrange(len(values)), (b'{"id":"x"}', REFUSED))
    logs[(TX_TOPIC, 0)] = [Message((TX_TOPIC, 0, offset, *kv)) for offset, kv in enumerate(values)]
    return {(TX_TOPIC, 0, offset) for offset, (_, value) in enumerate(values) if value == REFUSED}


@pytest.mark.parametrize("seed", range(6))
def test_a_refused_record_of_the_transaction_topic_is_staged_once_even_while_transactions_wait(seed: int) -> None:
    """A transaction-topic record the stager refuses has a stage line (it is dead-lettered), unlike
    the BEGINs and ENDs it counts: one at or above the bound waits with its line, and is staged once."""
    rng = random.Random(seed)
    logs = _logs(300, seed)
    refused = _with_refused_transaction_records(logs, rng)
    holds = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=lambda: False,
                             notify=lambda event, **fields: None)
    staged: list[tuple[str, int, int]] = []
    for messages, starts, ends in _cycles(logs, rng):
        plan = holds.plan(messages, starts, ends)
        planned = plan.result()
        lines = [line for chunk in planned.chunks(holds.mirror, False) for line in chunk.decode().splitlines()]
        assert planned.count.rows == len(lines)
        staged += [c for c in _coordinates(lines) if c[0] == TX_TOPIC]
        plan.committed.set()
    assert sorted(staged) == sorted(refused)


def _check_stored(logs: dict[tuple[str, int], list[Message]], stored: dict[tuple[str, int], int],
                  applied_at: dict[tuple[str, int, int], int]) -> None:
    """Below each stored offset every change is applied; at and above it none is."""
    for (topic, partition), next_offset in stored.items():
        if topic == TX_TOPIC:
            continue
        for message in logs[(topic, partition)]:
            assert ((topic, partition, message.offset()) in applied_at) == (message.offset() < next_offset)


def _check_whole(logs: dict[tuple[str, int], list[Message]], applied_at: dict[tuple[str, int, int], int]) -> None:
    """Every change applied, each source transaction's in one cycle, never before an earlier one's."""
    import json

    cycle_of_tx: dict[str, set[int]] = {}
    for (topic, partition), log in logs.items():
        if topic == TX_TOPIC:
            continue
        for m in log:
            value = m.value()
            if value is None:
                continue
            tx = json.loads(value)["transaction"]["id"].split(":")[0]
            cycle_of_tx.setdefault(tx, set()).add(applied_at[(topic, partition, m.offset())])
    assert all(len(cycles) == 1 for cycles in cycle_of_tx.values()), "a transaction applied over two cycles"
    order = [next(iter(cycle_of_tx[tx])) for tx in sorted(cycle_of_tx, key=int)]
    assert order == sorted(order), "a later source transaction applied before an earlier one"


def _first_halves(changes: int, seed: int) -> tuple[list[Message], dict[tuple[str, int], list[Message]]]:
    """A cycle of each log's first half (ending inside source transactions), and the logs."""
    logs = _logs(changes, seed)
    return [m for log in logs.values() for m in log[:len(log) // 2]], logs


def test_the_database_holds_while_held_changes_has_records_and_memory_once_it_is_empty() -> None:
    """H4: while ``held_changes`` holds records of the pipeline a cycle stages every record for the
    database's walk; the next plan waits for that cycle's commit, looks again, and walks in memory
    once it holds nothing."""
    import threading

    logs = _logs(60, 1)
    in_database = [True]
    holds = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=lambda: in_database[0],
                             notify=lambda event, **fields: None)
    ends = {tp: len(log) for tp, log in logs.items()}
    plan = holds.plan([m for log in logs.values() for m in log], {}, ends)
    planned = plan.result()
    assert planned.groups is not None and planned.ends == ends
    later = holds.plan([], {}, {})
    made = threading.Thread(target=later.result)
    made.start()
    made.join(0.3)
    assert made.is_alive()  # waits for the first cycle's commit
    in_database[0] = False
    plan.committed.set()
    made.join(5)
    assert later.result().groups is None  # walked in memory


def test_held_records_past_the_bound_or_too_old_go_to_the_database() -> None:
    """H3: what a cycle holds past ``max_bytes``, or longer than ``HOLD_SECONDS``, is staged for
    ``held_changes``, with every record of the cycle; its range ends where the reader's did."""
    first, logs = _first_halves(60, 4)
    halves = {tp: len(log) // 2 for tp, log in logs.items()}
    small = TransactionHolds(_mirror(), max_bytes=100, held_in_database=lambda: False,
                             notify=lambda event, **fields: None)
    planned = small.plan(first, {}, halves).result()
    assert planned.groups is not None and len(planned.records) == len(first)
    assert planned.count.rows == sum(1 for m in first if m.topic() != TX_TOPIC)
    assert planned.ends == halves and small.in_database

    now = [0.0]
    slow = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=lambda: False,
                            notify=lambda event, **fields: None, clock=lambda: now[0])
    plan = slow.plan(first, {}, halves)
    assert plan.result().groups is None and slow.held.groups and not slow.overdue()
    plan.committed.set()
    now[0] = cycle_hold.HOLD_SECONDS + 1
    assert slow.overdue()  # the loop commits an empty cycle for it
    assert slow.plan([], {}, {}).result().groups is not None and slow.in_database


def test_a_refused_walk_is_raised_by_its_plan_and_every_later_one() -> None:
    """H5: a change without transaction metadata in a whole mirror: the plan raises, every time,
    and so does the next cycle's (which never commits)."""
    logs = _logs(10, 2)
    change = next(m for m in logs[(f"{PREFIX}.public.t00", 0)] if m.value() is not None)
    value = change.value()
    assert value is not None
    stripped = value.replace(b'"transaction":{', b'"transaction":null,"x":{')
    holds = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=lambda: False,
                             notify=lambda event, **fields: None)
    bad = holds.plan([Message((*change.record[:4], stripped))], {}, {})
    for _ in range(2):
        with pytest.raises(TransactionError, match="carries no transaction"):
            bad.result()
    with pytest.raises(TransactionError):
        holds.plan([], {}, {}).result()


def test_a_retry_with_raw_bytes_stages_the_records_the_plan_applies() -> None:
    logs = _logs(80, 3)
    messages = [m for log in logs.values() for m in log[:25]]
    holds = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=lambda: False,
                             notify=lambda event, **fields: None)
    plan = holds.plan(messages, {}, {tp: 25 for tp in logs})
    first = _stage(plan, fail_copy=False)
    assert first is not None

    def stage_again(keep_raw: bool) -> list[str]:
        lines: list[str] = []
        plan.stage(lambda chunks, after: lines.extend(b"".join(chunks).decode().splitlines(keepends=True)), keep_raw)
        return lines

    assert stage_again(False) == first  # a retry: the same lines, made again
    raw = stage_again(True)
    assert _coordinates(raw) == _coordinates(first) and raw != first  # the same records, with their bytes


def test_a_failed_look_at_held_changes_leaves_the_walk_to_the_database() -> None:
    """The first plan looks at ``held_changes`` (H4); unreachable, it stages every record for the
    database's walk instead of failing the cycle, and tells why."""
    first, logs = _first_halves(60, 5)
    told: list[tuple[str, dict]] = []

    def unreachable() -> bool:
        raise ConnectionError("server closed the connection unexpectedly")

    holds = TransactionHolds(_mirror(), max_bytes=1 << 30, held_in_database=unreachable,
                             notify=lambda event, **fields: told.append((event, fields)))
    planned = holds.plan(first, {}, {tp: len(log) // 2 for tp, log in logs.items()}).result()
    assert planned.groups is not None and holds.in_database
    assert told[0][0] == "held_changes_not_read" and "closed the connection" in told[0][1]["error"]
