"""Debezium change records as the JSON converter writes them with schemas on
(``schemas.enable=true``) and ``column.propagate.source.type``: every column's schema names
its source type, which is all a table mirrored by pattern needs to make its target."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Connect's type for each source type used here (decimal.handling.mode=string).
_CONNECT = {"INT4": "int32", "INT8": "int64", "TEXT": "string", "NUMERIC": "string", "VARCHAR": "string"}


def _field(column: str, source_type: str) -> dict[str, Any]:
    name, _, modifier = source_type.partition("(")
    parameters = {"__debezium.source.column.type": name}
    if modifier:
        length, _, scale = modifier.rstrip(")").partition(",")
        parameters["__debezium.source.column.length"] = length
        if scale:
            parameters["__debezium.source.column.scale"] = scale
    return {"type": _CONNECT[name], "optional": True, "field": column, "parameters": parameters}


def typed_record(schema: str, table: str, op: str, key: Mapping[str, Any], row: Mapping[str, Any] | None,
                 types: Mapping[str, str], prefix: str = "app") -> tuple[bytes, bytes]:
    """A change of ``schema.table`` (``op`` c/r/u/d, ``row`` the after image, or the before of a
    delete) with its key and value schemas; ``types``: column -> source type, ``NUMERIC(20,6)``."""
    row_struct = {"type": "struct", "optional": True, "name": f"{prefix}.{schema}.{table}.Value",
                  "fields": [_field(c, t) for c, t in types.items()]}
    envelope = {"type": "struct", "optional": False, "name": f"{prefix}.{schema}.{table}.Envelope", "fields": [
        {**row_struct, "field": "before"}, {**row_struct, "field": "after"},
        {"type": "struct", "field": "source", "optional": False, "fields": []},
        {"type": "string", "optional": False, "field": "op"}]}
    payload = {"op": op, "before": row if op == "d" else None, "after": None if op == "d" else row,
               "source": {"schema": schema, "table": table}}
    key_schema = {"type": "struct", "optional": False, "name": f"{prefix}.{schema}.{table}.Key",
                  "fields": [{**_field(c, types[c]), "optional": False} for c in key]}
    return (json.dumps({"schema": key_schema, "payload": dict(key)}).encode(),
            json.dumps({"schema": envelope, "payload": payload}).encode())


def untyped_record(schema: str, table: str, key: Mapping[str, Any], row: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """A create without schemas (``schemas.enable=false``)."""
    payload = {"op": "c", "before": None, "after": dict(row), "source": {"schema": schema, "table": table}}
    return json.dumps(dict(key)).encode(), json.dumps(payload).encode()
