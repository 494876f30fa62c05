"""Differential test of the JVM record path (``sql_records``) against ``parse_record``.

A generated corpus of good and bad values goes through Spark's column and then
through the partition writer's own ``copy_chunks`` (the JVM's lines, plus
Python for what the JVM left). Every record must come out as the very line
``records.staging_lines`` writes for it: so the JVM never accepts a record
Python rejects, never changes an accepted value, and never rejects one (a
rejection is always Python's). The corpus's plain good records must also be
vouched for by the JVM, or the fast path would be silently dead.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from spark_apps.eos_stream.records import NULL, RecordError, parse_record, staging_lines
from spark_apps.eos_stream.sink.staging import copy_chunks
from spark_apps.eos_stream.spec import Field, PipelineSpec, RowTarget
from spark_apps.eos_stream.sql_records import supported, with_staging_line
from spark_apps.ledger.spec import LEDGER

SPEC = PipelineSpec(
    name="every-type",
    fields=(Field("t", "text"), Field("b", "bigint"), Field("i", "integer"), Field("d", "double precision"),
            Field("f", "boolean"), Field("ts", "timestamptz"), Field("o", "text", required=False)),
    targets=(RowTarget("x", columns=("t",)),),
)

# Raw JSON fragments per field; the first of each is plainly good.
CANDIDATES: dict[str, list[str]] = {
    "t": ['"abc"', '"a\\tb"', '"back\\\\slash"', '"new\\nline"', '"cr\\r"', '"\\u0000"', '"\\ud800"',
          '"\\ud83d\\ude00"', '"caf\u00e9"', '"\\u00e9"', '"}{[]"', '"\\""', '""', '123', '1.5', 'true', 'null',
          '[]', '{}', '{"x": 1}', '"12"'],
    "b": ['42', '-0', '0', '-5', '9223372036854775807', '-9223372036854775808', '9223372036854775808',
          '-9223372036854775809', '12345678901234567890123456789', '1.0', '1e2', '"12"', 'true', 'null', '[1]'],
    "i": ['7', '2147483647', '-2147483648', '2147483648', '-2147483649', '1.5', '"7"', 'false', 'null'],
    "d": ['1.5', '1', '0.1', '-0.0', '1e308', '1e309', '-1e-320', '123456789012345678', '9007199254740993',
          '1.23456789012345678901', '3.141592653589793', '2.5e-3', '"1.5"', 'true', 'NaN', 'Infinity', 'null'],
    "f": ['true', 'false', '1', '"true"', 'null', 'True'],
    "ts": ['"2024-01-01T10:00:00"', '"2024-01-01 10:00:00.123456+02:00"', '"2024-01-01T10:00:00Z"',
           '"2024-02-29T00:00"', '"2024-01-01T10:00:00.5-05:30"', '"2023-02-29T00:00"', '"2024-13-01T00:00"',
           '"2024-01-01"', '"0000-01-01T00:00"', '"2024-01-01T24:00"', '"2024-01-01T10:00:60"',
           '"2024-01-01T10:00:00.1234567"', '"2024-01-01T10:00:00+24:00"', '"2024-01-01T10:00:00z"',
           '"2024-01-01T10:00:00+05"', '"20240101T100000"', '"not a time"', '"2024-01-01T10:00:00\\u0000"',
           '"2024-04-31T00:00"', '"1900-02-29T00:00"', '"2000-02-29T00:00"', '"2024-00-10T00:00"',
           '"2024-01-00T00:00"', '123', 'null'],
    "o": [None, 'null', '"x"', '5', '"tab\\there"'],
}
# Values the JVM must vouch for (the fast path would be silently dead otherwise).
FAST = {
    "t": {'"abc"', '"a\\tb"', '"back\\\\slash"', '"new\\nline"', '"cr\\r"', '"\\ud83d\\ude00"', '"caf\u00e9"',
          '"}{[]"', '"\\""', '""'},
    "b": {'42', '-0', '0', '-5', '9223372036854775807', '-9223372036854775808'},
    "i": {'7', '2147483647', '-2147483648'},
    "d": {'1.5', '1', '0.1', '-0.0', '1e308', '2.5e-3'},
    "f": {'true', 'false'},
    "ts": {'"2024-01-01T10:00:00"', '"2024-01-01 10:00:00.123456+02:00"', '"2024-01-01T10:00:00Z"',
           '"2024-02-29T00:00"', '"2024-01-01T10:00:00.5-05:30"', '"2000-02-29T00:00"'},
    "o": {None, 'null', '"x"', '"tab\\there"'},
}
# The ledger's fields take the same kinds of values.
LEDGER_CANDIDATES = {"event_id": CANDIDATES["t"], "account_id": CANDIDATES["t"], "amount_cents": CANDIDATES["b"],
                     "ts": CANDIDATES["ts"], "seq": CANDIDATES["b"]}


def _object(values: dict[str, str | None], spaced: bool = False) -> bytes:
    separator, colon = (", ", ": ") if spaced else (",", ":")
    return ("{" + separator.join(f'"{k}"{colon}{v}' for k, v in values.items() if v is not None) + "}").encode()


def _corpus(spec: PipelineSpec, candidates: dict[str, list[str]],
            seed: int) -> Iterator[tuple[bytes | None, bytes | None, bool]]:
    """(key, value, expected to take the JVM path)."""
    plain_values = {name: values[0] for name, values in candidates.items()}
    valid = {name: [v for v in values if _accepts(spec, _object({**plain_values, name: v}))]
             for name, values in candidates.items()}
    yield None, _object(plain_values), True
    yield b"k", _object(plain_values, spaced=True), True
    for name, values in candidates.items():  # one field varied at a time
        kind = next(k for k, v in CANDIDATES.items() if v is values)
        for value in values:
            yield None, _object({**plain_values, name: value}), value in FAST[kind]
    rng = random.Random(seed)
    for _ in range(600):  # random combinations
        yield None, _object({n: rng.choice(v) for n, v in candidates.items()}, spaced=rng.random() < 0.5), False
    for _ in range(300):  # random combinations of values Python accepts
        yield None, _object({n: rng.choice(v) for n, v in valid.items()}, spaced=rng.random() < 0.5), False
    plain = _object(plain_values)
    for raw in [None, b"", b"null", b"[]", b'"str"', b"42", plain + b" trailing", plain + plain, plain + b"   \n",
                b"  " + plain, b"\xef\xbb\xbf" + plain, b"\xff" + plain, plain.replace(b'"abc"', b'"ab\xffc"'),
                plain.replace(b'"abc"', b'"a\tb"'), plain[:-1] + b',"t":"second"}',
                plain[:-1] + b',"\\u0074":"esc"}', plain[:-1] + b',"extra":{"deep":[1,2,{"x":null}]}}',
                plain[:-1] + b',"x":' + b"[" * 3000 + b"]" * 3000 + b"}",
                plain[:-1] + b',"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}", plain.replace(b":", b": ", 1),
                plain[:-1] + b',}', json.dumps(json.loads(plain), indent=2).encode()]:
        yield b"key", raw, False


def _staged_lines(spark, spec: PipelineSpec, corpus: list[tuple[bytes | None, bytes | None, bool]]):
    rows = [("topic.a", index % 3, index, key, value) for index, (key, value, _) in enumerate(corpus)]
    df = spark.createDataFrame(rows, "topic string, partition int, offset long, key binary, value binary")
    prepared = with_staging_line(df, spec)
    vouched = {row.offset for row in prepared.where("line IS NOT NULL").select("offset").collect()}
    counts = {"staged": 0, "parsed_in_python": 0}
    data = b"".join(bytes(chunk) for chunk in
                    copy_chunks(prepared.toArrow().to_batches(max_chunksize=97), spec, False, counts, True))
    lines = {int(line.split("\t")[2]): line + "\n" for line in data.decode().split("\n") if line}
    return lines, vouched, counts


def _same(spec: PipelineSpec, jvm: str, python: str) -> bool:
    """Equal lines; double precision cells as numbers (Java and Python print them differently)."""
    if jvm == python:
        return True
    doubles = {6 + i for i, f in enumerate(spec.fields) if f.pg_type == "double precision"}
    a, b = jvm.rstrip("\n").split("\t"), python.rstrip("\n").split("\t")
    return len(a) == len(b) and all(x == y or (i in doubles and NULL not in (x, y) and float(x) == float(y))
                                    for i, (x, y) in enumerate(zip(a, b, strict=True)))


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[1]").appName("eos-sql-records-test")
               .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1").getOrCreate())
    yield session
    session.stop()


@pytest.mark.parametrize(("spec", "candidates"), [(SPEC, CANDIDATES), (LEDGER, LEDGER_CANDIDATES)],
                         ids=["every-type", "ledger"])
def test_jvm_lines_equal_parse_record(spark, spec: PipelineSpec, candidates: dict[str, list[str]]) -> None:
    corpus = list(_corpus(spec, candidates, seed=7))
    assert supported(spec)
    lines, vouched, counts = _staged_lines(spark, spec, corpus)
    assert counts["staged"] == len(corpus) == len(lines)
    assert counts["parsed_in_python"] == len(corpus) - len(vouched)
    wrong = []
    for offset, (key, value, _) in enumerate(corpus):
        (expected,) = staging_lines(spec, [("topic.a", offset % 3, offset, key, value)], keep_raw=False)
        if not _same(spec, lines[offset], expected):
            wrong.append((value[:120] if value else value, lines[offset][:200], expected[:200]))
    assert not wrong, f"{len(wrong)} records differ from parse_record:\n" + "\n".join(map(repr, wrong[:10]))
    # Every record the JVM vouched for is one Python accepts, and the plain ones are all vouched for.
    for offset in vouched:
        parse_record(spec, corpus[offset][1])
    missed = [corpus[i][1] for i, (_, _, fast) in enumerate(corpus) if fast and i not in vouched]
    assert not missed, f"plain good records left to Python: {missed}"
    accepted = sum(1 for _, v, _ in corpus if _accepts(spec, v))
    print(f"{spec.name}: {len(corpus)} records, {accepted} valid, {len(vouched)} vouched for by the JVM")


def _accepts(spec: PipelineSpec, value: bytes | None) -> bool:
    try:
        parse_record(spec, value)
    except RecordError:
        return False
    return True
