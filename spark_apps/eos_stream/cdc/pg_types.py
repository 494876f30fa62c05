"""PostgreSQL type names: the ones a mirror definition may use, one spelling per type, the type a
change event's Connect schema names, and which types hold which without loss."""

from __future__ import annotations

import re

from spark_apps.eos_stream.cdc.values import FieldSchema

# A PostgreSQL type as a definition may name it. Types go into SQL as text (psycopg2.sql
# cannot quote a type), so anything beyond words, a (p[,s]) modifier and [] is refused.
_PG_TYPE = re.compile(r"^[a-z][a-z0-9_]*( [a-z][a-z0-9_]*)*( ?\(\d+( ?, ?\d+)?\))?( with(out)? time zone)?(\[\])*$")


class TypeNameError(ValueError):
    """A type name a mirror does not accept."""


def check_pg_type(column: str, pg_type: str) -> str:
    if not _PG_TYPE.match(pg_type.strip().lower()):
        raise TypeNameError(f"column {column!r}: {pg_type!r} is not a PostgreSQL type name a mirror accepts")
    return pg_type.strip().lower()


_ALIASES = {"int2": "smallint", "int4": "integer", "int": "integer", "int8": "bigint", "float4": "real",
            "float8": "double precision", "bool": "boolean", "varchar": "character varying",
            "bpchar": "character", "char": "character", "decimal": "numeric",
            "timestamp with time zone": "timestamptz", "timestamp without time zone": "timestamp",
            "time without time zone": "time", "time with time zone": "timetz",
            "serial": "integer", "bigserial": "bigint", "smallserial": "smallint"}
_SIMPLE_CONNECT = {("int16", None): "smallint", ("int32", None): "integer", ("int64", None): "bigint",
                   ("float32", None): "real", ("float64", None): "double precision", ("boolean", None): "boolean",
                   ("bytes", None): "bytea", ("string", "io.debezium.time.ZonedTimestamp"): "timestamptz",
                   ("string", "io.debezium.time.ZonedTime"): "timetz", ("string", "io.debezium.data.Json"): "jsonb",
                   ("string", "io.debezium.data.Uuid"): "uuid", ("string", "io.debezium.data.Xml"): "xml",
                   ("int32", "io.debezium.time.Date"): "date", ("int64", "io.debezium.time.MicroTime"): "time",
                   ("int32", "io.debezium.time.Time"): "time(3)",
                   ("int64", "io.debezium.time.MicroTimestamp"): "timestamp",
                   ("int64", "io.debezium.time.Timestamp"): "timestamp(3)",
                   ("struct", "io.debezium.data.VariableScaleDecimal"): "numeric"}
_WIDENS = {"smallint": ("integer", "bigint", "numeric"), "integer": ("bigint", "numeric"), "bigint": ("numeric",),
           "real": ("double precision",), "character varying": ("text",), "character": ("text",)}


def normalize(pg_type: str) -> str:
    """One spelling per type: ``INT4`` -> ``integer``, ``numeric(20, 6)`` -> ``numeric(20,6)``."""
    text = " ".join(pg_type.strip().lower().split())
    arrays = ""
    while text.endswith("[]"):
        text, arrays = text[:-2].strip(), arrays + "[]"
    match = re.match(r"^([a-z_][a-z0-9_ ]*?)\s*(\(\s*\d+\s*(,\s*\d+\s*)?\))?\s*((with|without) time zone)?$", text)
    if not match:
        return text + arrays
    name = " ".join(filter(None, [match.group(1), match.group(4)]))
    modifier = re.sub(r"\s", "", match.group(2) or "")
    name = _ALIASES.get(name, name)
    if modifier and name in ("timestamptz", "timetz"):
        base, zone = name[:-2], " with time zone"
        return f"{base}{modifier}{zone}{arrays}"
    return f"{name}{modifier}{arrays}"


def event_type(schema: FieldSchema | None) -> str | None:
    """The PostgreSQL type a column's event schema names, or None when it names none."""
    if schema is None:
        return None
    source = schema.parameters.get("__debezium.source.column.type")
    if source:
        name = source.lower()
        arrays = ""
        if name.startswith("_"):
            name, arrays = name[1:], "[]"
        length = schema.parameters.get("__debezium.source.column.length")
        scale = schema.parameters.get("__debezium.source.column.scale")
        if name in ("numeric", "decimal") and length and length != "0":
            name = f"numeric({length},{scale or 0})"
        elif name in ("varchar", "bpchar", "char") and length and length != "2147483647":
            name = f"{name}({length})"
        return normalize(name + arrays)
    if schema.type == "array":
        element = event_type(schema.items)
        return None if element is None else element + "[]"
    if schema.name == "org.apache.kafka.connect.data.Decimal":
        precision = schema.parameters.get("connect.decimal.precision")
        scale = schema.parameters.get("scale", "0")
        return f"numeric({precision},{scale})" if precision else "numeric"
    found = _SIMPLE_CONNECT.get((schema.type, schema.name))
    return None if found is None else normalize(found)


def holds(declared: str, arriving: str) -> bool:
    """Whether a column of type ``declared`` stores every value of ``arriving`` unchanged."""
    declared, arriving = normalize(declared), normalize(arriving)
    if declared == arriving:
        return True
    base_declared, base_arriving = declared.partition("(")[0], arriving.partition("(")[0]
    if declared in _WIDENS.get(base_arriving, ()) or (base_declared == "text" and base_arriving in _WIDENS):
        return True
    # numeric or varchar without a limit hold any of their kind
    return base_declared == base_arriving and "(" not in declared and base_declared in ("numeric", "character varying")


