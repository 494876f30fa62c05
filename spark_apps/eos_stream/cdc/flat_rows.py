"""The fast change path: a change whose rows are flat is staged with its rows as the connector
wrote them, without building a Python value per column.

Most changes of most tables are flat: every column of ``after`` (and of ``before``) is a JSON
string, an integer or null, of a column whose value the reference reading
(``envelope.decode_change`` then ``mirror.change_cells``) would stage as that same text. Such a
row's JSON is already what the apply reads: it casts ``_after->>column`` (and ``_keys->>column``)
to the column's type, and ``->>`` gives a JSON integer's digits exactly as it gives the string
of those digits. So the row's bytes go into the stage as they are; only the envelope, the key
and the row's column names and JSON types are read, in msgspec's C, against a per-table
:class:`_Plan` (a msgspec struct of the table's exact columns and their admitted JSON types).

This path only vouches, as ``fast_envelope`` does: :meth:`FlatLines.line` returns None for
anything it does not stage exactly as the reference would, and the record then takes the
reference path, which gives its verdict. That is every record but a well-formed change of a
listed table whose key and rows carry exactly the target's columns with admitted JSON types,
with no ``\\u`` escape (a NUL or a lone surrogate, which the reference refuses, are spelled that
way) and, where Debezium may write it, no text containing the unchanged-TOAST placeholder.

Admitted per column (``_admitted``): an integer column takes a JSON integer; a column the
reference keeps as it is (text, jsonb, uuid, timestamptz's ISO text, ...) a string or an
integer; a date, time or timestamp written as text, and a ``numeric`` in
``decimal.handling.mode=string``, a string. The one difference from the reference is there: the
reference reads a decimal string with Python's ``Decimal`` and stages its ``str``, which for the
plain decimal text Debezium writes is the same text; for text that is no decimal, here
PostgreSQL's ``numeric`` input gives the verdict (the record is quarantined with its coordinates
either way).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import msgspec

from spark_apps.eos_stream.cdc.definition import MirrorDefinition
from spark_apps.eos_stream.cdc.fast_envelope import KEY_SCHEMAS, OPS, ROW_SCHEMAS, SchemaRefused
from spark_apps.eos_stream.cdc.known_schemas import KnownSchemas
from spark_apps.eos_stream.cdc.mirror import MirrorTarget
from spark_apps.eos_stream.cdc.transaction_groups import GroupCounter
from spark_apps.eos_stream.cdc.transactions import tx_part
from spark_apps.eos_stream.cdc.values import DEFAULT_PLACEHOLDER, FieldSchema, base_type, plain_kind
from spark_apps.eos_stream.records.parsing import escape_copy

_NULL = "\\N"
_JSON_NULL = b"null"
_MAX_PLANS = 1024  # (table, schema) pairs kept; a pipeline holds about two per table
_TEXT_KINDS = ("date", "time", "timestamp")  # the reference keeps a string of these as it is
_DECIMAL_KINDS = ("numeric", "decimal")


class _ToReference(Exception):
    """The record is not one this path stages: the reference path reads it."""


class _Source(msgspec.Struct):
    schema: Any = None
    table: Any = None


class _Envelope(msgspec.Struct):
    """A change's envelope with its rows kept as raw JSON."""

    before: msgspec.Raw = msgspec.Raw(_JSON_NULL)
    after: msgspec.Raw = msgspec.Raw(_JSON_NULL)
    source: _Source | None = None
    op: Any = None
    transaction: Any = None


class _Wrapped(msgspec.Struct, forbid_unknown_fields=True):
    schema: msgspec.Raw
    payload: _Envelope


class _WrappedKey(msgspec.Struct, forbid_unknown_fields=True):
    schema: msgspec.Raw
    payload: msgspec.Raw


_VALUE = msgspec.json.Decoder(_Wrapped)
_PLAIN_VALUE = msgspec.json.Decoder(_Envelope)
_KEY = msgspec.json.Decoder(_WrappedKey)
# How Connect's JSON converter begins a record with schemas (the schema, then the payload).
_WITH_SCHEMA = b'{"schema":'
_VALUE_SCHEMAS: KnownSchemas[Any] = KnownSchemas()
_KEY_SCHEMAS: KnownSchemas[Any] = KnownSchemas()


def _admitted(pg_type: str, schema: FieldSchema | None) -> Any:
    """The JSON types a column's value may have on this path, or None when every value of the
    column must take the reference path (it converts them: bytes, arrays, booleans, epoch
    numbers, Connect decimals)."""
    kind = plain_kind(pg_type, schema)
    if kind == "integer":
        return int | None
    if kind == "scalar":
        return str | int | None
    name = schema.name if schema is not None else None
    if schema is not None and schema.type != "string":
        return None
    base = base_type(pg_type)
    if base in _TEXT_KINDS and name is None:
        return str | None
    if base in _DECIMAL_KINDS and not (name or "").endswith("Decimal"):
        return str | None
    return None


def _row_decoder(columns: Mapping[str, str], schemas: Mapping[str, FieldSchema] | None) -> Any:
    """A decoder that accepts exactly ``columns``, each with an admitted JSON type; None when a
    column admits nothing."""
    fields, names = [], {}
    for position, (column, pg_type) in enumerate(columns.items()):
        admitted = _admitted(pg_type, (schemas or {}).get(column))
        if admitted is None:
            return None
        fields.append((f"c{position}", admitted))
        names[f"c{position}"] = column
    row = msgspec.defstruct("Row", fields, rename=names, forbid_unknown_fields=True)
    return msgspec.json.Decoder(row)


class _Plan:
    """How one target's changes of one Connect schema are checked: its key's decoder, and
    its rows' (None: its rows always take the reference path)."""

    def __init__(self, target: MirrorTarget, key_schema: Any, row_schema: Any) -> None:
        self.target, self.key_schema, self.row_schema = target, key_schema, row_schema  # kept alive: ids key the cache
        self.key = _row_decoder({k: target.columns[k] for k in target.key}, key_schema)
        self.row = _row_decoder(target.columns, row_schema)
        self.table = escape_copy(target.table)


class FlatLines:
    """Stage lines of flat changes for one mirror definition (see the module)."""

    def __init__(self, definition: MirrorDefinition, counter: GroupCounter | None = None,
                 plans: dict[tuple[str, int, int], _Plan] | None = None) -> None:
        """:param counter: a whole mirror's, which counts each line made in its transaction's group.
        :param plans: the plans made before for ``definition``, shared: a plan's decoders are a
            struct type each, made in milliseconds, and a stager is made for every cycle."""
        self.definition, self.counter = definition, counter
        text = definition.placeholder or DEFAULT_PLACEHOLDER
        # Debezium writes the placeholder as its text, or base64 of it in a bytes column.
        self.placeholder, self.placeholder_base64 = text.encode(), base64.b64encode(text.encode())
        self.plans: dict[tuple[str, int, int], _Plan] = {} if plans is None else plans
        self.last_plan: _Plan | None = None
        # Topic and source table names as COPY cells: a handful of each, escaped once.
        self.escaped: dict[str, str] = {}

    def _plan(self, target: MirrorTarget, key_schema: Any, row_schema: Any) -> _Plan:
        last = self.last_plan  # most records are of the table and schema just seen
        if last is not None and last.target is target and last.key_schema is key_schema \
                and last.row_schema is row_schema:
            return last
        cache_key = (target.table, id(key_schema), id(row_schema))
        plan = self.plans.get(cache_key)
        if plan is None or plan.target is not target:
            if len(self.plans) >= _MAX_PLANS:
                self.plans.clear()
            plan = self.plans[cache_key] = _Plan(target, key_schema, row_schema)
        self.last_plan = plan
        return plan

    def _escape(self, name: str) -> str:
        escaped = self.escaped.get(name)
        if escaped is None:
            if len(self.escaped) >= _MAX_PLANS:
                self.escaped.clear()
            escaped = self.escaped[name] = escape_copy(name)
        return escaped

    def line(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None) -> str | None:
        """The record's stage line, or None when the reference path must stage it."""
        if key is None or value is None:
            return None
        try:
            return self._line(topic, partition, offset, key, value)
        except (_ToReference, msgspec.MsgspecError, SchemaRefused, UnicodeError, RecursionError, ValueError):
            return None

    def _line(self, topic: str, partition: int, offset: int, key: bytes, value: bytes) -> str:
        envelope, row_schema = self._envelope(value)
        source, op = envelope.source, envelope.op
        if op not in OPS or source is None or not isinstance(source.table, str):
            raise _ToReference
        table = f"{source.schema}.{source.table}" if isinstance(source.schema, str) else source.table
        target = self.definition.route(table)
        if target is None:
            raise _ToReference
        key_payload, key_schema = self._key(key)
        plan = self._plan(target, key_schema, row_schema)
        if plan.row is None or plan.key is None:
            raise _ToReference
        key_text = bytes(key_payload)
        if b"\\u" in key_text:  # a NUL the reference refuses, or an escape it must read
            raise _ToReference
        plan.key.decode(key_text)
        after = self._row(plan, envelope.after, op == "u")
        if after is None and op != "d":
            raise _ToReference
        before = None
        if target.feeds_aggregates:
            before = self._row(plan, envelope.before, op != "c")
        elif bytes(envelope.before)[:1] not in (b"{", b"n"):  # an object or null, as the reference requires
            raise _ToReference
        tx = envelope.transaction
        if tx is not None and not isinstance(tx, dict):
            raise _ToReference
        tx_id = None if not tx or tx.get("id") is None else tx_part(tx.get("id"))
        tx_cell = _NULL if tx_id is None else tx_id if tx_id.isdigit() else escape_copy(tx_id)  # PostgreSQL's: digits
        if self.counter is not None:
            if tx_id is not None:
                self.counter.change(topic, partition, offset, tx_id, table)
            else:
                self.counter.record(topic, partition, offset, op, False, tx_id, table)
        # The cells of mirror.STAGE_COLUMNS, in one format: no tuple, no join.
        return (f"{self._escape(topic)}\t{partition}\t{offset}\t\\N\t\\N\t\\N\t{plan.table}\t{op}\t"
                f"{escape_copy(key_text.decode())}\t{_NULL if after is None else after}\t[]\t"
                f"{_NULL if before is None else before}\t\\N\t\\N\t{tx_cell}\t{self._escape(table)}\n")

    @staticmethod
    def _envelope(value: bytes) -> tuple[_Envelope, Any]:
        # Only a record with schemas is tried as one: without schemas, that failed try and its
        # exception were 7 % of the continuous engine's time. A record with schemas the prefix
        # misses decodes here to an envelope without ``op``: the reference path reads it.
        if not value.startswith(_WITH_SCHEMA):
            return _PLAIN_VALUE.decode(value), None
        known = _VALUE_SCHEMAS.payload(value)
        if known is not None:
            return _PLAIN_VALUE.decode(known[0]), known[1]
        try:
            wrapped = _VALUE.decode(value)
        except msgspec.ValidationError:
            return _PLAIN_VALUE.decode(value), None
        row_schema = ROW_SCHEMAS.get(wrapped.schema)
        _VALUE_SCHEMAS.learn(value, bytes(wrapped.schema), row_schema)
        return wrapped.payload, row_schema

    @staticmethod
    def _key(key: bytes) -> tuple[msgspec.Raw | bytes, Any]:
        # As for the value; a key with schemas the prefix misses fails the key's decoder (it
        # admits exactly the key's columns), and the reference path reads the record. A known
        # schema's payload is checked later, by the plan's key decoder, as a raw one would be.
        if not key.startswith(_WITH_SCHEMA):
            return key, None
        known = _KEY_SCHEMAS.payload(key)
        if known is not None and known[0][:1] == b"{" and known[0][-1:] == b"}":
            return known
        try:
            wrapped = _KEY.decode(key)
        except msgspec.ValidationError:
            return key, None
        key_schema = KEY_SCHEMAS.get(wrapped.schema)
        _KEY_SCHEMAS.learn(key, bytes(wrapped.schema), key_schema)
        return wrapped.payload, key_schema

    def _row(self, plan: _Plan, raw: msgspec.Raw, placeholder_possible: bool) -> str | None:
        """The row's COPY cell; None for a JSON null."""
        text = bytes(raw)
        if text == _JSON_NULL:
            return None
        if b"\\u" in text or (placeholder_possible and (self.placeholder in text or self.placeholder_base64 in text)):
            raise _ToReference
        assert plan.row is not None
        plan.row.decode(text)
        return escape_copy(text.decode())
