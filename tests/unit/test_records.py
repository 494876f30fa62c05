"""Per-record parsing, validation and COPY encoding (pure logic)."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.records import RecordError, parse_record, staging_columns, staging_lines
from spark_apps.eos_stream.spec import Field, PipelineSpec, RowTarget, SpecError
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
        (encode({**GOOD, "amount_cents": 2**63}), "out of range for bigint"),
        (encode({**GOOD, "ts": "yesterday"}), "field 'ts'"),
        (encode({**GOOD, "account_id": 7}), "must be a string"),
        (None, "tombstone"),
    ],
)
def test_bad_records_raise_a_readable_reason(value: bytes | None, reason: str) -> None:
    with pytest.raises(RecordError, match=reason):
        parse_record(LEDGER, value)


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
