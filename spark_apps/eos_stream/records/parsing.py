"""Per-record parsing and the COPY text encoding of staging rows.

Runs on the executors, one record at a time, so a bad record costs one
dead-letter row and never the batch. Pure Python: unit-tested without Spark.

The parser checks the record's *shape*, the contract a producer signs: a JSON
object whose fields have the JSON types the spec names (a string for text and
timestamps, an integer for integer columns, a number for numeric and double precision,
true or false for booleans). It does not judge a value's *domain*: whether an
integer fits its column, whether a string is a timestamp PostgreSQL accepts,
whether text fits a ``varchar(n)``. Those verdicts are PostgreSQL's: values
are staged as text and cast by the database in the apply statement, where a
refusal comes back with its SQLSTATE inside the batch transaction
(``sink/batch_sink.py``, transition 6), so the database decides what is poison.

The one exception is what a COPY text line cannot carry at all: a NUL
character and a lone surrogate (not encodable as UTF-8). No PostgreSQL
text value can hold either, so rejecting them here is the database's verdict
known in advance, not a guess.
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Iterable, Iterator
from decimal import Decimal
from typing import Any

from spark_apps.eos_stream.records.spec import Field, PipelineSpec

# Decimal keeps a JSON number's digits as they were written: a numeric field
# stages them exactly, and a double precision field rounds them once, in float().
# Its scanner (C) is called directly: JSONDecoder.decode wraps it in two regex matches
# per call, a sixth of a record's parse (docs/benchmarks.md, the audit's read).
# (typeshed types make_scanner's argument as a scanner; a JSONDecoder is what json itself passes.)
_scan_json = json.scanner.make_scanner(json.JSONDecoder(parse_float=Decimal))  # type: ignore[arg-type]
_JSON_WHITESPACE = " \t\n\r"
_INTEGER_TYPES = ("bigint", "integer")


class RecordError(ValueError):
    """Why one record cannot be applied; stored with it in the dead-letter table."""


def _check_text(spec_field: Field, value: str) -> str:
    if "\x00" in value:
        raise RecordError(f"field {spec_field.name!r} contains a NUL character, which PostgreSQL text cannot store")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        # JSON's \ud800 escape decodes to a lone surrogate, which no UTF-8 COPY line can carry.
        raise RecordError(f"field {spec_field.name!r} is not valid Unicode: {exc.reason}") from exc
    return value


def _check_value(spec_field: Field, value: Any) -> Any:
    """The value if its JSON type is the one the field's column takes; its domain is the database's to judge."""
    kind = spec_field.pg_type
    if kind in _INTEGER_TYPES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"field {spec_field.name!r} must be an integer, got {type(value).__name__}")
        return value
    if kind in ("double precision", "numeric"):
        if isinstance(value, bool) or not isinstance(value, (int, Decimal, float)):  # float: NaN, Infinity
            raise RecordError(f"field {spec_field.name!r} must be a number, got {type(value).__name__}")
        return float(value) if kind == "double precision" else value
    if kind == "boolean":
        if not isinstance(value, bool):
            raise RecordError(f"field {spec_field.name!r} must be true or false")
        return value
    if not isinstance(value, str):
        expected = "an ISO-8601 timestamp string" if kind == "timestamptz" else "a string"
        raise RecordError(f"field {spec_field.name!r} must be {expected}, got {type(value).__name__}")
    return _check_text(spec_field, value)


def _decode_json(text: str) -> Any:
    """``json.loads(text)`` with ``parse_float=Decimal`` for a text without leading whitespace:
    the same value, and the same JSONDecodeError (message and position) for a text it refuses."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration as err:
        raise json.JSONDecodeError("Expecting value", text, err.value) from None
    if end != len(text):
        rest = text[end:]
        extra = rest.lstrip(_JSON_WHITESPACE)
        if extra:
            raise json.JSONDecodeError("Extra data", text, end + len(rest) - len(extra))
    return value


def parse_record(spec: PipelineSpec, value: bytes | None) -> dict[str, Any]:
    """Decodes one Kafka value into checked field values, or raises RecordError.

    Any exception raised on the record's bytes is that record's fault (an
    integer of 5,000 digits, nesting past the recursion limit, a float that
    overflows): it becomes a RecordError, so no record can fail its batch here."""
    if value is None:
        raise RecordError("record has no value (tombstone)")
    try:
        return _parse(spec, value)
    except RecordError:
        raise
    except RecursionError as exc:
        raise RecordError("malformed JSON: nested too deeply") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"malformed JSON: {exc}") from exc
    except (UnicodeError, ValueError) as exc:  # e.g. an integer past Python's 4300-digit conversion limit
        raise RecordError(f"malformed JSON: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # whatever the bytes provoke is the record's fault, never the batch's
        raise RecordError(f"unreadable record: {type(exc).__name__}: {exc}") from exc


def _parse(spec: PipelineSpec, value: bytes) -> dict[str, Any]:
    if value[:1] == b"{" and value[1:2] != b"\x00":
        # Exactly json.loads for bytes its detect_encoding calls UTF-8 (an
        # object's first byte, no BOM, no UTF-16/32 zero byte), without the detection.
        payload = _decode_json(value.decode("utf-8", "surrogatepass"))
    else:
        payload = json.loads(value, parse_float=Decimal)
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

NULL = "\\N"


def _encode(value: Any) -> str:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\\\x" + bytes(value).hex()
    return escape_copy(str(value))


def escape_copy(value: str) -> str:
    """A text as a COPY text cell: backslash first, so the escapes added after stay single.
    ``str.replace`` finds nothing in most values and returns them as they are, many times
    faster than ``str.translate`` with a mapping (which builds a new string char by char)."""
    return value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _encode_number(value: Any) -> str:
    return NULL if value is None else str(value)


def _encode_str(value: str | None) -> str:
    """``_encode`` for a str."""
    if value is None:
        return NULL
    return escape_copy(value)


def _encode_bool(value: bool | None) -> str:
    return NULL if value is None else ("t" if value else "f")


def _encoder(pg_type: str, checked: bool):
    """The field's COPY encoder. ``checked``: values are exactly what
    ``parse_record``'s checks return (no transform changed them), so text
    and timestamps are str and booleans bool, and need no type dispatch."""
    if pg_type in ("bigint", "integer", "numeric", "double precision"):
        return _encode_number  # numbers never need escaping
    if checked:
        return _encode_bool if pg_type == "boolean" else _encode_str
    return _encode


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
    encoders = [(f.name, _encoder(f.pg_type, checked=spec.transform is None)) for f in spec.fields]
    topics: dict[str, str] = {}  # a task reads one or a few topics: encode each name once
    for topic, partition, offset, key, value in records:
        encoded_topic = topics.get(topic)
        if encoded_topic is None:
            encoded_topic = topics[topic] = _encode(topic)
        try:
            parsed = parse_record(spec, value)
        except RecordError as exc:
            cells = [encoded_topic, str(partition), str(offset), _encode(key), _encode(value),
                     _encode(str(exc)), *nulls]
        else:
            raw_key, raw_value = (_encode(key), _encode(value)) if keep_raw else (NULL, NULL)
            cells = [encoded_topic, str(partition), str(offset), raw_key, raw_value,
                     NULL, *[encode(parsed[name]) for name, encode in encoders]]
        yield "\t".join(cells) + "\n"
