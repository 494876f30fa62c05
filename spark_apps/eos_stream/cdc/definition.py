"""Declarative mirror pipelines: many source tables, one pipeline, no Python.

The ``mirror`` section of a pipeline definition (YAML, parsed before it gets here; plain
dataclasses, as the app runs without pydantic) names the tables to mirror, each explicitly
or by a pattern over Debezium's per-table topics ``<topic_prefix>.<schema>.<table>``::

    mirror:
      topic_prefix: app
      tables:
        - source: public.customers          # target defaults to the table's name
          key: [id]
          columns: {id: bigint, name: text, balance: numeric(20,6), notes: text}
        - source: public.order_lines
          target: lines
          key: [order_id, line_no]
          columns: {order_id: bigint, line_no: integer, qty: integer}
        - source_pattern: inventory.*       # keys and types from the events' schema
          target: inv_{table}
      aggregates:
        - source: public.order_lines
          target: line_totals
          group_by: [order_id]
          sums: {qty_total: qty}

A pattern's tables take their key from the record key's schema and their column types from
the value's schema (``schemas.enable=true``, with ``column.propagate.source.type`` for the
types a plain string cannot tell; ``pg_types.event_type``); its ``columns`` may name
types the events do not. Every table routes to its own target under one driver and one set of
offsets: changes route by their ``source`` schema and table, whatever topic carried them.

Each level takes only its own keys (``MIRROR_KEYS``, ``TABLE_KEYS``, ``PATTERN_KEYS``,
``AGGREGATE_KEYS``): a misspelt key would otherwise drop its setting in silence, so it is refused
with the nearest known key (``known_keys``). A definition's ``mirror`` section is parsed here when
the definition loads (``pipeline_definition``), not only when the app starts.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_apps.eos_stream.cdc.deltas import ChangeAggregate
from spark_apps.eos_stream.cdc.mirror import MirrorError, MirrorTarget
from spark_apps.eos_stream.cdc.pg_types import TypeNameError, check_pg_type, event_type, normalize
from spark_apps.eos_stream.cdc.transactions import PER_KEY, TRANSACTION_MODES, WHOLE, transaction_topic
from spark_apps.eos_stream.cdc.values import DEFAULT_PLACEHOLDER, FieldSchema
from spark_apps.eos_stream.known_keys import unknown_key_message

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
_SUMMABLE = ("smallint", "integer", "bigint", "numeric")
# The keys each level of the section takes; any other is refused (a typo would drop its setting).
MIRROR_KEYS = ("topic_prefix", "tables", "aggregates", "placeholder", "transactions")
TABLE_KEYS = ("source", "target", "key", "columns")
PATTERN_KEYS = ("source_pattern", "target", "columns")
AGGREGATE_KEYS = ("source", "target", "group_by", "sums", "count_column")


def _fail(path: str, message: str) -> MirrorError:
    return MirrorError(f"{path}: {message}")


def _known_keys(path: str, entry: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(str(key) for key in entry if key not in allowed)
    if unknown:
        raise _fail(f"{path}.{unknown[0]}", unknown_key_message(unknown[0], allowed))


def _entries(path: str, value: Any) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(entry, Mapping) for entry in value):
        raise _fail(path, "must be a list of mappings")
    return value


def _name_list(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _fail(path, "must be a non-empty list of column names")
    return tuple(value)


def _source_name(path: str, value: Any) -> str:
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) != 2 or not all(parts):
        raise _fail(path, f"must name a source table as schema.table, got {value!r}")
    return value


def _columns(path: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(c, str) and isinstance(t, str) for c, t in value.items()):
        raise _fail(path, "must map column names to PostgreSQL types")
    try:
        return {c: check_pg_type(c, t) for c, t in value.items()}
    except TypeNameError as exc:
        raise _fail(path, str(exc)) from exc


@dataclass(frozen=True)
class TablePattern:
    """Source tables matched by a shell pattern over ``schema.table``; target named by
    ``target`` with ``{schema}`` and ``{table}`` filled in."""

    pattern: str
    target: str = "{table}"
    columns: Mapping[str, str] = field(default_factory=dict)

    def matches(self, source: str) -> bool:
        return fnmatch.fnmatchcase(source, self.pattern)

    def target_name(self, source: str) -> str:
        schema, table = source.split(".", 1)
        return self.target.format(schema=schema, table=table)


@dataclass(frozen=True)
class MirrorDefinition:
    topic_prefix: str
    tables: Mapping[str, MirrorTarget]  # source table -> target
    patterns: tuple[TablePattern, ...] = ()
    aggregates: tuple[ChangeAggregate, ...] = ()
    placeholder: str = DEFAULT_PLACEHOLDER
    transactions: str = PER_KEY  # ``whole``: source transactions applied whole (``transactions``)

    @property
    def whole_transactions(self) -> bool:
        return self.transactions == WHOLE

    def transaction_topic(self) -> str | None:
        """The connector's transaction topic, which a ``whole`` mirror reads with its change topics."""
        return transaction_topic(self.topic_prefix) if self.whole_transactions else None

    def topics(self) -> list[str]:
        """The explicit tables' topics, as Debezium names them."""
        return [f"{self.topic_prefix}.{source}" for source in self.tables]

    def topic_pattern(self) -> str | None:
        """A subscription pattern (regex) for the tables that patterns name, or None."""
        if not self.patterns:
            return None
        parts = [re.escape(self.topic_prefix + ".") + fnmatch.translate(p.pattern).removeprefix("(?s:").removesuffix(
            r")\Z") for p in self.patterns]
        return "^(?:" + "|".join(parts) + ")$"

    def subscription(self, topics: list[str]) -> str | None:
        """The Kafka subscription (a regex, Spark's ``subscribePattern``) of a pipeline that reads
        ``topics`` and every topic a pattern matches, created later too; None without patterns."""
        pattern = self.topic_pattern()
        if pattern is None:
            return None
        return "|".join(["^(?:" + "|".join(re.escape(t) for t in topics) + ")$", pattern] if topics else [pattern])

    def pattern_for(self, source: str) -> TablePattern | None:
        """The first pattern that matches a source table no entry lists, or None."""
        if source in self.tables:
            return None
        return next((p for p in self.patterns if p.matches(source)), None)

    def mirrors(self, source: str) -> bool:
        """Whether changes of ``source`` (``schema.table``) are mirrored: listed, or matched by a pattern."""
        return source in self.tables or self.pattern_for(source) is not None

    def route(self, source: str) -> MirrorTarget | None:
        """The target of a source table named explicitly (a pattern's are ``target_from_schema``'s)."""
        return self.tables.get(source)


def _table_name(path: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise _fail(path, f"must be a table name, got {value!r}")
    return value


def _table(path: str, entry: Mapping[str, Any]) -> MirrorTarget:
    _known_keys(path, entry, TABLE_KEYS)
    source = _source_name(f"{path}.source", entry.get("source"))
    target = _table_name(f"{path}.target", entry.get("target", source.split(".", 1)[1]))
    try:
        return MirrorTarget(source, target, _name_list(f"{path}.key", entry.get("key")),
                            _columns(f"{path}.columns", entry.get("columns")))
    except MirrorError as exc:
        raise _fail(path, str(exc)) from exc


def _pattern(path: str, entry: Mapping[str, Any]) -> TablePattern:
    _known_keys(path, entry, PATTERN_KEYS)
    pattern = entry["source_pattern"]
    if not isinstance(pattern, str) or "." not in pattern:
        raise _fail(f"{path}.source_pattern", f"must be a pattern over schema.table, got {pattern!r}")
    target = entry.get("target", "{table}")
    if not isinstance(target, str):
        raise _fail(f"{path}.target", "must be a table name, {table} and {schema} filled in")
    return TablePattern(pattern, target, _columns(f"{path}.columns", entry.get("columns", {})))


def _aggregate(path: str, entry: Mapping[str, Any], tables: Mapping[str, MirrorTarget]) -> ChangeAggregate:
    _known_keys(path, entry, AGGREGATE_KEYS)
    source = _source_name(f"{path}.source", entry.get("source"))
    mirrored = tables.get(source)
    if mirrored is None:
        raise _fail(f"{path}.source", f"{source!r} is not a mirrored table: an aggregate is fed by a mirror")
    sums = entry.get("sums", {})
    if not isinstance(sums, Mapping):
        raise _fail(f"{path}.sums", "must map aggregate columns to the source columns they sum")
    target = _table_name(f"{path}.target", entry.get("target"))
    aggregate = ChangeAggregate(source, target, _name_list(f"{path}.group_by", entry.get("group_by")),
                                dict(sums), str(entry.get("count_column", "row_count")))
    unknown = sorted(aggregate.inputs - set(mirrored.columns))
    if unknown:
        raise _fail(path, f"uses {unknown}, which are not columns of {source}")
    inexact = sorted(c for c in aggregate.sums.values() if normalize(mirrored.columns[c]).partition("(")[0]
                     not in _SUMMABLE)
    if inexact:
        raise _fail(f"{path}.sums", f"{inexact} are not of an exact type {_SUMMABLE}: a float sum depends on the order "
                    "of its additions, so it could never be checked")
    return aggregate


def parse_mirror(data: Mapping[str, Any], path: str = "mirror") -> MirrorDefinition:
    """A ``mirror`` section, checked; every error names its place in the definition."""
    _known_keys(path, data, MIRROR_KEYS)
    prefix = data.get("topic_prefix")
    if not isinstance(prefix, str) or not prefix:
        raise _fail(f"{path}.topic_prefix", "must name the connector's topic.prefix")
    entries = data.get("tables")
    if not isinstance(entries, list) or not entries:
        raise _fail(f"{path}.tables", "must list the tables to mirror")
    tables: dict[str, MirrorTarget] = {}
    patterns = []
    for index, entry in enumerate(_entries(f"{path}.tables", entries)):
        where = f"{path}.tables[{index}]"
        if "source_pattern" in entry:
            patterns.append(_pattern(where, entry))
            continue
        table = _table(where, entry)
        if table.source in tables:
            raise _fail(where, f"{table.source!r} is mirrored twice")
        tables[table.source] = table
    targets = [t.table for t in tables.values()]
    if len(set(targets)) != len(targets):
        raise _fail(f"{path}.tables", "two source tables share one target table")
    aggregates = tuple(_aggregate(f"{path}.aggregates[{index}]", entry, tables)
                       for index, entry in enumerate(_entries(f"{path}.aggregates", data.get("aggregates", []))))
    placeholder = data.get("placeholder", DEFAULT_PLACEHOLDER)
    return MirrorDefinition(prefix, tables, tuple(patterns), aggregates, str(placeholder),
                            _transactions(f"{path}.transactions", data.get("transactions", PER_KEY)))


def _transactions(path: str, value: Any) -> str:
    if value not in TRANSACTION_MODES:
        raise _fail(path, f"must be one of {', '.join(TRANSACTION_MODES)}, got {value!r}: {WHOLE} applies each source "
                    f"transaction whole (needs the connector's provide.transaction.metadata=true), {PER_KEY} applies "
                    "each key's last change per batch")
    return str(value)


def target_from_schema(pattern: TablePattern, source: str, key_fields: Mapping[str, FieldSchema] | None,
                       row_fields: Mapping[str, FieldSchema] | None) -> MirrorTarget:
    """A pattern's target for ``source``, from one of its change records' schemas: the key's
    fields are the key columns; each column's type is the pattern's ``columns`` entry, else
    the one its event schema names. A column whose type neither tells is refused by name."""
    if not key_fields or not row_fields:
        raise MirrorError(f"{source}: a table mirrored by pattern {pattern.pattern!r} needs change events with "
                          "schemas (key.converter.schemas.enable=true and value.converter.schemas.enable=true on the "
                          "connector, with column.propagate.source.type), or list the table under tables with its "
                          "key and columns")
    columns: dict[str, str] = {}
    untyped = []
    for column, schema in row_fields.items():
        pg_type = pattern.columns.get(column) or event_type(schema)
        if pg_type is None:
            untyped.append(column)
        else:
            columns[column] = pg_type
    if untyped:
        raise MirrorError(f"{source}: the events do not tell the types of columns {untyped}: name them under the "
                          f"pattern's columns, or set column.propagate.source.type on the connector")
    return MirrorTarget(source, pattern.target_name(source), tuple(key_fields), columns)
