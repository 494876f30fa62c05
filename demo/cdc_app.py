"""The change-data-capture application and its oracle, for the demo's mirror pipeline and the
mirror's integration test: three source tables (a composite key, jsonb, numeric(20,6),
timestamptz, an array, a TOASTed text most updates leave unchanged) changed in multi-row
transactions of inserts, updates (some to a primary key) and deletes; the mirror definition that
streams them; and the comparison of every mirror table with its source, and of the aggregate with
its GROUP BY over the source."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from typing import Any

from psycopg2 import sql

TABLES = {  # source table -> (key, columns in order)
    "customers": (("id",), ("id", "name", "balance", "updated_at", "prefs", "tags", "notes")),
    "order_lines": (("order_id", "line_no"), ("order_id", "line_no", "sku", "qty", "price")),
    "events": (("id",), ("id", "kind", "at", "payload")),
}
# Mirror tables named otherwise than their source table; and the aggregate's table.
TARGET_NAMES = {"order_lines": "lines"}
AGGREGATE = "sku_totals"
SOURCE_DDL = [
    "CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, balance numeric(20,6) NOT NULL,"
    " updated_at timestamptz NOT NULL, prefs jsonb, tags text[], notes text)",
    # Out of line and uncompressed from 2 kB on: an update that leaves notes alone sends the placeholder.
    "ALTER TABLE customers ALTER COLUMN notes SET STORAGE EXTERNAL",
    "CREATE TABLE order_lines (order_id bigint, line_no integer, sku text NOT NULL, qty integer NOT NULL,"
    " price numeric(12,2) NOT NULL, PRIMARY KEY (order_id, line_no))",
    "CREATE TABLE events (id bigint PRIMARY KEY, kind text NOT NULL, at timestamptz NOT NULL, payload jsonb)",
]
# A last transaction on every table: once the mirror holds it, the stream has read past all before it.
LAST_CHANGES = ["INSERT INTO customers VALUES (-1, 'last', 0, now(), NULL, NULL, NULL)",
                "INSERT INTO order_lines VALUES (-1, -1, 'z', 1, 1)",
                "INSERT INTO events VALUES (-1, 'last', now(), NULL)"]


def holds_last_changes(conn: Any, target_schema: str) -> bool:
    """The mirror holds ``LAST_CHANGES``'s rows: it applied every change committed before them. (The
    change topics' last stable offsets, read just after the source's commit, may not hold them yet.)"""
    with conn.cursor() as cur:
        cur.execute(sql.SQL(
            "SELECT (SELECT count(*) FROM {s}.customers WHERE id = -1)"
            " + (SELECT count(*) FROM {s}.{lines} WHERE order_id = -1 AND line_no = -1)"
            " + (SELECT count(*) FROM {s}.events WHERE id = -1)").format(
            s=sql.Identifier(target_schema), lines=sql.Identifier(TARGET_NAMES["order_lines"])))
        return cur.fetchone()[0] == len(LAST_CHANGES)


def mirror_definition(topic_prefix: str, schema: str) -> dict[str, Any]:
    """The mirror section of a pipeline definition (docs/cdc.md) over the three tables of ``schema``."""
    return {"mirror": {
        "topic_prefix": topic_prefix,
        "tables": [
            {"source": f"{schema}.customers", "key": ["id"],
             "columns": {"id": "bigint", "name": "text", "balance": "numeric(20,6)", "updated_at": "timestamptz",
                         "prefs": "jsonb", "tags": "text[]", "notes": "text"}},
            {"source": f"{schema}.order_lines", "target": "lines", "key": ["order_id", "line_no"],
             "columns": {"order_id": "bigint", "line_no": "integer", "sku": "text", "qty": "integer",
                         "price": "numeric(12,2)"}},
            {"source": f"{schema}.events", "key": ["id"],
             "columns": {"id": "bigint", "kind": "text", "at": "timestamptz", "payload": "jsonb"}},
        ],
        "aggregates": [{"source": f"{schema}.order_lines", "target": AGGREGATE, "group_by": ["sku"],
                        "sums": {"qty_total": "qty", "amount": "price"}}],
    }}


def change_topics(topic_prefix: str, schema: str) -> list[str]:
    """Debezium's topic per table: ``<topic.prefix>.<schema>.<table>``."""
    return [f"{topic_prefix}.{schema}.{table}" for table in TABLES]


def write_transaction(conn: Any, schema: str, statements: list[str]) -> None:
    """One multi-row transaction on ``schema`` (``conn`` is left in autocommit)."""
    conn.autocommit = False
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SET LOCAL search_path = {}").format(sql.Identifier(schema)))
        for statement in statements:
            cur.execute(statement)
    conn.commit()
    conn.autocommit = True


class Workload:
    """The application: multi-row transactions of inserts, updates (some to a primary key, most
    leaving the TOASTed notes alone) and deletes on the three tables, from a fixed seed.

    :param conn: a connection to the source database (autocommit; the workload's own).
    :param pause: the range of seconds it sleeps between two transactions.
    """

    def __init__(self, conn: Any, schema: str, seed: int = 35, pause: tuple[float, float] = (0.02, 0.1)) -> None:
        self.conn, self.schema, self.pause = conn, schema, pause
        self.random = random.Random(seed)
        self.customers: set[int] = set()
        self.lines: set[tuple[int, int]] = set()
        self.events: set[int] = set()
        self.next_id = 1
        self.transactions = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _pick(self, keys: set, most: int) -> list:
        return self.random.sample(sorted(keys), min(most, len(keys)))

    def _customer_changes(self, cur: Any) -> list[bytes]:
        r, out = self.random, []
        for _ in range(r.randint(1, 3)):
            cid = self._id()
            self.customers.add(cid)
            out.append(cur.mogrify(
                "INSERT INTO customers VALUES (%s, %s, %s, now() - %s * interval '1 second', %s, %s,"
                " (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 80)))",
                (cid, f"c{cid}", f"{r.randint(-10**9, 10**9)}.{r.randint(0, 999999):06d}", r.randint(0, 10**6),
                 json.dumps({"tier": r.randint(1, 3), "tags": ["x", str(cid)]}), ["a", f"t{cid % 7}", "b c"])))
        for cid in self._pick(self.customers, 3):  # notes unchanged: Debezium sends the placeholder
            out.append(cur.mogrify("UPDATE customers SET balance = balance + %s, updated_at = now(),"
                                   " prefs = jsonb_set(coalesce(prefs, '{}'), '{n}', to_jsonb(%s)) WHERE id = %s",
                                   (f"{r.randint(1, 10**6)}.000123", r.randint(0, 99), cid)))
        if r.random() < 0.3 and self.customers:
            cid = self._pick(self.customers, 1)[0]
            out.append(cur.mogrify("UPDATE customers SET notes = repeat(md5(%s), 90), tags = NULL WHERE id = %s",
                                   (str(r.random()), cid)))
        if r.random() < 0.3 and len(self.customers) > 5:
            cid = self._pick(self.customers, 1)[0]
            self.customers.discard(cid)
            out.append(cur.mogrify("DELETE FROM customers WHERE id = %s", (cid,)))
        return out

    def _line_changes(self, cur: Any) -> list[bytes]:
        r, out = self.random, []
        order = r.randint(1, 40)
        for _ in range(r.randint(1, 4)):
            key = (order, r.randint(1, 30))
            if key not in self.lines:
                self.lines.add(key)
                price = f"{r.randint(1, 99999)}.{r.randint(0, 99):02d}"
                out.append(cur.mogrify("INSERT INTO order_lines VALUES (%s, %s, %s, %s, %s)",
                                       (*key, r.choice("abcde"), r.randint(1, 50), price)))
        for key in self._pick(self.lines, 3):  # some move to another group
            out.append(cur.mogrify("UPDATE order_lines SET qty = qty + %s, sku = CASE WHEN %s THEN %s ELSE sku END"
                                   " WHERE order_id = %s AND line_no = %s",
                                   (r.randint(-5, 5), r.random() < 0.3, r.choice("abcde"), *key)))
        if r.random() < 0.3 and self.lines:  # a primary-key change: Debezium's delete and create
            key = self._pick(self.lines, 1)[0]
            moved = (key[0], key[1] + 1000 * r.randint(1, 9))
            if moved not in self.lines:
                self.lines.discard(key)
                self.lines.add(moved)
                out.append(cur.mogrify("UPDATE order_lines SET line_no = %s WHERE order_id = %s AND line_no = %s",
                                       (moved[1], *key)))
        if r.random() < 0.4 and len(self.lines) > 5:
            key = self._pick(self.lines, 1)[0]
            self.lines.discard(key)
            out.append(cur.mogrify("DELETE FROM order_lines WHERE order_id = %s AND line_no = %s", key))
        return out

    def _event_changes(self, cur: Any) -> list[bytes]:
        r, out = self.random, []
        eid = self._id()
        self.events.add(eid)
        payload = json.dumps({"v": r.random(), "k": [1, None]})
        out.append(cur.mogrify("INSERT INTO events VALUES (%s, %s, now(), %s)",
                               (eid, r.choice(["open", "close", "päy"]), payload)))
        if r.random() < 0.3 and self.events:
            old = self._pick(self.events, 1)[0]
            self.events.discard(old)
            new = self._id()
            self.events.add(new)
            out.append(cur.mogrify("UPDATE events SET id = %s, kind = 'moved' WHERE id = %s", (new, old)))
        if r.random() < 0.3 and len(self.events) > 3:
            old = self._pick(self.events, 1)[0]
            self.events.discard(old)
            out.append(cur.mogrify("DELETE FROM events WHERE id = %s", (old,)))
        return out

    def transaction(self) -> None:
        with self.conn.cursor() as cur:
            statements = [*self._customer_changes(cur), *self._line_changes(cur), *self._event_changes(cur)]
        write_transaction(self.conn, self.schema, [s.decode() for s in statements])
        self.transactions += 1

    def run(self, seconds: float) -> None:
        """Transactions until ``seconds`` passed or ``stop`` is set; an error is kept in ``error``."""
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not self.stop.is_set():
                self.transaction()
                self.stop.wait(self.random.uniform(*self.pause))
        except BaseException as exc:  # reported by whoever started the thread
            self.error = exc


def comparable(value: Any) -> Any:
    """A value as the comparison counts it: documents by content, arrays as tuples, bytea as bytes."""
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, list):
        return tuple(comparable(v) for v in value)
    if isinstance(value, memoryview):  # bytea
        return bytes(value)
    return value


def rows(conn: Any, schema: str, table: str, columns: tuple[str, ...]) -> Counter:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}.{}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(schema), sql.Identifier(table)))
        return Counter(tuple(comparable(v) for v in row) for row in cur.fetchall())


def differences(left: Counter, right: Counter) -> int:
    """Rows of either side the other lacks (EXCEPT ALL both ways)."""
    return sum((left - right).values()) + sum((right - left).values())


def compare(source_conn: Any, schema: str, target_conn: Any, target_schema: str) -> dict[str, tuple[int, int]]:
    """Per table (and the aggregate): (source rows, or GROUP BY groups; rows that differ)."""
    found = {}
    for table, (_, columns) in TABLES.items():
        target = TARGET_NAMES.get(table, table)
        wanted = rows(source_conn, schema, table, columns)
        found[table] = (sum(wanted.values()), differences(wanted, rows(target_conn, target_schema, target, columns)))
    with source_conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT sku, count(*), sum(qty), sum(price) FROM {}.order_lines GROUP BY sku").format(
            sql.Identifier(schema)))
        groups = Counter(cur.fetchall())
    totals = rows(target_conn, target_schema, AGGREGATE, ("sku", "row_count", "qty_total", "amount"))
    found[AGGREGATE] = (sum(groups.values()), differences(groups, totals))
    return found
