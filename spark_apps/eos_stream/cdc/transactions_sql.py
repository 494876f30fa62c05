"""Whole source transactions in SQL: the batch's stage rewritten to what it may apply.

In the batch's transaction, before the mirror's apply (``pipeline.MirrorBatches.batch_run``),
:func:`hold_and_release` takes the candidates' groups, per partition, kind, transaction and
table: the stage's as its stagers counted them while staging (``transaction_groups``; the
transaction topic's records are counted there, not staged), the pipeline's rows of
``held_changes`` counted here in one pass. The walk (``transaction_walk``) decides over those
counts, in Python, what ``transactions.plan`` decides record by record; one statement then
moves records by partition and offset, and the ENDs that wait into ``held_changes``, and leaves:

- in the stage, exactly the records to apply now: the free records and the events of the
  applicable transactions, those an earlier batch held included, and none of the transaction
  topic's (its BEGINs and applied ENDs are dropped; the apply has nothing to do with them);
- in ``held_changes``, every other candidate (events of incomplete transactions, the ENDs not
  applicable yet, and whatever follows a held record in its partition).

The walk's cost is a dictionary update per record in the stagers, the held records counted, and
statements that touch only the records they move (``docs/benchmarks.md``). When the stagers'
count cannot stand (a group of the stage straddles a stored offset: a batch partly re-read, by
another engine) or there is none (``groups`` None: the stage then holds the transaction topic's
records too), the database counts the stage in the same pass as the held records.

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

from collections.abc import Mapping
from typing import Any

from psycopg2 import sql

from spark_apps.eos_stream.cdc import transaction_groups, transaction_walk, transactions
from spark_apps.eos_stream.cdc.mirror import STAGE_COLUMNS
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.columns import Columns
from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.state import meta_tables


def _columns(prefix: str = "") -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(prefix, c) if prefix else sql.Identifier(c) for c in STAGE_COLUMNS)


def skip_applied_statement(stage: sql.Composable, meta_schema: str) -> sql.Composed:
    """Removes from the stage the records below the stored offsets (applied, or held, by an earlier batch)."""
    return sql.SQL(
        "DELETE FROM {stage} s USING {offsets} o WHERE o.pipeline = %(pipeline)s AND o.topic = s._topic"
        " AND o.partition = s._partition AND s._offset < o.next_offset"
    ).format(stage=stage, offsets=meta_tables.table(meta_schema, meta_tables.OFFSETS))


_KIND = """CASE WHEN _op = {end} AND _error IS NULL THEN {end}
  WHEN _tx IS NOT NULL AND _op IS DISTINCT FROM {end} THEN {change}
  WHEN _op IN ('c', 'u', 'd') AND _error IS NULL THEN {untracked} ELSE {free} END"""

# One pass over the candidates counts them per partition, kind, transaction and table (an END a
# group of its own; with copies of a retried task possible, distinct offsets, else count(*),
# which the database hashes instead of sorting the batch); ``transaction_walk`` decides over the
# groups. ``first``/``last``: the group's offsets; ``counts``: an END's, as staged.
_COUNT = """
SELECT _topic, _partition, kind, _tx, _collection, {events}, min(_offset), max(_offset), max(_after),
  count(*) FILTER (WHERE NOT _was_held), {staged}, count(*) FILTER (WHERE _was_held)
FROM (SELECT TRUE AS _was_held, _topic, _partition, _offset, {kind} AS kind, _tx, _collection,
        CASE WHEN _op = {end} THEN _after END AS _after FROM {held} WHERE pipeline = %(pipeline)s
      {stage_part}) c
GROUP BY _topic, _partition, kind, _tx, _collection, CASE WHEN kind = {end} THEN _offset END
"""
_STAGE_PART = """UNION ALL
      SELECT FALSE, _topic, _partition, _offset, {kind}, _tx, _collection,
        CASE WHEN _op = {end} THEN _after END FROM {stage}"""


def count_statement(stage: sql.Composable | None, meta_schema: str, copies: bool) -> sql.Composed:
    """The candidates' groups (``transaction_walk.Group``'s fields, in order): the held records',
    and the stage's unless ``stage`` is None (the stagers counted them). ``copies``: the stage may
    hold a record twice, so offsets are counted distinct."""
    names = {"end": sql.Literal(transactions.END), "change": sql.Literal(transactions.CHANGE),
             "untracked": sql.Literal(transactions.UNTRACKED), "free": sql.Literal(transactions.FREE)}
    kind = sql.SQL(_KIND).format(**names)
    counts = ({"events": sql.SQL("count(DISTINCT _offset)"),
               "staged": sql.SQL("count(DISTINCT _offset) FILTER (WHERE NOT _was_held)")} if copies else
              {"events": sql.SQL("count(*)"), "staged": sql.SQL("count(*) FILTER (WHERE NOT _was_held)")})
    stage_part = sql.SQL("") if stage is None else sql.SQL(_STAGE_PART).format(kind=kind, end=names["end"],
                                                                               stage=stage)
    return sql.SQL(_COUNT).format(held=meta_tables.table(meta_schema, meta_tables.HELD_CHANGES),
                                  stage_part=stage_part, kind=kind, end=names["end"], **counts)


# ``stage_floor``, the lowest bound a stage record can meet, is checked first: a comparison of
# integers rejects nearly every record of the stage before the join hashes its topic and
# partition (27-45 ms of the statement's 64-110 for a stage of 50,000; its scan, ~30 ms, stays).
# The records held now leave the stage for held_changes; the records held before and not now
# come back to the stage (an END is done once its transaction applies); the transaction topic's
# records left in the stage (its BEGINs, the ENDs applied) go: the apply has nothing to do with them.
_MOVE = """
WITH counted_ends AS (INSERT INTO {held} (pipeline, _topic, _partition, _offset, _op, _after, _tx)
                      SELECT %(pipeline)s, e.topic, e.partition, e."offset", {end}, e.counts, e.tx
                      FROM unnest(%(end_topics)s::text[], %(end_partitions)s::int[], %(end_offsets)s::bigint[],
                                  %(end_counts)s::text[], %(end_txs)s::text[]) e(topic, partition, "offset", counts, tx)
                      ON CONFLICT DO NOTHING RETURNING 1),
held_from AS (SELECT * FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(offsets)s::bigint[],
                                        %(ends_only)s::boolean[]) f(topic, partition, first, ends_only)),
moved AS (DELETE FROM {stage} s USING held_from f
          WHERE s._offset >= %(stage_floor)s
            AND s._topic = f.topic AND s._partition = f.partition AND s._offset >= f.first
            AND (NOT f.ends_only OR s._op = {end})
          RETURNING {stage_columns}),
kept AS (INSERT INTO {held} (pipeline, {columns}) SELECT %(pipeline)s, * FROM moved ON CONFLICT DO NOTHING RETURNING 1),
released AS (DELETE FROM {held} h WHERE h.pipeline = %(pipeline)s AND NOT EXISTS (
               SELECT 1 FROM held_from f WHERE h._topic = f.topic AND h._partition = f.partition
                                           AND h._offset >= f.first AND (NOT f.ends_only OR h._op = {end}))
             RETURNING {held_columns}),
back AS (INSERT INTO {stage} ({columns}) SELECT * FROM released WHERE _op IS DISTINCT FROM {end} RETURNING 1)
SELECT (SELECT count(*) FROM kept) + (SELECT count(*) FROM counted_ends), (SELECT count(*) FROM released),
       (SELECT count(*) FROM back)
"""


def move_statement(stage: sql.Composable, meta_schema: str) -> sql.Composed:
    """Moves records between the stage and ``held_changes`` as the walk's bounds say;
    one row: (records newly held, records released, of them changes back in the stage)."""
    return sql.SQL(_MOVE).format(
        held=meta_tables.table(meta_schema, meta_tables.HELD_CHANGES), stage=stage, end=sql.Literal(transactions.END),
        columns=_columns(), held_columns=_columns("h"), stage_columns=_columns("s"))


def drop_transaction_records_statement(stage: sql.Composable) -> sql.Composed:
    """Removes the transaction topic's records the walk left in the stage (a refused one stays, to be dead-lettered)."""
    return sql.SQL("DELETE FROM {} WHERE _topic = %(transaction_topic)s AND _error IS NULL").format(stage)


def hold_and_release(cur: Any, stage: sql.Composable, meta_schema: str, pipeline: str,
                     skip_applied: bool, transaction_topic: str, staged_once: bool = False,
                     groups: Columns | None = None, starts: Mapping[TopicPartition, int] | None = None
                     ) -> dict[str, Any]:
    """Rewrites the stage to the records this batch applies (see the module), on ``cur``, in the
    batch's transaction; returns what it did, for the batch's event. ``copies``: the stage held a
    record twice (a retried task), so the apply must dedupe; released records never repeat a
    staged one (they are below the stored offsets, the stage's records at or above them).
    ``staged_once``: the writer counted no copies in the stage, so none are looked for.
    ``groups``: the stagers' count of the stage (``transaction_groups``), whose transaction-topic
    records they did not stage; None: the stage holds every record, and is counted here.
    ``starts``: where the batch's ranges start; when none starts below its stored offset (every
    batch but one read again), nothing in the stage lies below them, and neither the stage nor
    its groups are searched for such records (None: not known, so they are).

    :raises transactions.TransactionError: an END counting fewer events than arrived, a
        complete transaction behind a held record of its partition, or a streaming change
        without transaction metadata; the batch's transaction then rolls back."""
    params: dict[str, Any] = {"pipeline": pipeline, "transaction_topic": transaction_topic}
    stored = OffsetsStore(meta_schema, pipeline).load(cur.connection) if skip_applied else {}
    read_again = skip_applied and reads_below(starts, stored)
    if read_again:
        cur.execute(skip_applied_statement(stage, meta_schema), params)
    staged = None if groups is None else transaction_walk.Groups.cast(groups)
    below = stored if read_again else None
    candidates, ends, stage_counted = _candidates(cur, stage, meta_schema, params, staged, below, staged_once)
    walked = transaction_walk.walk(candidates)
    params.update(_move_params(walked.bounds, ends, stage_holds_ends=staged is None))
    cur.execute(move_statement(stage, meta_schema), params)
    kept, released, _ = cur.fetchone()
    if staged is None:  # the stage holds the transaction topic's records
        cur.execute(drop_transaction_records_statement(stage), params)
    copies = walked.copies if stage_counted else int(not staged_once)
    return {"held_now": int(kept), "released": int(released), "held": walked.held_before - released + kept,
            "copies": copies, "transactions_applied": walked.ready, "waiting": walked.waiting}


def reads_below(starts: Mapping[TopicPartition, int] | None, stored: Mapping[TopicPartition, int]) -> bool:
    """Whether a batch starting at ``starts`` may stage records below the ``stored`` offsets
    (a batch read again, or ``starts`` not known)."""
    return starts is None or any(start < stored.get(tp, start) for tp, start in starts.items())


def _candidates(cur: Any, stage: sql.Composable, meta_schema: str, params: dict[str, Any],
                staged: transaction_walk.Groups | None, below: Mapping[TopicPartition, int] | None,
                staged_once: bool) -> tuple[transaction_walk.Groups, transaction_walk.Groups, bool]:
    """The walk's groups: the held records' counted here, and the stage's as its stagers counted
    them (those at or above the stored offsets ``below``, when the stage may hold records below
    them: None when it cannot), or counted here when that count cannot stand
    (``transaction_groups.applicable``) or there is none. Also the stagers' ENDs (never staged),
    and whether the stage was counted here."""
    stored = below or {}
    counted = None if staged is None else staged if below is None else transaction_groups.applicable(staged, stored)
    cur.execute(count_statement(stage if counted is None else None, meta_schema, copies=not staged_once), params)
    found = transaction_walk.Groups.of(cur.fetchall())
    if counted is not None:
        return transaction_walk.Groups.joined([found, counted]), counted.of_kind(transactions.END), False
    ends = transaction_groups.applicable(staged.of_kind(transactions.END), stored) if staged is not None else None
    ends = ends if ends is not None else transaction_walk.Groups()
    return transaction_walk.Groups.joined([found, ends]), ends, True


def _move_params(bounds: list[transaction_walk.Bound], ends: transaction_walk.Groups,
                 stage_holds_ends: bool) -> dict[str, Any]:
    """``move_statement``'s parameters: the walk's bounds, the lowest a stage record can meet
    (an ENDs-only bound only when the stage holds the transaction topic's ENDs: the stagers
    count them instead, and a refused one staged has no ``END`` op), and the ENDs the stagers
    counted that the bounds hold (not in the stage: they go to ``held_changes`` as they are)."""
    stage_floor = min((first for _, _, first, ends_only in bounds if stage_holds_ends or not ends_only),
                      default=transaction_walk.NO_BOUND)
    bound_of = {(t, p): first for t, p, first, _ in bounds}
    held_ends = ends.at_or_above(bound_of, transaction_walk.NO_BOUND) if bound_of else transaction_walk.Groups()
    topics, partitions, _, txs, _, _, firsts, _, counts = held_ends.columns[:9]
    return {"stage_floor": stage_floor,
            "topics": [b[0] for b in bounds], "partitions": [b[1] for b in bounds], "offsets": [b[2] for b in bounds],
            "ends_only": [b[3] for b in bounds], "end_topics": topics, "end_partitions": partitions,
            "end_offsets": firsts, "end_counts": counts, "end_txs": txs}


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
    if not holds_records(cur, meta_schema, pipeline):
        return 0
    if skip_applied:
        cur.execute(skip_applied_statement(stage, meta_schema), params)
    cur.execute(sql.SQL(_RELEASE_ALL).format(held=held, stage=stage, columns=_columns(),
                                             end=sql.Literal(transactions.END)), params)
    return int(cur.rowcount)


def holds_records(cur: Any, meta_schema: str, pipeline: str) -> bool:
    """Whether ``held_changes`` holds records of ``pipeline`` (one index probe)."""
    cur.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE pipeline = %s)").format(
        meta_tables.table(meta_schema, meta_tables.HELD_CHANGES)), (pipeline,))
    row = cur.fetchone()
    return row is not None and bool(row[0])


def remove_held(stage: sql.Composable, bound: dict[tuple[str, int], int]) -> tuple[sql.Composed, tuple]:
    """The statement and parameters that remove from ``stage`` the records at or above each
    partition's ``bound`` (``{(topic, partition): first held offset}``: held in memory instead)."""
    topics, partitions, firsts = zip(*((t, p, first) for (t, p), first in sorted(bound.items())), strict=True)
    statement = sql.SQL("DELETE FROM {} s USING unnest(%s::text[], %s::int[], %s::bigint[]) b(topic, partition,"
                        " first) WHERE s._topic = b.topic AND s._partition = b.partition AND s._offset >= b.first"
                        ).format(stage)
    return statement, (list(topics), list(partitions), list(firsts))
