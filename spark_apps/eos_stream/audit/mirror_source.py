"""The source audit of a mirror: a mirror pipeline's targets against its source database.

A mirror is right when every target table holds its source table's rows and every aggregate
holds its ``GROUP BY`` over the source table. Source and target are usually two databases,
often on two servers, so no ``EXCEPT`` can join them: each side is read in one REPEATABLE
READ, READ ONLY transaction through a server-side cursor, ordered by key, and the two
streams are merged in this process (memory stays at one fetch per side, whatever the size).

Rules:

* **Keys order both sides alike.** Rows are ordered by their key columns' text in the ``C``
  collation, NULLs first (an aggregate's group may be NULL), which is the order Python gives
  those strings, so the merge needs no collation of either server and the key's type may
  differ between the sides.
* **Values compare as values.** ``1.50`` equals ``1.5`` (numeric), two ``timestamptz``
  values at one instant are equal whatever the session's time zone, ``jsonb`` compares as a
  document. A sum over NULLs is 0, as the aggregate adds a NULL as nothing. A row counts
  once as ``differing`` when its key is on both sides with other values, as ``missing`` or
  ``extra`` when its key is on one side only.
* **The source's columns are compared.** A column the mirror keeps after the source dropped
  it is not compared (``docs/cdc.md``, "Schema changes"); a source column the target lacks
  is reported in ``missing_columns`` and makes the table wrong.
* **Only a quiet point is exact.** The audit cannot know which source transactions the mirror
  has applied: run it once the source is quiet and the pipeline has caught up with the
  change topics' last stable offset (the health DAG's ``caught_up`` check). Otherwise a
  difference may be a change still in flight, and the report says it is not conclusive.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import ISOLATION_LEVEL_REPEATABLE_READ

from spark_apps.eos_stream.cdc.definition import MirrorDefinition
from spark_apps.eos_stream.cdc.deltas import ChangeAggregate
from spark_apps.eos_stream.cdc.mirror import MirrorTarget

FETCH_ROWS = 10_000
EXAMPLES = 5
# (the key: per column (not NULL, its text), in the database's sort order; the row's values)
Keyed = tuple[tuple[tuple[bool, str], ...], tuple[Any, ...]]


@dataclass
class Comparison:
    """One target against its source: counts, and a few keys of each kind of difference."""

    target: str
    source_rows: int = 0
    target_rows: int = 0
    missing: int = 0
    extra: int = 0
    differing: int = 0
    missing_columns: list[str] = field(default_factory=list)
    examples: dict[str, list[list[str | None]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.differing or self.missing_columns)

    def note(self, kind: str, key: tuple[tuple[bool, str], ...]) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        shown = self.examples.setdefault(kind, [])
        if len(shown) < EXAMPLES:
            shown.append([text if present else None for present, text in key])

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "ok": self.ok, "source_rows": self.source_rows,
                "target_rows": self.target_rows, "missing": self.missing, "extra": self.extra,
                "differing": self.differing, "rows_that_differ": self.missing + self.extra + self.differing,
                "missing_columns": self.missing_columns, "examples": self.examples}


def comparable(value: Any) -> Any:
    """A value as the audit compares it: numbers by value, documents by content, bytes as bytes."""
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, list | tuple):
        return tuple(comparable(v) for v in value)
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, float):
        return Decimal(repr(value))
    return value


def merge(comparison: Comparison, source: Iterator[Keyed], target: Iterator[Keyed]) -> Comparison:
    """Counts the rows of two key-ordered streams that differ (``Keyed`` rows, keys unique)."""
    end = object()
    left: Any = next(source, end)
    right: Any = next(target, end)
    while left is not end or right is not end:
        if right is end or (left is not end and left[0] < right[0]):
            comparison.source_rows += 1
            comparison.note("missing", left[0])
            left = next(source, end)
        elif left is end or right[0] < left[0]:
            comparison.target_rows += 1
            comparison.note("extra", right[0])
            right = next(target, end)
        else:
            comparison.source_rows += 1
            comparison.target_rows += 1
            if tuple(map(comparable, left[1])) != tuple(map(comparable, right[1])):
                comparison.note("differing", left[0])
            left, right = next(source, end), next(target, end)
    return comparison


def _columns(cur: Any, schema: str, table: str) -> list[str]:
    cur.execute("SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s"
                " AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum", (schema, table))
    return [row[0] for row in cur.fetchall()]


def _ordered(conn: Any, name: str, schema: str, table: str, key: list[str], columns: list[str],
             group: bool = False, sums: dict[str, str] | None = None) -> Iterator[Keyed]:
    """The table's rows (or, with ``group``, its ``GROUP BY key`` totals) ordered by the key's
    text in the ``C`` collation, through a server-side cursor."""
    key_text = [sql.SQL("{}::text").format(sql.Identifier(k)) for k in key]
    if group:
        values = [*(sql.Identifier(k) for k in key), sql.SQL("count(*)"),
                  *(sql.SQL("COALESCE(sum({}), 0)").format(sql.Identifier(c)) for c in (sums or {}).values())]
    else:
        values = [sql.Identifier(c) for c in columns]
    query = sql.SQL("SELECT {}, {} FROM {}.{} {} ORDER BY {}").format(
        sql.SQL(", ").join(key_text), sql.SQL(", ").join(values), sql.Identifier(schema), sql.Identifier(table),
        sql.SQL("GROUP BY {}").format(sql.SQL(", ").join(map(sql.Identifier, key))) if group else sql.SQL(""),
        sql.SQL(", ").join(sql.SQL('{} COLLATE "C" NULLS FIRST').format(t) for t in key_text))
    with conn.cursor(name=name) as cur:
        cur.itersize = FETCH_ROWS
        cur.execute(query)
        for row in cur:
            yield tuple((False, "") if k is None else (True, k) for k in row[:len(key)]), tuple(row[len(key):])


def compare_table(source: Any, target: Any, mirror: MirrorTarget, target_schema: str) -> Comparison:
    """One mirror target against its source table, over the source's columns."""
    schema, table = mirror.source.split(".", 1)
    comparison = Comparison(mirror.table)
    with source.cursor() as cur:
        source_columns = _columns(cur, schema, table)
    with target.cursor() as cur:
        target_columns = set(_columns(cur, target_schema, mirror.table))
    if not source_columns:
        raise LookupError(f"the source table {mirror.source} does not exist in the source database")
    comparison.missing_columns = [c for c in source_columns if c not in target_columns]
    shared = [c for c in source_columns if c in target_columns]
    key = list(mirror.key)
    return merge(comparison, _ordered(source, "eos_audit_source", schema, table, key, shared),
                 _ordered(target, "eos_audit_target", target_schema, mirror.table, key, shared))


def compare_aggregate(source: Any, target: Any, aggregate: ChangeAggregate, target_schema: str) -> Comparison:
    """An aggregate target against ``GROUP BY`` over its source table."""
    schema, table = aggregate.source.split(".", 1)
    key = list(aggregate.group_by)
    stored = [aggregate.count_column, *aggregate.sums]
    return merge(Comparison(aggregate.table),
                 _ordered(source, "eos_audit_source", schema, table, key, [], group=True, sums=dict(aggregate.sums)),
                 _ordered(target, "eos_audit_target", target_schema, aggregate.table, key, [*key, *stored]))


def _snapshot(conn: Any) -> None:
    """One REPEATABLE READ, READ ONLY transaction, values rendered alike on both servers."""
    conn.set_session(isolation_level=ISOLATION_LEVEL_REPEATABLE_READ, readonly=True, autocommit=False)
    with conn.cursor() as cur:
        cur.execute("SET LOCAL TimeZone = 'UTC'; SET LOCAL extra_float_digits = 3")


def audit_against_source(source: Any, target: Any, definition: MirrorDefinition, target_schema: str) -> dict[str, Any]:
    """The report of every target of ``definition``: ``ok`` only when each equals its source."""
    _snapshot(source)
    _snapshot(target)
    try:
        tables = [compare_table(source, target, t, target_schema) for t in definition.tables.values()]
        aggregates = [compare_aggregate(source, target, a, target_schema) for a in definition.aggregates]
    finally:
        source.rollback()
        target.rollback()
    every = tables + aggregates
    return {"ok": all(c.ok for c in every), "tables": [c.as_dict() for c in tables],
            "aggregates": [c.as_dict() for c in aggregates],
            "rows_that_differ": sum(c.missing + c.extra + c.differing for c in every)}


def main(argv: list[str] | None = None) -> int:
    """``python -m spark_apps.eos_stream.audit.mirror_source --config pipeline.json --source DSN``:
    prints the report as JSON; exits 0 when every target equals its source, 1 otherwise."""
    import argparse

    import psycopg2

    from spark_apps.eos_stream.cdc.definition import parse_mirror
    from spark_apps.eos_stream.run.config import add_config_arguments, config_from_arguments

    parser = argparse.ArgumentParser(prog="python -m spark_apps.eos_stream.audit.mirror_source",
                                     description="Audit a mirror pipeline's targets against its source database")
    add_config_arguments(parser)
    parser.add_argument("--source", required=True,
                        help="the source database as a libpq connection string without a password "
                             "(libpq reads it from PGPASSWORD or PGPASSFILE)")
    args = parser.parse_args(argv)
    if "password" in args.source.lower():
        parser.error("--source must not hold a password: a command line is visible to every user of the "
                     "machine; set PGPASSWORD or a PGPASSFILE instead")
    config = config_from_arguments(args)
    if config.mirror is None:
        parser.error(f"pipeline {config.pipeline} is not a mirror pipeline (its spec is {config.spec!r})")
    definition = parse_mirror(config.mirror)
    source, target = psycopg2.connect(args.source), psycopg2.connect(**config.postgres.dsn_kwargs())
    try:
        report = audit_against_source(source, target, definition, config.target_schema)
    finally:
        source.close()
        target.close()
    print(json.dumps({"pipeline": config.pipeline, **report}, indent=2, sort_keys=True, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
