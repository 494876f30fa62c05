"""The records' fast path: a whole Arrow batch parsed and COPY-encoded in
Arrow's C++ (its JSON reader and compute kernels), no Python per record.

``records.parse_record`` stays the one definition of a valid record. This
module vouches only for records whose staging line it can write exactly as
``records.staging_lines(..., keep_raw=False)`` would, and leaves every other
record to ``staging_lines`` itself, which gives it its verdict (a dead-letter
line with its error, or a good line after all). So the fast path never
rejects anything, and it accepts only what Python accepts
(``tests/unit/test_batch_lines.py`` compares the two over a corpus of good
and bad values, line for line).

A record is vouched for when all of these hold, and the rest go to Python:

* its value holds no byte below 0x20, no ``\\u`` escape, no ``[`` and only
  one ``{``. A raw control character is either invalid JSON or whitespace
  that would break the one-value-per-line input of Arrow's reader; a ``\\u``
  escape is how a NUL, a lone surrogate or a second spelling of a key would
  arrive, the cases where Python's verdict is subtle; and Arrow's reader
  recurses once per level of nesting, so deep nesting would overflow its
  stack and crash the worker (a flat object has none; a bracket inside a
  string sends a good record to Python, which is only slower);
* no run of 1,000 digits: Python refuses an integer past 4,300 digits even
  in a field nobody reads, which Arrow's reader would skip;
* the value is one object with nothing but spaces around it (Arrow 26's
  reader crashes on a bare ``null``); one regular expression checks this
  rule and the first one together;
* the batch's values are all valid UTF-8, which the cast to Arrow strings
  checks (the JSON reader does not); otherwise the batch goes to Python;
* each spec field has the JSON type Python requires. Arrow's reader, given
  the spec's fields as an explicit schema, refuses a string where a number
  belongs and the reverse, a fraction or an exponent for an integer, an
  integer past 64 bits, a key given twice, a value that is not an object,
  and anything that is not JSON. Such a refusal is for the whole batch: the
  batch then goes to Python, record by record, as before this module;
* a required field is present and not null.

Specs with a per-record ``transform`` (Python code) or a field whose text
Python writes differently from Arrow (``numeric`` keeps a number's digits as
written, ``double precision`` is printed by Python's float repr) never take
this path.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

from spark_apps.eos_stream.records.parsing import NULL, staging_lines
from spark_apps.eos_stream.records.spec import PipelineSpec

_ARROW_TYPES = {"text": "string", "timestamptz": "string", "bigint": "int64", "integer": "int64",
                "boolean": "bool"}
# What Arrow may read at all, in one pass: one object with nothing but spaces around it (a bare
# ``null`` line crashes Arrow 26's reader), holding no control character (raw, so invalid JSON
# or line-breaking whitespace), no array and no second object (nesting: Arrow's reader recurses
# per level and deep nesting overflows its stack, a crash of the worker, not an error), and no
# \u escape (a backslash is let through only before another character).
_FLAT_OBJECT = r"^ *\{(?:[^{\[\x00-\x1f\\]|\\[^u{\[\x00-\x1f])*\} *$"
# A run of this many digits goes to Python; only a value at least this long can hold one, so
# the costlier search runs only when a batch has such a value.
_DIGITS = 1000
_DIGIT_RUN = rf"[0-9]{{{_DIGITS}}}"
_COPY_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))


def supported(spec: PipelineSpec) -> bool:
    """Whether Arrow can vouch for this spec's records at all."""
    return spec.transform is None and all(f.pg_type in _ARROW_TYPES for f in spec.fields)


def arrow_schema(spec: PipelineSpec) -> Any:
    """The spec's fields as Arrow types (what ``_parse`` reads them as)."""
    import pyarrow as pa

    return pa.schema([(f.name, pa.type_for_alias(_ARROW_TYPES[f.pg_type])) for f in spec.fields])


def _parse(values: Any, spec: PipelineSpec) -> Any | None:
    """The spec's fields of ``values`` (binary, none null, none left to Python) as a
    record batch of one row per value, or None when Arrow's reader refuses the batch."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    # One value per line: none holds a line break (_FLAT_OBJECT).
    text = pc.binary_join_element_wise(values, pa.scalar(b"", pa.binary()), b"\n")
    try:
        # Arrow's JSON reader does not check UTF-8 (a surrogate's raw bytes pass through it); the cast does.
        text.cast(pa.string())
        table = pj.read_json(
            io.BytesIO(string_data(text)),
            read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, 2 * text.nbytes)),
            parse_options=pj.ParseOptions(explicit_schema=arrow_schema(spec), unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    # Two objects on one line would be two rows: the lines no longer match the records.
    if table.num_rows != len(values):
        return None
    return table.combine_chunks().to_batches()[0]


def _cell(column: Any, pg_type: str, escaped: bool) -> Any:
    """A field's COPY cells, as ``records._encoder`` writes them (NULL for a null).

    :param escaped: whether the values' JSON held a backslash: without one, no string
        in them holds a character COPY must escape (raw control characters never reach
        Arrow), so four passes over each text column are saved."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pg_type == "boolean":
        text = pc.if_else(column, pa.scalar("t"), pa.scalar("f"))
    elif pg_type in ("bigint", "integer"):
        text = pc.cast(column, pa.string())
    else:
        text = column
        for char, escape in _COPY_ESCAPES if escaped else ():  # backslash first, as str.translate does it in one pass
            text = pc.replace_substring(text, char, escape)
    return pc.fill_null(text, NULL)


def _candidates(values: Any) -> Any:
    """One flag per value: whether Arrow's reader may try it (the first three rules above)."""
    import pyarrow.compute as pc

    flat = pc.fill_null(pc.match_substring_regex(values, _FLAT_OBJECT), False)
    long = pc.and_(flat, pc.fill_null(pc.greater_equal(pc.binary_length(values), _DIGITS), False))
    if pc.any(long).as_py():
        digits = pc.fill_null(pc.match_substring_regex(values, _DIGIT_RUN), True)
        flat = pc.and_not(flat, pc.and_(long, digits))
    return flat


def arrow_records(batch: Any) -> Iterator[tuple]:
    """An Arrow batch's rows as tuples: the (topic, partition, offset, key,
    value) of each record a task read, for ``staging_lines``."""
    return zip(*(column.to_pylist() for column in batch.columns), strict=True)


def string_data(lines: Any) -> memoryview:
    """The bytes of an Arrow string or binary array without nulls, all its
    values back to back, straight from its data buffer."""
    import pyarrow as pa

    width = 8 if pa.types.is_large_string(lines.type) or pa.types.is_large_binary(lines.type) else 4
    offsets = memoryview(lines.buffers()[1]).cast("B")
    first, last = lines.offset * width, (lines.offset + len(lines)) * width
    start = int.from_bytes(offsets[first:first + width], "little", signed=True)
    end = int.from_bytes(offsets[last:last + width], "little", signed=True)
    data = lines.buffers()[2]
    return memoryview(data).cast("B")[start:end] if data is not None else memoryview(b"")


def vouched_fields(batch: Any, spec: PipelineSpec) -> tuple[Any, Any | None, bool]:
    """Which records of an Arrow batch of (topic, partition, offset, key, value) Arrow vouches
    for: one flag per record, the spec's typed fields of exactly those records (None when
    there are none) and whether their JSON held a backslash (see ``_cell``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    value = batch.column(4)
    candidate = _candidates(value)
    chosen = pc.filter(value, candidate)
    fields = _parse(chosen, spec) if len(chosen) else None
    if fields is None:
        return pa.repeat(False, len(value)), None, False
    complete = pa.repeat(True, len(chosen))
    for f in spec.fields:
        if f.required:  # a missing or null required field: Python's error says which
            complete = pc.and_(complete, pc.is_valid(fields.column(f.name)))
    if not pc.any(complete).as_py():
        return pa.repeat(False, len(value)), None, False
    # One flag per record of the batch: each candidate's own where it stands, False elsewhere.
    vouched = pc.replace_with_mask(candidate, candidate, complete)
    escaped = b"\\" in string_data(chosen).tobytes()  # a memoryview has no substring search
    return vouched, fields.filter(complete), escaped


def copy_text(cells: list[Any]) -> memoryview:
    """COPY text of rows given as one Arrow string array (or scalar) per column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lines = pc.binary_join_element_wise(*cells, "\t")
    return string_data(pc.binary_join_element_wise(lines, pa.scalar(""), "\n"))


def coordinate_cells(batch: Any, mask: Any) -> list[Any]:
    """The topic, partition and offset COPY cells of the records ``mask`` flags."""
    import pyarrow as pa
    import pyarrow.compute as pc

    topic, partition, offset = batch.columns[:3]
    return [pc.filter(topic, mask), pc.cast(pc.filter(partition, mask), pa.string()),
            pc.cast(pc.filter(offset, mask), pa.string())]


def field_cells(fields: Any, spec: PipelineSpec, names: Iterable[str], escaped: bool) -> list[Any]:
    """The COPY cells of the typed ``fields`` columns named ``names``."""
    types = {f.name: f.pg_type for f in spec.fields}
    return [_cell(fields.column(name), types[name], escaped) for name in names]


def batch_lines(batch: Any, spec: PipelineSpec) -> Iterator[bytes | memoryview]:
    """The COPY data of one Arrow batch of (topic, partition, offset, key, value)
    records, without raw bytes for good records: the records Arrow vouches for
    in one chunk, the rest from ``staging_lines``. Yields nothing for an empty batch."""
    import pyarrow as pa
    import pyarrow.compute as pc

    vouched, fields, escaped = vouched_fields(batch, spec)
    if fields is not None:
        yield copy_text([*coordinate_cells(batch, vouched),
                         *[pa.scalar(NULL)] * 3,  # key, value, error
                         *field_cells(fields, spec, (f.name for f in spec.fields), escaped)])
    left = batch.filter(pc.invert(vouched))
    if left.num_rows:
        yield "".join(staging_lines(spec, arrow_records(left), keep_raw=False)).encode()
