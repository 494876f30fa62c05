"""SQL that applies one staged micro-batch to the targets.

Everything here is built with psycopg2.sql: identifiers are always quoted and
values always bound, so a table name like ``x"; DROP TABLE y; --`` is just a
name that does not exist.
"""

from __future__ import annotations

from psycopg2 import sql

from spark_apps.eos_stream.records.parsing import staging_columns
from spark_apps.eos_stream.records.spec import SOURCE_COLUMNS, AggregateTarget, PipelineSpec, RowTarget
from spark_apps.eos_stream.state import meta_tables


def _qualified(schema: str, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def _ident_list(names: list[str] | tuple[str, ...]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def apply_batch_statement(
    spec: PipelineSpec,
    *,
    stage: sql.Composed,
    target_schema: str,
    meta_schema: str,
    skip_applied: bool,
    dedupe: bool,
    upsert_rows: bool,
    only_record: bool = False,
    only_range: bool = False,
) -> sql.Composed:
    """One statement that moves a staged batch into every target.

    :param skip_applied: drop records below the pipeline's stored next offset
        (read under the same transaction), so a replayed batch applies nothing twice.
    :param dedupe: keep one staged copy per (topic, partition, offset): a
        retried Spark task may have staged its partition twice.
    :param upsert_rows: ON CONFLICT DO NOTHING on row targets (idempotent mode).
    :param only_record: restrict to the record bound as %(topic)s/%(partition)s/%(offset)s.
    :param only_range: restrict to the records from %(first_topic)s/%(first_partition)s/%(first_offset)s
        to %(last_topic)s/%(last_partition)s/%(last_offset)s, both included, in
        (topic, partition, offset) order (isolating the records of a poisoned batch).

    Binds %(pipeline)s; returns (applied, dead_lettered) counts.
    """
    fresh = _fresh_records(spec, stage, meta_schema, skip_applied=skip_applied, dedupe=dedupe,
                           only_record=only_record, only_range=only_range)
    parts = [sql.SQL("WITH fresh AS MATERIALIZED ({})").format(fresh)]
    for index, target in enumerate(spec.targets):
        table = _qualified(target_schema, target.table)
        if isinstance(target, RowTarget):
            statement = _rows_from_records(table, target, upsert_rows)
        else:
            statement = _aggregate_from_records(table, target, {f.name: f.pg_type for f in spec.fields})
        parts.append(sql.SQL(", {} AS ({})").format(sql.Identifier(f"t{index}"), statement))
    parts.append(sql.SQL(", dlq AS ({})").format(dead_letters_statement(sql.SQL("fresh"), meta_schema)))
    parts.append(sql.SQL(
        " SELECT count(*) FILTER (WHERE _error IS NULL), count(*) FILTER (WHERE _error IS NOT NULL) FROM fresh"
    ))
    return sql.Composed(parts)


def _fresh_records(spec: PipelineSpec, stage: sql.Composed, meta_schema: str, *, skip_applied: bool,
                   dedupe: bool, only_record: bool, only_range: bool) -> sql.Composed:
    """The SELECT of the staged records the batch applies, typed (``apply_batch_statement``'s
    switches say which)."""
    offsets = meta_tables.table(meta_schema, meta_tables.OFFSETS)
    conditions = [sql.SQL("TRUE")]
    join = sql.SQL("")
    if skip_applied:
        join = sql.SQL(
            " LEFT JOIN {offsets} o ON o.pipeline = %(pipeline)s AND o.topic = s._topic"
            " AND o.partition = s._partition"
        ).format(offsets=offsets)
        conditions.append(sql.SQL("s._offset >= COALESCE(o.next_offset, 0)"))
    if only_record:
        conditions.append(
            sql.SQL("s._topic = %(topic)s AND s._partition = %(partition)s AND s._offset = %(offset)s")
        )
    if only_range:
        # A row comparison: the stage's index on the coordinates serves it.
        conditions.append(sql.SQL(
            "(s._topic, s._partition, s._offset) >= (%(first_topic)s, %(first_partition)s, %(first_offset)s)"
            " AND (s._topic, s._partition, s._offset) <= (%(last_topic)s, %(last_partition)s, %(last_offset)s)"
        ))
    distinct = sql.SQL("DISTINCT ON (s._topic, s._partition, s._offset) ") if dedupe else sql.SQL("")
    return sql.SQL("SELECT {distinct}{columns} FROM {stage} s{join} WHERE {where}").format(
        distinct=distinct, columns=typed_stage_columns(spec), stage=stage, join=join,
        where=sql.SQL(" AND ").join(conditions),
    )


def _rows_from_records(table: sql.Composed, target: RowTarget, upsert_rows: bool) -> sql.Composed:
    """The INSERT of a row target's rows from the fresh records that parsed."""
    return sql.SQL(
        "INSERT INTO {table} ({cols}) SELECT _topic, _partition, _offset, {fields}"
        " FROM fresh WHERE _error IS NULL{conflict}"
    ).format(
        table=table,
        cols=_ident_list([*SOURCE_COLUMNS, *target.columns]),
        fields=_ident_list(target.columns),
        conflict=sql.SQL(" ON CONFLICT DO NOTHING") if upsert_rows else sql.SQL(""),
    )


def typed_stage_columns(spec: PipelineSpec) -> sql.Composed:
    """A staged record's columns, its fields cast from staged text to their
    types: the database judges each value here (``staging.stage_column_types``)."""
    # pg_type is one of spec.SUPPORTED_TYPES (checked by Field), never user text.
    types = {f.name: sql.SQL(f.pg_type) for f in spec.fields}
    return sql.SQL(", ").join(
        sql.SQL("CAST(s.{c} AS {t}) AS {c}").format(c=sql.Identifier(c), t=types[c]) if c in types
        else sql.SQL("s.{}").format(sql.Identifier(c))
        for c in staging_columns(spec)
    )


def _aggregate_upsert(table: sql.Composed, target: AggregateTarget, source: sql.Composable,
                      deltas: list[sql.Composable], group: bool = True) -> sql.Composed:
    # Deltas are summed per key first, so each key is written once per batch:
    # concurrent writers never fight over one row within a batch. Keys are
    # written in one stable order (ORDER BY the group keys), so two pipelines
    # upserting overlapping keys of one aggregate table lock them in the same
    # order: one waits for the other instead of both deadlocking.
    # Latest values: the batch's last record of the key in Kafka order. Batches apply in
    # offset order per partition, so overwriting the stored value keeps the last one.
    # An increment never becomes NULL: a key's sum over records whose value is
    # NULL is 0 (COALESCE below and in the deltas), and a NULL left by an older
    # writer counts as 0, so the column means in SQL what the audit sums.
    updates = [
        sql.SQL("{col} = COALESCE({table}.{col}, 0) + EXCLUDED.{col}").format(col=sql.Identifier(c), table=table)
        for c in target.increments
    ] + [sql.SQL("{col} = EXCLUDED.{col}").format(col=sql.Identifier(c)) for c in target.latest]
    return sql.SQL(
        "INSERT INTO {table} ({keys}, {cols}) SELECT {keys}, {deltas} FROM {source}"
        "{group} ORDER BY {keys} ON CONFLICT ({keys}) DO UPDATE SET {updates}"
    ).format(
        table=table,
        keys=_ident_list(target.group_by),
        cols=_ident_list(target.columns),
        deltas=sql.SQL(", ").join(deltas),
        source=source,
        group=sql.SQL(" GROUP BY {}").format(_ident_list(target.group_by)) if group else sql.SQL(""),
        updates=sql.SQL(", ").join(updates),
    )


def aggregate_deltas_statement(spec: PipelineSpec, target: AggregateTarget, target_schema: str) -> sql.Composed:
    """Upserts deltas already summed per key (``aggregate_deltas.recordset_json``, bound
    as %(deltas)s): the same upsert as the staged apply's, fed one row per key.

    A sum arrives as numeric, as ``sum()`` of an integer column returns it, and is
    assigned to the target column the same way, so an overflow fails alike."""
    types = {f.name: f.pg_type for f in spec.fields}
    # pg_type is one of spec.SUPPORTED_TYPES (checked by Field), never user text.
    definitions = [sql.SQL("{} {}").format(sql.Identifier(k), sql.SQL(types[k])) for k in target.group_by] + [
        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL("numeric" if source else "bigint"))
        for c, source in target.increments.items()
    ] + [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(types[source])) for c, source in target.latest.items()]
    source = sql.SQL("json_to_recordset(%(deltas)s::json) AS d({})").format(sql.SQL(", ").join(definitions))
    return _aggregate_upsert(_qualified(target_schema, target.table), target, source,
                             [sql.Identifier(c) for c in target.columns], group=False)


# Latest values of these types are picked by a plain max() over an integer array, which the
# database can hash-aggregate; any other type needs an ordered aggregate, which makes it sort
# the whole batch by the group keys (2.6x the cost of the aggregate target's part of the apply,
# 100k-row batches of 200 keys: docs/benchmarks.md).
_INTEGER_TYPES = ("bigint", "integer")


def _last_of_key(column: str, pg_type: str, partition: str, offset: str) -> sql.Composed:
    """The value of ``column`` in the key's last record: the one with the highest
    (partition, offset), the order batches apply in."""
    if pg_type in _INTEGER_TYPES:
        # Arrays compare element by element, and no two records share (partition, offset), so
        # the maximum is that record's, its value (NULL included) never deciding.
        return sql.SQL("(max(ARRAY[{}::bigint, {}, {}::bigint]))[3]").format(
            sql.Identifier(partition), sql.Identifier(offset), sql.Identifier(column))
    return sql.SQL("(array_agg({} ORDER BY {} DESC, {} DESC))[1]").format(
        sql.Identifier(column), sql.Identifier(partition), sql.Identifier(offset))


def _aggregate_from_records(table: sql.Composed, target: AggregateTarget, types: dict[str, str]) -> sql.Composed:
    deltas = [
        sql.SQL("COALESCE(sum({}), 0)").format(sql.Identifier(source)) if source else sql.SQL("count(*)")
        for source in target.increments.values()
    ] + [_last_of_key(source, types[source], "_partition", "_offset") for source in target.latest.values()]
    return _aggregate_upsert(table, target, sql.SQL("fresh WHERE _error IS NULL"), deltas)


def dead_letters_statement(source: sql.Composable, meta_schema: str) -> sql.Composed:
    """Quarantines the staged records that carry an ``_error`` (parse or
    validation failures). Binds %(pipeline)s."""
    return sql.SQL(
        "INSERT INTO {dlq} (pipeline, topic, partition, \"offset\", key, value, error)"
        " SELECT %(pipeline)s, _topic, _partition, _offset, _key, _value, _error"
        " FROM {source} WHERE _error IS NOT NULL ON CONFLICT DO NOTHING"
    ).format(dlq=meta_tables.table(meta_schema, meta_tables.DEAD_LETTERS), source=source)


def quarantine_record_statement(stage: sql.Composed, meta_schema: str) -> sql.Composed:
    """Dead-letters one staged record with the database error that rejected it
    and that error's SQLSTATE (only ever a data error: see ``errors.classify``).

    Binds %(pipeline)s, %(topic)s, %(partition)s, %(offset)s, %(error)s, %(sqlstate)s."""
    return sql.SQL(
        "INSERT INTO {dlq} (pipeline, topic, partition, \"offset\", key, value, error, sqlstate)"
        " SELECT %(pipeline)s, _topic, _partition, _offset, _key, _value, %(error)s, %(sqlstate)s FROM {stage}"
        " WHERE _topic = %(topic)s AND _partition = %(partition)s AND _offset = %(offset)s LIMIT 1"
        " ON CONFLICT DO NOTHING"
    ).format(dlq=meta_tables.table(meta_schema, meta_tables.DEAD_LETTERS), stage=stage)
