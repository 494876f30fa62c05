"""A mirror of whole source transactions (``mirror.transactions: whole``) through the sink on the
real PostgreSQL (no Kafka: each batch's stage is filled as the executors fill it, from three topics:
two tables' change topics and the connector's transaction topic).

A transaction split across batches is invisible until its END and all its events are there, then
visible whole; one larger than a batch accumulates in ``held_changes``; a later complete transaction
waits for an earlier incomplete one; a snapshot read applies at once; a batch that fails after the
walk leaves ``held_changes`` and the offsets as the previous batch left them, and applying a batch
again changes nothing."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.cdc import mirror_sql
from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.eos_stream.cdc.transactions import END, Candidate, TransactionError, plan
from spark_apps.eos_stream.records.spec import StageCount
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.in_doubt import find_in_doubt
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.settings import SinkSettings
from tests.helpers.mirror_sink import MirrorSink

ACCOUNTS, LEDGER, TX = "app.public.accounts", "app.public.ledger", "app.transaction"
SECTION = {"topic_prefix": "app", "transactions": "whole", "tables": [
    {"source": "public.accounts", "key": ["id"], "columns": {"id": "bigint", "balance": "numeric(20,6)"}},
    {"source": "public.ledger", "key": ["id"], "columns": {"id": "bigint", "account": "bigint",
                                                          "amount": "numeric(20,6)"}}],
    "aggregates": [{"source": "public.ledger", "target": "ledger_sums", "group_by": ["account"],
                    "sums": {"total": "amount"}}]}
Record = tuple[str, int, bytes | None, bytes | None]  # topic, partition, key, value


def account(op: str, key: int, balance: str, tx: str | None) -> Record:
    return _change(ACCOUNTS, "accounts", op, {"id": key, "balance": balance}, tx)


def ledger(key: int, account_id: int, amount: str, tx: str | None) -> Record:
    return _change(LEDGER, "ledger", "c", {"id": key, "account": account_id, "amount": amount}, tx)


def _change(topic: str, table: str, op: str, row: dict[str, Any], tx: str | None) -> Record:
    value = {"op": op, "before": None, "after": row, "source": {"schema": "public", "table": table},
             "transaction": None if tx is None else {"id": f"{tx}:{row['id'] * 7 + 3}",
                                                      "total_order": 1, "data_collection_order": 1}}
    return topic, 0, json.dumps({"id": row["id"]}).encode(), json.dumps(value).encode()


def end(tx: str, accounts: int = 0, ledgers: int = 0) -> Record:
    counts = {"public.accounts": accounts, "public.ledger": ledgers}
    value = {"status": "END", "id": f"{tx}:999", "event_count": accounts + ledgers, "ts_ms": 1,
             "data_collections": [{"data_collection": t, "event_count": n} for t, n in counts.items() if n]}
    return TX, 0, json.dumps({"id": tx}).encode(), json.dumps(value).encode()


def begin(tx: str) -> Record:
    return TX, 0, json.dumps({"id": tx}).encode(), json.dumps({"status": "BEGIN", "id": f"{tx}:1"}).encode()


class _Feed(MirrorSink):
    """The sink of SECTION, fed batch after batch of records, each partition's offsets continuing."""

    def __init__(self, stack: dict[str, str], unique_name: str, delivery: str = "exactly_once") -> None:
        super().__init__(stack, SECTION, f"t_txn_{unique_name}", f"m_txn_{unique_name}", f"txn_{unique_name}",
                         delivery=delivery)
        self.next: dict[tuple[str, int], int] = {}
        self.batch_id = 0
        self.delivery = delivery

    def switch(self, transactions: str) -> None:
        """The same pipeline from now on, with its definition's ``mirror.transactions`` set to ``transactions``."""
        self.spec = mirror_spec({**SECTION, "transactions": transactions})
        settings = SinkSettings(spec=self.spec, mode=MODES[self.delivery], pipeline=self.name,
                                target_schema=self.target, meta_schema=self.meta, max_batch_attempts=1,
                                transient_retry_seconds=0)
        self.sink = BatchSink(settings, conn=self.conn, guard_conn=self.guard)

    def apply(self, records: list[Record], again: bool = False, copies: int = 1) -> Any:
        """One batch of ``records`` after the ones before (``again``: the previous batch once more),
        staged ``copies`` times, as retried tasks stage their share again."""
        if again:
            self.next, self.batch_id = self.previous
        self.previous = dict(self.next), self.batch_id
        start = dict(self.next)
        rows = []
        for topic, partition, key, value in records:
            offset = self.next.setdefault((topic, partition), 0)
            start.setdefault((topic, partition), offset)
            rows.append((topic, partition, offset, key, value))
            self.next[(topic, partition)] = offset + 1
        batch = pa.record_batch([pa.array([r[i] for r in rows], t) for i, t in enumerate(
            (pa.string(), pa.int32(), pa.int64(), pa.binary(), pa.binary()))],
            names=["topic", "partition", "offset", "key", "value"])

        def fill_stage(stage_name: str, keep_raw: bool) -> StageCount:
            reported = [self.stage(stage_name, keep_raw, batch) for _ in range(copies)]
            return reported[0]  # the successful attempt's report; the others' copies stay in the stage

        self.batch_id += 1
        return self.sink.process(self.batch_id, start, dict(self.next), fill_stage)

    def query(self, statement: str, schema: str | None = None) -> list[tuple]:
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL(statement).format(s=sql.Identifier(schema or self.target), m=sql.Identifier(self.meta)),
                        {"p": self.name})
            found = cur.fetchall()
        self.conn.commit()
        return found

    def accounts(self) -> list[tuple]:
        return self.query("SELECT id, balance::text FROM {s}.accounts ORDER BY id")

    def ledgers(self) -> list[tuple]:
        return self.query("SELECT id, account, amount::text FROM {s}.ledger ORDER BY id")

    def held(self) -> list[tuple]:
        return self.query("SELECT _topic, _offset, _tx FROM {m}.held_changes WHERE pipeline = %(p)s"
                          " ORDER BY _topic, _offset")

    def offsets(self) -> dict[tuple[str, int], int]:
        found = self.query("SELECT topic, partition, next_offset FROM {m}.kafka_offsets WHERE pipeline = %(p)s")
        return {(t, p): n for t, p, n in found}


@pytest.fixture(params=["exactly_once"])
def feed(stack: dict[str, str], unique_name: str, request: pytest.FixtureRequest) -> Iterator[_Feed]:
    sink = _Feed(stack, unique_name, request.param)
    try:
        yield sink
    finally:
        sink.conn.rollback()
        sink.conn.autocommit = True  # ROLLBACK PREPARED runs outside a transaction
        for prepared in find_in_doubt(sink.conn, sink.name):  # none unless a two_phase batch failed mid-way
            with sink.conn.cursor() as cur:
                cur.execute("ROLLBACK PREPARED %s", (prepared["gid"],))
        sink.conn.autocommit = False
        sink.close()


@pytest.mark.parametrize("feed", ["exactly_once", "two_phase"], indirect=True)
def test_a_transaction_split_across_batches_is_invisible_until_whole_and_a_snapshot_read_is_free(
        feed: _Feed) -> None:
    feed.apply([account("r", 9, "90", None), begin("100"), account("c", 1, "10", "100"),
                account("c", 2, "20", "100")])
    assert feed.accounts() == [(9, "90.000000")]  # the snapshot read at once, nothing of transaction 100
    assert [h[:2] for h in feed.held()] == [(ACCOUNTS, 1), (ACCOUNTS, 2)]
    assert feed.offsets() == {(ACCOUNTS, 0): 3, (TX, 0): 1}  # the batch's end: held records are below

    feed.apply([ledger(1, 1, "10", "100"), end("100", accounts=2, ledgers=1)])
    assert feed.accounts() == [(1, "10.000000"), (2, "20.000000"), (9, "90.000000")]
    assert feed.ledgers() == [(1, 1, "10.000000")]
    assert feed.query("SELECT account, total::text FROM {s}.ledger_sums") == [(1, "10.000000")]
    assert feed.held() == [] and feed.offsets() == {(ACCOUNTS, 0): 3, (TX, 0): 2, (LEDGER, 0): 1}


def test_a_transaction_larger_than_a_batch_accumulates_then_applies_whole_in_commit_order(feed: _Feed) -> None:
    feed.apply([account("c", key, "1", "200") for key in (1, 2)])
    feed.apply([account("c", key, "1", "200") for key in (3, 4)])
    assert feed.accounts() == [] and len(feed.held()) == 4
    # 200 completes; 201's END comes with it but one of its events is still missing.
    feed.apply([account("u", 4, "5", "200"), end("200", accounts=5), account("u", 1, "7", "201"),
                ledger(1, 1, "6", "201"), end("201", accounts=1, ledgers=2)])
    assert feed.accounts() == [(1, "1.000000"), (2, "1.000000"), (3, "1.000000"), (4, "5.000000")]
    assert feed.ledgers() == [] and [h[2] for h in feed.held()] == ["201", "201", "201"]
    feed.apply([ledger(2, 1, "1", "201")])
    assert feed.accounts()[0] == (1, "7.000000") and [r[0] for r in feed.ledgers()] == [1, 2]
    assert feed.held() == []


def test_a_later_complete_transaction_waits_for_an_earlier_incomplete_one(feed: _Feed) -> None:
    feed.apply([account("c", 1, "1", "300"), ledger(1, 5, "2", "301"), end("300", accounts=2),
                end("301", ledgers=1)])
    assert feed.accounts() == [] and feed.ledgers() == []
    assert {h[2] for h in feed.held()} == {"300", "301"}
    feed.apply([account("c", 2, "1", "300")])
    assert [r[0] for r in feed.accounts()] == [1, 2] and feed.ledgers() == [(1, 5, "2.000000")]


def test_a_failed_batch_leaves_held_changes_and_offsets_as_they_were_and_a_rerun_applies_once(
        feed: _Feed, monkeypatch: pytest.MonkeyPatch) -> None:
    feed.apply([account("c", 1, "10", "400"), ledger(1, 1, "10", "400")])
    held, offsets = feed.held(), feed.offsets()
    real = mirror_sql.apply_mirror_statement

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the driver dies after the walk, before the commit")

    monkeypatch.setattr(mirror_sql, "apply_mirror_statement", crash)
    with pytest.raises(RuntimeError, match="driver dies"):
        feed.apply([end("400", accounts=1, ledgers=1)])
    assert feed.held() == held and feed.offsets() == offsets and feed.accounts() == []
    monkeypatch.setattr(mirror_sql, "apply_mirror_statement", real)
    first = feed.apply([end("400", accounts=1, ledgers=1)], again=True)
    assert feed.accounts() == [(1, "10.000000")] and feed.held() == []
    assert feed.query("SELECT account, total::text FROM {s}.ledger_sums") == [(1, "10.000000")]
    again = feed.apply([end("400", accounts=1, ledgers=1)], again=True)
    assert (first.applied, again.applied) == (2, 0), (first, again)  # the END is read, not applied
    assert feed.query("SELECT account, total::text FROM {s}.ledger_sums") == [(1, "10.000000")]
    assert feed.offsets() == {(ACCOUNTS, 0): 1, (LEDGER, 0): 1, (TX, 0): 1}


def test_a_batch_read_again_from_below_the_stored_offsets_counts_each_event_once(feed: _Feed) -> None:
    """A batch re-read from below the stored offsets and on past them (another engine's ranges):
    the stagers' group of transaction 901 straddles the stored offset, so the stage is counted
    after its applied records go; counted as staged, 901 would have more events than its END."""
    first = [ledger(1, 1, "10", "900"), end("900", ledgers=1), ledger(2, 2, "5", "901")]
    feed.apply(first)
    assert feed.ledgers() == [(1, 1, "10.000000")] and len(feed.held()) == 1
    result = feed.apply([*first, ledger(3, 2, "1", "901"), end("901", ledgers=2)], again=True)
    assert (result.applied, result.dead_lettered) == (2, 0), result
    assert feed.ledgers() == [(1, 1, "10.000000"), (2, 2, "5.000000"), (3, 2, "1.000000")] and feed.held() == []
    assert feed.query("SELECT account, total::text FROM {s}.ledger_sums ORDER BY account") == [
        (1, "10.000000"), (2, "6.000000")]


def test_a_refused_event_of_a_released_transaction_is_isolated_and_the_rest_applies(feed: _Feed) -> None:
    feed.apply([account("c", 1, "10", "500")])
    result = feed.apply([account("c", 2, "123456789012345678901234", "500"), end("500", accounts=2)])
    assert result.record_by_record and (result.applied, result.dead_lettered) == (1, 1), result
    assert feed.accounts() == [(1, "10.000000")] and feed.held() == []
    assert feed.query('SELECT topic, "offset", sqlstate FROM {m}.dead_letters') == [(ACCOUNTS, 1, "22003")]


def _source_run(rng: random.Random, transactions_count: int) -> tuple[dict[tuple[str, int], list], list[dict]]:
    """A source's history as Kafka holds it: per partition, its records (with the walk's view of
    each), accounts snapshot-read first; and the accounts' state after each transaction."""
    streams: dict[tuple[str, int], list] = {}

    def put(record: Record, partition: int, candidate: dict[str, Any]) -> None:
        streams.setdefault((record[0], partition), []).append(((record[0], partition, *record[2:]), candidate))

    state = {key: "0" for key in range(6)}
    for key in state:
        put(account("r", key, "0", None), key % 2, {"kind": "free", "snapshot": key})
    states = [dict(state)]
    for number in range(1, transactions_count + 1):
        tx = str(1000 + number)
        put(begin(tx), 0, {"kind": "free"})
        keys = rng.sample(sorted(state), rng.randint(1, 4))
        for key in keys:
            state[key] = str(rng.randint(1, 99))
            put(account("u", key, state[key], tx), key % 2,
                {"kind": "change", "tx": tx, "collection": "public.accounts"})
        put(end(tx, accounts=len(keys)), 0, {"kind": END, "tx": tx, "counts": {"public.accounts": len(keys)}})
        states.append(dict(state))
    return streams, states


def _cut(rng: random.Random, streams: dict[tuple[str, int], list], feed: _Feed, read: list[Candidate]) -> list:
    """The next batch: up to three records of each partition, taken from ``streams``; their
    walk's view appended to ``read`` at the offsets the feed will give them."""
    batch = []
    for stream in streams.values():
        take = stream[:rng.randint(0, 3)]
        del stream[:len(take)]
        batch += take
    offsets = dict(feed.next)
    for (topic, partition, _key, _value), view in batch:
        offset = offsets.setdefault((topic, partition), 0)
        offsets[(topic, partition)] = offset + 1
        read.append(Candidate((topic, partition, offset), view["kind"], view.get("tx"), view.get("collection"),
                              view.get("counts", {})))
    return batch


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_cuts_hold_what_the_model_holds_and_show_only_states_the_source_had(
        feed: _Feed, seed: int) -> None:
    rng = random.Random(seed)
    streams, states = _source_run(rng, 12)
    read: list[Candidate] = []
    snapshot_read: set[int] = set()  # keys whose snapshot read is in: the mirror holds them
    states_shown = set()
    while any(streams.values()):
        batch = _cut(rng, streams, feed, read)
        if not batch:
            continue
        snapshot_read.update(view["snapshot"] for _, view in batch if "snapshot" in view)
        feed.apply([record for record, _ in batch])
        expected = plan(read)
        assert {(t, o) for t, o, _ in feed.held()} == {(t, o) for t, _, o in expected.held}
        last = int(expected.applicable[-1]) - 1000 if expected.applicable else 0
        states_shown.add((last, bool(expected.held)))
        assert dict(feed.accounts()) == {k: f"{v}.000000" for k, v in states[last].items() if k in snapshot_read}
    # The cuts did split transactions (held records), and the last batch showed the last state.
    assert any(held for _, held in states_shown) and (12, False) in states_shown, states_shown


@pytest.mark.parametrize("seed", [4, 5, 6, 7])
def test_random_cuts_with_lost_ends_hold_what_the_model_holds_or_fail_where_it_fails(feed: _Feed, seed: int) -> None:
    """The walk in the database against the reference model, ``transactions.plan``, with some
    ENDs lost: batch after batch the same records held, until the model refuses a batch (a
    complete transaction behind a held event); then the sink refuses it too, applying nothing."""
    rng = random.Random(seed)
    streams, _ = _source_run(rng, 10)
    streams[(TX, 0)] = [item for item in streams[(TX, 0)] if item[1]["kind"] != END or rng.random() < 0.8]
    read: list[Candidate] = []
    while any(streams.values()):
        batch = _cut(rng, streams, feed, read)
        try:
            expected = plan(read)
        except TransactionError as refusal:
            held = feed.held()
            assert "is complete, but" in str(refusal)  # the only refusal these histories can earn
            with pytest.raises(TransactionError, match=r"is complete, but its event at .* whose END has not come"):
                feed.apply([record for record, _ in batch])
            assert feed.held() == held
            return
        feed.apply([record for record, _ in batch])
        assert {(t, o) for t, o, _ in feed.held()} == {(t, o) for t, _, o in expected.held}


def test_a_lost_end_fails_loudly_once_a_later_transaction_completes_behind_it(feed: _Feed) -> None:
    feed.apply([account("c", 1, "1", "600")])
    assert feed.accounts() == [] and len(feed.held()) == 1  # 600's END may still come: its events wait
    # 601's END, and no END of 600 before it in the transaction topic: 600's is lost.
    with pytest.raises(TransactionError, match=r"601 is complete, but .* of transaction 600, whose END has not come"):
        feed.apply([account("c", 2, "2", "601"), end("601", accounts=1)])
    assert feed.accounts() == [] and len(feed.held()) == 1


@pytest.mark.parametrize("feed", ["exactly_once", "two_phase"], indirect=True)
def test_switched_to_per_key_a_mirror_applies_what_it_held_and_leaves_nothing_behind(feed: _Feed) -> None:
    """The way out when a transaction can never complete (its END lost): ``transactions: per_key``.
    Its next batch applies every change the mirror held, per key and in Kafka order with its own
    (the held create of account 1 does not overwrite the newer update), and drops the held ENDs."""
    # 600's events without their END, and 601's END without its event: all three held.
    feed.apply([account("c", 1, "1", "600"), ledger(1, 1, "1", "600"), end("601", accounts=1)])
    assert feed.accounts() == [] and len(feed.held()) == 3
    feed.switch("per_key")
    feed.apply([account("u", 1, "3", "602"), account("c", 2, "2", "602")])
    assert feed.accounts() == [(1, "3.000000"), (2, "2.000000")]
    assert feed.ledgers() == [(1, 1, "1.000000")] and feed.held() == []
    assert feed.query("SELECT account, total::text FROM {s}.ledger_sums ORDER BY account") == [(1, "1.000000")]
    feed.apply([account("u", 2, "4", "603")])  # a batch with nothing held: the probe alone
    assert feed.accounts() == [(1, "3.000000"), (2, "4.000000")]


def test_more_events_than_the_end_counts_fail_the_batch_and_apply_nothing(feed: _Feed) -> None:
    with pytest.raises(TransactionError, match=r"source transaction 700: more change events of"):
        feed.apply([account("c", 1, "1", "700"), account("c", 2, "2", "700"), end("700", accounts=1)])
    assert feed.accounts() == [] and feed.held() == [] and feed.offsets() == {}


def test_records_staged_twice_by_retried_tasks_apply_once(feed: _Feed) -> None:
    feed.apply([ledger(1, 1, "10", "800"), ledger(2, 1, "5", "800")], copies=2)
    assert feed.ledgers() == [] and len(feed.held()) == 2
    result = feed.apply([ledger(3, 2, "1", "800"), end("800", ledgers=3), account("r", 9, "9", None)], copies=2)
    assert (result.applied, result.dead_lettered) == (4, 0), result  # three ledger rows and the snapshot read
    assert feed.query("SELECT account, total::text FROM {s}.ledger_sums ORDER BY account") == [
        (1, "15.000000"), (2, "1.000000")]
    assert feed.accounts() == [(9, "9.000000")] and feed.held() == []
