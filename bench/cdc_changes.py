"""Debezium change topics for bench/cdc_throughput.py, generated rather than captured, and the
final state they must leave in a mirror.

Each record is what Debezium 3.6's PostgreSQL connector writes for a table
``t<NN> (id bigint PRIMARY KEY, name text NOT NULL, qty integer NOT NULL, balance numeric(20,6)
NOT NULL, updated_at timestamptz NOT NULL, prefs jsonb)`` under the default replica identity,
with ``decimal.handling.mode=string`` and the JSON converter, with or without schemas: the key
``{"id": n}``, the envelope (``before``, ``after``, ``source``, ``transaction``, ``op``,
``ts_*``), a delete's ``before`` holding the key and each other NOT NULL column's zero value,
and a tombstone after each delete (``tests/unit/debezium_bench_sample.json`` holds the records
the real connector wrote for this table; ``tests/unit/test_bench_cdc_changes.py`` compares).
Records are keyed by primary key and partitioned as Kafka Connect's producer does (murmur2).

The stream is random but reproducible (a seed): per table, creates, updates of live keys
(many keys change several times within a batch) and deletes, grouped into source transactions
of 1-8 changes. :class:`ChangeStream` keeps the rows each table must end with.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

COLUMNS = {"id": "bigint", "name": "text", "qty": "integer", "balance": "numeric(20,6)",
           "updated_at": "timestamptz", "prefs": "jsonb"}
# A delete's ``before`` under the default replica identity: the key, and each other column's
# zero value (NULL where the column allows it), as the connector writes it.
DELETE_BEFORE = {"name": "", "qty": 0, "balance": "0.000000", "updated_at": "1970-01-01T00:00:00Z", "prefs": None}
OP_WEIGHTS = (("c", 0.40), ("u", 0.45), ("d", 0.15))  # of changes, once a table holds MIN_LIVE rows
MIN_LIVE = 50
EPOCH = datetime(2026, 11, 27, tzinfo=timezone.utc)

_FIELD_SCHEMAS = [
    {"type": "int64", "optional": False, "field": "id"},
    {"type": "string", "optional": False, "field": "name"},
    {"type": "int32", "optional": False, "field": "qty"},
    {"type": "string", "optional": False, "field": "balance"},
    {"type": "string", "optional": False, "name": "io.debezium.time.ZonedTimestamp", "version": 1,
     "field": "updated_at"},
    {"type": "string", "optional": True, "name": "io.debezium.data.Json", "version": 1, "field": "prefs"},
]
_SOURCE_FIELDS = [
    {"type": "string", "optional": False, "field": "version"},
    {"type": "string", "optional": False, "field": "connector"},
    {"type": "string", "optional": False, "field": "name"},
    {"type": "int64", "optional": False, "field": "ts_ms"},
    {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
     "parameters": {"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"},
     "default": "false", "field": "snapshot"},
    {"type": "string", "optional": False, "field": "db"},
    {"type": "string", "optional": True, "field": "sequence"},
    {"type": "int64", "optional": True, "field": "ts_us"},
    {"type": "int64", "optional": True, "field": "ts_ns"},
    {"type": "string", "optional": False, "field": "schema"},
    {"type": "string", "optional": False, "field": "table"},
    {"type": "int64", "optional": True, "field": "txId"},
    {"type": "int64", "optional": True, "field": "lsn"},
    {"type": "int64", "optional": True, "field": "xmin"},
    {"type": "string", "optional": True, "field": "origin"},
    {"type": "int64", "optional": True, "field": "origin_lsn"},
]
_TRANSACTION_FIELDS = [
    {"type": "string", "optional": False, "field": "id"},
    {"type": "int64", "optional": False, "field": "total_order"},
    {"type": "int64", "optional": False, "field": "data_collection_order"},
]


_TRANSACTION_KEY_SCHEMA = {"type": "struct", "fields": [{"type": "string", "optional": False, "field": "id"}],
                           "optional": False, "name": "io.debezium.connector.common.TransactionMetadataKey",
                           "version": 1}
_TRANSACTION_VALUE_SCHEMA = {"type": "struct", "fields": [
    {"type": "string", "optional": False, "field": "status"},
    {"type": "string", "optional": False, "field": "id"},
    {"type": "int64", "optional": True, "field": "event_count"},
    {"type": "array", "items": {"type": "struct", "fields": [
        {"type": "string", "optional": False, "field": "data_collection"},
        {"type": "int64", "optional": False, "field": "event_count"}], "optional": False,
        "name": "io.debezium.connector.common.TransactionMetadataDataCollectionValue"},
     "optional": True, "field": "data_collections"},
    {"type": "int64", "optional": False, "field": "ts_ms"}], "optional": False,
    "name": "io.debezium.connector.common.TransactionMetadataValue", "version": 1}


def _compact(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)


def value_schema(prefix: str, schema: str, table: str) -> dict[str, Any]:
    """The envelope's Connect schema, as the JSON converter writes it with schemas enabled."""
    row = {"type": "struct", "fields": _FIELD_SCHEMAS, "optional": True, "name": f"{prefix}.{schema}.{table}.Value"}
    return {"type": "struct", "fields": [
        {**row, "field": "before"}, {**row, "field": "after"},
        {"type": "struct", "fields": _SOURCE_FIELDS, "optional": False,
         "name": "io.debezium.connector.postgresql.Source", "version": 1, "field": "source"},
        {"type": "struct", "fields": _TRANSACTION_FIELDS, "optional": True, "name": "event.block", "version": 1,
         "field": "transaction"},
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"},
        {"type": "int64", "optional": True, "field": "ts_us"},
        {"type": "int64", "optional": True, "field": "ts_ns"},
    ], "optional": False, "name": f"{prefix}.{schema}.{table}.Envelope", "version": 2}


def key_schema(prefix: str, schema: str, table: str) -> dict[str, Any]:
    return {"type": "struct", "fields": [_FIELD_SCHEMAS[0]], "optional": False,
            "name": f"{prefix}.{schema}.{table}.Key"}


def table_names(tables: int) -> list[str]:
    return [f"t{index:02d}" for index in range(tables)]


def topic_of(prefix: str, schema: str, table: str) -> str:
    """Debezium's topic for a table: ``<topic.prefix>.<schema>.<table>``."""
    return f"{prefix}.{schema}.{table}"


@dataclass
class _Table:
    """A source table's live rows (id -> the row as Debezium writes it) and its next id."""

    name: str
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    live: list[int] = field(default_factory=list)  # rows' ids, for a uniform pick
    where: dict[int, int] = field(default_factory=dict)  # id -> index in live
    next_id: int = 1

    def put(self, row: dict[str, Any]) -> None:
        if row["id"] not in self.rows:
            self.where[row["id"]] = len(self.live)
            self.live.append(row["id"])
        self.rows[row["id"]] = row

    def remove(self, key: int) -> None:
        del self.rows[key]
        index = self.where.pop(key)
        last = self.live.pop()
        if last != key:
            self.live[index] = last
            self.where[last] = index


class ChangeStream:
    """A reproducible stream of ``changes`` row changes over ``tables`` tables (``t00``...),
    as Debezium's records (:meth:`records`), and the rows it leaves (:meth:`final_rows`).

    :param schemas: the JSON converter's ``schemas.enable``.
    :param transaction_changes: the largest source transaction; sizes from 1 to it, as many of each.
    :param begins: the transaction topic's BEGINs written (False: its ENDs only, as a connector
        transform that drops the BEGINs would leave it; the changes are the same either way).
    """

    def __init__(self, tables: int, changes: int, *, prefix: str, schema: str = "public", seed: int = 35,
                 schemas: bool = False, transaction_metadata: bool = False, transaction_changes: int = 8,
                 begins: bool = True) -> None:
        self.tables = [_Table(name) for name in table_names(tables)]
        self.changes, self.prefix, self.schema, self.schemas = changes, prefix, schema, schemas
        self.transaction_metadata, self.transaction_changes = transaction_metadata, transaction_changes
        self.begins = begins
        self.random = random.Random(seed)
        self.counts = {"c": 0, "u": 0, "d": 0, "tombstones": 0, "transactions": 0}
        self._lsn, self._tx, self._clock_us = 30_000_000, 700, int(EPOCH.timestamp() * 1_000_000)
        self._wrappers = {t.name: self._wrapper(t.name) for t in self.tables}

    def _wrapper(self, table: str) -> tuple[str, str, str, str]:
        """The text around a key's and a value's payload: the converter's schema, when enabled."""
        if not self.schemas:
            return "", "", "", ""
        key = '{"schema":' + _compact(key_schema(self.prefix, self.schema, table)) + ',"payload":'
        value = '{"schema":' + _compact(value_schema(self.prefix, self.schema, table)) + ',"payload":'
        return key, "}", value, "}"

    def topics(self) -> list[str]:
        """The change topics (the transaction topic, if any, is :meth:`transaction_topic`)."""
        return [topic_of(self.prefix, self.schema, t.name) for t in self.tables]

    def transaction_topic(self) -> str | None:
        """``<prefix>.transaction``, with ``transaction_metadata`` (one partition, as Debezium's)."""
        return f"{self.prefix}.transaction" if self.transaction_metadata else None

    def _transaction_record(self, status: str, table: str, size: int) -> tuple[str, bytes, bytes]:
        """A BEGIN or END of the transaction topic, as ``provide.transaction.metadata`` writes it."""
        tx_id = f"{self._tx}:{self._lsn}"
        end = status == "END"
        payload: dict[str, Any] = {
            "status": status, "id": tx_id, "event_count": size if end else None,
            "data_collections": [{"data_collection": f"{self.schema}.{table}", "event_count": size}] if end else None,
            "ts_ms": self._clock_us // 1000}
        key: dict[str, Any] = {"id": tx_id}
        value = payload
        if self.schemas:
            key = {"schema": _TRANSACTION_KEY_SCHEMA, "payload": key}
            value = {"schema": _TRANSACTION_VALUE_SCHEMA, "payload": payload}
        return str(self.transaction_topic()), _compact(key).encode(), _compact(value).encode()

    def _row(self, key: int) -> dict[str, Any]:
        r = self.random
        stamp = EPOCH + timedelta(microseconds=self._clock_us % 10**12 + r.randrange(10**6))
        prefs = None if r.random() < 0.1 else json.dumps({"tier": r.randint(1, 5), "tags": ["a", str(key % 13)]})
        return {"id": key, "name": f"n{key}-{r.randrange(10**6)}", "qty": r.randint(-1000, 1000),
                "balance": f"{r.randint(-10**12, 10**12)}.{r.randrange(10**6):06d}",
                "updated_at": zoned_timestamp(stamp), "prefs": prefs}

    def _op(self, table: _Table) -> str:
        if len(table.live) < MIN_LIVE:
            return "c"
        pick = self.random.random()
        for op, weight in OP_WEIGHTS:
            if pick < weight:
                return op
            pick -= weight
        return OP_WEIGHTS[-1][0]

    def _envelope(self, table: str, op: str, before: dict | None, after: dict | None, first: bool,
                  order: int) -> str:
        self._lsn += self.random.randrange(150, 400)
        self._clock_us += self.random.randrange(5, 50)
        ms, us = self._clock_us // 1000, self._clock_us
        source = {"version": "3.6.1.Final", "connector": "postgresql", "name": self.prefix, "ts_ms": ms,
                  "snapshot": "false", "db": "app", "sequence": _compact([None if first else str(self._lsn - 200),
                                                                          str(self._lsn)]),
                  "ts_us": us, "ts_ns": us * 1000, "schema": self.schema, "table": table, "txId": self._tx,
                  "lsn": self._lsn, "xmin": None, "origin": None, "origin_lsn": None}
        sent = us + 800
        block = ({"id": f"{self._tx}:{self._lsn}", "total_order": order, "data_collection_order": order}
                 if self.transaction_metadata else None)
        return _compact({"before": before, "after": after, "source": source, "transaction": block, "op": op,
                         "ts_ms": sent // 1000, "ts_us": sent, "ts_ns": sent * 1000 + 373})

    def _change(self, table: _Table, order: int) -> Iterator[tuple[str, str, str | None]]:
        """(table, key JSON, value JSON or None for a tombstone) of one change."""
        op = self._op(table)
        self.counts[op] += 1
        if op == "c":
            key = table.next_id
            table.next_id += 1
            before, after = None, self._row(key)
            table.put(after)
        else:
            key = table.live[self.random.randrange(len(table.live))]
            if op == "u":
                before, after = None, self._row(key)
                table.put(after)
            else:
                before, after = {"id": key, **DELETE_BEFORE}, None
                table.remove(key)
        key_text = _compact({"id": key})
        yield table.name, key_text, self._envelope(table.name, op, before, after, order == 1, order)
        if op == "d":
            self.counts["tombstones"] += 1
            yield table.name, key_text, None

    def records(self) -> Iterator[tuple[str, bytes, bytes | None]]:
        """(topic, key, value) of every record, in the order the connector writes them:
        source transactions of 1 to ``transaction_changes`` changes (8 unless asked), each on one
        table (with ``transaction_metadata``, each between its BEGIN and its END in the
        transaction topic)."""
        made = 0
        while made < self.changes:
            table = self.tables[self.random.randrange(len(self.tables))]
            self._tx += 1
            self.counts["transactions"] += 1
            size = min(self.random.randint(1, self.transaction_changes), self.changes - made)
            key_head, key_tail, value_head, value_tail = self._wrappers[table.name]
            topic = topic_of(self.prefix, self.schema, table.name)
            if self.transaction_metadata and self.begins:
                yield self._transaction_record("BEGIN", table.name, size)
            for index in range(size):
                for _, key, value in self._change(table, order=index + 1):
                    yield (topic, (key_head + key + key_tail).encode(),
                           None if value is None else (value_head + value + value_tail).encode())
            if self.transaction_metadata:
                yield self._transaction_record("END", table.name, size)
            made += size

    def final_rows(self) -> dict[str, dict[int, tuple]]:
        """Per table, id -> the row a mirror must hold once every record is applied, in
        ``COLUMNS`` order, as psycopg2 reads it (Decimal, aware datetime, the jsonb's document)."""
        return {t.name: {key: typed_row(row) for key, row in t.rows.items()} for t in self.tables}


def zoned_timestamp(stamp: datetime) -> str:
    """A timestamptz as ``io.debezium.time.ZonedTimestamp``: ISO 8601 in UTC, its fraction's
    trailing zeros dropped (Java's ISO_OFFSET_DATE_TIME), none for a whole second."""
    fraction = f"{stamp.microsecond:06d}".rstrip("0")
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if fraction else "") + "Z"


def typed_row(row: dict[str, Any]) -> tuple:
    """A row as Debezium writes it, as psycopg2 reads the mirror's columns back."""
    stamp = datetime.fromisoformat(row["updated_at"])
    prefs = None if row["prefs"] is None else json.loads(row["prefs"])
    return (row["id"], row["name"], row["qty"], Decimal(row["balance"]), stamp, prefs)
