"""Whole source transactions in SQL: the batch's stage rewritten to what it may apply.

In the batch's transaction, before the mirror's apply (``pipeline.MirrorBatches.batch_run``),
:func:`hold_and_release` computes ``transactions.plan`` over the candidates (the stage's
records not applied yet, plus the pipeline's rows of ``held_changes``) and leaves:

- in the stage, exactly the records to apply now: the free records and the events of the
  applicable transactions, those an earlier batch held included;
- in ``held_changes``, every other candidate (events of incomplete transactions, the ENDs not
  applicable yet, and whatever follows a held record in its partition).

A mirror switched back to ``per_key`` (the way out when a transaction can never complete) gets
the records it held in its next batch (:func:`release_all`), and applies them per key with the
rest: nothing read from Kafka stays behind in ``held_changes``.

The stored offsets stay the batch's end offsets: held records are below them, so no engine
reads them from Kafka again, and a restore carries them with the offsets (``held_changes`` is
in the meta schema, which every snapshot takes). All of it commits or rolls back with the
batch's rows and offsets, so a crash leaves the previous batch's held records and offsets.
No temporary table: a ``two_phase`` batch must PREPARE, which a temporary table forbids.
"""

from __future__ import annotations

from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.cdc import transactions
from spark_apps.eos_stream.cdc.mirror import STAGE_COLUMNS
from spark_apps.eos_stream.state import meta_tables

# The columns the walk reads (a change's row is not among them: only an END's counts, in _after);
# a candidate's other columns are only moved, between the stage and held_changes.
_WALKED = ("_topic", "_partition", "_offset", "_error", "_op", "_tx", "_collection")


def _columns(prefix: str = "") -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(prefix, c) if prefix else sql.Identifier(c) for c in STAGE_COLUMNS)


def skip_applied_statement(stage: sql.Composable, meta_schema: str) -> sql.Composed:
    """Removes from the stage the records below the stored offsets (applied, or held, by an earlier batch)."""
    return sql.SQL(
        "DELETE FROM {stage} s USING {offsets} o WHERE o.pipeline = %(pipeline)s AND o.topic = s._topic"
        " AND o.partition = s._partition AND s._offset < o.next_offset"
    ).format(stage=stage, offsets=meta_tables.table(meta_schema, meta_tables.OFFSETS))


_WALK = """
WITH cand AS MATERIALIZED (
  SELECT DISTINCT ON (_topic, _partition, _offset) * FROM (
    SELECT TRUE AS _was_held, {narrow} FROM {held} WHERE pipeline = %(pipeline)s
    UNION ALL SELECT FALSE, {narrow} FROM {stage}) u
  ORDER BY _topic, _partition, _offset, _was_held DESC),
ends AS (SELECT _topic, _partition, _offset, _tx, CAST(_after AS jsonb) AS counts FROM cand
         WHERE _op = {end} AND _error IS NULL),
seen AS (SELECT _tx, _collection, count(*) AS n FROM cand
         WHERE _tx IS NOT NULL AND _op IS DISTINCT FROM {end} GROUP BY _tx, _collection),
expected AS (SELECT e._topic, e._partition, e._offset, e._tx, c.t AS _collection, c.n::bigint AS n
             FROM ends e CROSS JOIN LATERAL jsonb_each_text(e.counts) c(t, n)),
extra AS (SELECT s._tx, s._collection FROM seen s JOIN (SELECT DISTINCT _tx FROM ends) e ON e._tx = s._tx
          LEFT JOIN expected x ON x._tx = s._tx AND x._collection = s._collection
          WHERE x._tx IS NULL OR s.n > x.n),
verdict AS (
  SELECT e._topic, e._partition, e._offset, e._tx, COALESCE(bool_and(COALESCE(s.n, 0) = x.n), TRUE) AS complete
  FROM ends e
  LEFT JOIN expected x ON (x._topic, x._partition, x._offset) = (e._topic, e._partition, e._offset)
  LEFT JOIN seen s ON s._tx = x._tx AND s._collection = x._collection
  GROUP BY e._topic, e._partition, e._offset, e._tx),
walk AS (SELECT *, bool_and(complete) OVER (ORDER BY _topic, _partition, _offset) AS applicable FROM verdict),
ready AS (SELECT DISTINCT _tx FROM walk WHERE applicable),
by_tx AS (SELECT c._topic, c._partition, c._offset, c._tx FROM cand c
          WHERE c._tx IS NOT NULL AND c._op IS DISTINCT FROM {end} AND c._tx NOT IN (SELECT _tx FROM ready)),
block AS (SELECT DISTINCT ON (_topic, _partition) _topic, _partition, _offset AS first, _tx AS first_tx FROM by_tx
          ORDER BY _topic, _partition, _offset),
held AS MATERIALIZED (
  SELECT c.*, c._tx IN (SELECT _tx FROM ready) AND c._op IS DISTINCT FROM {end} AS _ready, b.first_tx FROM cand c
  LEFT JOIN block b ON b._topic = c._topic AND b._partition = c._partition
  WHERE c._offset >= b.first
     OR (c._op = {end} AND NOT EXISTS (SELECT 1 FROM walk w WHERE w.applicable AND (w._topic, w._partition, w._offset)
                                       = (c._topic, c._partition, c._offset)))),
moved AS (INSERT INTO {held} (pipeline, {columns}) SELECT %(pipeline)s, {stage_columns} FROM {stage} s
          JOIN held x ON (x._topic, x._partition, x._offset) = (s._topic, s._partition, s._offset)
          WHERE NOT x._was_held ON CONFLICT DO NOTHING RETURNING 1),
released AS (DELETE FROM {held} h WHERE h.pipeline = %(pipeline)s
             AND NOT EXISTS (SELECT 1 FROM held x WHERE (x._topic, x._partition, x._offset)
                                                       = (h._topic, h._partition, h._offset))
             RETURNING {held_columns}),
back AS (INSERT INTO {stage} ({columns}) SELECT * FROM released RETURNING 1)
SELECT (SELECT count(*) FROM held WHERE NOT _was_held), (SELECT count(*) FROM moved),
  (SELECT count(*) FROM {stage}) - (SELECT count(*) FROM cand WHERE NOT _was_held), (SELECT count(*) FROM back),
  (SELECT count(*) FROM held), (SELECT count(*) FROM walk WHERE applicable),
  (SELECT string_agg(_tx || ' (' || _collection || ')', '; ' ORDER BY _tx, _collection) FROM extra),
  (SELECT min(_tx || ' at ' || _topic || '[' || _partition || ']@' || _offset || ' behind ' || first_tx)
   FROM held WHERE _ready),
  (SELECT min(_topic || '[' || _partition || ']@' || _offset) FROM cand
   WHERE _op IN ('c', 'u', 'd') AND _tx IS NULL AND _error IS NULL),
  (SELECT string_agg(_tx, ', ' ORDER BY _topic, _partition, _offset) FROM walk WHERE NOT applicable)
"""


def walk_statement(stage: sql.Composable, meta_schema: str) -> sql.Composed:
    """The walk over the candidates, moving records between the stage and ``held_changes``;
    one row: (records held now, rows inserted into held_changes, copies of a coordinate in the stage
    (a retried task's), records released, records held in all, transactions applicable,
    transactions with too many events, an applicable transaction's event held by its partition,
    a streaming change without transaction metadata, the transactions waiting)."""
    return sql.SQL(_WALK).format(
        held=meta_tables.table(meta_schema, meta_tables.HELD_CHANGES), stage=stage,
        columns=_columns(), held_columns=_columns("h"), stage_columns=_columns("s"), end=sql.Literal(transactions.END),
        narrow=sql.SQL(", ").join([*map(sql.Identifier, _WALKED), sql.SQL(
            "CASE WHEN _op = {end} THEN _after END AS _after").format(end=sql.Literal(transactions.END))]))


def drop_held_statement(stage: sql.Composable, meta_schema: str) -> sql.Composed:
    """Removes from the stage the records the walk moved to ``held_changes`` (and their copies)."""
    return sql.SQL(
        "DELETE FROM {stage} s USING {held} h WHERE h.pipeline = %(pipeline)s"
        " AND (h._topic, h._partition, h._offset) = (s._topic, s._partition, s._offset)"
    ).format(stage=stage, held=meta_tables.table(meta_schema, meta_tables.HELD_CHANGES))


def hold_and_release(cur: Any, stage: sql.Composable, meta_schema: str, pipeline: str,
                     skip_applied: bool) -> dict[str, Any]:
    """Rewrites the stage to the records this batch applies (see the module), on ``cur``, in the
    batch's transaction; returns what it did, for the batch's event. ``copies``: the stage held a
    record twice (a retried task), so the apply must dedupe; released records never repeat a
    staged one (they are below the stored offsets, the stage's records at or above them).

    :raises transactions.TransactionError: an END counting fewer events than arrived, a
        complete transaction behind a held record of its partition, or a streaming change
        without transaction metadata; the batch's transaction then rolls back."""
    params = {"pipeline": pipeline}
    if skip_applied:
        cur.execute(skip_applied_statement(stage, meta_schema), params)
    cur.execute(walk_statement(stage, meta_schema), params)
    row = cur.fetchone()
    assert row is not None
    moved, _, copies, released, held, applicable, too_many, misordered, untracked, waiting = row
    if too_many:
        raise transactions.TransactionError(transactions.impossible_message(too_many.split(" (")[0], too_many))
    if misordered:
        tx, _, where = misordered.partition(" at ")
        where, _, earlier = where.partition(" behind ")
        raise transactions.TransactionError(transactions.misordered_message(tx, where, earlier))
    if untracked:
        raise transactions.TransactionError(
            f"the change at {untracked} carries no transaction: a mirror with transactions: whole needs the "
            "connector's provide.transaction.metadata=true (postgres_connector_config sets it); set it and restart "
            "the connector, or set mirror.transactions: per_key")
    if moved:
        cur.execute(drop_held_statement(stage, meta_schema), params)
    return {"held_now": int(moved), "released": int(released), "held": int(held), "copies": int(copies),
            "transactions_applied": int(applicable), "waiting": (waiting or "").split(", ")[:5] if waiting else []}


_RELEASE_ALL = """
WITH released AS (DELETE FROM {held} WHERE pipeline = %(pipeline)s RETURNING {columns})
INSERT INTO {stage} ({columns}) SELECT * FROM released WHERE _op IS DISTINCT FROM {end}
"""


def release_all(cur: Any, stage: sql.Composable, meta_schema: str, pipeline: str, skip_applied: bool) -> int:
    """A ``per_key`` batch of a mirror that held records while it ran ``whole``: every held change
    moved into the stage (the ENDs dropped), in the batch's transaction, so the apply takes them
    with the batch's own records, each key's last change in Kafka order. Returns the changes
    released; 0, after one cheap probe, for a mirror that holds none (every other batch).

    The released records are below the stored offsets, so the stage's own records below them go
    first (``skip_applied``) and the apply must not skip by offset again."""
    held = meta_tables.table(meta_schema, meta_tables.HELD_CHANGES)
    params = {"pipeline": pipeline}
    cur.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE pipeline = %(pipeline)s)").format(held), params)
    row = cur.fetchone()
    if row is None or not row[0]:
        return 0
    if skip_applied:
        cur.execute(skip_applied_statement(stage, meta_schema), params)
    cur.execute(sql.SQL(_RELEASE_ALL).format(held=held, stage=stage, columns=_columns(),
                                             end=sql.Literal(transactions.END)), params)
    return int(cur.rowcount)
