"""The latency probe: a paced transactional producer and a watcher of the targets.

The producer (a process of its own, so the watcher's clock is not held up by its
work) commits one Kafka transaction every ``interval`` seconds, ledger events
keyed by account, and reports each transaction as soon as ``commit_transaction()``
returns: when (``time.monotonic()``, one clock for every process of the machine),
the offsets its records got in each partition (from the delivery reports, all in
before the commit returns), and the highest ``seq`` it gave each account.

The watcher polls every ``poll`` seconds, in one REPEATABLE READ transaction (one
snapshot for both targets):

* the row target: per partition, the offsets visible above that partition's
  confirmed frontier (an index range scan of the watcher's index on
  ``(kafka_topic, kafka_partition, kafka_offset)``, so a poll reads only the
  rows it has not confirmed yet). A transaction's range in a partition is
  confirmed when every one of its offsets is visible: a count, exact whatever
  order parts become visible in;
* the aggregate (``account_balances``, 200 rows): an account is confirmed up to
  ``last_seq``; the ledger applies an account's events in Kafka order, so a
  ``last_seq`` at or above the transaction's highest ``seq`` for that account
  means every one of its amounts for the account is in the balance.

A transaction is visible at the first poll that confirms all of its ranges and
accounts; its latency is that poll's start minus its commit.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from psycopg2 import sql

ACCOUNTS = 200
# Above the seed events' seq (pipeline.SEED_EVENTS, from 0): an account's last_seq from a seed event
# never confirms a probe transaction.
FIRST_SEQ = 10**9


@dataclass
class Transaction:
    """One committed producer transaction: its commit time and what it wrote."""
    index: int
    committed_at: float
    ranges: dict[int, tuple[int, int]]  # partition -> (first offset, last offset)
    accounts: dict[str, int]  # account -> highest seq in this transaction
    outstanding: int = 0
    visible_at: float | None = None


def _events(rng: random.Random, seq: int, count: int) -> list[tuple[str, bytes, int]]:
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    out = []
    for s in range(seq, seq + count):
        account = f"acct-{rng.randrange(ACCOUNTS):05d}"
        value = {"event_id": str(uuid.UUID(int=rng.getrandbits(128))), "account_id": account,
                 "amount_cents": rng.randint(-5_000, 10_000), "ts": (start + timedelta(milliseconds=s)).isoformat(),
                 "seq": s}
        out.append((account, json.dumps(value).encode(), s))
    return out


def produce_paced(bootstrap: str, topic: str, rate: int, interval: float, seconds: float,
                  reports: Any, seed: int) -> None:
    """Commits a transaction of ``rate * interval`` events every ``interval`` seconds for
    ``seconds``; puts each one's (index, committed_at, ranges, accounts) on ``reports``,
    then None. Runs in its own process."""
    from confluent_kafka import Producer

    rng = random.Random(seed)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"latency-{uuid.uuid4().hex[:8]}",
                         "linger.ms": 1, "compression.type": "lz4"})
    producer.init_transactions(30)
    per_transaction = max(1, round(rate * interval))
    seq, index, started = FIRST_SEQ, 0, time.monotonic()
    late = 0
    while time.monotonic() - started < seconds:
        offsets: dict[int, list[int]] = {}

        def delivered(err: Any, msg: Any, offsets: dict[int, list[int]] = offsets) -> None:
            if err is None:
                offsets.setdefault(msg.partition(), []).append(msg.offset())

        producer.begin_transaction()
        accounts: dict[str, int] = {}
        for account, value, s in _events(rng, seq, per_transaction):
            producer.produce(topic, key=account.encode(), value=value, on_delivery=delivered)
            accounts[account] = s
        producer.commit_transaction(30)
        committed_at = time.monotonic()
        ranges = {p: (min(o), max(o)) for p, o in offsets.items()}
        if sum(o[1] - o[0] + 1 for o in ranges.values()) != per_transaction:
            raise RuntimeError(f"transaction {index}: its offsets are not contiguous per partition")
        reports.put((index, committed_at, ranges, accounts))
        seq += per_transaction
        index += 1
        wait = started + index * interval - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        else:
            late += 1
    reports.put(("late", late))
    reports.put(None)


@dataclass
class Watcher:
    """Polls a pipeline's targets and stamps each reported transaction when it is all visible."""
    connect: Any
    target_schema: str
    topic: str
    aggregate: bool
    poll: float = 0.02
    transactions: list[Transaction] = field(default_factory=list)
    late_transactions: int = 0
    polls: int = 0
    poll_ms: list[float] = field(default_factory=list)
    _confirmed: dict[int, int] = field(default_factory=dict)  # partition -> highest offset confirmed
    _ranges: dict[int, deque] = field(default_factory=dict)  # partition -> deque of (txn, first, last)
    _accounts: dict[str, deque] = field(default_factory=dict)  # account -> deque of (txn, seq)
    _produced_all: bool = False

    def _take(self, reports: Any) -> None:
        while True:
            try:
                report = reports.get_nowait()
            except Exception:  # queue.Empty
                return
            if report is None:
                self._produced_all = True
                return
            if report[0] == "late":
                self.late_transactions = report[1]
                continue
            index, committed_at, ranges, accounts = report
            txn = Transaction(index, committed_at, ranges, accounts)
            txn.outstanding = len(ranges) + (len(accounts) if self.aggregate else 0)
            self.transactions.append(txn)
            for partition, (first, last) in ranges.items():
                self._ranges.setdefault(partition, deque()).append((txn, first, last))
                self._confirmed.setdefault(partition, first - 1)  # earlier rows are not the probe's
            if self.aggregate:
                for account, seq in accounts.items():
                    self._accounts.setdefault(account, deque()).append((txn, seq))

    def _confirm(self, txn: Transaction, at: float) -> None:
        txn.outstanding -= 1
        if txn.outstanding == 0:
            txn.visible_at = at

    def poll_once(self, conn: Any) -> None:
        rows_sql = sql.SQL(
            "SELECT f.p, x.o FROM unnest(%s::int[], %s::bigint[]) AS f(p, c),"
            " LATERAL (SELECT kafka_offset FROM {} WHERE kafka_topic = %s AND kafka_partition = f.p"
            " AND kafka_offset > f.c) AS x(o)").format(sql.Identifier(self.target_schema, "ledger_events"))
        parts = sorted(p for p, q in self._ranges.items() if q)
        at = time.monotonic()
        with conn.cursor() as cur:
            cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            visible: dict[int, set[int]] = {p: set() for p in parts}
            if parts:
                cur.execute(rows_sql, (parts, [self._confirmed[p] for p in parts], self.topic))
                for p, o in cur.fetchall():
                    visible[p].add(o)
            latest: dict[str, int] = {}
            if self.aggregate and any(self._accounts.values()):
                cur.execute(sql.SQL("SELECT account_id, last_seq FROM {}").format(
                    sql.Identifier(self.target_schema, "account_balances")))
                latest = {a: s for a, s in cur.fetchall() if s is not None}
            cur.execute("COMMIT")
        self.poll_ms.append((time.monotonic() - at) * 1000)
        for p in parts:
            queue, seen = self._ranges[p], visible[p]
            while queue and sum(1 for o in range(queue[0][1], queue[0][2] + 1) if o in seen) == \
                    queue[0][2] - queue[0][1] + 1:
                txn, _first, last = queue.popleft()
                self._confirmed[p] = last
                self._confirm(txn, at)
        for account, queue in self._accounts.items():
            while queue and latest.get(account, -1) >= queue[0][1]:
                self._confirm(queue.popleft()[0], at)

    def run(self, reports: Any, stop: threading.Event, drain_seconds: float) -> None:
        """Polls until the producer is done and every transaction is visible, ``stop`` is set,
        or ``drain_seconds`` after the producer's end."""
        conn = self.connect()
        conn.autocommit = True
        drained_by: float | None = None
        try:
            next_at = time.monotonic()
            while not stop.is_set():
                self._take(reports)
                self.poll_once(conn)
                self.polls += 1
                if self._produced_all:
                    if all(t.visible_at is not None for t in self.transactions):
                        return
                    drained_by = drained_by or time.monotonic() + drain_seconds
                    if time.monotonic() > drained_by:
                        return
                # A slow poll is not followed by a burst of catching up: the next is a period later.
                next_at = max(next_at + self.poll, time.monotonic())
                time.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            conn.close()


def start_producer(bootstrap: str, topic: str, rate: int, interval: float, seconds: float,
                   seed: int) -> tuple[Any, Any]:
    """The producer process, started, and the queue of its reports."""
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    process = context.Process(target=produce_paced, args=(bootstrap, topic, rate, interval, seconds, reports, seed),
                              daemon=True)
    process.start()
    return process, reports
