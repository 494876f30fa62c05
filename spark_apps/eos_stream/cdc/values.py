"""Column values as Debezium's JSON converter writes them, decoded and re-encoded as
PostgreSQL's text input.

A value's encoding is told by the change event's schema when the converter carries one
(``schemas.enable=true``: the field's Connect type, semantic name and parameters), and
otherwise by the column's PostgreSQL type in the mirror definition. The connector settings
this module expects (docs/cdc.md, "Connector settings"):

* ``decimal.handling.mode=string``: a numeric arrives as its exact decimal text, which needs
  no schema to read. ``precise`` (the default) writes the unscaled integer as base64 bytes
  whose scale is only in the schema, so a schemaless record could not be read at all, and a
  ``numeric`` without a declared scale becomes a struct per value; ``double`` rounds. With a
  schema, ``precise`` values are decoded too.
* ``time.precision.mode=adaptive_time_microseconds`` (or ``adaptive``): ``time`` is
  microseconds since midnight; ``date`` is days since the epoch; ``timestamp`` is micro- or
  milliseconds since the epoch by its declared precision, as Debezium's adaptive mode does.
* ``binary.handling.mode=base64`` (or ``bytes``, which the JSON converter writes as base64).

Only representations are converted here. Whether a value fits its column (a date's range,
a string's length, a text that is no valid jsonb) is PostgreSQL's verdict, given in the
apply, as for every other pipeline (``records.py``).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import functools
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

# What Debezium writes for an unchanged TOASTed column it cannot read (``unavailable.value.placeholder``).
DEFAULT_PLACEHOLDER = "__debezium_unavailable_value"

_EPOCH_DATE = datetime.date(1970, 1, 1)
_EPOCH = datetime.datetime(1970, 1, 1)
_MICROS_PER_DAY = 86_400_000_000
_INTEGER_TYPES = ("smallint", "integer", "bigint", "int2", "int4", "int8")


class ColumnValueError(ValueError):
    """A value whose encoding does not match its column; the message names the column."""


@dataclass(frozen=True)
class FieldSchema:
    """One field of a change event's Connect schema.

    :param type: the Connect type (int32, string, bytes, array, struct, ...).
    :param name: the semantic type (io.debezium.time.Date, ...), or None.
    :param parameters: the schema's parameters (a Decimal's scale, a propagated source type).
    :param items: an array's element schema.
    """

    type: str
    name: str | None = None
    parameters: Mapping[str, str] = field(default_factory=dict)
    items: FieldSchema | None = None

    @classmethod
    def from_json(cls, schema: Mapping[str, Any]) -> FieldSchema:
        items = schema.get("items")
        return cls(str(schema.get("type")), schema.get("name"), dict(schema.get("parameters") or {}),
                   cls.from_json(items) if isinstance(items, Mapping) else None)


@functools.lru_cache(maxsize=1024)  # asked for every value of every change: a table has few types
def base_type(pg_type: str) -> str:
    """``numeric(20,6)`` -> ``numeric``, ``timestamp(3) with time zone`` -> ``timestamptz``."""
    text = pg_type.strip().lower()
    head, _, rest = text.partition("(")
    tail = rest.partition(")")[2] if rest else ""
    name = " ".join((head + tail).split())
    return {"timestamp with time zone": "timestamptz", "time with time zone": "timetz",
            "timestamp without time zone": "timestamp", "time without time zone": "time"}.get(name, name)


def declared_precision(pg_type: str) -> int | None:
    """The ``(p)`` of ``timestamp(p)`` or ``time(p)``, None when not written."""
    inside = pg_type.partition("(")[2].partition(")")[0]
    return int(inside) if inside.strip().isdigit() else None


@functools.lru_cache(maxsize=1024)
def element_type(pg_type: str) -> str | None:
    """``text[]`` -> ``text``; None for a type that is no array."""
    text = pg_type.strip()
    return text[:-2].strip() if text.endswith("[]") else None


class Placeholders:
    """The forms an unchanged TOASTed value takes, per kind of column (Debezium's
    ``UnchangedToastedReplicationMessageColumn``): the placeholder text, its bytes (bytea,
    base64 in JSON), a one-element list for text arrays, one element per byte for integer
    arrays, and the name-based UUID of its bytes for uuid arrays. Computed once per decoder:
    every column of every update is checked against them."""

    def __init__(self, text: str = DEFAULT_PLACEHOLDER) -> None:
        self.text = text
        self._strings = (text, base64.b64encode(text.encode()).decode())
        self._lists = ([text], [_name_uuid(text.encode())], list(text.encode()))

    def matches(self, raw: Any) -> bool:
        if isinstance(raw, str):
            return raw in self._strings
        return isinstance(raw, list) and bool(raw) and raw in self._lists


def _name_uuid(name: bytes) -> str:
    """Java's UUID.nameUUIDFromBytes: an MD5 with version 3 and the IETF variant."""
    digest = bytearray(hashlib.md5(name, usedforsecurity=False).digest())
    digest[6] = (digest[6] & 0x0F) | 0x30
    digest[8] = (digest[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(digest)))


def _fail(column: str, expected: str, raw: Any) -> ColumnValueError:
    return ColumnValueError(f"column {column!r}: expected {expected}, got {type(raw).__name__} {str(raw)[:80]!r}")


def _integer(column: str, raw: Any, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise _fail(column, what, raw)
    return raw


def _time_of_day(column: str, micros: int) -> str:
    """``HH:MM:SS.ffffff``; PostgreSQL's ``24:00:00`` included, which datetime.time cannot hold."""
    if not 0 <= micros <= _MICROS_PER_DAY:
        raise _fail(column, "a time of day in microseconds (0 to 24h)", micros)
    seconds, fraction = divmod(micros, 1_000_000)
    hours, rest = divmod(seconds, 3600)
    return f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}.{fraction:06d}"


def _timestamp(column: str, raw: Any, per_second: int) -> str:
    units = _integer(column, raw, "a timestamp as an integer since the epoch")
    try:
        return (_EPOCH + datetime.timedelta(microseconds=units * (1_000_000 // per_second))).isoformat(" ")
    except OverflowError as exc:
        raise _fail(column, "a timestamp within years 1 to 9999", raw) from exc


def _date(column: str, raw: Any) -> datetime.date | str:
    if isinstance(raw, str):
        return raw  # an ISO date written by a converter that formats dates itself: PostgreSQL reads it
    days = _integer(column, raw, "a date as days since 1970-01-01")
    try:
        return _EPOCH_DATE + datetime.timedelta(days=days)
    except OverflowError as exc:
        raise _fail(column, "a date within years 1 to 9999", raw) from exc


def _decimal_bytes(column: str, raw: Any, scale: int) -> Decimal:
    """Connect's Decimal (``precise`` mode): base64 of the unscaled two's-complement integer."""
    if not isinstance(raw, str):
        raise _fail(column, "a base64 Decimal", raw)
    try:
        unscaled = int.from_bytes(base64.b64decode(raw, validate=True), "big", signed=True)
    except (binascii.Error, ValueError) as exc:
        raise _fail(column, "a base64 Decimal", raw) from exc
    return Decimal(unscaled).scaleb(-scale)


def _numeric(column: str, raw: Any, schema: FieldSchema | None) -> Decimal | str:
    if schema is not None and schema.name == "org.apache.kafka.connect.data.Decimal":
        return _decimal_bytes(column, raw, int(schema.parameters.get("scale", "0")))
    if schema is not None and schema.name == "io.debezium.data.VariableScaleDecimal":
        if not isinstance(raw, Mapping):
            raise _fail(column, "a VariableScaleDecimal struct", raw)
        return _decimal_bytes(column, raw.get("value"), _integer(column, raw.get("scale"), "a scale"))
    if isinstance(raw, str):
        try:
            return Decimal(raw)  # exact; NaN and Infinity too
        except InvalidOperation as exc:
            raise _fail(column, "a decimal string (decimal.handling.mode=string)", raw) from exc
    if isinstance(raw, int) and not isinstance(raw, bool):
        return Decimal(raw)
    raise _fail(column, "a decimal string: the connector must run with decimal.handling.mode=string "
                "(a JSON number there means decimal.handling.mode=double, which rounds)", raw)


_NAMED_TIMES = {"io.debezium.time.MicroTime": 1_000_000, "io.debezium.time.Time": 1000,
                "org.apache.kafka.connect.data.Time": 1000, "io.debezium.time.NanoTime": 1_000_000_000}
_NAMED_TIMESTAMPS = {"io.debezium.time.MicroTimestamp": 1_000_000, "io.debezium.time.Timestamp": 1000,
                     "org.apache.kafka.connect.data.Timestamp": 1000,
                     "io.debezium.time.NanoTimestamp": 1_000_000_000}


def _adaptive_units(pg_type: str) -> int:
    """Units per second Debezium's adaptive mode uses for a declared time or timestamp."""
    precision = declared_precision(pg_type)
    return 1000 if precision is not None and precision <= 3 else 1_000_000


@functools.lru_cache(maxsize=4096)  # asked for every value: a table has few (type, schema) pairs
def _plain_kind(pg_type: str, schema_type: str | None, name: str | None) -> str | None:
    """``scalar`` when ``decode_value`` keeps a column's value as it is unless it is an object or
    an array, ``integer`` when it keeps an int as it is; None when it converts. The branches
    ``decode_value`` takes before its last two checks, each ruled out once per type."""
    kind = base_type(pg_type)
    if (element_type(pg_type) is not None or schema_type in ("array", "bytes") or name in _NAMED_TIMES
            or name in _NAMED_TIMESTAMPS or name == "io.debezium.time.Date" or (name or "").endswith("Decimal")
            or kind in ("date", "numeric", "decimal", "time", "timestamp", "bytea", "boolean")):
        return None
    return "integer" if kind in _INTEGER_TYPES else "scalar"


def plain_kind(pg_type: str, schema: FieldSchema | None) -> str | None:
    """``_plain_kind`` of a column (its event schema is no cache key: its parameters are a dict)."""
    return _plain_kind(pg_type, None, None) if schema is None else _plain_kind(pg_type, schema.type, schema.name)


def decode_value(column: str, raw: Any, pg_type: str, schema: FieldSchema | None = None) -> Any:
    """One column's value: None, bool, int, float, Decimal, str, bytes, datetime.date, or a
    list of those. Times and timestamps come back as their ISO text, jsonb as its JSON text."""
    if raw is None:
        return None
    plain = plain_kind(pg_type, schema)
    if plain == "scalar" and not isinstance(raw, (dict, list)):
        return raw
    if plain == "integer" and type(raw) is int:
        return raw
    element = element_type(pg_type)
    if element is not None or (schema is not None and schema.type == "array"):
        if not isinstance(raw, list):
            raise _fail(column, "a JSON array", raw)
        item_schema = schema.items if schema is not None else None
        return [decode_value(column, item, element or "text", item_schema) for item in raw]
    name = schema.name if schema is not None else None
    kind = base_type(pg_type)
    if name in _NAMED_TIMES:
        return _time_of_day(column, _integer(column, raw, "a time") * 1_000_000 // _NAMED_TIMES[name])
    if name in _NAMED_TIMESTAMPS:
        return _timestamp(column, raw, _NAMED_TIMESTAMPS[name])
    if name == "io.debezium.time.Date" or kind == "date":
        return _date(column, raw)
    if kind in ("numeric", "decimal") or (name or "").endswith("Decimal"):
        return _numeric(column, raw, schema)
    if kind == "time" and not isinstance(raw, str):
        return _time_of_day(column, _integer(column, raw, "a time") * 1_000_000 // _adaptive_units(pg_type))
    if kind == "timestamp" and not isinstance(raw, str):
        return _timestamp(column, raw, _adaptive_units(pg_type))
    if kind == "bytea" or (schema is not None and schema.type == "bytes"):
        if not isinstance(raw, str):
            raise _fail(column, "base64 bytes (binary.handling.mode=base64)", raw)
        try:
            return base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _fail(column, "base64 bytes (binary.handling.mode=base64)", raw) from exc
    if kind in _INTEGER_TYPES:
        return _integer(column, raw, "an integer")
    if kind == "boolean" and not isinstance(raw, bool):
        raise _fail(column, "true or false", raw)
    if isinstance(raw, (dict, list)):
        raise _fail(column, f"a scalar for {pg_type}", raw)
    return raw  # text, jsonb (io.debezium.data.Json is its JSON text), uuid, timestamptz's ISO text, ...


# --- PostgreSQL text input ---------------------------------------------------


def _array_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return _array_literal(value)
    text = pg_text(value)
    assert text is not None
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _array_literal(values: list) -> str:
    return "{" + ",".join(_array_element(v) for v in values) + "}"


def pg_text(value: Any) -> str | None:
    """A decoded value as the text PostgreSQL's input function of its column reads
    (None stays None: SQL NULL)."""
    if value is None or type(value) is str:
        return value
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + bytes(value).hex()
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, list):
        return _array_literal(value)
    return str(value)
