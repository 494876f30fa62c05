"""Debezium PostgreSQL change records as the JSON converter writes them, with and without
schemas (Debezium's documented envelope: op, before, after, source, ts_ms)."""

from __future__ import annotations

import json
from typing import Any

PLACEHOLDER = "__debezium_unavailable_value"


def source(table: str = "customers", lsn: int = 24023128, tx_id: int = 555, snapshot: str = "false") -> dict:
    return {"version": "3.6.1.Final", "connector": "postgresql", "name": "app", "ts_ms": 1764230000000,
            "snapshot": snapshot, "db": "appdb", "sequence": f'["{lsn - 8}","{lsn}"]', "schema": "public",
            "table": table, "txId": tx_id, "lsn": lsn, "xmin": None}


def value(op: str, before: dict | None, after: dict | None, table: str = "customers", **src: Any) -> bytes:
    return json.dumps({"before": before, "after": after, "source": source(table, **src), "op": op,
                       "ts_ms": 1764230000123, "transaction": None}).encode()


def key(**columns: Any) -> bytes:
    return json.dumps(columns).encode()


# Field schemas of a table with every type the mirror maps (schemas.enable=true).
ROW_FIELDS = [
    {"type": "int64", "optional": False, "field": "id"},
    {"type": "string", "optional": True, "field": "name"},
    {"type": "string", "optional": True, "field": "balance"},  # numeric(20,6), decimal.handling.mode=string
    {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "version": 1,
     "field": "updated_at"},
    {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "version": 1, "field": "born"},
    {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTime", "version": 1, "field": "wakes"},
    {"type": "string", "optional": True, "name": "io.debezium.data.Json", "version": 1, "field": "prefs"},
    {"type": "array", "items": {"type": "string", "optional": True}, "optional": True, "field": "tags"},
    {"type": "string", "optional": True, "field": "photo"},  # bytea, binary.handling.mode=base64
    {"type": "string", "optional": True, "field": "notes"},
]
ROW_TYPES = {"id": "bigint", "name": "text", "balance": "numeric(20,6)", "updated_at": "timestamptz",
             "born": "date", "wakes": "time", "prefs": "jsonb", "tags": "text[]", "photo": "bytea", "notes": "text"}


def with_schema(payload_bytes: bytes, fields: list | None = None, table: str = "customers") -> bytes:
    """The same value as the converter writes it with ``schemas.enable=true``."""
    row = {"type": "struct", "fields": fields or ROW_FIELDS, "optional": True, "name": f"app.public.{table}.Value"}
    schema = {"type": "struct", "name": f"app.public.{table}.Envelope", "optional": False, "fields": [
        {**row, "field": "before"}, {**row, "field": "after"},
        {"type": "struct", "field": "source", "optional": False, "fields": []},
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"}]}
    return json.dumps({"schema": schema, "payload": json.loads(payload_bytes)}).encode()


def key_with_schema(key_bytes: bytes, table: str = "customers") -> bytes:
    columns = json.loads(key_bytes)
    fields = [{"type": "int64", "optional": False, "field": c} for c in columns]
    return json.dumps({"schema": {"type": "struct", "fields": fields, "optional": False,
                                  "name": f"app.public.{table}.Key"}, "payload": columns}).encode()


FULL_ROW = {"id": 7, "name": "Ada", "balance": "12345678901234.123456", "updated_at": "2026-11-27T09:30:00.123456Z",
            "born": 19000, "wakes": 25_200_000_000, "prefs": '{"theme": "dark", "n": [1, 2]}',
            "tags": ["a", "b,c", 'd"e', None], "photo": "3q2+7w==", "notes": "long text"}
