"""What a mirror does when the source's columns change (docs/cdc.md, "Schema changes").

Decided per batch, on the driver, before the apply, from the columns the batch's changes
carry (each with its Connect schema when the converter sends one):

* **A new column** (in ``after`` but not in the target): added, with ``ALTER TABLE ADD
  COLUMN`` in the batch's own transaction, when its type is known: the exact source type
  that ``column.propagate.source.type`` puts in the schema's parameters, or a Connect type
  that names one PostgreSQL type. A plain string (text? varchar? a numeric in string
  mode? a uuid?) names none, and a record without schema names nothing: the batch is
  refused, naming the column and the fix. Never guessed: a wrong guess would be a silent
  type change.
* **A dropped column** (known to the target, absent from an ``after``): kept. Rows the
  source updates keep their stored value, new rows get NULL (``mirror_sql``); nothing is
  deleted. The plan names it, for a warning.
* **A changed type** (a known column whose event type is not the target's, nor one it
  holds without loss): refused, naming the column, both types and the fix. The mirror
  never converts a column by itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_apps.eos_stream.cdc.mirror import MirrorTarget
from spark_apps.eos_stream.cdc.pg_types import TypeNameError, check_pg_type, event_type, holds
from spark_apps.eos_stream.cdc.values import FieldSchema
from spark_apps.eos_stream.state.ddl import AddColumn


class SchemaChangeRefused(RuntimeError):
    """The batch carries a schema change the mirror will not make by itself."""


@dataclass
class SchemaPlan:
    """:param add: columns to add in the batch's transaction (``ddl.run_ddl`` runs them).
    :param new_columns: the columns added, with their types, for the target's definition.
    :param dropped: known columns some change of the batch lacked: kept, named for a warning."""

    add: list[AddColumn] = field(default_factory=list)
    new_columns: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


def _refusal_for_new(target: MirrorTarget, column: str, schema: FieldSchema | None) -> str:
    why = ("the events carry no schema" if schema is None
           else f"its event type ({schema.type}{', ' + schema.name if schema.name else ''}) names no single type")
    return (f"column {column!r} of {target.source} is new in the change events, and {why}: add it to the "
            f"table's columns in the mirror definition (e.g. {column}: text) and to the target table {target.table!r} "
            "(ALTER TABLE ... ADD COLUMN), or set column.propagate.source.type on the connector with "
            "schemas.enable=true, then restart the pipeline")


def plan_schema_changes(target: MirrorTarget, target_schema: str, seen: Mapping[str, FieldSchema | None],
                        rows_lacking: Iterable[str] = ()) -> SchemaPlan:
    """The batch's schema changes for ``target``: ``seen`` maps every column the batch's
    ``after`` values carry to its event schema (None without); ``rows_lacking`` names known
    columns some ``after`` lacked (neither a value nor the unchanged-TOAST placeholder)."""
    plan = SchemaPlan(dropped=sorted(set(rows_lacking) & set(target.columns)))
    refusals = []
    for column, schema in sorted(seen.items()):
        arriving = event_type(schema)
        declared = target.columns.get(column)
        if declared is None:
            if arriving is None:
                refusals.append(_refusal_for_new(target, column, schema))
                continue
            try:
                pg_type = check_pg_type(column, arriving)
            except TypeNameError as exc:
                refusals.append(f"{target.source}: {exc}")
                continue
            plan.add.append(AddColumn(target_schema, target.table, column, pg_type))
            plan.new_columns[column] = pg_type
        elif arriving is not None and not holds(declared, arriving):
            refusals.append(
                f"column {column!r} of {target.source} changed type: the mirror's {target.table!r} has {declared}, "
                f"the change events carry {arriving}. The mirror never converts a column by itself: ALTER the "
                f"target column to a type that holds {arriving}, change the mirror definition to match, and restart")
    if refusals:
        raise SchemaChangeRefused("; ".join(refusals))
    return plan


def plan_from_shapes(target: MirrorTarget, target_schema: str, shapes: Iterable[str]) -> SchemaPlan:
    """The plan for the distinct ``_shape`` cells of the target's staged changes
    (``SELECT DISTINCT _shape FROM stage WHERE _target = ... AND _shape IS NOT NULL``)."""
    types: dict[str, str | None] = {}
    lacking: set[str] = set()
    for shape in shapes:
        decoded = json.loads(shape)
        lacking.update(decoded["lacking"])
        for column, pg_type in decoded["columns"].items():
            if types.get(column) not in (None, pg_type) and pg_type is not None:
                raise SchemaChangeRefused(f"column {column!r} of {target.source} arrives as {types[column]} and as "
                                          f"{pg_type} in one batch: ALTER the target column, then restart")
            types[column] = types.get(column) or pg_type
    seen = {c: None if t is None else FieldSchema("string", None, {"__debezium.source.column.type": t})
            for c, t in types.items()}
    return plan_schema_changes(target, target_schema, seen, lacking)


def stored_columns(cur: Any, schema: str, tables: list[str]) -> dict[str, dict[str, str]]:
    """Each target table's columns and types as the database holds them."""
    cur.execute(
        "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
        " JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = ANY(%s) AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (schema, tables))
    found: dict[str, dict[str, str]] = {}
    for table, column, pg_type in cur.fetchall():
        found.setdefault(table, {})[column] = pg_type
    return found
