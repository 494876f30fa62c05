"""The fast change path (``flat_rows``) stages what the reference path stages, in meaning: every
cell the same, and the JSON cells (``_keys``, ``_after``, ``_before``) giving the same text for
every column under ``->>``, which is all the apply reads of them. Every record it does not vouch
for is left to the reference path (``line`` returns None)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.cdc_changes import ChangeStream
from bench.cdc_throughput import mirror_definition
from spark_apps.eos_stream.cdc import mirror, patterns, transactions
from spark_apps.eos_stream.cdc.definition import MirrorDefinition, parse_mirror
from spark_apps.eos_stream.cdc.flat_rows import FlatLines
from tests.unit.cdc_samples import FULL_ROW, PLACEHOLDER, key, key_with_schema, value, with_schema

JSON_CELLS = {mirror.STAGE_COLUMNS.index(c) for c in ("_keys", "_after", "_before")}
FLAT_COLUMNS = {"id": "bigint", "name": "text", "balance": "numeric(20,6)", "updated_at": "timestamptz",
                "prefs": "jsonb", "notes": "text"}
FLAT_ROW = {c: FULL_ROW[c] for c in FLAT_COLUMNS}
FLAT_FIELDS = [{"type": "int64", "optional": False, "field": "id"},
               *[{"type": "string", "optional": True, "field": c} for c in FLAT_COLUMNS if c != "id"]]
Record = tuple[str, int, int, bytes | None, bytes | None]


def _definition(aggregates: bool = False) -> MirrorDefinition:
    section: dict[str, Any] = {"topic_prefix": "app", "tables": [
        {"source": "public.customers", "key": ["id"], "columns": FLAT_COLUMNS}]}
    if aggregates:
        section["aggregates"] = [{"source": "public.customers", "target": "by_name", "group_by": ["name"],
                                  "count_column": "n"}]
    return parse_mirror(section)


def _unescape(cell: str) -> str | None:
    if cell == "\\N":
        return None
    out, chars = [], iter(cell)
    for char in chars:
        if char == "\\":
            nxt = next(chars)
            out.append({"t": "\t", "n": "\n", "r": "\r"}.get(nxt, nxt))
        else:
            out.append(char)
    return "".join(out)


def _as_text(value: Any) -> Any:
    """What ``->>`` gives for a JSON value the two paths may write: a string, or an integer's digits."""
    return value if value is None or isinstance(value, str) else str(value)


def _meaning(line: str) -> list[Any]:
    assert line.endswith("\n") and line.count("\n") == 1
    cells: list[Any] = [_unescape(c) for c in line[:-1].split("\t")]
    assert len(cells) == len(mirror.STAGE_COLUMNS)
    for index in JSON_CELLS:
        if cells[index] is not None:
            cells[index] = {c: _as_text(v) for c, v in json.loads(cells[index]).items()}
    return cells


def _reference(definition: MirrorDefinition, record: Record) -> str:
    lines = list(mirror.resolved_staging_lines(patterns.Router(definition).resolve, [record], False,
                                               transactions.transaction_topic(definition.topic_prefix),
                                               definition.mirrors))
    assert len(lines) == 1
    return lines[0]


def _check_same(definition: MirrorDefinition, records: list[Record]) -> int:
    """Asserts every fast line means the reference's; returns how many records took the fast path."""
    flat, fast = FlatLines(definition), 0
    for record in records:
        line = flat.line(*record)
        if line is not None:
            fast += 1
            assert _meaning(line) == _meaning(_reference(definition, record)), record
    return fast


@pytest.mark.parametrize("schemas", [False, True])
@pytest.mark.parametrize("metadata", [False, True])
def test_the_benchmark_stream_takes_the_fast_path_and_stages_what_the_reference_stages(schemas: bool,
                                                                                      metadata: bool) -> None:
    stream = ChangeStream(2, 3000, prefix="fp", schemas=schemas, transaction_metadata=metadata)
    definition = parse_mirror(mirror_definition(stream)["mirror"])
    records = [(topic, 0, offset, key_bytes.encode() if isinstance(key_bytes, str) else key_bytes,
                value_bytes.encode() if isinstance(value_bytes, str) else value_bytes)
               for offset, (topic, key_bytes, value_bytes) in enumerate(stream.records())]
    changes = [r for r in records if r[4] is not None and not r[0].endswith(".transaction")]
    assert _check_same(definition, records) == len(changes) == 3000


def _sample(op: str, before: dict | None, after: dict | None, schemas: bool, **key_columns: Any) -> Record:
    k, v = key(**(key_columns or {"id": 7})), value(op, before, after)
    if schemas:
        k, v = key_with_schema(k), with_schema(v, FLAT_FIELDS)
    return ("app.public.customers", 3, 41, k, v)


ODD_TEXT = {**FLAT_ROW, "name": "Zoë \u2028 \t tab\nline \\ back \"q\"", "notes": None}


@pytest.mark.parametrize("aggregates", [False, True])
@pytest.mark.parametrize("schemas", [False, True])
def test_flat_samples_stage_what_the_reference_stages(schemas: bool, aggregates: bool) -> None:
    deleted_before = {**FLAT_ROW, "name": "", "notes": None}
    records = [_sample("c", None, FLAT_ROW, schemas), _sample("r", None, FLAT_ROW, schemas),
               _sample("u", FLAT_ROW, {**FLAT_ROW, "balance": "-0.500000"}, schemas),
               _sample("d", deleted_before, None, schemas), _sample("u", None, FLAT_ROW, schemas, id=2**40)]
    non_ascii = ("app.public.customers", 0, 9, key(id=7),
                 json.dumps({"op": "c", "before": None, "after": ODD_TEXT,
                             "source": {"schema": "public", "table": "customers"}}, ensure_ascii=False).encode())
    assert _check_same(_definition(aggregates), [*records, non_ascii]) == 6


BAD_AFTER = {
    "a NUL": {**FLAT_ROW, "name": "a\u0000b"},
    "a lone surrogate": {**FLAT_ROW, "name": "\ud800"},
    "a float": {**FLAT_ROW, "id": 7.0},
    "a boolean in text": {**FLAT_ROW, "name": True},
    "an object in text": {**FLAT_ROW, "notes": {"a": 1}},
    "a string in bigint": {**FLAT_ROW, "id": "7"},
    "a missing column": {c: v for c, v in FLAT_ROW.items() if c != "notes"},
    "a new column": {**FLAT_ROW, "added": "x"},
    "the placeholder": {**FLAT_ROW, "notes": PLACEHOLDER},
}


@pytest.mark.parametrize("case", sorted(BAD_AFTER))
def test_rows_the_reference_must_judge_are_left_to_it(case: str) -> None:
    record = _sample("u", None, BAD_AFTER[case], schemas=False)
    assert FlatLines(_definition()).line(*record) is None
    assert _reference(_definition(), record)  # which stages it, refused or as a schema change


def _raw(document: dict) -> bytes:
    return json.dumps(document).encode()


ENVELOPE = {"op": "c", "before": None, "after": FLAT_ROW, "source": {"schema": "public", "table": "customers"}}
BAD_RECORDS: dict[str, tuple[bytes | None, bytes | None]] = {
    "a tombstone": (key(id=7), None),
    "no key": (None, _raw(ENVELOPE)),
    "a key with another column": (key(id=7, region="eu"), _raw(ENVELOPE)),
    "a key of the wrong type": (key(id="7"), _raw(ENVELOPE)),
    "an unknown op": (key(id=7), _raw({**ENVELOPE, "op": "x"})),
    "a create without after": (key(id=7), _raw({**ENVELOPE, "after": None})),
    "a before that is no object": (key(id=7), _raw({**ENVELOPE, "before": 5})),
    "a transaction that is no object": (key(id=7), _raw({**ENVELOPE, "transaction": "t1"})),
    "a table not in the definition": (key(id=7), _raw({**ENVELOPE, "source": {"schema": "public", "table": "x"}})),
    "invalid JSON": (key(id=7), b'{"op": "c", '),
    "a schema that is no object": (key(id=7), _raw({"schema": 5, "payload": ENVELOPE})),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_records_the_reference_must_judge_are_left_to_it(case: str) -> None:
    assert FlatLines(_definition()).line("app.public.customers", 0, 1, *BAD_RECORDS[case]) is None


def test_a_key_with_a_nul_is_left_to_the_reference() -> None:
    definition = parse_mirror({"topic_prefix": "app", "tables": [
        {"source": "public.customers", "key": ["id", "name"], "columns": FLAT_COLUMNS}]})
    flat = FlatLines(definition)
    assert flat.line("app.public.customers", 0, 1, key(id=7, name="a"), _raw(ENVELOPE)) is not None
    assert flat.line("app.public.customers", 0, 2, key(id=7, name="a\u0000"), _raw(ENVELOPE)) is None


def test_a_table_with_a_column_it_cannot_stage_as_written_always_takes_the_reference_path() -> None:
    definition = parse_mirror({"topic_prefix": "app", "tables": [
        {"source": "public.customers", "key": ["id"], "columns": {**FLAT_COLUMNS, "photo": "bytea"}}]})
    record = ("app.public.customers", 0, 1, key(id=7), value("c", None, {**FLAT_ROW, "photo": "3q2+7w=="}))
    assert FlatLines(definition).line(*record) is None


def test_keep_raw_stages_every_record_on_the_reference_path() -> None:
    record = _sample("c", None, FLAT_ROW, schemas=False)
    definition = _definition()
    line = next(mirror.resolved_staging_lines(patterns.Router(definition).resolve, [record], True,
                                              flat=FlatLines(definition).line))
    assert _meaning(line)[mirror.STAGE_COLUMNS.index("_value")] is not None


def test_a_record_with_schemas_that_does_not_begin_with_its_schema_is_left_to_the_reference() -> None:
    topic, partition, offset, key_bytes, value_bytes = _sample("c", None, FLAT_ROW, schemas=True)
    assert key_bytes is not None and value_bytes is not None
    assert FlatLines(_definition()).line(topic, partition, offset, key_bytes, value_bytes) is not None

    def payload_first(raw: bytes) -> bytes:
        document = json.loads(raw)
        return json.dumps({"payload": document["payload"], "schema": document["schema"]}).encode()

    for record in ((topic, partition, offset, payload_first(key_bytes), value_bytes),
                   (topic, partition, offset, key_bytes, payload_first(value_bytes))):
        assert FlatLines(_definition()).line(*record) is None
        assert _reference(_definition(), record)
