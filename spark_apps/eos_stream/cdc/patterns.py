"""Tables a mirror definition names by pattern (``source_pattern``): their targets made from
the change events' own schemas, in the transaction of the first batch that carries them.

On the executors (:class:`Router`), a record of a table that no entry lists but a pattern
matches is typed by its own schema (``definition.target_from_schema``: the record key's
fields are the key, the value schema's columns with their types the columns) and staged with
a ``_create`` cell naming the target's source, table, key and columns. A record of such a
table without schemas, or with a column whose type its schema does not tell, is the
pipeline's fault, not the record's: it is staged with a refusal in ``_create``.

In the batch's transaction, before the apply (:func:`batch_targets`), the driver reads the
distinct ``_create`` cells. A refusal fails the batch, naming the table and the fix. Each
target that does not exist yet is created (``CREATE TABLE IF NOT EXISTS``, the key's fields
as primary key), and a column a later schema carries is added by the schema-change rules
(``schema_changes``). All of it runs in the batch's transaction, with the rows and the
offsets: a crash leaves neither the table nor the rows.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.cdc import mirror_sql
from spark_apps.eos_stream.cdc.definition import MirrorDefinition, target_from_schema
from spark_apps.eos_stream.cdc.envelope import EnvelopeError, decode_change, parse_envelope
from spark_apps.eos_stream.cdc.mirror import MirrorError, MirrorTarget, Resolved, TargetRefused
from spark_apps.eos_stream.cdc.schema_changes import SchemaChangeRefused, plan_schema_changes, stored_columns
from spark_apps.eos_stream.cdc.values import DEFAULT_PLACEHOLDER, FieldSchema, Placeholders
from spark_apps.eos_stream.events import emit
from spark_apps.eos_stream.state.ddl import run_ddl


def create_cell(target: MirrorTarget) -> str:
    """The ``_create`` cell of a pattern table's change: what its target is made of. The same
    schema always gives the same text (columns in the schema's order), so a batch's changes
    collapse to one cell per schema under ``SELECT DISTINCT``."""
    return json.dumps({"source": target.source, "table": target.table, "key": list(target.key),
                       "columns": dict(target.columns)}, separators=(",", ":"))


def refusal_cell(source: str, why: str) -> str:
    return json.dumps({"source": source, "refused": why}, separators=(",", ":"))


class Router:
    """Resolves each record of a mirror definition to its change and target on the executors:
    a listed table's target from the definition, a pattern table's from the record's schema."""

    def __init__(self, definition: MirrorDefinition) -> None:
        self.definition = definition
        self.placeholders = Placeholders(definition.placeholder or DEFAULT_PLACEHOLDER)

    def resolve(self, key: bytes | None, value: bytes | None) -> Resolved | None:
        """(change, target, ``_create`` cell or None) of one record; None for a tombstone.

        :raises EnvelopeError: the record's fault (dead-lettered).
        :raises TargetRefused: a pattern table whose target the record cannot tell."""
        raw = parse_envelope(key, value)
        if raw is None:
            return None
        definition = self.definition
        target = definition.route(raw.source_table)
        create = None
        if target is None:
            pattern = definition.pattern_for(raw.source_table)
            if pattern is None:
                raise EnvelopeError(f"no mirror target for source table {raw.source_table!r}")
            try:
                target = target_from_schema(pattern, raw.source_table, raw.key_schema, raw.row_schema)
            except MirrorError as exc:
                raise TargetRefused(pattern.target_name(raw.source_table),
                                    refusal_cell(raw.source_table, str(exc))) from None
            create = create_cell(target)
        return decode_change(raw, target.columns, self.placeholders), target, create


def _typed(pg_type: str) -> FieldSchema:
    """An event schema naming ``pg_type`` exactly, for ``plan_schema_changes``."""
    return FieldSchema("string", None, {"__debezium.source.column.type": pg_type})


def _one_source(table: str, cells: list[Mapping[str, Any]], listed: Collection[str]) -> tuple[str, tuple[str, ...]]:
    """The one source table and key of a pattern target's cells, or the batch is refused."""
    sources = sorted({c["source"] for c in cells})
    if len(sources) > 1 or table in listed:
        also = " and a listed table" if table in listed else ""
        raise SchemaChangeRefused(
            f"target table {table!r} would mirror {sources}{also}: give the pattern a target that tells them apart "
            "(e.g. target: {schema}_{table}), then restart")
    keys = sorted({tuple(c["key"]) for c in cells})
    if len(keys) > 1:
        raise SchemaChangeRefused(f"the key of {sources[0]} changed within one batch ({keys}): a mirror's key is "
                                  f"the target {table!r}'s primary key; re-create the target with the new key, "
                                  "then restart")
    return sources[0], keys[0]


def _target_for_batch(cur: Any, target_schema: str, table: str, cells: list[Mapping[str, Any]],
                      stored: Mapping[str, str] | None, listed: Collection[str]) -> MirrorTarget:
    """The pattern target as this batch writes it: created if missing, grown by the columns
    the batch's schemas carry and the table lacks (a changed type refused)."""
    source, key = _one_source(table, cells, listed)
    if stored is None:
        created = MirrorTarget(source, table, key, cells[0]["columns"])
        run_ddl(cur, [mirror_sql.target_ddl(created, target_schema)])
        emit("mirror_target_created", table=table, source=source, key=list(key), columns=dict(created.columns))
        stored = created.columns
    target = MirrorTarget(source, table, key, stored)
    seen: dict[str, str] = {}
    for cell in cells:
        for column, pg_type in cell["columns"].items():
            if seen.setdefault(column, pg_type) != pg_type:
                raise SchemaChangeRefused(f"column {column!r} of {source} arrives as {seen[column]} and as "
                                          f"{pg_type} in one batch: ALTER the target column, then restart")
    plan = plan_schema_changes(target, target_schema, {c: _typed(t) for c, t in seen.items()})
    if plan.add:
        run_ddl(cur, plan.add)
        target = dataclasses.replace(target, columns={**target.columns, **plan.new_columns})
        emit("mirror_columns_added", table=table, columns=plan.new_columns)
    return target


def batch_targets(cur: Any, stage: Any, target_schema: str, listed: Collection[str]) -> list[MirrorTarget]:
    """The targets of the pattern tables a staged batch carries, created or grown on ``cur``
    (the batch's transaction). ``listed``: the definition's own target tables.

    :raises SchemaChangeRefused: a record's target cannot be made (no schemas, an untyped
        column), two sources share a target, or a key or type changed: no record is at fault."""
    cur.execute(sql.SQL("SELECT DISTINCT _create FROM {} WHERE _create IS NOT NULL").format(stage))
    cells = [json.loads(row[0]) for row in cur.fetchall()]
    refusals = sorted({c["refused"] for c in cells if "refused" in c})
    if refusals:
        raise SchemaChangeRefused("; ".join(refusals))
    by_table: dict[str, list[Mapping[str, Any]]] = {}
    for cell in cells:
        by_table.setdefault(cell["table"], []).append(cell)
    if not by_table:
        return []
    stored = stored_columns(cur, target_schema, sorted(by_table))
    return [_target_for_batch(cur, target_schema, table, by_table[table], stored.get(table), listed)
            for table in sorted(by_table)]
