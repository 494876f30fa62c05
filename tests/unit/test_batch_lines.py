"""Differential test of the Arrow fast path (``batch_lines``) against ``staging_lines``.

``records.parse_record`` is the one definition of a valid record: for every
value of a corpus of good and bad ones, alone in a batch and mixed with the
others, the fast path must write exactly the lines ``staging_lines`` writes.
It also checks that the fast path does the work: the good values' lines come
from Arrow, not from Python."""

from __future__ import annotations

import json
import random
from collections import Counter
from unittest import mock

import pyarrow as pa
import pytest

from spark_apps.eos_stream.records import batch_lines as fast
from spark_apps.eos_stream.records.parsing import staging_lines
from spark_apps.eos_stream.records.spec import Field, PipelineSpec, RowTarget
from spark_apps.ledger.spec import LEDGER

# Every type the fast path takes, optional fields included.
MIXED = PipelineSpec(
    name="mixed",
    fields=(Field("name", "text"), Field("n", "integer"), Field("flag", "boolean", required=False),
            Field("at", "timestamptz", required=False), Field("big", "bigint", required=False)),
    targets=(RowTarget("mixed", columns=("name", "n", "flag", "at", "big")),),
)
GOOD_LEDGER = {"event_id": "e1", "account_id": "acct-1", "amount_cents": -250, "ts": "2026-01-01T00:00:00+00:00",
               "seq": 3}
GOOD_MIXED = {"name": "x", "n": 1, "flag": True, "at": "2026-01-01", "big": 2**62}


def _variants(good: dict) -> list[bytes | None]:
    """Good values, every field given each wrong JSON type, missing or null, and raw-byte oddities."""
    out: list[bytes | None] = [json.dumps(good).encode(), json.dumps(good, separators=(",", ":")).encode()]
    wrong = ["12", 12, -0, 1.0, 1e2, 1.5, 2**63, -(2**64), 10**30, True, False, None, [], {}, [1], {"a": 1}, "",
             "a\\b", "tab\there", "new\nline", "cr\rx", "quote\"x", "slash/x", "\u00e9\u4e2d\U0001f600", "\x7f",
             "\u2028", "\x00", "\ud800", "\\N", "\\.", "t", "f"]
    for name in good:
        out.append(json.dumps({k: v for k, v in good.items() if k != name}).encode())
        for value in wrong:
            try:
                out.append(json.dumps({**good, name: value}, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            except UnicodeEncodeError:
                pass
            out.append(json.dumps({**good, name: value}).encode())  # \u escapes for non-ASCII
    body = json.dumps(good)[1:-1]
    first = next(iter(good))
    out += [
        None, b"", b" ", b"null", b"1", b'"s"', b"[]", b"[" + json.dumps(good).encode() + b"]", b"{}",
        ("{" + body + ', "' + first + '": ' + json.dumps(good[first]) + "}").encode(),  # a key given twice
        ("{" + body + ', "\\u00' + format(ord(first[0]), "x") + first[1:] + '": 1}').encode(),  # twice, escaped
        ("{" + body + "} ").encode(), ("{" + body + "}\n").encode(), ("{" + body + "} x").encode(),
        ("{" + body + "}{" + body + "}").encode(), (" \t{" + body + "}").encode(),
        ("{" + body + ', "extra": {"deep": [1, {"x": null}]}}').encode(),
        ("{" + body + ', "nan": NaN}').encode(), ("{" + body.replace(": ", ":\n") + "}").encode(),
        b"\xef\xbb\xbf" + json.dumps(good).encode(),  # a UTF-8 BOM
        json.dumps(good).encode("utf-16"), b"\xff\xfe",
        ("{" + body + ', "bad": "\xff"}').encode("latin-1"),  # invalid UTF-8 in a field nobody reads
        json.dumps({**good, first: "x"}).encode().replace(b'"x"', b'"\xed\xa0\x80"'),  # a surrogate, raw
        json.dumps({**good, first: "x"}).encode().replace(b'"x"', b'"\xc3\x28"'),
        b'{"a": ' * 2000 + b"1" + b"}" * 2000,
        ("{" + body + ', "big": ' + "9" * 5000 + "}").encode(),
    ]
    return out


def _batch(values: list[bytes | None], first_offset: int = 0) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_pydict({
        "topic": pa.array(["orders.v1"] * n), "partition": pa.array([3] * n, pa.int32()),
        "offset": pa.array(range(first_offset, first_offset + n), pa.int64()),
        "key": pa.array([b"k%d" % i if i % 3 else None for i in range(n)], pa.binary()),
        "value": pa.array(values, pa.binary()),
    })


def _python_lines(spec: PipelineSpec, batch: pa.RecordBatch) -> Counter:
    return Counter("".join(staging_lines(spec, fast.arrow_records(batch), keep_raw=False)).splitlines(keepends=True))


def _fast_lines(spec: PipelineSpec, batch: pa.RecordBatch) -> Counter:
    data = b"".join(bytes(chunk) for chunk in fast.batch_lines(batch, spec))
    return Counter(data.decode("utf-8").splitlines(keepends=True))


@pytest.mark.parametrize("spec, good", [(LEDGER, GOOD_LEDGER), (MIXED, GOOD_MIXED)], ids=["ledger", "mixed"])
def test_every_value_alone_gets_pythons_line(spec: PipelineSpec, good: dict) -> None:
    for offset, value in enumerate(_variants(good)):
        batch = _batch([value], offset)
        assert _fast_lines(spec, batch) == _python_lines(spec, batch), value


@pytest.mark.parametrize("spec, good", [(LEDGER, GOOD_LEDGER), (MIXED, GOOD_MIXED)], ids=["ledger", "mixed"])
def test_mixed_batches_get_pythons_lines(spec: PipelineSpec, good: dict) -> None:
    values = _variants(good)
    rng = random.Random(25)
    for _ in range(30):
        batch = _batch(rng.sample(values, k=rng.randint(1, len(values))))
        assert _fast_lines(spec, batch) == _python_lines(spec, batch)


def test_good_records_are_encoded_by_arrow_not_by_python() -> None:
    values = [json.dumps({**GOOD_LEDGER, "seq": i, "event_id": f"e\\{i}\t"}).encode() for i in range(500)]
    values[7] = b"{not json"  # what Arrow refuses alone, not a whole batch
    batch = _batch(values)
    with mock.patch.object(fast, "staging_lines", wraps=staging_lines) as python:
        lines = _fast_lines(LEDGER, batch)
    assert lines == _python_lines(LEDGER, batch)
    # One refused record sends the batch to Python; without it, Python sees nothing.
    assert python.call_count == 1
    good = _batch(values[:7] + values[8:])
    with mock.patch.object(fast, "staging_lines", wraps=staging_lines) as python:
        assert _fast_lines(LEDGER, good) == _python_lines(LEDGER, good)
    assert python.call_count == 0


def test_only_specs_arrow_can_write_exactly_take_the_fast_path() -> None:
    assert fast.supported(LEDGER) and fast.supported(MIXED)
    for pg_type in ("numeric", "double precision"):
        spec = PipelineSpec(name="s", fields=(Field("x", pg_type),), targets=(RowTarget("t", columns=("x",)),))
        assert not fast.supported(spec)
    transformed = PipelineSpec(name="s", fields=LEDGER.fields, targets=LEDGER.targets, transform=lambda r: r)
    assert not fast.supported(transformed)


@pytest.mark.parametrize("spec, good", [(LEDGER, GOOD_LEDGER), (MIXED, GOOD_MIXED)], ids=["ledger", "mixed"])
def test_mutated_values_get_pythons_lines(spec: PipelineSpec, good: dict) -> None:
    """Random byte edits of a good value (36,000 of them passed when this was written; 600 here)."""
    rng, base = random.Random(7), json.dumps(good).encode()
    alphabet = b'{}[]":,\\ 0123456789.eE+-tfnulrsa\x00\x7f\xc3\xa9\xed\xa0\x80\xff/'
    values = []
    for _ in range(600):
        value = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            at, byte = rng.randrange(len(value)), alphabet[rng.randrange(len(alphabet))]
            value[at:at + rng.randint(0, 1)] = bytes([byte]) * rng.randint(0, 1)  # replace, insert or delete
        values.append(bytes(value))
    for offset, value in enumerate(values):
        batch = _batch([value], offset)
        assert _fast_lines(spec, batch) == _python_lines(spec, batch), value
    batch = _batch(values)
    assert _fast_lines(spec, batch) == _python_lines(spec, batch)
