"""The source application of the real-stack mirror tests (tests/integration/test_cdc_mirror.py):
five tables, their mirror definition, and a workload of multi-row transactions that keeps going
through a PostgreSQL crash and can add a column to a table while it runs."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors
from psycopg2 import sql

from airflow_provider_eos.utils.debezium_config import postgres_connector_config
from demo.cdc_app import SOURCE_DDL as DEMO_SOURCE_DDL
from tests.helpers.cdc_source import source_connection

KEYS = {  # source table -> its primary key
    "customers": ("id",),
    "order_lines": ("order_id", "line_no"),
    "events": ("id",),
    "visits": ("id",),
    "rates": ("currency", "day"),
}
# How the workload's model holds a key (rates' day as days from 2026-01-01), read and matched.
_KEY_SELECT = {"rates": "currency, day - date '2026-01-01'"}
_KEY_MATCH = {"customers": "id = %s", "order_lines": "order_id = %s AND line_no = %s", "events": "id = %s",
              "visits": "id = %s", "rates": "currency = %s AND day = date '2026-01-01' + %s"}
TARGETS = {"order_lines": "lines"}  # a target named apart from its source; the others keep the source's name
SOURCE_DDL = [  # the demo application's three tables, and two more
    *DEMO_SOURCE_DDL,
    "CREATE TABLE visits (id bigint PRIMARY KEY, day date, starts time, blob bytea, note text)",
    "CREATE TABLE rates (currency text, day date, rate numeric(20,6) NOT NULL, volume numeric,"
    " PRIMARY KEY (currency, day))",
]
# (source table, target, group by, sums): each aggregate must equal its GROUP BY over the source.
AGGREGATES = [
    ("order_lines", "sku_totals", ("sku",), {"qty_total": "qty", "amount": "price"}),
    ("rates", "currency_totals", ("currency",), {"rate_total": "rate", "volume_total": "volume"}),
]


def target_of(table: str) -> str:
    return TARGETS.get(table, table)


def mirror_connector(env: dict[str, str], schema: str, slot: str) -> dict[str, Any]:
    """The project's connector over the mirror's tables, naming each column's source type (a
    column added mid-stream is then typed by its events)."""
    return postgres_connector_config(env, schema, slot, [f"{schema}.{table}" for table in KEYS],
                                     **{"column.propagate.source.type": ".*"})


def mirror_definition(schema: str) -> dict[str, Any]:
    """The declarative mirror: it lists the tables' columns as created, never a column added later."""
    tables = [
        {"source": f"{schema}.customers", "key": ["id"],
         "columns": {"id": "bigint", "name": "text", "balance": "numeric(20,6)", "updated_at": "timestamptz",
                     "prefs": "jsonb", "tags": "text[]", "notes": "text"}},
        {"source": f"{schema}.order_lines", "target": "lines", "key": ["order_id", "line_no"],
         "columns": {"order_id": "bigint", "line_no": "integer", "sku": "text", "qty": "integer",
                     "price": "numeric(12,2)"}},
        {"source": f"{schema}.events", "key": ["id"],
         "columns": {"id": "bigint", "kind": "text", "at": "timestamptz", "payload": "jsonb"}},
        {"source": f"{schema}.visits", "key": ["id"],
         "columns": {"id": "bigint", "day": "date", "starts": "time", "blob": "bytea", "note": "text"}},
        {"source": f"{schema}.rates", "key": ["currency", "day"],
         "columns": {"currency": "text", "day": "date", "rate": "numeric(20,6)", "volume": "numeric"}},
    ]
    aggregates = [{"source": f"{schema}.{source}", "target": target, "group_by": list(group_by), "sums": sums}
                  for source, target, group_by, sums in AGGREGATES]
    return {"mirror": {"topic_prefix": schema, "tables": tables, "aggregates": aggregates}}


def holds_marks(target: Any, target_schema: str, marks: dict[str, tuple[str, tuple]]) -> bool:
    """Whether the mirror's target holds every row of a ``Workload.marker()`` transaction (not
    before a first batch created the tables)."""
    with target.cursor() as cur:
        for table, (match, values) in marks.items():
            try:
                cur.execute(sql.SQL("SELECT 1 FROM {}.{} WHERE {}").format(
                    sql.Identifier(target_schema), sql.Identifier(target_of(table)), sql.SQL(match)), values)
            except psycopg2.errors.UndefinedTable:
                return False
            if cur.fetchone() is None:
                return False
    return True


@dataclass(frozen=True)
class NewColumn:
    """A column the workload adds to ``table`` mid-stream; later transactions set it from ``value``."""

    table: str
    column: str
    type: str
    value: Callable[[random.Random], Any]


@dataclass
class WorkloadStats:
    transactions: int = 0
    connection_errors: int = 0  # transactions cut by a lost connection (the PostgreSQL fault)
    resyncs: int = 0
    added: list[str] = field(default_factory=list)


class Workload:
    """The application: multi-row transactions of inserts, updates (some to a primary key, most
    leaving the TOASTed notes alone) and deletes on the five tables, from a fixed seed. A
    transaction cut by a lost connection may or may not have committed, so the workload then
    reconnects and reads the keys back from the source (its own model is only a guide)."""

    def __init__(self, env: dict[str, str], schema: str) -> None:
        self.env, self.schema = env, schema
        self.conn = source_connection(env)
        self.random = random.Random(35)
        self.keys: dict[str, set] = {table: set() for table in KEYS}
        self.next_id = 1
        self.new_columns: list[NewColumn] = []
        self.stats = WorkloadStats()
        self.error: BaseException | None = None

    def close(self) -> None:
        self.conn.close()

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, table: str, most: int) -> list:
        keys = self.keys[table]
        return self.random.sample(sorted(keys), min(most, len(keys)))

    def _customer_changes(self, cur: Any) -> list[bytes]:
        r, out, keys = self.random, [], self.keys["customers"]
        for _ in range(r.randint(1, 3)):
            cid = self._id()
            keys.add(cid)
            out.append(cur.mogrify(
                "INSERT INTO customers VALUES (%s, %s, %s, now() - %s * interval '1 second', %s, %s,"
                " (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 80)))",
                (cid, f"c{cid}", f"{r.randint(-10**9, 10**9)}.{r.randint(0, 999999):06d}", r.randint(0, 10**6),
                 json.dumps({"tier": r.randint(1, 3), "tags": ["x", str(cid)]}), ["a", f"t{cid % 7}", "b c"])))
        for cid in self._pick("customers", 3):  # notes unchanged: Debezium sends the placeholder
            out.append(cur.mogrify("UPDATE customers SET balance = balance + %s, updated_at = now(),"
                                   " prefs = jsonb_set(coalesce(prefs, '{}'), '{n}', to_jsonb(%s)) WHERE id = %s",
                                   (f"{r.randint(1, 10**6)}.000123", r.randint(0, 99), cid)))
        if r.random() < 0.3 and keys:
            cid = self._pick("customers", 1)[0]
            out.append(cur.mogrify("UPDATE customers SET notes = repeat(md5(%s), 90), tags = NULL WHERE id = %s",
                                   (str(r.random()), cid)))
        if r.random() < 0.3 and len(keys) > 5:
            cid = self._pick("customers", 1)[0]
            keys.discard(cid)
            out.append(cur.mogrify("DELETE FROM customers WHERE id = %s", (cid,)))
        return out

    def _line_changes(self, cur: Any) -> list[bytes]:
        r, out, keys = self.random, [], self.keys["order_lines"]
        order = r.randint(1, 40)
        for _ in range(r.randint(1, 4)):
            key = (order, r.randint(1, 30))
            if key not in keys:
                keys.add(key)
                price = f"{r.randint(1, 99999)}.{r.randint(0, 99):02d}"
                out.append(cur.mogrify("INSERT INTO order_lines VALUES (%s, %s, %s, %s, %s)",
                                       (*key, r.choice("abcde"), r.randint(1, 50), price)))
        for key in self._pick("order_lines", 3):  # some move to another group
            out.append(cur.mogrify("UPDATE order_lines SET qty = qty + %s, sku = CASE WHEN %s THEN %s ELSE sku END"
                                   " WHERE order_id = %s AND line_no = %s",
                                   (r.randint(-5, 5), r.random() < 0.3, r.choice("abcde"), *key)))
        if r.random() < 0.3 and keys:  # a primary-key change: Debezium's delete and create
            key = self._pick("order_lines", 1)[0]
            moved = (key[0], key[1] + 1000 * r.randint(1, 9))
            if moved not in keys:
                keys.discard(key)
                keys.add(moved)
                out.append(cur.mogrify("UPDATE order_lines SET line_no = %s WHERE order_id = %s AND line_no = %s",
                                       (moved[1], *key)))
        if r.random() < 0.4 and len(keys) > 5:
            key = self._pick("order_lines", 1)[0]
            keys.discard(key)
            out.append(cur.mogrify("DELETE FROM order_lines WHERE order_id = %s AND line_no = %s", key))
        return out

    def _event_changes(self, cur: Any) -> list[bytes]:
        r, out, keys = self.random, [], self.keys["events"]
        eid = self._id()
        keys.add(eid)
        payload = json.dumps({"v": r.random(), "k": [1, None]})
        out.append(cur.mogrify("INSERT INTO events VALUES (%s, %s, now(), %s)",
                               (eid, r.choice(["open", "close", "päy"]), payload)))
        if r.random() < 0.3 and keys:
            old = self._pick("events", 1)[0]
            keys.discard(old)
            new = self._id()
            keys.add(new)
            out.append(cur.mogrify("UPDATE events SET id = %s, kind = 'moved' WHERE id = %s", (new, old)))
        if r.random() < 0.3 and len(keys) > 3:
            old = self._pick("events", 1)[0]
            keys.discard(old)
            out.append(cur.mogrify("DELETE FROM events WHERE id = %s", (old,)))
        return out

    def _maybe(self, value: Any) -> Any:
        """``value``, or NULL one time in four."""
        return None if self.random.random() < 0.25 else value

    def _visit_changes(self, cur: Any) -> list[bytes]:
        r, out, keys = self.random, [], self.keys["visits"]
        for _ in range(r.randint(1, 2)):
            vid = self._id()
            keys.add(vid)
            blob = psycopg2.Binary(bytes([0, 255, *r.randbytes(r.randint(0, 40))]))
            out.append(cur.mogrify(
                "INSERT INTO visits VALUES (%s, date '2020-02-29' + %s::integer,"
                " time '00:00' + %s::bigint * interval '1 microsecond', %s, %s)",
                (vid, self._maybe(r.randint(-800, 4000)), self._maybe(r.randint(0, 86399999999)), self._maybe(blob),
                 self._maybe(f"v{vid} ✓"))))
        for vid in self._pick("visits", 2):
            out.append(cur.mogrify("UPDATE visits SET day = day + 1, blob = %s, note = NULL WHERE id = %s",
                                   (self._maybe(psycopg2.Binary(r.randbytes(8))), vid)))
        if r.random() < 0.3 and len(keys) > 3:
            vid = self._pick("visits", 1)[0]
            keys.discard(vid)
            out.append(cur.mogrify("DELETE FROM visits WHERE id = %s", (vid,)))
        return out

    def _rate_changes(self, cur: Any) -> list[bytes]:
        r, out, keys = self.random, [], self.keys["rates"]
        currency, day = r.choice(["EUR", "USD", "JPY", "CHF"]), r.randint(0, 400)
        if (currency, day) not in keys:
            keys.add((currency, day))
            volume = f"{r.randint(0, 10**20)}.{r.randint(0, 10**9)}"  # numeric without a declared scale
            out.append(cur.mogrify("INSERT INTO rates VALUES (%s, date '2026-01-01' + %s, %s, %s)",
                                   (currency, day, f"{r.randint(0, 10**6)}.{r.randint(0, 999999):06d}",
                                    self._maybe(volume))))
        for currency, day in self._pick("rates", 2):
            out.append(cur.mogrify("UPDATE rates SET rate = rate + 0.000001 * %s WHERE currency = %s"
                                   " AND day = date '2026-01-01' + %s", (r.randint(-10**6, 10**6), currency, day)))
        if r.random() < 0.3 and keys:  # a composite key change: one of its columns moves
            currency, day = self._pick("rates", 1)[0]
            moved = (currency, day + 1000 + r.randint(0, 10**4))
            if moved not in keys:
                keys.discard((currency, day))
                keys.add(moved)
                out.append(cur.mogrify("UPDATE rates SET day = date '2026-01-01' + %s WHERE currency = %s"
                                       " AND day = date '2026-01-01' + %s", (moved[1], currency, day)))
        if r.random() < 0.3 and len(keys) > 5:
            currency, day = self._pick("rates", 1)[0]
            keys.discard((currency, day))
            out.append(cur.mogrify("DELETE FROM rates WHERE currency = %s AND day = date '2026-01-01' + %s",
                                   (currency, day)))
        return out

    def _new_column_changes(self, cur: Any) -> list[bytes]:
        out = []
        for new in self.new_columns:
            for key in self._pick(new.table, 2):
                values = key if isinstance(key, tuple) else (key,)
                out.append(cur.mogrify(sql.SQL("UPDATE {} SET {} = %s WHERE {}").format(
                    sql.Identifier(new.table), sql.Identifier(new.column), sql.SQL(_KEY_MATCH[new.table])),
                    (new.value(self.random), *values)))
        return out

    def _statements(self) -> list[str]:
        with self.conn.cursor() as cur:
            statements = [*self._customer_changes(cur), *self._line_changes(cur), *self._event_changes(cur),
                          *self._visit_changes(cur), *self._rate_changes(cur), *self._new_column_changes(cur)]
        return [s.decode() for s in statements]

    def _write(self, statements: list[str | sql.Composable]) -> None:
        """One transaction on the source schema."""
        conn = self.conn
        conn.autocommit = False
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("SET LOCAL search_path = {}").format(sql.Identifier(self.schema)))
                for statement in statements:
                    cur.execute(statement)
            conn.commit()
        except BaseException:
            if not conn.closed:
                conn.rollback()
            raise
        finally:
            if not conn.closed:
                conn.autocommit = True

    def transaction(self) -> None:
        """One multi-row transaction; after a lost connection or a key its model got wrong (a
        commit whose outcome the lost connection hid), reconnects and reads the keys back."""
        try:
            self._write(list(self._statements()))
            self.stats.transactions += 1
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            self.stats.connection_errors += 1
            self._reconnect()
        except psycopg2.IntegrityError:
            self._resync()

    def _reconnect(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn.close()
                self.conn = source_connection(self.env)
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self._resync()

    def _resync(self) -> None:
        self.stats.resyncs += 1
        with self.conn.cursor() as cur:
            for table, key in KEYS.items():
                cur.execute(sql.SQL("SELECT {} FROM {}.{}").format(
                    sql.SQL(_KEY_SELECT.get(table, ", ".join(key))), sql.Identifier(self.schema),
                    sql.Identifier(table)))
                self.keys[table] = {row if len(row) > 1 else row[0] for row in cur.fetchall()}
        ids = [k for t in ("customers", "events", "visits") for k in self.keys[t]]
        self.next_id = max([self.next_id, *ids])

    def marker(self) -> dict[str, tuple[str, tuple]]:
        """One transaction inserting a fresh row in every table: once the mirror holds them all,
        the stream has read everything committed before. Returns each table's key match and key."""
        n = self._id()
        inserts: dict[str, tuple[str, tuple]] = {  # statement, its parameters, the key in the model
            "customers": ("INSERT INTO customers (id, name, balance, updated_at) VALUES (%s, 'last', 0, now())", (n,)),
            "order_lines": ("INSERT INTO order_lines VALUES (%s, %s, 'z', 1, 1)", (-n, 1)),
            "events": ("INSERT INTO events VALUES (%s, 'last', now(), NULL)", (n,)),
            "visits": ("INSERT INTO visits (id) VALUES (%s)", (n,)),
            "rates": ("INSERT INTO rates VALUES ('ZZZ', date '2026-01-01' + %s, 0, NULL)", ("ZZZ", n)),
        }
        with self.conn.cursor() as cur:
            statements = [cur.mogrify(statement, key[1:] if table == "rates" else key).decode()
                          for table, (statement, key) in inserts.items()]
        self._write(list(statements))
        for table, (_, key) in inserts.items():
            self.keys[table].add(key if len(key) > 1 else key[0])
        return {table: (_KEY_MATCH[table], key) for table, (_, key) in inserts.items()}

    def add_column(self, new: NewColumn) -> None:
        """``ALTER TABLE ... ADD COLUMN`` on the source, then later transactions set it."""
        self._write([sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(
            sql.Identifier(new.table), sql.Identifier(new.column), sql.SQL(new.type))])
        self.new_columns.append(new)
        self.stats.added.append(f"{new.table}.{new.column} {new.type}")

    def run(self, seconds: float, stop: threading.Event, new_column: NewColumn | None = None,
            add_after: float = 0.0) -> None:
        """Transactions for ``seconds`` (or until ``stop``), adding ``new_column`` ``add_after`` seconds in."""
        try:
            started = time.monotonic()
            while time.monotonic() < started + seconds and not stop.is_set():
                if new_column is not None and time.monotonic() >= started + add_after:
                    self.add_column(new_column)
                    new_column = None
                self.transaction()
                time.sleep(self.random.uniform(0.02, 0.1))
        except BaseException as exc:  # reported by the test's main thread
            self.error = exc
