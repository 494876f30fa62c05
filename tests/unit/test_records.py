"""Per-record parsing, validation and COPY encoding (pure logic)."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.records.parsing import RecordError, parse_record, staging_columns, staging_lines
from spark_apps.eos_stream.records.spec import Field, PipelineSpec, RowTarget, SpecError
from spark_apps.ledger.spec import LEDGER

GOOD = {"event_id": "e1", "account_id": "acct-1", "amount_cents": -250, "ts": "2026-01-01T00:00:00+00:00", "seq": 3}


def encode(value: object) -> bytes:
    return json.dumps(value).encode()


def test_valid_record_parses_to_typed_fields() -> None:
    assert parse_record(LEDGER, encode(GOOD)) == GOOD


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{not json", "malformed JSON"),
        (b"\xff\xfe", "malformed JSON"),
        (encode([1, 2]), "must be a JSON object"),
        (encode({k: v for k, v in GOOD.items() if k != "amount_cents"}), "missing required field 'amount_cents'"),
        (encode({**GOOD, "amount_cents": "12"}), "must be an integer"),
        (encode({**GOOD, "amount_cents": True}), "must be an integer"),
        (encode({**GOOD, "ts": 1700000000}), "must be an ISO-8601 timestamp string"),
        (encode({**GOOD, "account_id": 7}), "must be a string"),
        (None, "tombstone"),
        (b'{"event_id": "\\ud800"}', "not valid Unicode"),  # a lone surrogate: no UTF-8 COPY line can hold it
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": {"b": ' * 20_000 + b"1" + b"}" * 40_000, "nested too deeply"),
        # ValueError from int(): past Python's 4300-digit limit for integer strings
        (b'{"amount_cents": ' + b"9" * 5000 + b"}", "malformed JSON: ValueError"),
        (b"\x00\x00\x00{", "malformed JSON"),  # UTF-32 detected, then undecodable: a UnicodeError
    ],
)
def test_bad_records_raise_a_readable_reason(value: bytes | None, reason: str) -> None:
    with pytest.raises(RecordError, match=reason):
        parse_record(LEDGER, value)


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (b'"\\u0000"', "contains a NUL character"),  # the one way a NUL gets into a JSON string
        (b'"a\\u0000b"', "contains a NUL character"),
        (b'"\\ud800"', "not valid Unicode"),  # a lone surrogate by escape
        (b'"\\uDFFF x"', "not valid Unicode"),
        (b'"\xed\xa0\x80"', "not valid Unicode"),  # ... and by bytes (decoded with surrogatepass)
        (b'"\xed\xbf\xbf"', "not valid Unicode"),
        (b'"\x00"', "malformed JSON"),  # a raw control character: the scanner refuses it first
        (b'"\xed\x9e\xa3"', None),  # U+D7A3 (a Hangul syllable) starts with the byte ED and is fine
        (b'"\\u00e9\\\\u"', None),  # escapes that are neither
        (b'"\\\\u0000"', None),  # an escaped backslash, then "u0000": text, not a NUL
    ],
)
def test_text_that_no_copy_line_can_carry_is_refused_on_every_path(text: bytes, refused: str | None) -> None:
    """Each way a NUL or a lone surrogate gets into a string is refused, and what only looks
    like one (an escaped backslash, a character whose UTF-8 starts with the byte ED) passes."""
    value = b'{"event_id": ' + text + b', "account_id": "a", "amount_cents": 1, "ts": "t", "seq": 1}'
    if refused is None:
        assert parse_record(LEDGER, value)["event_id"] == json.loads(value)["event_id"]
    else:
        with pytest.raises(RecordError, match=refused):
            parse_record(LEDGER, value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("amount_cents", 2**63),  # past bigint: PostgreSQL says 22003
        ("amount_cents", -(10**30)),
        ("ts", "2026-01-01T00:00:00+16:00"),  # an offset PostgreSQL refuses (22009), Python takes
        ("ts", "yesterday"),  # PostgreSQL's own keyword: resolved by the database, not here
        ("ts", "2023-02-30"),  # no such date: 22008 from the database
        ("account_id", "x" * 10_000),  # too long for varchar(64): 22001 from the database
    ],
)
def test_a_values_domain_is_left_to_the_database(field: str, value: object) -> None:
    """The parser checks the JSON shape; whether a value fits its column is
    PostgreSQL's verdict (tests/integration/test_nasty_records.py), so here it passes."""
    assert parse_record(LEDGER, encode({**GOOD, field: value}))[field] == value


def test_any_exception_on_a_records_bytes_is_that_records_error() -> None:
    """A number no double holds raises OverflowError in float(): the record's fault."""
    spec = PipelineSpec("t", (Field("x", "double precision"),), (RowTarget("t", ("x",)),))
    with pytest.raises(RecordError, match="OverflowError"):
        parse_record(spec, b'{"x": ' + b"9" * 400 + b"}")


def test_transform_failure_is_a_record_error() -> None:
    def reject_negative(record: dict) -> dict:
        if record["n"] < 0:
            raise ValueError("negative")
        return record

    spec = PipelineSpec("t", (Field("n", "bigint"),), (RowTarget("t", ("n",)),), transform=reject_negative)
    assert parse_record(spec, encode({"n": 1})) == {"n": 1}
    with pytest.raises(RecordError, match="transform failed: ValueError: negative"):
        parse_record(spec, encode({"n": -1}))


def test_copy_lines_escape_text_and_mark_errors() -> None:
    tricky = {**GOOD, "event_id": "tab\there\\back\nline"}
    records = [("t", 0, 5, b"k", encode(tricky)), ("t", 1, 9, b"k2", b"{oops")]
    good, bad = list(staging_lines(LEDGER, records, keep_raw=False))
    cells = good.rstrip("\n").split("\t")
    assert len(cells) == len(staging_columns(LEDGER))
    assert cells[:6] == ["t", "0", "5", "\\N", "\\N", "\\N"]  # no raw bytes kept for good records
    assert cells[6] == "tab\\there\\\\back\\nline"
    bad_cells = bad.rstrip("\n").split("\t")
    assert bad_cells[3] == "\\\\x" + b"k2".hex() and bad_cells[4] == "\\\\x" + b"{oops".hex()
    assert bad_cells[5].startswith("malformed JSON") and bad_cells[6:] == ["\\N"] * 5


def test_keep_raw_keeps_bytes_of_good_records() -> None:
    (line,) = staging_lines(LEDGER, [("t", 0, 1, None, encode(GOOD))], keep_raw=True)
    cells = line.split("\t")
    assert cells[3] == "\\N" and cells[4] == "\\\\x" + encode(GOOD).hex()


def test_spec_rejects_unknown_fields_and_types() -> None:
    with pytest.raises(SpecError, match="unknown fields"):
        PipelineSpec("t", (Field("a", "text"),), (RowTarget("t", ("b",)),))
    with pytest.raises(SpecError, match="is not one of"):
        Field("a", "money")


def test_json_bytes_are_read_as_json_loads_reads_them() -> None:
    """parse_record skips json.loads' encoding detection only where it would say UTF-8."""
    text = '{"event_id": "\u00e9", "account_id": "a", "amount_cents": 1, "ts": "2026-01-01T00:00:00", "seq": 1}'
    for value in (text.encode(), text.encode("utf-16-le"), text.encode("utf-16"), text.encode("utf-32"),
                  text.encode("utf-8-sig"), b"{", b"{\x00", b'{"event_id": "\xed\xa0\x80"}'):
        try:
            expected: object = json.loads(value)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            expected = f"malformed JSON: {exc}"
        try:
            got: object = parse_record(PipelineSpec("any", fields=(Field("event_id", "text", required=False),),
                                                    targets=(RowTarget("x", columns=("event_id",)),)), value)
        except RecordError as exc:
            got = str(exc)
        if isinstance(expected, dict):
            assert got == {"event_id": expected["event_id"]} or "not valid Unicode" in str(got), value
        else:
            assert got == expected, value


@pytest.mark.parametrize("text", [
    '{"a": 1}', '{"a": 1.50, "b": [1e400, -0.0, "x"]}', '{"a": NaN, "b": Infinity}', '{}', '{"a": {"b": null}}',
    '{"a": 1} \t\r\n', '{"a": 1}  x', '{"a": 1}{"b": 2}', '{"a": 1} ]', '{', '{"a"', '{"a": }', '{"a": 1,}',
    '{"a": "\\ud800"}', '{"a": "unterminated}', "{'a': 1}", '{"a": 01}', '{"a": 1}\u00a0', '{"a": 1}\x00',
])
def test_the_json_decode_is_json_loads(text: str) -> None:
    """records._decode_json calls json's scanner directly: for every text (an object's first
    byte, as parse_record hands it over) the same value, or the same error and position."""
    from decimal import Decimal

    from spark_apps.eos_stream.records.parsing import _decode_json

    def outcome(decode):  # type: ignore[no-untyped-def]
        try:
            return "value", repr(decode(text))
        except json.JSONDecodeError as exc:
            return "error", str(exc), exc.pos

    assert outcome(_decode_json) == outcome(lambda t: json.loads(t, parse_float=Decimal))


def _generic_line(spec: PipelineSpec, record: tuple, keep_raw: bool) -> str:
    """Every cell through the generic encoder: what the specialised encoders must equal."""
    from spark_apps.eos_stream.records.parsing import NULL, _encode

    topic, partition, offset, key, value = record
    try:
        parsed = parse_record(spec, value)
    except RecordError as exc:
        cells = [_encode(topic), str(partition), str(offset), _encode(key), _encode(value), _encode(str(exc))]
        cells += [NULL] * len(spec.fields)
    else:
        raw = (key, value) if keep_raw else (None, None)
        cells = [_encode(topic), str(partition), str(offset), _encode(raw[0]), _encode(raw[1]), NULL]
        cells += [_encode(parsed[f.name]) for f in spec.fields]
    return "\t".join(cells) + "\n"


def test_specialised_encoders_equal_the_generic_one() -> None:
    spec = PipelineSpec("every-type", fields=(
        Field("t", "text"), Field("b", "bigint"), Field("d", "double precision"), Field("f", "boolean"),
        Field("ts", "timestamptz"), Field("o", "text", required=False), Field("g", "boolean", required=False)),
        targets=(RowTarget("x", columns=("t",)),))
    texts = ["plain", "tab\there", "new\nline", "cr\rx", "back\\slash", "all\\\t\n\r", "", "caf\u00e9 \U0001f600"]
    records = []
    for index, text in enumerate(texts):
        for flag in (True, False, None):
            value = {"t": text, "b": -index, "d": index / 3, "f": bool(index % 2), "ts": "2026-01-01 10:00:00",
                     "o": None if index % 3 else text, "g": flag}
            records.append(("topic.a", index % 2, len(records), b"k\t" if index % 2 else None, encode(value)))
    records.append(("topic.a", 0, len(records), None, b'{"t": 5}'))  # a dead letter
    for keep_raw in (False, True):
        lines = list(staging_lines(spec, records, keep_raw))
        assert lines == [_generic_line(spec, r, keep_raw) for r in records]


def test_a_numeric_field_keeps_the_digits_as_written() -> None:
    """numeric sums are exact in PostgreSQL and in the audit: nothing may round a value on the way."""
    from decimal import Decimal

    spec = PipelineSpec("t", (Field("x", "numeric"), Field("d", "double precision")), (RowTarget("t", ("x", "d")),))
    parsed = parse_record(spec, b'{"x": 0.1000000000000000055511151231257827, "d": 0.1}')
    assert parsed == {"x": Decimal("0.1000000000000000055511151231257827"), "d": 0.1}
    line = next(staging_lines(spec, [("t", 0, 0, None, b'{"x": 1e-30, "d": 2}')], keep_raw=False))
    assert line.split("\t")[-2:] == ["1E-30", "2.0\n"]
