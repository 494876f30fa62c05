"""SQL that applies a staged batch of changes to its mirror targets, in one statement.

Per target, over the batch's staged changes (``mirror.STAGE_COLUMNS``):

1. ``k``: the target's changes, their key values cast to the key columns' types (a key the
   database refuses fails the statement as a data error, so isolation finds its record);
2. ``l``: the last change of each key, highest (partition, offset) first;
3. ``m``: the row the key's changes leave, merged since its last full image (create,
   snapshot read or delete) in Kafka order, later values winning (``jsonb_object_agg``
   keeps a key's last value). A column no change carried (an unchanged TOASTed value, a
   column dropped at the source) is absent, and the stored value stays. A key whose last
   change carries every column needs no merge: its ``after`` is the row;
4. ``q``: an update whose unread columns no change of the batch supplied, for a key the
   target has no row of: it is quarantined (the mirror cannot know those values);
5. ``u``: INSERT ... ON CONFLICT (key) DO UPDATE of every other non-delete key. A column
   the merged row lacks takes the stored value, read in the same statement (its TOAST
   pointer is kept, never rewritten); values are cast from text here, judged by the database;
6. ``d``: DELETE of the keys whose last change is a delete;
7. ``a``: the deltas of each aggregate the target feeds (``aggregate_sql``), from the rows
   the upsert returns and the stored rows of the keys it writes or deletes.

Keys are distinct after step 2, so the upsert and the delete of one statement never touch
one row twice (a primary-key change is a delete of one key and a create of another). Each
CTE reads the snapshot from before the statement, which is what step 5 wants of ``t``.
Identifiers are quoted and values bound, as in ``sink/apply_sql.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from psycopg2 import sql

from spark_apps.eos_stream.cdc.aggregate_sql import aggregate_cte
from spark_apps.eos_stream.cdc.deltas import ChangeAggregate
from spark_apps.eos_stream.cdc.mirror import MirrorTarget
from spark_apps.eos_stream.sink import apply_sql
from spark_apps.eos_stream.state import meta_tables


def _qualified(schema: str, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def _idents(names: Sequence[str], prefix: str | None = None) -> sql.Composed:
    if prefix is None:
        return sql.SQL(", ").join(sql.Identifier(n) for n in names)
    return sql.SQL(", ").join(sql.Identifier(prefix, n) for n in names)


def _keys_match(key: Sequence[str], left: str, right: str) -> sql.Composed:
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, k), sql.Identifier(right, k)) for k in key)


def fresh_statement(stage: sql.Composable, meta_schema: str, *, skip_applied: bool, dedupe: bool,
                    only_range: bool) -> sql.Composed:
    """The batch's staged records not applied yet (the same conditions as the row pipeline's
    ``fresh``: stored offsets, one copy per coordinate, an isolated range)."""
    conditions = [sql.SQL("TRUE")]
    join = sql.SQL("")
    if skip_applied:
        join = sql.SQL(" LEFT JOIN {} o ON o.pipeline = %(pipeline)s AND o.topic = s._topic"
                       " AND o.partition = s._partition").format(meta_tables.table(meta_schema, meta_tables.OFFSETS))
        conditions.append(sql.SQL("s._offset >= COALESCE(o.next_offset, 0)"))
    if only_range:
        conditions.append(sql.SQL(
            "(s._topic, s._partition, s._offset) >= (%(first_topic)s, %(first_partition)s, %(first_offset)s)"
            " AND (s._topic, s._partition, s._offset) <= (%(last_topic)s, %(last_partition)s, %(last_offset)s)"))
    return sql.SQL(
        "SELECT {distinct}s._topic, s._partition, s._offset, s._key, s._value, s._error, s._target, s._op,"
        " CAST(s._keys AS jsonb) AS _keys, CAST(s._after AS jsonb) AS _after,"
        " CAST(s._unchanged AS jsonb) AS _unchanged FROM {stage} s{join} WHERE {where}"
    ).format(distinct=sql.SQL("DISTINCT ON (s._topic, s._partition, s._offset) ") if dedupe else sql.SQL(""),
             stage=stage, join=join, where=sql.SQL(" AND ").join(conditions))


def _changes(target: MirrorTarget, name: str) -> sql.Composed:
    casts = sql.SQL(", ").join(
        sql.SQL("CAST(_keys->>{} AS {}) AS {}").format(sql.Literal(k), sql.SQL(target.columns[k]), sql.Identifier(k))
        for k in target.key)
    return sql.SQL(
        "{name} AS (SELECT {casts}, _topic, _partition, _offset, _key, _value, _op, _after, _unchanged"
        " FROM fresh WHERE _error IS NULL AND _op IS NOT NULL AND _target = {table})"
    ).format(name=sql.Identifier(name), casts=casts, table=sql.Literal(target.table))


def _last(target: MirrorTarget, changes: str, name: str) -> sql.Composed:
    """The key's last change, with ``_reset``: the position of its last full image (create,
    snapshot read or delete), where the merge of its row starts."""
    keys = _idents(target.key)
    return sql.SQL(
        "{name} AS (SELECT DISTINCT ON ({keys}) {keys}, _topic, _partition, _offset, _key, _value, _op, _after,"
        " _unchanged,"
        " max(ARRAY[_partition::bigint, _offset]) FILTER (WHERE _op <> 'u') OVER (PARTITION BY {keys}) AS _reset"
        " FROM {changes} ORDER BY {keys}, _partition DESC, _offset DESC)"
    ).format(name=sql.Identifier(name), keys=keys, changes=sql.Identifier(changes))


def _whole(target: MirrorTarget, last: str) -> sql.Composed:
    """True for a key whose last change carries every column's value (no unchanged TOASTed
    value, no column missing): the row it leaves is that change's ``after``, whatever came before."""
    return sql.SQL("({last}._op <> 'd' AND {last}._unchanged = '[]'::jsonb AND {last}._after ?& {columns})").format(
        last=sql.Identifier(last), columns=sql.SQL("ARRAY[{}]").format(
            sql.SQL(", ").join(sql.Literal(c) for c in target.columns)))


def _merged(target: MirrorTarget, changes: str, last: str, name: str) -> sql.Composed:
    """The row each key's changes leave. Most keys' last change is whole (``_whole``): its
    ``after`` is the row, and only the others are merged column by column (``jsonb_each`` of
    every change since the key's last full image, the most expensive step of the apply)."""
    whole = _whole(target, "l")
    return sql.SQL(
        "{name} AS (SELECT {lkeys}, l._after FROM {last} l WHERE {whole}"
        " UNION ALL SELECT {lkeys}, jsonb_object_agg(e.key, e.value ORDER BY c._partition, c._offset) AS _after"
        " FROM {last} l JOIN {changes} c ON {same}"
        " CROSS JOIN LATERAL jsonb_each(c._after) e"
        " WHERE l._op <> 'd' AND NOT {whole}"
        " AND ARRAY[c._partition::bigint, c._offset] >= COALESCE(l._reset, ARRAY[-1, -1]::bigint[])"
        " GROUP BY {lkeys})"
    ).format(name=sql.Identifier(name), lkeys=_idents(target.key, "l"), last=sql.Identifier(last),
             changes=sql.Identifier(changes), same=_keys_match(target.key, "c", "l"), whole=whole)


def _unreadable(last: str, merged: str) -> sql.Composed:
    """True for an update that leaves a column unread that no change of the batch gave.

    Its first conditions read the last change alone, so the planner filters ``last`` before
    joining it with ``merged``: the CTEs have no statistics, and a join of every update with
    every merged row (a nested loop over both) was quadratic in the batch's keys."""
    return sql.SQL(
        "({last}._op = 'u' AND {last}._unchanged <> '[]'::jsonb"
        " AND EXISTS (SELECT 1 FROM jsonb_array_elements_text({last}._unchanged) x(c)"
        " WHERE NOT {merged}._after ? x.c))").format(last=sql.Identifier(last), merged=sql.Identifier(merged))


def _quarantine(target: MirrorTarget, table: sql.Composed, meta_schema: str, last: str, merged: str,
                name: str) -> sql.Composed:
    error = (f"update of a {target.table!r} row the mirror does not hold, leaving columns unread "
             "(unchanged TOASTed values Debezium could not send): the change stream lacks the row's earlier "
             "changes (a skipped snapshot?); re-snapshot the table, or give it REPLICA IDENTITY FULL. Key: ")
    return sql.SQL(
        "{name} AS (INSERT INTO {dlq} (pipeline, topic, partition, \"offset\", key, value, error)"
        " SELECT %(pipeline)s, l._topic, l._partition, l._offset, l._key, l._value, {error} || {keyjson}"
        " FROM {last} l JOIN {merged} m ON {same} LEFT JOIN {table} t ON {stored} AND l._reset IS NULL"
        " WHERE {unreadable} AND t.{first} IS NULL ON CONFLICT DO NOTHING RETURNING 1)"
    ).format(name=sql.Identifier(name), dlq=meta_tables.table(meta_schema, meta_tables.DEAD_LETTERS),
             error=sql.Literal(error), keyjson=sql.SQL("jsonb_build_object({})::text").format(sql.SQL(", ").join(
                 sql.SQL("{}, {}").format(sql.Literal(k), sql.Identifier("l", k)) for k in target.key)),
             last=sql.Identifier(last), merged=sql.Identifier(merged), same=_keys_match(target.key, "m", "l"),
             table=table, stored=_keys_match(target.key, "t", "l"), unreadable=_unreadable("l", "m"),
             first=sql.Identifier(target.key[0]))


def _upsert(target: MirrorTarget, table: sql.Composed, last: str, merged: str, name: str) -> sql.Composed:
    values = [sql.SQL("CASE WHEN m._after ? {c} THEN CAST(m._after->>{c} AS {t}) ELSE t.{col} END").format(
        c=sql.Literal(c), t=sql.SQL(target.columns[c]), col=sql.Identifier(c)) for c in target.value_columns]
    conflict = sql.SQL("DO NOTHING") if not values else sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
        sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in target.value_columns))
    return sql.SQL(
        "{name} AS (INSERT INTO {table} ({columns}) SELECT {lkeys}{values} FROM {last} l JOIN {merged} m ON {same}"
        " LEFT JOIN {table} t ON {stored} AND l._reset IS NULL WHERE NOT ({unreadable} AND t.{first} IS NULL)"
        " ORDER BY {lkeys} ON CONFLICT ({keys}) {conflict} RETURNING *)"
    ).format(name=sql.Identifier(name), table=table, columns=_idents([*target.key, *target.value_columns]),
             lkeys=_idents(target.key, "l"), values=sql.SQL("").join(sql.SQL(", ") + v for v in values),
             last=sql.Identifier(last), merged=sql.Identifier(merged), same=_keys_match(target.key, "m", "l"),
             stored=_keys_match(target.key, "t", "l"), unreadable=_unreadable("l", "m"),
             first=sql.Identifier(target.key[0]), keys=_idents(target.key), conflict=conflict)


def _delete(target: MirrorTarget, table: sql.Composed, last: str, name: str) -> sql.Composed:
    return sql.SQL("{name} AS (DELETE FROM {table} t USING {last} l WHERE l._op = 'd' AND {same} RETURNING 1)").format(
        name=sql.Identifier(name), table=table, last=sql.Identifier(last), same=_keys_match(target.key, "t", "l"))


def apply_mirror_statement(targets: Sequence[MirrorTarget], *, stage: sql.Composable, target_schema: str,
                           meta_schema: str, skip_applied: bool, dedupe: bool, only_range: bool = False,
                           aggregates: Sequence[ChangeAggregate] = ()) -> sql.Composed:
    """One statement that applies a staged change batch to every mirror target.

    Binds %(pipeline)s (and the range's bounds with ``only_range``); returns one row:
    (records applied, records dead-lettered), the quarantined updates among the latter.
    With ``aggregates``, the batch's transaction then runs ``aggregate_sql.prune_empty_groups``."""
    parts = [sql.SQL("WITH fresh AS MATERIALIZED ({})").format(
        fresh_statement(stage, meta_schema, skip_applied=skip_applied, dedupe=dedupe, only_range=only_range))]
    quarantined = []
    for index, target in enumerate(targets):
        table = _qualified(target_schema, target.table)
        names = {part: f"{part}{index}" for part in ("k", "l", "m", "q", "u", "d")}
        parts += [sql.SQL(", ") + _changes(target, names["k"]),
                  sql.SQL(", ") + _last(target, names["k"], names["l"]),
                  sql.SQL(", ") + _merged(target, names["k"], names["l"], names["m"]),
                  sql.SQL(", ") + _quarantine(target, table, meta_schema, names["l"], names["m"], names["q"]),
                  sql.SQL(", ") + _upsert(target, table, names["l"], names["m"], names["u"]),
                  sql.SQL(", ") + _delete(target, table, names["l"], names["d"])]
        parts += [sql.SQL(", ") + aggregate_cte(aggregate, target, target_schema, last=names["l"],
                                                upserted=names["u"], name=f"a{index}_{number}")
                  for number, aggregate in enumerate(aggregates) if aggregate.source == target.source]
        quarantined.append(sql.SQL("(SELECT count(*) FROM {})").format(sql.Identifier(names["q"])))
    parts.append(sql.SQL(", dlq AS ({})").format(apply_sql.dead_letters_statement(sql.SQL("fresh"), meta_schema)))
    held = sql.SQL(" + ").join(quarantined) if quarantined else sql.SQL("0")
    parts.append(sql.SQL(
        " SELECT count(*) FILTER (WHERE _error IS NULL) - {held}, count(*) FILTER (WHERE _error IS NOT NULL) + {held}"
        " FROM fresh").format(held=held))
    return sql.Composed(parts)


def target_ddl(target: MirrorTarget, target_schema: str) -> sql.Composed:
    """CREATE TABLE IF NOT EXISTS for a mirror target: its columns, the key as primary key.
    No other constraint: the mirror applies a batch's keys in one statement, and a unique
    or foreign key of the source could fail on an order within the batch the source never had."""
    return sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY ({}))").format(
        _qualified(target_schema, target.table),
        sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in target.columns.items()),
        _idents(target.key))
