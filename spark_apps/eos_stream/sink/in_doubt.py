"""PostgreSQL prepared transactions of ``two_phase`` delivery: their ids, and
how a restarted driver finds and finishes the ones its predecessor left.

A batch's transaction id is deterministic: ``eos:<pipeline>:<digest of the
batch's start offsets>``. A restarted driver therefore recognises its own
orphans by prefix in ``pg_prepared_xacts``, without any state of its own.

An orphan is a batch that was PREPAREd (data, dead letters and next offsets,
written under the pipeline's advisory lock with the skip-applied guard) and
never reached COMMIT PREPARED because the driver died in between: the
*in-doubt* window of two-phase commit. It holds its row locks and the
pipeline's advisory lock until resolved, so every other writer of the
pipeline waits on it. Resolution commits it (like Flink's committer, which
re-commits the pending transactions of the last checkpoint on recovery):
it is self-contained, so committing finishes exactly what the dead driver was
about to do, and the next batch starts from the offsets it stored. Rolling it
back would be exact as well (the batch would be read again from Kafka), and is
what a restore does, because it replaces the state the orphan was built on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Literal

from psycopg2.extensions import connection as PgConnection

from spark_apps.eos_stream.kafka.partitions import TopicPartition

GID_LIMIT = 200  # PostgreSQL's maximum length of a prepared transaction's identifier


def gid_prefix(pipeline: str) -> str:
    """The prefix every prepared transaction of ``pipeline`` starts with."""
    return f"eos:{pipeline}:"


def transaction_id(pipeline: str, start_offsets: Mapping[TopicPartition, int]) -> str:
    """The deterministic id of the batch starting at ``start_offsets``."""
    canonical = ",".join(f"{t}:{p}:{o}" for (t, p), o in sorted(start_offsets.items()))
    gid = gid_prefix(pipeline) + hashlib.sha256(canonical.encode()).hexdigest()[:24]
    if len(gid) > GID_LIMIT:
        raise ValueError(f"pipeline name too long for a prepared transaction id: {pipeline[:40]}...")
    return gid


def find_in_doubt(conn: PgConnection, pipeline: str) -> list[dict[str, str]]:
    """Prepared transactions of ``pipeline`` in the connected database, oldest first."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT gid, prepared::text, owner FROM pg_prepared_xacts"
            " WHERE database = current_database() AND starts_with(gid, %s) ORDER BY prepared",
            (gid_prefix(pipeline),),
        )
        rows = [{"gid": gid, "prepared": prepared, "owner": owner} for gid, prepared, owner in cur.fetchall()]
    conn.rollback()
    return rows


def resolve_in_doubt(
    conn: PgConnection, pipeline: str, action: Literal["commit", "rollback"] = "commit"
) -> list[dict[str, str]]:
    """Commits (or rolls back) every prepared transaction of ``pipeline``.

    Idempotent: a transaction another process resolved meanwhile is skipped."""
    resolved = []
    orphans = find_in_doubt(conn, pipeline)
    # COMMIT/ROLLBACK PREPARED cannot run inside a transaction block.
    previous, conn.autocommit = conn.autocommit, True
    try:
        with conn.cursor() as cur:
            for orphan in orphans:
                try:
                    # gid is a string literal here, so it is passed as a parameter, not an identifier.
                    cur.execute(("COMMIT PREPARED %s" if action == "commit" else "ROLLBACK PREPARED %s"),
                                (orphan["gid"],))
                except Exception as exc:  # UndefinedObject: resolved by someone else in between
                    if getattr(exc, "pgcode", None) != "42704":
                        raise
                    continue
                resolved.append({**orphan, "action": action})
    finally:
        conn.autocommit = previous
    return resolved


def max_prepared_transactions(conn: PgConnection) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting('max_prepared_transactions')::int")
        row = cur.fetchone()
    conn.rollback()
    return int(row[0]) if row else 0



class PreparedTransactionsExhausted(RuntimeError):
    """PREPARE TRANSACTION found no free prepared-transaction slot on the server."""


def prepare_failure(exc: BaseException, gid: str | None = None) -> PreparedTransactionsExhausted | None:
    """The clear error to raise instead of ``exc``, an error of PREPARE TRANSACTION
    (``conn.tpc_prepare()``), when the server has no free prepared-transaction
    slot; None for any other error (raise that one as it is).

    What PostgreSQL answers (twophase.c, MarkAsPreparing): every slot taken is
    SQLSTATE 53200 "maximum number of prepared transactions reached" (its hint names
    the setting); ``max_prepared_transactions = 0`` is 55000 "prepared transactions
    are disabled". 53400 (configuration_limit_exceeded), which some reports name, is also
    accepted here. None of them is transient in the usual sense, nor any record's
    fault: the slots are held by transactions left in doubt (this pipeline's or
    another's, holding their locks until resolved) or the setting is too low for the
    two_phase pipelines writing to this server. Retrying without freeing a slot fails
    the same way, so the message says what to do."""
    code = getattr(exc, "pgcode", None)
    text = str(getattr(exc, "pgerror", None) or exc).strip()
    lowered = text.lower()
    exhausted = code == "53400" or (code == "53200" and "prepared transactions" in lowered)
    disabled = code == "55000" and "prepared transactions are disabled" in lowered
    if not (exhausted or disabled):
        return None
    first = text.splitlines()[0].removeprefix("ERROR:").strip() if text else "no detail"
    what = ("prepared transactions are disabled on this server (max_prepared_transactions = 0)" if disabled else
            "the server has no free prepared-transaction slot (max_prepared_transactions are all in use)")
    return PreparedTransactionsExhausted(
        f"PREPARE TRANSACTION{f' {gid}' if gid else ''} failed: {what} (SQLSTATE {code}: {first}). Each two_phase "
        "batch holds one slot from PREPARE to COMMIT PREPARED, and a transaction left in doubt keeps its slot and "
        "its locks: list them in pg_prepared_xacts and resolve old ones (COMMIT PREPARED or ROLLBACK PREPARED; "
        "restarting the pipeline whose gid prefix 'eos:<pipeline>:' they carry commits its own), or raise "
        "max_prepared_transactions in postgresql.conf (at least one per two_phase pipeline writing to this "
        "server; it takes a server restart)."
    )
