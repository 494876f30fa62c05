"""``fast_envelope`` reads what ``json`` reads, and leaves every other record to it: over good
and bad records, with and without schemas, ``parse_envelope`` (fast path first) gives the
same change or the same refusal as the reference reading alone."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.cdc import envelope, fast_envelope, mirror
from spark_apps.eos_stream.cdc.envelope import EnvelopeError, parse_envelope
from tests.unit.cdc_samples import FULL_ROW, key, key_with_schema, source, value, with_schema

GOOD_ROWS = [
    FULL_ROW,
    {**FULL_ROW, "notes": None, "name": "Zoë \u2028 \t tab\nline \\ back \"q\""},
    {**FULL_ROW, "id": 2**70, "name": "big id"},  # past 64 bits: an int in both readings
]
VALUES = [
    value("c", None, FULL_ROW), value("u", None, GOOD_ROWS[1]), value("d", FULL_ROW, None),
    value("r", None, GOOD_ROWS[2], snapshot="true"),
    value("c", None, FULL_ROW, lsn=True, tx_id=2**70),  # no int lsn, a txId past 64 bits
]


def _outcome(key_bytes: bytes | None, value_bytes: bytes, read: object) -> object:
    try:
        return read(key_bytes, value_bytes)  # type: ignore[operator]
    except EnvelopeError as exc:
        return ("refused", str(exc))


def _same_as_reference(key_bytes: bytes | None, value_bytes: bytes) -> object:
    fast = _outcome(key_bytes, value_bytes, parse_envelope)
    assert fast == _outcome(key_bytes, value_bytes, envelope._parse_with_json)
    return fast


@pytest.mark.parametrize("schemas", [False, True])
@pytest.mark.parametrize("index", range(len(VALUES)))
def test_good_records_take_the_fast_path_and_read_as_json_reads_them(schemas: bool, index: int) -> None:
    k, v = key(id=7), VALUES[index]
    if schemas:
        k, v = key_with_schema(k), with_schema(v)
    assert fast_envelope.read(k, v) is not None
    change = _same_as_reference(k, v)
    assert not isinstance(change, tuple)


def test_a_float_reads_as_its_decimal_and_a_schema_once_read_is_shared() -> None:
    row = ('{"before": null, "after": {"id": 1, "x": 1.10, "y": 1e400}, "source": ' + json.dumps(source())
           + ', "op": "c"}').encode()
    assert fast_envelope.read(key(id=1), row) is not None
    raw = _same_as_reference(key(id=1), row)
    assert [str(raw.after[c]) for c in ("x", "y")] == ["1.10", "1E+400"]  # type: ignore[attr-defined]
    first = parse_envelope(key_with_schema(key(id=7)), with_schema(VALUES[0]))
    again = parse_envelope(key_with_schema(key(id=8)), with_schema(VALUES[1]))
    assert first is not None and again is not None and first.row_schema is again.row_schema


def _wrapped(schema: str, payload: str) -> bytes:
    return ('{"schema":' + schema + ',"payload":' + payload + "}").encode()


PLAIN = VALUES[0].decode()
ODD_VALUES = [
    b"not json", b"[1]", b"null", b'"text"', b"\xef\xbb\xbf" + VALUES[0], VALUES[0] + b" x",
    b'{"op": "x", "source": {"table": "t"}}', b'{"op": "c", "after": {"id": 1}}',
    b'{"op": "c", "after": null, "source": {"table": "t"}}', b'{"op": "u", "after": [1], "source": {"table": "t"}}',
    b'{"op": "d", "before": 5, "source": {"table": "t"}}', b'{"op": "c", "after": {}, "source": "t"}',
    b'{"op": "c", "after": {}, "source": {"table": 5}}', b'{"op": "c", "after": {"a": NaN}, "source": {"table": "t"}}',
    b'{"op": "c", "after": {"a": "\\ud800"}, "source": {"table": "t"}}',  # a lone surrogate: json reads it
    b'{"op": "c", "after": {"a": "\xff"}, "source": {"table": "t"}}',
    b'{"op": "c", "after": {"a": ' + b"9" * 4301 + b'}, "source": {"table": "t"}}',
    b'{"op": "c", "op": "d", "before": {"id": 1}, "after": null, "source": {"table": "t"}}',
    b'{"op": "c", "after": {"a": 1, "a": 2}, "source": {"table": "t", "table": "u"}}',
    b"[" * 50_000 + b"]" * 50_000,
    _wrapped("null", PLAIN), _wrapped("5", PLAIN), _wrapped("{}", PLAIN), _wrapped('{"fields": 3}', PLAIN),
    _wrapped('{"a":}', PLAIN), _wrapped("{}", "[1]"), _wrapped("{}", '{"op": "c"}'),
    ('{"schema": {}, "payload": ' + PLAIN + ', "op": "c"}').encode(),  # three keys: no wrapper
    ('{"schema": {}, "payload": ' + PLAIN + ', "payload": ' + VALUES[1].decode() + "}").encode(),
]
ODD_KEYS = [None, b"", b"{}", b"[1]", b"not json", b'{"schema": {}, "payload": {}}',
            b'{"schema": 5, "payload": {"id": 1}}', b'{"schema": null, "payload": {"id": 1}}',
            b'{"schema": {}, "payload": {"id": 1}, "x": 1}', b'{"id": 1, "id": 2}']


@pytest.mark.parametrize("index", range(len(ODD_VALUES)))
def test_an_odd_value_gets_the_reference_verdict(index: int) -> None:
    _same_as_reference(key(id=1), ODD_VALUES[index])


@pytest.mark.parametrize("index", range(len(ODD_KEYS)))
def test_an_odd_key_gets_the_reference_verdict(index: int) -> None:
    _same_as_reference(ODD_KEYS[index], VALUES[0])


@pytest.mark.parametrize("row", [{"a": "x\ud800"}, {"a": "nul\x00"}, {"a": "Zoë\n\t\\\"", "b": None, "c": 5}])
def test_row_json_writes_what_json_dumps_writes(row: dict) -> None:
    try:
        text = mirror._row_json(row)
    except EnvelopeError as exc:
        assert "Unicode" in str(exc) or "NUL" in str(exc)
        return
    assert text == json.dumps({c: None if v is None else str(v) for c, v in row.items()}, ensure_ascii=False,
                              separators=(",", ":"))
