"""A record's schema read once per text (``cdc.known_schemas``): only a record that is, byte for
byte, a remembered prefix, a payload and ``}`` skips its schema, and it reads as if decoded whole."""

from __future__ import annotations

import pytest

from bench.cdc_changes import ChangeStream
from bench.cdc_throughput import mirror_definition
from spark_apps.eos_stream.cdc import fast_envelope, flat_rows
from spark_apps.eos_stream.cdc.definition import parse_mirror
from spark_apps.eos_stream.cdc.flat_rows import FlatLines
from spark_apps.eos_stream.cdc.known_schemas import KnownSchemas

SCHEMA = b'{"type":"struct","fields":[{"type":"int64","field":"id"}]}'
OTHER = b'{"type":"struct","fields":[{"type":"string","field":"id"}]}'


def _record(schema: bytes, payload: bytes) -> bytes:
    return b'{"schema":' + schema + b',"payload":' + payload + b"}"


def test_a_record_of_a_remembered_schema_gives_its_payload_and_the_derived_value() -> None:
    known: KnownSchemas[str] = KnownSchemas()
    assert known.payload(_record(SCHEMA, b'{"id":1}')) is None  # nothing learnt yet
    known.learn(_record(SCHEMA, b'{"id":1}'), SCHEMA, "derived")
    assert known.payload(_record(SCHEMA, b'{"id":22}')) == (b'{"id":22}', "derived")
    known.learn(_record(OTHER, b'{"id":"a"}'), OTHER, "other")
    assert known.payload(_record(SCHEMA, b'{"id":3}')) == (b'{"id":3}', "derived")  # not only the last one
    assert known.payload(_record(OTHER, b'{"id":"b"}')) == (b'{"id":"b"}', "other")


@pytest.mark.parametrize("record", [
    _record(SCHEMA + b" ", b'{"id":1}'),  # another schema text
    _record(SCHEMA, b'{"id":1}') + b" ",  # does not end with }
    b'{"schema": ' + SCHEMA + b',"payload":{"id":1}}',  # whitespace the prefix does not have
    _record(SCHEMA, b'{"id":1}')[:-2],  # cut short
])
def test_anything_else_is_decoded_whole(record: bytes) -> None:
    known: KnownSchemas[str] = KnownSchemas()
    known.learn(_record(SCHEMA, b'{"id":1}'), SCHEMA, "derived")
    assert known.payload(record) is None


def test_a_record_not_written_compactly_is_not_remembered() -> None:
    known: KnownSchemas[str] = KnownSchemas()
    spaced = b'{"schema": ' + SCHEMA + b', "payload": {"id": 1}}'
    known.learn(spaced, SCHEMA, "derived")
    assert known.known == {} and known.payload(spaced) is None


def _stream_records(schemas: bool) -> list[tuple[str, int, int, bytes | None, bytes | None]]:
    stream = ChangeStream(1, 400, prefix="ks", schemas=schemas)
    return [(topic, 0, offset, key, value) for offset, (topic, key, value) in enumerate(stream.records())]


def test_the_fast_path_stages_the_same_lines_with_the_schemas_known_or_not() -> None:
    definition = parse_mirror(mirror_definition(ChangeStream(1, 1, prefix="ks"))["mirror"])
    records = _stream_records(schemas=True)
    flat_rows._VALUE_SCHEMAS.known.clear()
    flat_rows._KEY_SCHEMAS.known.clear()
    first = [FlatLines(definition).line(*r) for r in records]
    assert flat_rows._VALUE_SCHEMAS.known and flat_rows._KEY_SCHEMAS.known  # learnt on the first record
    assert [FlatLines(definition).line(*r) for r in records] == first
    assert sum(line is not None for line in first) > 300


def test_a_known_prefix_with_a_payload_that_is_no_envelope_is_left_to_the_reference() -> None:
    definition = parse_mirror(mirror_definition(ChangeStream(1, 1, prefix="ks"))["mirror"])
    topic, _, _, key, value = next(r for r in _stream_records(schemas=True) if r[4] is not None)
    assert key is not None and value is not None
    flat = FlatLines(definition)
    assert flat.line(topic, 0, 1, key, value) is not None  # learns the prefix
    payload_at = value.index(b',"payload":') + len(b',"payload":')
    extra_key = value[:-1] + b',"extra":1}'  # a third key the wrapper forbids
    assert flat.line(topic, 0, 2, key, extra_key) is None
    not_envelope = value[:payload_at] + b"[1]}"
    assert flat.line(topic, 0, 3, key, not_envelope) is None
    extra_key_in_key = key[:-1] + b',"extra":1}'
    assert flat.line(topic, 0, 4, extra_key_in_key, value) is None


def test_the_reference_reading_reads_a_known_schema_as_it_read_it_whole() -> None:
    reads = [(key, value) for _, _, _, key, value in _stream_records(schemas=True) if value is not None]
    fast_envelope._VALUE_SCHEMAS.known.clear()
    whole = fast_envelope.read(*reads[0])
    assert fast_envelope._VALUE_SCHEMAS.known
    assert fast_envelope.read(*reads[0]) == whole is not None
    assert all(fast_envelope.read(*r) is not None for r in reads)
    not_envelope = reads[0][1][:reads[0][1].index(b',"payload":') + len(b',"payload":')] + b"[1]}"
    assert fast_envelope.read(reads[0][0], not_envelope) is None
