"""Table checksums: what a snapshot's manifest records per table, what the scratch validation and
the swap's postlude check against it.

Checksum of a table: ``count(*)`` and the sum, as numeric, of the first 64 bits of
``md5(row::text)`` over all rows. It is independent of row order (no sort, constant memory, so it
scales to large tables), a duplicated or lost row changes it, and any changed value changes the
row's md5. Row text depends on session settings, so every session that computes one first sets
TimeZone, DateStyle, IntervalStyle, bytea_output and extra_float_digits (``NORMALIZE``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from airflow_provider_eos.recovery.manifest import TableState

NORMALIZE = (
    "SET TIME ZONE 'UTC'",
    "SET DateStyle = 'ISO, YMD'",
    "SET IntervalStyle = 'postgres'",
    "SET bytea_output = 'hex'",
    "SET extra_float_digits = 3",
)
# Per-row 64-bit hash, summed as numeric: order-independent and exact.
CHECKSUM_COLUMNS = "count(*), coalesce(sum(('x' || substr(md5(t::text), 1, 16))::bit(64)::bigint::numeric), 0)::text"
_CHECKSUM_SQL = "SELECT " + CHECKSUM_COLUMNS + " FROM {table} AS t"  # noqa: S608 -- {table} is an Identifier
TableRef = tuple[str, str]


def checksum_statement(schema: str, table: str) -> sql.Composed:
    return sql.SQL(_CHECKSUM_SQL).format(table=sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table)))


def _checksum(count: Any, total: Any) -> str:
    return f"{int(count)}:{total}"


def compare(expected: Iterable[TableState], actual: dict[TableRef, TableState]) -> list[str]:
    """Differences between manifest tables and measured ones, one line each."""
    problems = []
    for state in expected:
        got = actual.get((state.schema, state.table))
        if got is None:
            problems.append(f"{state.qualified}: missing")
        elif got.rows != state.rows:
            problems.append(f"{state.qualified}: {got.rows} rows, manifest says {state.rows}")
        elif got.checksum != state.checksum:
            problems.append(f"{state.qualified}: checksum {got.checksum} != manifest {state.checksum}")
    return problems


def normalize(cur: Any) -> None:
    """Session settings every checksum is computed under (row text depends on them)."""
    for statement in NORMALIZE:
        cur.execute(statement)


def measure(conn: PgConnection, tables: Iterable[TableRef], roles: dict[TableRef, str] | None = None
            ) -> dict[TableRef, TableState]:
    """Row count and checksum of each table, in ``conn``'s current transaction."""
    out: dict[TableRef, TableState] = {}
    with conn.cursor() as cur:
        normalize(cur)
        for schema, table in tables:
            cur.execute(checksum_statement(schema, table))
            row = cur.fetchone()
            assert row is not None
            out[(schema, table)] = TableState(
                schema, table, int(row[0]), _checksum(*row), (roles or {}).get((schema, table), "target")
            )
    return out
