"""SQL of the aggregates fed by a mirror: per-group deltas from the mirror's rows before and
after the batch (``deltas.deltas_from_states``), in the mirror's own apply statement.

Every CTE of a statement reads the snapshot from before it, so the target table read here
holds each key's row before the batch, while the upsert's RETURNING gives the row after.
Old rows are taken for the keys the statement deletes or upserts, never for a quarantined
update's key, whose stored row stays. Per group: ``row count += new rows - old rows``, each
sum ``+= new values - old values`` (NULL as 0). Groups left with no rows are removed by a
second statement of the batch's transaction (``prune_empty_groups``): one statement cannot
touch a row twice. The aggregate table needs a unique index on its group columns with
``NULLS NOT DISTINCT`` when a group column can be NULL (as GROUP BY gathers NULLs in one group).
"""

from __future__ import annotations

from psycopg2 import sql

from spark_apps.eos_stream.cdc.deltas import ChangeAggregate
from spark_apps.eos_stream.cdc.mirror import MirrorTarget


def _qualified(schema: str, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def _contribution(aggregate: ChangeAggregate, alias: str, sign: str) -> sql.Composed:
    groups = [sql.SQL("{} AS {}").format(sql.Identifier(alias, g), sql.Identifier(g)) for g in aggregate.group_by]
    sums = [sql.SQL("{}COALESCE({}, 0) AS {}").format(sql.SQL(sign), sql.Identifier(alias, source), sql.Identifier(col))
            for col, source in aggregate.sums.items()]
    count = sql.SQL("{}1 AS {}").format(sql.SQL(sign), sql.Identifier(aggregate.count_column))
    return sql.SQL(", ").join([*groups, count, *sums])


def aggregate_cte(aggregate: ChangeAggregate, mirror: MirrorTarget, target_schema: str, *, last: str, upserted: str,
                  name: str) -> sql.Composed:
    """``name AS (INSERT ... ON CONFLICT DO UPDATE)``: the batch's deltas of one aggregate.
    ``last`` is the mirror's last-change CTE, ``upserted`` its upsert (RETURNING the new rows)."""
    table = _qualified(target_schema, aggregate.table)
    mirror_table = _qualified(target_schema, mirror.table)
    groups = sql.SQL(", ").join(sql.Identifier(g) for g in aggregate.group_by)
    values = [aggregate.count_column, *aggregate.sums]
    same = sql.SQL(" AND ").join(sql.SQL("{} = {}").format(sql.Identifier("t", k), sql.Identifier("l", k))
                                 for k in mirror.key)
    written = sql.SQL(" AND ").join(sql.SQL("{} = {}").format(sql.Identifier("w", k), sql.Identifier("t", k))
                                    for k in mirror.key)
    return sql.SQL(
        "{name} AS (INSERT INTO {table} ({groups}, {columns})"
        " SELECT {groups}, {sums} FROM ("
        "SELECT {new} FROM {upserted} n"
        " UNION ALL SELECT {old} FROM {mirror_table} t JOIN {last} l ON {same}"
        " WHERE l._op = 'd' OR EXISTS (SELECT 1 FROM {upserted} w WHERE {written})"
        ") x GROUP BY {groups} ORDER BY {groups}"
        " ON CONFLICT ({groups}) DO UPDATE SET {updates} RETURNING 1)"
    ).format(
        name=sql.Identifier(name), table=table, groups=groups,
        columns=sql.SQL(", ").join(sql.Identifier(c) for c in values),
        sums=sql.SQL(", ").join(sql.SQL("sum({})").format(sql.Identifier(c)) for c in values),
        new=_contribution(aggregate, "n", ""), upserted=sql.Identifier(upserted),
        old=_contribution(aggregate, "t", "-"), mirror_table=mirror_table, last=sql.Identifier(last), same=same,
        written=written,
        updates=sql.SQL(", ").join(sql.SQL("{c} = {t}.{c} + EXCLUDED.{c}").format(c=sql.Identifier(c), t=table)
                                   for c in values))


def prune_empty_groups(aggregate: ChangeAggregate, target_schema: str) -> sql.Composed:
    """Removes the groups the batch left with no rows (run after the apply, in its transaction)."""
    return sql.SQL("DELETE FROM {} WHERE {} = 0").format(
        _qualified(target_schema, aggregate.table), sql.Identifier(aggregate.count_column))


def aggregate_ddl(aggregate: ChangeAggregate, mirror: MirrorTarget, target_schema: str) -> sql.Composed:
    """CREATE TABLE IF NOT EXISTS for an aggregate: its group columns typed as the mirror's,
    unique with NULLS NOT DISTINCT (PostgreSQL 15+), the count and the sums as numeric."""
    columns = [sql.SQL("{} {}").format(sql.Identifier(g), sql.SQL(mirror.columns[g])) for g in aggregate.group_by]
    columns.append(sql.SQL("{} bigint NOT NULL").format(sql.Identifier(aggregate.count_column)))
    columns += [sql.SQL("{} numeric NOT NULL").format(sql.Identifier(c)) for c in aggregate.sums]
    return sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, UNIQUE NULLS NOT DISTINCT ({}))").format(
        _qualified(target_schema, aggregate.table), sql.SQL(", ").join(columns),
        sql.SQL(", ").join(sql.Identifier(g) for g in aggregate.group_by))
