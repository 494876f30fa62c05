"""A source application whose every transaction keeps rules across tables, and a reader that
checks those rules on a mirror (tests/integration/test_cdc_whole_transactions.py).

The bank: ``accounts(id, balance)`` and ``ledger(id, account, amount)``. The rules, true after
every source transaction:
- the balances sum to ``ACCOUNTS * OPENING`` (transfers move money, never make it);
- each balance equals the sum of its account's ledger rows.

Its transactions: the opening (every account and its opening ledger row, one transaction of
2 x ``ACCOUNTS`` rows), transfers (two balance updates and two ledger rows), settlements (many
transfers in one transaction, several hundred rows, larger than a test's batch) and compactions
(an account's ledger rows deleted and replaced by one row of their sum: deletes, tombstones).

The reader polls the mirror in ``REPEATABLE READ`` (one snapshot per poll, as a report would read
it) and counts every poll on which a rule is false. Before the mirror holds the opening it is
empty, which breaks no rule."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg2
import psycopg2.errors
from psycopg2 import extensions, sql

ACCOUNTS = 80
OPENING = Decimal("1000.00")
DDL = ["CREATE TABLE accounts (id bigint PRIMARY KEY, balance numeric(20,2) NOT NULL)",
       "CREATE TABLE ledger (id bigint PRIMARY KEY, account bigint NOT NULL, amount numeric(20,2) NOT NULL)"]
SETTLEMENT_TRANSFERS = 40  # 160 changes in one source transaction


def mirror_section(schema: str, transactions: str) -> dict[str, Any]:
    """The mirror of the bank's two tables, and the ledger's sum per account as an aggregate."""
    return {"topic_prefix": schema, "transactions": transactions, "tables": [
        {"source": f"{schema}.accounts", "key": ["id"], "columns": {"id": "bigint", "balance": "numeric(20,2)"}},
        {"source": f"{schema}.ledger", "key": ["id"],
         "columns": {"id": "bigint", "account": "bigint", "amount": "numeric(20,2)"}}],
        "aggregates": [{"source": f"{schema}.ledger", "target": "ledger_sums", "group_by": ["account"],
                        "sums": {"total": "amount"}}]}


@dataclass
class Bank:
    """The application, writing to ``schema`` of the source database over ``conn``. A lost
    connection (a PostgreSQL restart) is opened again with ``reconnect``; the transaction it cut
    is not retried (committed or not, it kept the rules, and the test compares with the source)."""

    conn: Any
    schema: str
    reconnect: Callable[[], Any] | None = None
    seed: int = 45
    transactions: int = 0
    changes: int = 0
    connection_errors: int = 0
    error: BaseException | None = None
    _next_ledger_id: int = 1
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _transaction(self, statements: list[tuple[str, tuple]]) -> None:
        self.conn.autocommit = False
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("SET LOCAL search_path = {}").format(sql.Identifier(self.schema)))
            for statement, values in statements:
                cur.execute(statement, values)
                self.changes += cur.rowcount
        self.conn.commit()
        self.conn.autocommit = True
        self.transactions += 1

    def _ledger_row(self, account: int, amount: Decimal) -> tuple[str, tuple]:
        row = ("INSERT INTO ledger VALUES (%s, %s, %s)", (self._next_ledger_id, account, amount))
        self._next_ledger_id += 1
        return row

    def create(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
        self._transaction([(statement, ()) for statement in DDL])

    def open(self) -> None:
        """Every account with its opening ledger row, in one transaction."""
        self._transaction([("INSERT INTO accounts VALUES (%s, %s)", (a, OPENING)) for a in range(1, ACCOUNTS + 1)]
                          + [self._ledger_row(a, OPENING) for a in range(1, ACCOUNTS + 1)])

    def _transfer(self) -> list[tuple[str, tuple]]:
        debit, credit = self._rng.sample(range(1, ACCOUNTS + 1), 2)
        amount = Decimal(self._rng.randint(1, 5000)) / 100
        return [("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, debit)),
                ("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, credit)),
                self._ledger_row(debit, -amount), self._ledger_row(credit, amount)]

    def _compaction(self) -> list[tuple[str, tuple]]:
        account = self._rng.randint(1, ACCOUNTS)
        new_id = self._next_ledger_id
        self._next_ledger_id += 1
        return [("INSERT INTO ledger SELECT %s, account, sum(amount) FROM ledger WHERE account = %s GROUP BY account",
                 (new_id, account)),
                ("DELETE FROM ledger WHERE account = %s AND id <> %s", (account, new_id))]

    def step(self, index: int) -> None:
        """One source transaction: a settlement every 20th, a compaction every 9th, else a transfer."""
        if index % 20 == 19:
            self._transaction([row for _ in range(SETTLEMENT_TRANSFERS) for row in self._transfer()])
        elif index % 9 == 8:
            self._transaction(self._compaction())
        else:
            self._transaction(self._transfer())

    def run(self, seconds: float, stop: threading.Event, per_second: float = 10) -> None:
        """Transactions at about ``per_second`` for ``seconds`` (a thread's target; an error is kept)."""
        started, index = time.monotonic(), 0
        try:
            while not stop.is_set() and time.monotonic() - started < seconds:
                try:
                    self.step(index)
                except (psycopg2.OperationalError, psycopg2.InterfaceError):
                    if self.reconnect is None:
                        raise
                    self.connection_errors += 1
                    self.conn = _open_again(self.reconnect, stop)
                index += 1
                time.sleep(max(0.0, started + index / per_second - time.monotonic()))
        except BaseException as exc:
            self.error = exc


def _open_again(connect: Callable[[], Any], stop: threading.Event, timeout: float = 120) -> Any:
    """A new connection once the server takes one again (a restart takes seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return connect()
        except psycopg2.OperationalError:
            if stop.is_set() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass
class Reader:
    """Polls the mirror's three tables in ``target_schema`` in REPEATABLE READ until stopped."""

    dsn: dict[str, Any]
    target_schema: str
    polls: int = 0
    violations: int = 0
    connection_errors: int = 0
    examples: list[str] = field(default_factory=list)
    error: BaseException | None = None

    def _check(self, cur: Any) -> str | None:
        """The first rule this snapshot breaks, or None."""
        schema = sql.Identifier(self.target_schema)
        cur.execute(sql.SQL("SELECT count(*), coalesce(sum(balance), 0) FROM {}.accounts").format(schema))
        count, total = cur.fetchone()
        cur.execute(sql.SQL("SELECT count(*) FROM {0}.accounts a FULL JOIN (SELECT account, sum(amount) s FROM"
                            " {0}.ledger GROUP BY account) l ON l.account = a.id"
                            " WHERE a.balance IS DISTINCT FROM l.s").format(schema))
        unbalanced = cur.fetchone()[0]
        cur.execute(sql.SQL("SELECT count(*) FROM {0}.accounts a FULL JOIN {0}.ledger_sums g ON g.account = a.id"
                            " WHERE a.balance IS DISTINCT FROM g.total").format(schema))
        aggregate_off = cur.fetchone()[0]
        if count == 0 and unbalanced == 0 and aggregate_off == 0:
            return None  # before the opening: empty
        if count != ACCOUNTS or total != ACCOUNTS * OPENING:
            return f"{count} accounts holding {total}"
        if unbalanced:
            return f"{unbalanced} balances differ from their ledger"
        return f"{aggregate_off} ledger_sums rows differ from the balances" if aggregate_off else None

    def _connect(self) -> Any:
        conn = psycopg2.connect(**self.dsn)
        conn.set_session(isolation_level=extensions.ISOLATION_LEVEL_REPEATABLE_READ)
        return conn

    def run(self, stop: threading.Event) -> None:
        conn = self._connect()
        try:
            while not stop.is_set():
                try:
                    with conn.cursor() as cur:
                        broken = self._check(cur)
                    conn.commit()
                except psycopg2.errors.UndefinedTable:  # before the first batch created the targets
                    conn.rollback()
                    time.sleep(0.2)
                    continue
                except (psycopg2.OperationalError, psycopg2.InterfaceError):  # a PostgreSQL restart
                    self.connection_errors += 1
                    conn.close()
                    conn = _open_again(self._connect, stop)
                    continue
                self.polls += 1
                if broken is not None:
                    self.violations += 1
                    if len(self.examples) < 5:
                        self.examples.append(broken)
                time.sleep(0.01)
        except BaseException as exc:
            self.error = exc
        finally:
            conn.close()
