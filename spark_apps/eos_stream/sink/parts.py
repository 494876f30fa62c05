"""Each row written once: a batch's parts and how they are decided and committed.

A *part* is one Spark task's share of a batch, COPYed straight into the row
target inside a prepared transaction of its own (``part_writer``), as Flink's
JDBC exactly-once sink has each subtask write in an XA transaction. The
driver's batch transaction is the decision: under the pipeline lock and the
ownership check it upserts the tasks' aggregate deltas, advances the offsets
and names the parts it decided in ``decided_parts``. Once it has committed,
the committer issues COMMIT PREPARED for each decided part and forgets them.

Ids are deterministic and say whose a part is:
``eos-part:<pipeline>:<epoch>:<batch id>:<task>:<task attempt id>``. Only the
parts a decision names are ever committed; every other part of the pipeline
is rolled back, which is safe once the epoch that wrote it is fenced, because
then no decision can name it any more. The failure transitions are P1-P6
below; the staged way's (1-10) are in ``batch_sink``.

Between the decision and the last COMMIT PREPARED (a millisecond, or until
the next start if the driver dies there) a reader of the target sees the
batch's offsets and aggregates without its rows. The two readers that need a
consistent cut wait that window out: a snapshot (``recovery.dump``) and the
audit (``audit``) take their snapshot only when no decided part is pending.

Failure transitions
-------------------

In ``exactly_once`` a batch is first tried as prepared parts (``parts``,
``part_writer``): each Spark task COPYs its share straight into the row target
inside a prepared transaction and sends its aggregate deltas; the batch
transaction decides (lock, ownership, deltas, ``decided_parts``, offsets) and
the committer then issues COMMIT PREPARED for each part. Transitions:

P1. a crash while tasks write or after some PREPAREd, before the decision
    commits: prepared parts no decision names. The next start rolls them back
    after its epoch bump (``parts.resolve``: from then on no decision of the dead
    driver can commit), and the batch is read again from the stored offsets.
P2. a part the tasks cannot write (a record Python refuses, a value or
    constraint the database refuses in the COPY, no prepared-transaction slot)
    or a failed write job: the batch's parts are rolled back and it is written
    the staged way (1-9), where each record gets the database's verdict and
    its dead letter. Nothing is counted for it.
P3. the decision fails (a stored offset past the batch's start, as in 4; a
    delta the aggregate refuses; a lost connection): it rolls back, the
    batch's parts are rolled back (on a broken connection: at the retry,
    ``_prepare_retry``) and the batch is written the staged way. Fenced
    instead (7): the parts are rolled back and the driver exits as in 7.
P4. a crash after the decision commits, before every COMMIT PREPARED: the
    offsets and aggregates are committed, some rows are still prepared. The
    next start (or a stop's fence, ``recovery.guards``) commits every part a
    decision names, so the batch is whole, then reads on from the stored
    offsets. A reader of the target sees the batch's aggregates without those
    rows in between; snapshots and the audit wait until no decided part is
    pending (``parts.pending_decided``).
P5. COMMIT PREPARED fails in this driver (a lost connection): the batch is
    decided, so the error goes to the retry as in 8, whose ``_prepare_retry``
    commits the decided parts; the retry then applies nothing (its records are
    below the stored offsets, as in 4).
P6. a retried or speculative Spark task writes its share twice: each attempt
    prepares a part of its own id, the decision names only the attempts Spark
    reported, and the others are rolled back as in P1 (the next start) or P3.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream import errors
from spark_apps.eos_stream.records import aggregate_deltas
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec, RowTarget
from spark_apps.eos_stream.state import meta_tables

PREFIX = "eos-part:"
# PostgreSQL: "prepared transaction with identifier ... does not exist": someone resolved it already.
_UNDEFINED_OBJECT = "42704"


class NotDecidable(RuntimeError):
    """A batch written as parts that its decision cannot take (P3): it is written the staged way."""


def pipeline_prefix(pipeline: str) -> str:
    """The prefix of every part of ``pipeline`` (never a prefix of a two_phase batch id,
    ``in_doubt.gid_prefix``, which a restart commits unconditionally)."""
    return f"{PREFIX}{pipeline}:"


def batch_prefix(pipeline: str, epoch: int, batch_id: int) -> str:
    return f"{pipeline_prefix(pipeline)}{epoch}:{batch_id}:"


def supported(spec: PipelineSpec) -> bool:
    """Whether a spec's batches can be written as parts: Arrow vouches for its records
    (``batch_lines.supported``) and it has at most one row target (a task writes one
    COPY; a second row target would need a second pass over the records)."""
    from spark_apps.eos_stream.records import batch_lines

    return batch_lines.supported(spec) and sum(isinstance(t, RowTarget) for t in spec.targets) <= 1


def aggregate_targets(spec: PipelineSpec) -> list[AggregateTarget]:
    return [t for t in spec.targets if isinstance(t, AggregateTarget)]


@dataclass
class WrittenParts:
    """A batch written as prepared parts, waiting for its decision.

    :param gids: the parts to commit, one per task that wrote rows (the attempts Spark
        reported; a failed attempt's part is never named here).
    :param rows: the records the parts hold.
    :param deltas: the tasks' merged aggregate deltas (``aggregate_deltas``).
    :param write_ms: how long writing them took.
    :param prefix: the batch's id prefix (``batch_prefix``): every part of it, reported or not.
    :param task_ms: the slowest task's own time (``write_ms`` less it is Spark's scheduling).
    """

    gids: tuple[str, ...]
    rows: int
    deltas: aggregate_deltas.Deltas = field(default_factory=list)
    write_ms: int = 0
    prefix: str = ""
    task_ms: int = 0


def gather(results: list[dict[str, Any]], spec: PipelineSpec, prefix: str, write_ms: int
           ) -> WrittenParts | list[str]:
    """The batch the tasks' ``part_writer.part_result``s describe, or their refusals (P2)."""
    refusals = [r["refused"] for r in results if r["refused"]]
    if refusals:
        return refusals
    targets = aggregate_targets(spec)
    deltas = aggregate_deltas.empty(targets)
    for result in results:
        if result["deltas"]:
            aggregate_deltas.merge(deltas, aggregate_deltas.from_wire(result["deltas"]), targets)
    return WrittenParts(tuple(r["gid"] for r in results if r["gid"]), sum(r["rows"] for r in results), deltas,
                        write_ms, prefix, max((r.get("ms", 0) for r in results), default=0))


# Writes a batch's parts under the prefix it is given; returns each part's ``part_result``.
WriteParts = Callable[[str], list[dict[str, Any]]]


def write_batch(write: WriteParts, spec: PipelineSpec, prefix: str, batch_id: int, started: float,
                notify: Callable[..., None]) -> WrittenParts | None:
    """The batch ``write(prefix)`` wrote as prepared parts, or None after telling ``notify``
    why not (``parts_refused``: a task refused, P2; ``parts_failed``: the write raised). The
    parts it left are then the caller's to roll back, on a connection of its own.

    :param started: when the write started (``time.perf_counter()``), for its ``write_ms``."""
    try:
        written = gather(write(prefix), spec, prefix, round((time.perf_counter() - started) * 1000))
        if isinstance(written, WrittenParts):
            return written
        notify("parts_refused", batch_id=batch_id, reasons=[errors.one_line(r) for r in written[:3]])
    except Exception as exc:
        notify("parts_failed", batch_id=batch_id, error=errors.one_line(exc))
    return None


def decide(cur, spec: PipelineSpec, target_schema: str, meta_schema: str, pipeline: str, batch_id: int,
           parts: WrittenParts) -> None:
    """The decision's writes, in the caller's batch transaction (after the lock and the
    ownership check, before the offsets): the aggregate deltas and the decided parts."""
    from spark_apps.eos_stream.sink import apply_sql

    for target, deltas in zip(aggregate_targets(spec), parts.deltas, strict=True):
        if deltas:
            cur.execute(apply_sql.aggregate_deltas_statement(spec, target, target_schema),
                        {"deltas": aggregate_deltas.recordset_json(target, deltas)})
    if parts.gids:
        cur.execute(
            sql.SQL("INSERT INTO {} (pipeline, gid, batch_id) SELECT %s, unnest(%s::text[]), %s").format(
                meta_tables.table(meta_schema, meta_tables.DECIDED_PARTS)),
            (pipeline, list(parts.gids), batch_id))


def _finish(conn: PgConnection, gids: Iterable[str], action: str) -> list[str]:
    """COMMIT PREPARED (or ROLLBACK PREPARED) each of ``gids``; returns the ones this call
    finished (one someone else finished meanwhile is skipped: both are idempotent)."""
    done = []
    # COMMIT/ROLLBACK PREPARED cannot run inside a transaction block.
    conn.rollback()
    previous, conn.autocommit = conn.autocommit, True
    try:
        with conn.cursor() as cur:
            for gid in gids:
                try:
                    # A string literal, so a parameter, not an identifier.
                    cur.execute(f"{action} PREPARED %s", (gid,))
                except Exception as exc:
                    if getattr(exc, "pgcode", None) != _UNDEFINED_OBJECT:
                        raise
                    continue
                done.append(gid)
    finally:
        conn.autocommit = previous
    return done


def commit(conn: PgConnection, meta_schema: str, pipeline: str, gids: Iterable[str]) -> list[str]:
    """The committer: commits decided parts, then forgets them. Forgetting last, so a
    crash in between leaves rows that name parts already committed: the next
    ``resolve`` finds them gone from ``pg_prepared_xacts`` and only forgets them."""
    gids = list(gids)
    committed = _finish(conn, gids, "COMMIT")
    _forget(conn, meta_schema, pipeline, gids)
    return committed


def _forget(conn: PgConnection, meta_schema: str, pipeline: str, gids: list[str]) -> None:
    if not gids:
        return
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DELETE FROM {} WHERE pipeline = %s AND gid = ANY(%s)").format(
            meta_tables.table(meta_schema, meta_tables.DECIDED_PARTS)), (pipeline, gids))
    conn.commit()


def prepared(conn: PgConnection, prefix: str) -> list[str]:
    """The prepared parts whose id starts with ``prefix``, in this database, oldest first."""
    with conn.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                    " AND starts_with(gid, %s) ORDER BY prepared", (prefix,))
        gids = [row[0] for row in cur.fetchall()]
    conn.rollback()
    return gids


def roll_back(conn: PgConnection, prefix: str) -> list[str]:
    """Rolls back every prepared part whose id starts with ``prefix``. Only for parts no
    decision names and none can name any more (this driver's own undecided batch, or
    parts of a fenced epoch)."""
    return _finish(conn, prepared(conn, prefix), "ROLLBACK")


def _decided_column(cur, meta_schema: str, select: str, params: tuple = ()) -> list:
    """The first column of ``select`` over ``decided_parts`` (its ``{}``), in the caller's
    transaction; empty before the table exists (a pipeline that never ran)."""
    table = meta_tables.table(meta_schema, meta_tables.DECIDED_PARTS)
    cur.execute("SELECT to_regclass(%s)", (table.as_string(cur),))
    row = cur.fetchone()
    if row is None or row[0] is None:
        return []
    cur.execute(sql.SQL(select).format(table), params or None)
    return [r[0] for r in cur.fetchall()]


def decided(conn: PgConnection, meta_schema: str, pipeline: str) -> list[str]:
    """The parts the pipeline's committed decisions name."""
    with conn.cursor() as cur:
        gids = _decided_column(cur, meta_schema, "SELECT gid FROM {} WHERE pipeline = %s ORDER BY batch_id, gid",
                               (pipeline,))
    conn.rollback()
    return gids


def resolve(conn: PgConnection, meta_schema: str, pipeline: str, undecided: str = "rollback"
            ) -> dict[str, list[str]]:
    """Finishes what a dead driver left: commits every decided part still prepared and
    forgets the decided ones; rolls back every other part of the pipeline
    (``undecided="rollback"``) or leaves them (``"keep"``).

    Roll back only once every epoch that may still decide is fenced: at a driver's
    start after its epoch bump, a stop's fence, a restore. Committing decided parts is
    safe at any time: the decision is committed, so this is what its driver was doing."""
    names = decided(conn, meta_schema, pipeline)
    committed = _finish(conn, names, "COMMIT")
    _forget(conn, meta_schema, pipeline, names)
    named = set(names)
    rolled_back = [] if undecided == "keep" else _finish(
        conn, [g for g in prepared(conn, pipeline_prefix(pipeline)) if g not in named], "ROLLBACK")
    return {"committed": committed, "rolled_back": rolled_back}


def pending_decided(cur, meta_schema: str, pipeline: str | None = None) -> int:
    """How many decided parts this transaction's snapshot sees not yet committed and
    forgotten (of one pipeline, or of all): nonzero means the snapshot has a batch's
    offsets and aggregates without all of its rows."""
    if pipeline is None:
        return len(_decided_column(cur, meta_schema, "SELECT gid FROM {}"))
    return len(_decided_column(cur, meta_schema, "SELECT gid FROM {} WHERE pipeline = %s", (pipeline,)))


def pipelines_with_decided(conn: PgConnection, meta_schema: str) -> list[str]:
    """The pipelines with decided parts not yet forgotten."""
    with conn.cursor() as cur:
        names = _decided_column(cur, meta_schema, "SELECT DISTINCT pipeline FROM {} ORDER BY 1")
    conn.rollback()
    return names
