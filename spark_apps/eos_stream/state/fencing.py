"""Fencing: the database decides which driver may write a pipeline's target.

Modelled on Kafka's producer epochs (a new ``init_transactions`` bumps the
epoch and the broker rejects the zombie that still holds the old one) and on
Flink's fencing tokens. Each pipeline has an **epoch** in
``<meta_schema>.pipeline_epochs``:

* a driver bumps it when it starts and remembers the value it got;
* every operation that takes the target away from a running stream bumps it
  too: a restore (inside its swap transaction), a stop for recovery, the
  fence operator;
* every batch transaction, under the pipeline's advisory lock and before it
  writes anything, checks that the epoch is still the driver's and that no
  partition's stored ``next_offset`` is *below* the batch's start offset (a
  stored offset below the start means the target was put back, and applying
  the batch would leave a gap). Either failure rolls the batch back and the
  driver exits with ``EXIT_FENCED``.

Bumps and batch checks take the same transaction-scoped advisory lock as the
batch (``eos:<pipeline>``), so a bump waits for an in-flight batch to finish
and every batch that starts after it sees the new epoch. The epoch table is
operational state, like the stop requests: it is never in a snapshot, so a
restore cannot move it backwards.

Offsets *above* a batch's start are not fencing: that is a zombie's or a
replayed batch, and the skip-applied rule in SQL drops its records.
"""

from __future__ import annotations

from collections.abc import Mapping

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import cursor as PgCursor

from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.state import meta_tables

EXIT_FENCED = 3


class Fenced(RuntimeError):
    """This driver no longer owns the pipeline's target (its epoch is stale, or the
    target was put back below where the batch starts). Nothing was written."""


def pipeline_lock_key(pipeline: str) -> str:
    """The key of the transaction-scoped advisory lock every writer of the pipeline takes."""
    return "eos:" + pipeline


def lock_pipeline(cur: PgCursor, pipeline: str) -> None:
    """Serializes batch transactions, epoch bumps and restore swaps of one pipeline
    until the current transaction ends."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (pipeline_lock_key(pipeline),))


def bump_epoch_statement(meta_schema: str) -> sql.Composed:
    """SQL that bumps the epoch, returning the new one.

    Binds %(pipeline)s, %(by)s, %(reason)s. Built for embedding in another
    transaction (a restore's swap script), so the caller owns the commit, and
    the caller has taken the pipeline lock (``lock_pipeline``) first, before
    any table lock, so that it never holds one while a batch ends."""
    return sql.SQL(
        "INSERT INTO {t} AS e (pipeline, epoch, changed_by, reason) VALUES (%(pipeline)s, 1, %(by)s, %(reason)s)"
        " ON CONFLICT (pipeline) DO UPDATE SET epoch = e.epoch + 1, changed_by = EXCLUDED.changed_by,"
        " reason = EXCLUDED.reason, changed_at = now() RETURNING epoch"
    ).format(t=meta_tables.table(meta_schema, meta_tables.EPOCHS))


def bump_epoch(conn: PgConnection, meta_schema: str, pipeline: str, by: str, reason: str) -> int:
    """Bumps the pipeline's epoch in its own transaction and returns the new value.

    Waits for an in-flight batch of the pipeline to end (its advisory lock); a
    driver holding an older epoch can write nothing after this returns."""
    with conn.cursor() as cur:
        lock_pipeline(cur, pipeline)  # first: never hold a table lock while waiting for a batch
        for statement in meta_tables.epochs_ddl_statements(meta_schema):
            cur.execute(statement)
        cur.execute(bump_epoch_statement(meta_schema), {"pipeline": pipeline, "by": by, "reason": reason})
        row = cur.fetchone()
    conn.commit()
    assert row is not None
    return int(row[0])


def current_epoch(cur: PgCursor, meta_schema: str, pipeline: str) -> int:
    """The pipeline's epoch now (0 when it was never bumped)."""
    cur.execute(sql.SQL("SELECT epoch FROM {} WHERE pipeline = %s").format(
        meta_tables.table(meta_schema, meta_tables.EPOCHS)), (pipeline,))
    row = cur.fetchone()
    return int(row[0]) if row else 0


def ownership_problem(
    cur: PgCursor,
    meta_schema: str,
    pipeline: str,
    epoch: int,
    start_offsets: Mapping[TopicPartition, int],
) -> str | None:
    """Why a batch of a driver at ``epoch`` starting at ``start_offsets`` must not
    write, or None when it still owns the target. Call it under ``lock_pipeline``.

    A negative start offset (Kafka's "earliest" for a partition the pipeline
    never applied) can be below nothing, so it is never a gap."""
    now = current_epoch(cur, meta_schema, pipeline)
    if now != epoch:
        return (f"pipeline {pipeline!r} was fenced: its epoch is {now}, this driver started at epoch {epoch} "
                "(a restore, a stop for recovery, a fence or a newer driver took the target over)")
    starts = [(t, p, o) for (t, p), o in sorted(start_offsets.items()) if o >= 0]
    if not starts:
        return None
    cur.execute(
        sql.SQL(
            "SELECT s.topic, s.partition, s.start, o.next_offset"
            " FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS s(topic, partition, start)"
            " LEFT JOIN {offsets} o ON o.pipeline = %s AND o.topic = s.topic AND o.partition = s.partition"
            " WHERE COALESCE(o.next_offset, -1) < s.start ORDER BY 1, 2"
        ).format(offsets=meta_tables.table(meta_schema, meta_tables.OFFSETS)),
        ([t for t, _, _ in starts], [p for _, p, _ in starts], [o for _, _, o in starts], pipeline),
    )
    gaps = cur.fetchall()
    if not gaps:
        return None
    described = ", ".join(f"{t}[{p}] stored {'none' if n is None else n} < batch start {s}" for t, p, s, n in gaps)
    return (f"pipeline {pipeline!r}: the target was put back below this batch's start ({described}); "
            "applying it would leave a gap, so the driver must restart from the database's offsets")
