"""Decoding Debezium change records into typed changes (spark_apps/eos_stream/cdc/envelope.py, values.py)."""

from __future__ import annotations

import datetime
import json
from decimal import Decimal

import pytest

from spark_apps.eos_stream.cdc import values
from spark_apps.eos_stream.cdc.envelope import EnvelopeError, decode_change, decoder, parse_envelope
from tests.unit.cdc_samples import FULL_ROW, PLACEHOLDER, ROW_TYPES, key, key_with_schema, value, with_schema

EXPECTED = {"id": 7, "name": "Ada", "balance": Decimal("12345678901234.123456"),
            "updated_at": "2026-11-27T09:30:00.123456Z", "born": datetime.date(2022, 1, 8),
            "wakes": "07:00:00.000000", "prefs": '{"theme": "dark", "n": [1, 2]}',
            "tags": ["a", "b,c", 'd"e', None], "photo": b"\xde\xad\xbe\xef", "notes": "long text"}


def decode(k: bytes | None, v: bytes | None):
    return decoder(lambda table: ROW_TYPES if table == "public.customers" else None)(k, v)


@pytest.mark.parametrize("schemas", [False, True])
def test_insert_decodes_every_type_with_and_without_schemas(schemas: bool) -> None:
    k, v = key(id=7), value("c", None, FULL_ROW)
    if schemas:
        k, v = key_with_schema(k), with_schema(v)
    change = decode(k, v)
    assert change is not None
    assert (change.table, change.op, change.key, change.before) == ("public.customers", "c", {"id": 7}, None)
    assert change.after == EXPECTED
    assert (change.lsn, change.tx_id, change.unchanged) == (24023128, 555, frozenset())
    assert (change.row_schema is not None) == schemas


def test_tombstone_is_no_change() -> None:
    assert decode(key(id=7), None) is None


def test_update_marks_the_toast_placeholder_unchanged_and_never_returns_it() -> None:
    photo = "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=="  # the placeholder's bytes, base64
    after = {**FULL_ROW, "notes": PLACEHOLDER, "tags": [PLACEHOLDER], "photo": photo}
    change = decode(key(id=7), value("u", None, after))
    assert change is not None and change.op == "u"
    assert change.unchanged == {"notes", "tags", "photo"}
    assert change.after is not None and not {"notes", "tags", "photo"} & set(change.after)
    assert PLACEHOLDER not in json.dumps(change.after, default=str)


def test_integer_array_placeholder_is_one_element_per_byte() -> None:
    change = decoder(lambda t: {"id": "bigint", "scores": "integer[]"})(
        key(id=1), value("u", None, {"id": 1, "scores": list(PLACEHOLDER.encode())}))
    assert change is not None and change.unchanged == {"scores"}


def test_placeholder_text_in_an_insert_is_data() -> None:
    change = decode(key(id=7), value("c", None, {**FULL_ROW, "notes": PLACEHOLDER}))
    assert change is not None and change.after is not None
    assert change.after["notes"] == PLACEHOLDER and change.unchanged == frozenset()


def test_delete_keeps_before_and_marks_its_unavailable_columns() -> None:
    change = decode(key(id=7), value("d", {**FULL_ROW, "notes": PLACEHOLDER}, None))
    assert change is not None and change.after is None and change.before is not None
    assert change.before["balance"] == Decimal("12345678901234.123456")
    assert change.before_unavailable == {"notes"}


def test_snapshot_read_and_nulls() -> None:
    nulls = {c: None for c in FULL_ROW} | {"id": 8}
    change = decode(key(id=8), value("r", None, nulls, snapshot="true"))
    assert change is not None and change.op == "r" and change.after == nulls


def test_precise_decimal_with_schema_is_exact() -> None:
    fields = [{"type": "int64", "optional": False, "field": "id"},
              {"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
               "parameters": {"scale": "6", "connect.decimal.precision": "20"}, "field": "balance"}]
    unscaled = -12345678901234123456
    encoded = __import__("base64").b64encode(unscaled.to_bytes(9, "big", signed=True)).decode()
    v = with_schema(value("c", None, {"id": 1, "balance": encoded}), fields)
    change = decoder(lambda t: {"id": "bigint", "balance": "numeric(20,6)"})(key(id=1), v)
    assert change is not None and change.after == {"id": 1, "balance": Decimal("-12345678901234.123456")}


def test_time_and_timestamp_follow_the_declared_precision_without_schema() -> None:
    assert values.decode_value("t", 86_400_000_000, "time") == "24:00:00.000000"
    assert values.decode_value("t", 1500, "time(3)") == "00:00:01.500000"
    assert values.decode_value("ts", 1_500_000, "timestamp") == "1970-01-01 00:00:01.500000"
    assert values.decode_value("ts", 1500, "timestamp(3)") == "1970-01-01 00:00:01.500000"


@pytest.mark.parametrize(("v", "why"), [
    (b"not json", "malformed value JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"op": "x", "source": {"table": "t"}}', "op 'x'"),
    (b'{"op": "c", "after": {"id": 1}}', "no source.table"),
    (b'{"op": "c", "after": null, "source": {"table": "t"}}', "must carry 'after'"),
    (b'{"op": "u", "after": [1], "source": {"table": "t"}}', "'after' must be a JSON object"),
])
def test_malformed_envelopes_are_refused_with_a_reason(v: bytes, why: str) -> None:
    with pytest.raises(EnvelopeError, match=why):
        parse_envelope(key(id=1), v)


def test_a_record_without_a_key_is_refused() -> None:
    with pytest.raises(EnvelopeError, match="primary key"):
        parse_envelope(None, value("c", None, FULL_ROW))


@pytest.mark.parametrize(("column", "raw", "why"), [
    ("balance", 1.5, "decimal.handling.mode=string"),
    ("balance", "12,5", "decimal string"),
    ("born", "2022-01-08", None),  # an ISO-ish string is PostgreSQL's to judge
    ("born", {"days": 1}, "days since"),
    ("photo", "not base64!", "base64"),
    ("id", "7", "an integer"),
    ("tags", "a,b", "JSON array"),
])
def test_wrong_encodings_name_the_column(column: str, raw: object, why: str | None) -> None:
    raw_change = parse_envelope(key(id=7), value("c", None, {**FULL_ROW, column: raw}))
    assert raw_change is not None
    if why is None:
        decode_change(raw_change, ROW_TYPES)
        return
    with pytest.raises(EnvelopeError, match=f"public.customers: column '{column}'.*{why}"):
        decode_change(raw_change, ROW_TYPES)


def test_unknown_source_table_is_refused() -> None:
    with pytest.raises(EnvelopeError, match=r"no mirror target for source table 'public\.orders'"):
        decode(key(id=1), value("c", None, {"id": 1}, table="orders"))


def test_pg_text_encodes_arrays_bytes_and_dates() -> None:
    assert values.pg_text(["a", "b,c", 'd"e', None, "x\\y"]) == '{"a","b,c","d\\"e",NULL,"x\\\\y"}'
    assert values.pg_text(b"\x00\xff") == "\\x00ff"
    assert values.pg_text(datetime.date(2022, 1, 8)) == "2022-01-08"
    assert values.pg_text([[1, 2], [3, None]]) == '{{"1","2"},{"3",NULL}}'
    assert values.pg_text(True) == "t" and values.pg_text(None) is None


def test_every_placeholder_form_debezium_writes_is_recognised() -> None:
    forms = values.Placeholders()
    assert forms.matches(PLACEHOLDER) and forms.matches("X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ==")
    assert forms.matches([PLACEHOLDER]) and forms.matches(list(PLACEHOLDER.encode()))
    assert forms.matches(["b68a35a7-17ad-35b3-af2a-ae46edb4545a"])  # uuid[]: the UUID Debezium documents
    assert not forms.matches([]) and not forms.matches("x") and not forms.matches(None)
    custom = values.Placeholders("~unavailable~")
    assert custom.matches("~unavailable~") and not custom.matches(PLACEHOLDER)
