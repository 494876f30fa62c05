"""Per-record parsing and validation, and the COPY text encoding of staging rows.

Runs on the executors, one record at a time, so a bad record costs one
dead-letter row and never the batch. Pure Python: unit-tested without Spark.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

from spark_apps.eos_stream.spec import Field, PipelineSpec

_INT_RANGES = {"bigint": (-(2**63), 2**63 - 1), "integer": (-(2**31), 2**31 - 1)}


class RecordError(ValueError):
    """Why one record cannot be applied; stored with it in the dead-letter table."""


def _check_value(spec_field: Field, value: Any) -> Any:
    kind = spec_field.pg_type
    if kind in _INT_RANGES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"field {spec_field.name!r} must be an integer, got {type(value).__name__}")
        low, high = _INT_RANGES[kind]
        if not low <= value <= high:
            raise RecordError(f"field {spec_field.name!r} = {value} is out of range for {kind}")
        return value
    if kind == "double precision":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"field {spec_field.name!r} must be a number, got {type(value).__name__}")
        return float(value)
    if kind == "boolean":
        if not isinstance(value, bool):
            raise RecordError(f"field {spec_field.name!r} must be true or false")
        return value
    if kind == "timestamptz":
        if not isinstance(value, str):
            raise RecordError(f"field {spec_field.name!r} must be an ISO-8601 timestamp string")
        try:
            datetime.fromisoformat(value)
        except ValueError as exc:
            raise RecordError(f"field {spec_field.name!r}: {exc}") from exc
        return value
    if not isinstance(value, str):
        raise RecordError(f"field {spec_field.name!r} must be a string, got {type(value).__name__}")
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL: COPY into the staging table would
        # fail the whole batch on the executors, where no SQLSTATE reaches the
        # poison guard, so the record could never be quarantined.
        raise RecordError(f"field {spec_field.name!r} contains a NUL character, which PostgreSQL text cannot store")
    return value


def parse_record(spec: PipelineSpec, value: bytes | None) -> dict[str, Any]:
    """Decodes one Kafka value into validated field values, or raises RecordError."""
    if value is None:
        raise RecordError("record has no value (tombstone)")
    try:
        payload = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"malformed JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise RecordError(f"record must be a JSON object, got {type(payload).__name__}")
    out: dict[str, Any] = {}
    for spec_field in spec.fields:
        raw = payload.get(spec_field.name)
        if raw is None:
            if spec_field.required:
                raise RecordError(f"missing required field {spec_field.name!r}")
            out[spec_field.name] = None
            continue
        out[spec_field.name] = _check_value(spec_field, raw)
    if spec.transform is not None:
        try:
            out = spec.transform(out)
        except Exception as exc:  # the user's code: any failure quarantines the record
            raise RecordError(f"transform failed: {type(exc).__name__}: {exc}") from exc
    return out


# --- COPY text format -------------------------------------------------------

_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
NULL = "\\N"


def _encode(value: Any) -> str:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\\\x" + bytes(value).hex()
    return str(value).translate(_ESCAPES)


def _encode_number(value: Any) -> str:
    return NULL if value is None else str(value)


def _encoder(pg_type: str):
    # Numbers never need escaping; only text-like values go through _encode.
    return _encode_number if pg_type in ("bigint", "integer", "double precision") else _encode


def staging_columns(spec: PipelineSpec) -> list[str]:
    """Column order of a staging table and of the COPY lines below."""
    return ["_topic", "_partition", "_offset", "_key", "_value", "_error", *(f.name for f in spec.fields)]


def staging_lines(
    spec: PipelineSpec,
    records: Iterable[tuple[str, int, int, bytes | None, bytes | None]],
    keep_raw: bool,
) -> Iterator[str]:
    """One COPY line per record: good records carry their fields, bad ones their
    error and raw bytes. ``keep_raw`` keeps key and value for good records too,
    so a record that later fails in the database can be quarantined whole."""
    nulls = [NULL] * len(spec.fields)
    encoders = [(f.name, _encoder(f.pg_type)) for f in spec.fields]
    for topic, partition, offset, key, value in records:
        try:
            parsed = parse_record(spec, value)
        except RecordError as exc:
            cells = [_encode(topic), str(partition), str(offset), _encode(key), _encode(value),
                     _encode(str(exc)), *nulls]
        else:
            raw_key, raw_value = (key, value) if keep_raw else (None, None)
            cells = [_encode(topic), str(partition), str(offset), _encode(raw_key), _encode(raw_value),
                     NULL, *[encode(parsed[name]) for name, encode in encoders]]
        yield "\t".join(cells) + "\n"
