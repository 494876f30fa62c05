"""Debezium change events: the key and value a connector writes to Kafka, decoded into a
typed :class:`Change`.

The JSON converter writes each with or without its Connect schema
(``{"schema": ..., "payload": ...}`` when ``schemas.enable=true``); both are read. The value
is an envelope: ``op`` (``c`` create, ``r`` snapshot read, ``u`` update, ``d`` delete),
``before`` and ``after`` (the row's columns), ``source`` (``schema``, ``table``, ``lsn``,
``txId``, ...). A delete is followed by a tombstone (same key, no value) for log
compaction; it carries nothing the delete did not, and decodes to None.

Every refusal is an :class:`EnvelopeError`: the record's fault, dead-lettered with its
coordinates like any other record a parser refuses (``records.RecordError``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from spark_apps.eos_stream.cdc import fast_envelope
from spark_apps.eos_stream.cdc.fast_envelope import OPS, row_schema, struct_fields
from spark_apps.eos_stream.cdc.transactions import transaction_of_payload, tx_part
from spark_apps.eos_stream.cdc.values import ColumnValueError, FieldSchema, Placeholders, decode_value, plain_kind

_DEFAULT_PLACEHOLDERS = Placeholders()
_NONE: frozenset[str] = frozenset()
_NO_SCHEMAS: dict[str, FieldSchema] = {}


class EnvelopeError(ValueError):
    """Why one change record cannot be applied; stored with it in the dead-letter table."""


@dataclass(frozen=True)
class RawChange:
    """An envelope read but not yet typed: what routing needs (the source table) and the
    raw column values, with the event's column schemas when it carries them."""

    source_table: str  # "schema.table"
    op: str
    key: dict[str, Any]
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    lsn: int | None
    tx_id: int | None
    snapshot: bool
    key_schema: dict[str, FieldSchema] | None
    row_schema: dict[str, FieldSchema] | None
    transaction: str | None = None  # the txId part of the event's transaction block (``transactions``)


@dataclass(frozen=True)
class Change:
    """One row change, typed by the target's column types.

    :param unchanged: columns of ``after`` Debezium could not read (unchanged TOASTed values,
        sent as ``__debezium_unavailable_value``): absent from ``after``, never written; the
        mirror keeps what it stores.
    :param before_unavailable: the same for ``before``.
    """

    table: str
    op: str
    key: dict[str, Any]
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    unchanged: frozenset[str] = frozenset()
    before_unavailable: frozenset[str] = frozenset()
    lsn: int | None = None
    tx_id: int | None = None
    row_schema: dict[str, FieldSchema] | None = field(default=None, compare=False)
    transaction: str | None = None


# One decoder for every record: json.loads with parse_float builds a new one per call.
_DECODER = json.JSONDecoder(parse_float=Decimal)


def _json(value: bytes, what: str) -> Any:
    try:
        return _DECODER.decode(value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value)
    except RecursionError as exc:
        raise EnvelopeError(f"malformed {what} JSON: nested too deeply") from exc
    except (UnicodeError, ValueError) as exc:
        raise EnvelopeError(f"malformed {what} JSON: {exc}") from exc


def _unwrap(document: Any, what: str) -> tuple[Any, Mapping[str, Any] | None]:
    """(payload, schema) of a converter's output, with or without its schema wrapper."""
    if isinstance(document, dict) and set(document) == {"schema", "payload"}:
        schema = document["schema"]
        if schema is not None and not isinstance(schema, Mapping):
            raise EnvelopeError(f"{what} schema must be a JSON object")
        return document["payload"], schema
    return document, None


def _row(payload: Mapping[str, Any], side: str) -> dict[str, Any] | None:
    row = payload.get(side)
    if row is not None and not isinstance(row, dict):
        raise EnvelopeError(f"{side!r} must be a JSON object or null, got {type(row).__name__}")
    return row


def _optional_int(source: Mapping[str, Any], name: str) -> int | None:
    value = source.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_envelope(key: bytes | None, value: bytes | None) -> RawChange | None:
    """Reads one Kafka record of a Debezium topic; None for a tombstone. A well-formed change
    is read by ``fast_envelope``; any other record by ``json`` here, which gives its verdict."""
    if value is None:
        return None
    read = fast_envelope.read(key, value)
    if read is None:
        return _parse_with_json(key, value)
    return _raw_change(read.op, read.before, read.after, read.source, read.key, read.key_schema, read.row_schema,
                       tx_part(read.transaction.get("id")) if read.transaction else None)


def _raw_change(op: str, before: dict[str, Any] | None, after: dict[str, Any] | None, source: Mapping[str, Any],
                key: dict[str, Any], key_schema: dict[str, FieldSchema] | None,
                row_fields: dict[str, FieldSchema] | None, transaction: str | None) -> RawChange:
    schema_name = source.get("schema")
    table = f"{schema_name}.{source['table']}" if isinstance(schema_name, str) else source["table"]
    snapshot = source.get("snapshot") not in (None, False, "false")
    return RawChange(table, op, key, before, after, _optional_int(source, "lsn"), _optional_int(source, "txId"),
                     snapshot, key_schema, row_fields, transaction)


def _parse_with_json(key: bytes | None, value: bytes) -> RawChange:
    """The reference reading of a change record: every refusal is raised here."""
    payload, value_schema = _unwrap(_json(value, "value"), "value")
    if not isinstance(payload, dict):
        raise EnvelopeError(f"change event must be a JSON object, got {type(payload).__name__}")
    op = payload.get("op")
    if op not in OPS:
        raise EnvelopeError(f"change event has op {op!r}, not one of {OPS} (is this a Debezium topic?)")
    source = payload.get("source")
    if not isinstance(source, dict) or not isinstance(source.get("table"), str):
        raise EnvelopeError("change event has no source.table")
    before, after = _row(payload, "before"), _row(payload, "after")
    if op in ("c", "r", "u") and after is None:
        raise EnvelopeError(f"a {op!r} change must carry 'after'")
    if key is None:
        raise EnvelopeError("change record has no key: the source table needs a primary key "
                            "(or the connector's message.key.columns) to be mirrored")
    key_payload, key_schema = _unwrap(_json(key, "key"), "key")
    if not isinstance(key_payload, dict) or not key_payload:
        raise EnvelopeError("change record key must be a non-empty JSON object of the key columns")
    return _raw_change(op, before, after, source, key_payload, struct_fields(key_schema), row_schema(value_schema),
                       transaction_of_payload(payload))


def _typed_row(row: dict[str, Any] | None, types: Mapping[str, str], schemas: Mapping[str, FieldSchema] | None,
               placeholders: Placeholders | None) -> tuple[dict[str, Any] | None, frozenset[str]]:
    """The row's values decoded by their column types, and the columns that held the
    unchanged-TOAST placeholder (left out). A column the target does not know yet keeps
    its raw value: the schema-change rules judge it (``schema_changes``)."""
    if row is None:
        return None, _NONE
    out: dict[str, Any] = {}
    unavailable = set()
    type_of, schema_of = types.get, (schemas or _NO_SCHEMAS).get
    for column, raw in row.items():
        if raw is None:  # NULL whatever the column: nothing to decode, no placeholder
            out[column] = None
            continue
        if placeholders is not None and placeholders.matches(raw):
            unavailable.add(column)
            continue
        pg_type, schema = type_of(column), schema_of(column)
        if pg_type is None and schema is None:
            out[column] = raw  # a column the target does not know yet
        elif type(raw) is str and plain_kind(pg_type or "text", schema) == "scalar":
            out[column] = raw  # what decode_value returns, its checks skipped
        else:
            out[column] = decode_value(column, raw, pg_type or "text", schema)
    return out, frozenset(unavailable) if unavailable else _NONE


def decode_change(raw: RawChange, types: Mapping[str, str], placeholders: Placeholders | None = None) -> Change:
    """Types a parsed envelope by ``types`` (column -> PostgreSQL type) and the event's own schema.

    The placeholder is looked for only where Debezium writes it: in the ``after`` of an
    update and the ``before`` of an update or delete. An insert or a snapshot read always
    carries every value, so a text that happens to spell the placeholder there is data."""
    placeholders = placeholders or _DEFAULT_PLACEHOLDERS
    try:
        key, _ = _typed_row(raw.key, types, raw.key_schema, None)
        after, unchanged = _typed_row(raw.after, types, raw.row_schema, placeholders if raw.op == "u" else None)
        before, before_unavailable = _typed_row(raw.before, types, raw.row_schema,
                                                placeholders if raw.op in ("u", "d") else None)
    except ColumnValueError as exc:
        raise EnvelopeError(f"{raw.source_table}: {exc}") from exc
    assert key is not None
    return Change(raw.source_table, raw.op, key, before, after, unchanged, before_unavailable,
                  raw.lsn, raw.tx_id, raw.row_schema, raw.transaction)


def decoder(types_of: Callable[[str], Mapping[str, str] | None],
            placeholder: str | None = None) -> Callable[[bytes | None, bytes | None], Change | None]:
    """A record decoder for one pipeline: ``types_of(source_table)`` gives the target's
    column types, or None for a table the pipeline does not mirror (an error: its topic
    was subscribed, so the definition should name it)."""
    placeholders = Placeholders(placeholder) if placeholder else _DEFAULT_PLACEHOLDERS

    def decode(key: bytes | None, value: bytes | None) -> Change | None:
        raw = parse_envelope(key, value)
        if raw is None:
            return None
        types = types_of(raw.source_table)
        if types is None:
            raise EnvelopeError(f"no mirror target for source table {raw.source_table!r}")
        return decode_change(raw, types, placeholders)

    return decode
