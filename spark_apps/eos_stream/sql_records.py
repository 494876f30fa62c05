"""The records' fast path: parsing, validation and COPY encoding in the JVM.

``records.parse_record`` stays the one definition of a valid record. This
module builds a Spark SQL column that, for every record it can vouch for,
holds exactly the staging line ``records.staging_lines`` would write, and is
NULL for any record it cannot vouch for. Those NULL records, and only those,
go through ``parse_record`` in Python, which gives them their verdict: a
dead-letter line with the exact error, or a good line after all. So the JVM
never rejects anything, and it accepts only what Python accepts
(``tests/integration/test_sql_records.py`` checks both over a generated
corpus).

It vouches for a record only when every one of these holds, and leaves the
rest to Python:

* the value is valid UTF-8 and one flat JSON object with nothing after it
  (Spark's parser ignores trailing data, Python's does not; nested values,
  even in fields nobody reads, go to Python);
* Spark parses it as a variant (this refuses duplicate keys, whose last
  value Python would keep, and lone surrogates);
* each field has the JSON type Python requires: a string for text and
  timestamptz (without NUL), an integer token that fits a Java long for bigint
  and integer (``1.0`` and ``1e2`` are not integers to Python), true or false
  for boolean, a number for double precision (at most 15 significant digits
  when decimal, so the conversion is exact);
* a missing or null field is optional.

Like Python, it leaves a value's domain (an integer's range, a timestamp's
spelling) to PostgreSQL, which casts the staged text in the apply.

Specs with a per-record ``transform`` (Python code) and field names that are
not plain identifiers never take this path.
"""

from __future__ import annotations

import re
from typing import Any

from spark_apps.eos_stream.records import NULL
from spark_apps.eos_stream.spec import Field, PipelineSpec

# One flat JSON object (string literals may hold anything, escapes included)
# and nothing after it. Possessive quantifiers: Java's regex engine would
# otherwise recurse once per character and overflow its stack on a long value.
_FLAT_OBJECT = r'^\{(?:[^"{}\[\]]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+\}[ \t\n\r]*$'
_PLAIN_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_DOUBLE_EXACT_INTEGER = 2**53
_DECIMAL_EXACT_DIGITS = 15


def supported(spec: PipelineSpec) -> bool:
    """Whether the JVM can vouch for this spec's records at all."""
    # numeric keeps a number's written digits (records.parse_record), which a variant does not.
    return spec.transform is None and all(_PLAIN_NAME.match(f.name) and f.pg_type != "numeric" for f in spec.fields)


def _escaped(text: Any) -> Any:
    """COPY text escaping, as ``records._encode`` does it (backslash first)."""
    from pyspark.sql import functions as F

    for char, escape in (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r")):
        text = F.replace(text, F.lit(char), F.lit(escape))
    return text


_TYPED = {"bigint": "bigint", "integer": "bigint", "double precision": "double", "boolean": "boolean",
          "timestamptz": "string", "text": "string"}


def _kind(index: int) -> str:
    return f"_kind{index}"


def _value(index: int) -> str:
    return f"_value{index}"


def _field_cell(field: Field, index: int) -> Any:
    """The field's COPY cell from its JSON type (``_kind<i>``) and typed value
    (``_value<i>``), or NULL when the JVM cannot vouch for it."""
    from pyspark.sql import functions as F

    kind, value = F.col(_kind(index)), F.col(_value(index))
    absent = kind.isNull() | (kind == "VOID")
    if field.pg_type in ("bigint", "integer"):
        good = kind == "BIGINT"
        cell = value.cast("string")
    elif field.pg_type == "double precision":
        digits = F.regexp_extract(kind, r"^DECIMAL\((\d+),", 1)
        good = ((kind == "DOUBLE")
                | ((kind == "BIGINT") & (F.abs(value) <= _DOUBLE_EXACT_INTEGER))
                | ((digits != "") & (digits.cast("int") <= _DECIMAL_EXACT_DIGITS)))
        cell = value.cast("string")
    elif field.pg_type == "boolean":
        good = kind == "BOOLEAN"
        cell = F.when(value, F.lit("t")).otherwise(F.lit("f"))
    else:  # text and timestamptz
        good = (kind == "STRING") & (F.instr(value, "\x00") == 0)
        cell = _escaped(value)
    vouched = F.when(good, cell)  # NULL otherwise, which NULLs the whole line
    return F.when(absent, F.lit(NULL) if not field.required else F.lit(None)).otherwise(vouched)


def with_staging_line(records: Any, spec: PipelineSpec) -> Any:
    """(line, topic, partition, offset, key, value) for the partition writer,
    from (topic, partition, offset, key, value).

    ``line`` is the record's staging line without raw bytes
    (``staging_lines(..., keep_raw=False)``), or NULL where the JVM leaves the
    record to Python; key and value travel only with those records."""
    from pyspark.sql import functions as F

    source = ["topic", "partition", "offset", "key", "value"]
    text = F.col("value").cast("string")
    gate = F.col("value").isNotNull() & F.is_valid_utf8(F.col("value")) & text.rlike(_FLAT_OBJECT)
    # One projection per step: Spark does not inline an expensive expression
    # used more than once into the next, so each record is parsed once and
    # each field looked up once (a single projection parsed it per use).
    parsed = records.select(*source, F.when(gate, F.try_parse_json(text)).alias("_parsed"))
    parsed_value = F.col("_parsed")
    fields = parsed.select(*source, parsed_value, *(
        column
        for index, field in enumerate(spec.fields)
        for column in (
            F.schema_of_variant(F.try_variant_get(parsed_value, f"$.{field.name}", "variant")).alias(_kind(index)),
            F.try_variant_get(parsed_value, f"$.{field.name}", _TYPED[field.pg_type]).alias(_value(index)),
        )
    ))
    cells = [
        # Kafka topic names are [a-zA-Z0-9._-]: nothing to escape.
        F.col("topic"), F.col("partition").cast("string"), F.col("offset").cast("string"),
        F.lit(NULL), F.lit(NULL), F.lit(NULL),  # key, value, error
        *(_field_cell(f, i) for i, f in enumerate(spec.fields)),
    ]
    parts: list[Any] = [F.lit("\t")] * (2 * len(cells) - 1)
    parts[::2] = cells
    # concat is NULL when any cell is: one field the JVM cannot vouch for sends the record to Python.
    line = F.when(parsed_value.isNotNull(), F.concat(*parts, F.lit("\n")))
    lines = fields.select(line.alias("line"), *source)
    left = F.col("line").isNull()
    return lines.select(
        "line", "topic", "partition", "offset",
        F.when(left, F.col("key")).alias("key"), F.when(left, F.col("value")).alias("value"),
    )
