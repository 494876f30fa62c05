"""Running DDL without taking locks it does not need.

``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` takes ACCESS EXCLUSIVE on the table
before it looks for the column. A start that upgrades a table made by an older
version would then queue behind any reader of the target (a long report, a
``LOCK ... IN SHARE MODE``) and fail on ``lock_timeout``, even when there is
nothing to add. ``AddColumn`` asks the catalog first and alters only when the
column is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

from psycopg2 import sql


@dataclass(frozen=True)
class AddColumn:
    """A column added since a table's first release.

    :param schema: the table's schema.
    :param table: the table.
    :param column: the new column.
    :param type: its SQL type; a constant from code, never from configuration.
    """

    schema: str
    table: str
    column: str
    type: str

    def qualified(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.table))

    def statement(self) -> sql.Composed:
        # IF NOT EXISTS still matters: two apps starting at once may both find it missing.
        return sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
            self.qualified(), sql.Identifier(self.column), sql.SQL(self.type))


DdlStatement: TypeAlias = "sql.Composable | AddColumn"


def _has_column(cur: Any, change: AddColumn) -> bool:
    cur.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
        (change.qualified().as_string(cur), change.column),
    )
    return cur.fetchone() is not None


def run_ddl(cur: Any, statements: Iterable[DdlStatement]) -> None:
    """Executes ``statements`` in order on ``cur``; an ``AddColumn`` only if its column is missing."""
    for statement in statements:
        if isinstance(statement, AddColumn):
            if not _has_column(cur, statement):
                cur.execute(statement.statement())
        else:
            cur.execute(statement)
