"""The common Debezium record read in msgspec's C, its Connect schema read once per schema.

A change record with schemas (``{"schema": ..., "payload": ...}``) is mostly its schema, the
same text in every record of a table. Here the schema is skipped as raw bytes (``msgspec.Raw``:
its JSON syntax still checked) and its column schemas are read once per distinct text
(:class:`_SchemaCache`); the payload is read into structs that keep only the fields the mirror
uses, so ``source``'s and the envelope's other fields are never built as Python objects.

This path only vouches: :func:`read` returns None for anything but a well-formed change
(invalid JSON, a value msgspec reads otherwise than ``json`` would, a missing or mistyped
field, a schema that is no object), and ``envelope.parse_envelope`` then reads the record with
``json``, the reference, which gives its verdict. So a record is refused, and in the same
words, exactly when it was before this path existed. Numbers read as ``json`` reads them with
``parse_float=Decimal``: a fraction or exponent as its Decimal (``float_hook``), an integer of
any length up to Python's 4,300 digits (beyond it msgspec refuses too: the reference decides).
Literals ``json`` takes and msgspec does not (``NaN``, a lone surrogate escape) also go back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, NamedTuple

import msgspec

from spark_apps.eos_stream.cdc.known_schemas import KnownSchemas
from spark_apps.eos_stream.cdc.values import FieldSchema

OPS = ("c", "r", "u", "d")
_MAX_SCHEMAS = 256  # distinct schema texts kept; a pipeline holds about two per table


class _Source(msgspec.Struct):
    """What the mirror reads of ``source``; the connector's other fields are skipped."""

    schema: Any = None
    table: Any = None
    lsn: Any = None
    txId: Any = None  # Debezium's name
    snapshot: Any = None


class _Envelope(msgspec.Struct):
    before: Any = None
    after: Any = None
    source: _Source | None = None
    op: Any = None
    transaction: Any = None  # {id, total_order, data_collection_order}, or null (a snapshot read)


class _Wrapped(msgspec.Struct, forbid_unknown_fields=True):
    """The converter's output with schemas: exactly these two keys, as ``envelope._unwrap`` requires."""

    schema: msgspec.Raw
    payload: _Envelope


class _WrappedKey(msgspec.Struct, forbid_unknown_fields=True):
    schema: msgspec.Raw
    payload: Any


_VALUE = msgspec.json.Decoder(_Wrapped, float_hook=Decimal)
_PLAIN_VALUE = msgspec.json.Decoder(_Envelope, float_hook=Decimal)
_KEY = msgspec.json.Decoder(_WrappedKey, float_hook=Decimal)
_ANY = msgspec.json.Decoder(float_hook=Decimal)


def struct_fields(schema: Mapping[str, Any] | None) -> dict[str, FieldSchema] | None:
    """A struct schema's fields by name, None when ``schema`` is no struct schema."""
    if schema is None or not isinstance(schema.get("fields"), list):
        return None
    return {str(f.get("field")): FieldSchema.from_json(f) for f in schema["fields"] if isinstance(f, Mapping)}


def row_schema(value_schema: Mapping[str, Any] | None) -> dict[str, FieldSchema] | None:
    """The row's column schemas: the ``after`` (else ``before``) struct of the envelope's schema."""
    fields = None if value_schema is None else value_schema.get("fields")
    if not isinstance(fields, list):  # no struct schema: read as without schemas
        return None
    structs = {f.get("field"): f for f in fields if isinstance(f, Mapping)}
    for side in ("after", "before"):
        fields = struct_fields(structs.get(side))
        if fields is not None:
            return fields
    return None


class SchemaRefused(Exception):
    """A schema text the reference must judge."""


class _SchemaCache:
    """A Connect schema's text -> what ``derive`` makes of it, for the last ``_MAX_SCHEMAS``
    texts. The values are shared by every change of that schema: nothing may change them."""

    def __init__(self, derive: Callable[[Mapping[str, Any] | None], dict[str, FieldSchema] | None]) -> None:
        self.derive = derive
        self.known: dict[bytes, dict[str, FieldSchema] | None] = {}

    def get(self, raw: msgspec.Raw) -> dict[str, FieldSchema] | None:
        text = bytes(raw)
        try:
            return self.known[text]
        except KeyError:
            pass
        schema = _ANY.decode(text)
        if schema is not None and not isinstance(schema, dict):
            raise SchemaRefused
        if len(self.known) >= _MAX_SCHEMAS:
            self.known.clear()  # a schema per table: only a pipeline of very many tables gets here
        derived = self.known[text] = self.derive(schema)
        return derived


KEY_SCHEMAS = _SchemaCache(struct_fields)
ROW_SCHEMAS = _SchemaCache(row_schema)
_VALUE_SCHEMAS: KnownSchemas[dict[str, FieldSchema] | None] = KnownSchemas()


class Read(NamedTuple):
    """A change record as ``envelope.parse_envelope`` needs it; ``source`` as a mapping."""

    op: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    source: dict[str, Any]
    key: dict[str, Any]
    key_schema: dict[str, FieldSchema] | None
    row_schema: dict[str, FieldSchema] | None
    transaction: Any = None


def _key(key: bytes) -> tuple[dict[str, Any], dict[str, FieldSchema] | None] | None:
    try:
        wrapped = _KEY.decode(key)
        payload, schema = wrapped.payload, KEY_SCHEMAS.get(wrapped.schema)
    except msgspec.ValidationError:  # no schema wrapper: the key's columns themselves
        payload, schema = _ANY.decode(key), None
        if isinstance(payload, dict) and set(payload) == {"schema", "payload"}:
            return None
    if not isinstance(payload, dict) or not payload:
        return None
    return payload, schema


def _value(value: bytes) -> tuple[_Envelope, dict[str, FieldSchema] | None]:
    known = _VALUE_SCHEMAS.payload(value)
    if known is not None:
        return _PLAIN_VALUE.decode(known[0]), known[1]
    try:
        wrapped = _VALUE.decode(value)
        row_schema = ROW_SCHEMAS.get(wrapped.schema)
        _VALUE_SCHEMAS.learn(value, bytes(wrapped.schema), row_schema)
        return wrapped.payload, row_schema
    except msgspec.ValidationError:
        # No schema wrapper, or one whose payload is no envelope: an ``op`` is required below,
        # so a document of only ``schema`` and ``payload`` never passes as an envelope.
        return _PLAIN_VALUE.decode(value), None


def read(key: bytes | None, value: bytes) -> Read | None:
    """The record's change, or None when the reference reading must decide (see the module)."""
    try:
        envelope, schema = _value(value)
        source = envelope.source
        if envelope.op not in OPS or source is None or not isinstance(source.table, str):
            return None
        before, after = envelope.before, envelope.after
        if not (before is None or isinstance(before, dict)) or not (after is None or isinstance(after, dict)):
            return None
        if (after is None and envelope.op != "d") or key is None:
            return None
        keyed = _key(key)
    except (msgspec.MsgspecError, SchemaRefused, UnicodeError, RecursionError, ValueError):
        return None
    if keyed is None:
        return None
    fields = {"schema": source.schema, "table": source.table, "lsn": source.lsn, "txId": source.txId,
              "snapshot": source.snapshot}
    transaction = envelope.transaction
    if transaction is not None and not isinstance(transaction, dict):
        return None
    return Read(envelope.op, before, after, fields, keyed[0], keyed[1], schema, transaction)


# --- the transaction topic's BEGIN and END (``transactions``) ----------------------------------


class _Collection(msgspec.Struct):
    data_collection: str
    event_count: int


class _TransactionPayload(msgspec.Struct):
    """What ``transactions.parse_transaction_record`` reads of a BEGIN or an END; ``event_count``
    and ``ts_ms`` are skipped."""

    status: str
    id: str
    data_collections: list[_Collection] | None = None


class _WrappedTransaction(msgspec.Struct, forbid_unknown_fields=True):
    schema: msgspec.Raw
    payload: _TransactionPayload


_TRANSACTION = msgspec.json.Decoder(_WrappedTransaction)
_PLAIN_TRANSACTION = msgspec.json.Decoder(_TransactionPayload)
# The transaction topic's schema texts: two (a BEGIN's and an END's are one), four fifths of a record.
_TRANSACTION_SCHEMAS: KnownSchemas[None] = KnownSchemas()


def _transaction_payload(value: bytes) -> _TransactionPayload:
    """The record's payload: read alone behind a schema prefix seen before, else the record whole."""
    known = _TRANSACTION_SCHEMAS.payload(value)
    if known is not None:
        try:
            return _PLAIN_TRANSACTION.decode(known[0])
        except msgspec.ValidationError:  # not one JSON value: decoded whole, for the verdict
            pass
    try:
        wrapped = _TRANSACTION.decode(value)
    except msgspec.ValidationError:  # no schema wrapper: the payload itself
        return _PLAIN_TRANSACTION.decode(value)
    _TRANSACTION_SCHEMAS.learn(value, bytes(wrapped.schema), None)
    return wrapped.payload


def transaction_record(value: bytes) -> tuple[str, str, dict[str, int]] | None:
    """(status, transaction id as Debezium wrote it, events per ``schema.table``) of a
    well-formed BEGIN or END, or None when ``transactions``' ``json`` reading must decide (and
    give its verdict in its words): anything mistyped, a count below 0, an id that is no string.
    A record with schemas is mostly its schema, skipped here as raw bytes."""
    try:
        payload = _transaction_payload(value)
    except (msgspec.MsgspecError, UnicodeError, RecursionError, ValueError):
        return None
    if payload.status != "END":
        return (payload.status, payload.id, {}) if payload.status == "BEGIN" else None
    counts = _event_counts(payload.data_collections)
    return None if counts is None else (payload.status, payload.id, counts)


def _event_counts(entries: list[_Collection] | None) -> dict[str, int] | None:
    """An END's events per ``schema.table``; None for a count below 0 (the reference decides)."""
    counts: dict[str, int] = {}
    for entry in entries or ():
        if entry.event_count < 0:
            return None
        counts[entry.data_collection] = counts.get(entry.data_collection, 0) + entry.event_count
    return counts


class _TransactionHead(msgspec.Struct):
    """A BEGIN's or an END's status and id, its ``data_collections`` kept as their JSON text:
    a stream's ENDs repeat a few such texts, each read once (:func:`event_counts_of_text`)."""

    status: str
    id: str
    data_collections: msgspec.Raw = msgspec.Raw(b"null")


_TRANSACTION_HEAD = msgspec.json.Decoder(_TransactionHead)
_COLLECTIONS = msgspec.json.Decoder(list[_Collection] | None)


def transaction_head(value: bytes) -> tuple[str, str, bytes] | None:
    """(status, transaction id as Debezium wrote it, ``data_collections``' JSON text) of a BEGIN
    or END behind a schema prefix :func:`transaction_record` has seen; None for any other record,
    which :func:`transaction_record` then reads. Half the cost of that reading for an END: its
    counts are neither read nor built again (a whole mirror's stagers count one END every few
    changes)."""
    known = _TRANSACTION_SCHEMAS.payload(value)
    if known is None:
        return None
    try:
        head = _TRANSACTION_HEAD.decode(known[0])
    except (msgspec.MsgspecError, UnicodeError, RecursionError, ValueError):
        return None
    return head.status, head.id, bytes(head.data_collections)


def event_counts_of_text(text: bytes) -> dict[str, int] | None:
    """An END's events per ``schema.table`` from its ``data_collections`` text (as
    :func:`transaction_head` gives it), as :func:`transaction_record` reads them; None where that
    reading returns None."""
    try:
        return _event_counts(_COLLECTIONS.decode(text))
    except (msgspec.MsgspecError, UnicodeError, RecursionError, ValueError):
        return None
