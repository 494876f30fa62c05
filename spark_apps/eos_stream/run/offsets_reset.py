"""Moving a pipeline's stored offsets on purpose: the way out of lost data (``kafka.lost_data``).

When Kafka no longer holds the records at a pipeline's stored offset, the run fails with
``EXIT_DATA_LOST`` and no restart can mend it. ``eos offsets reset`` (``airflow_provider_eos.cli``)
calls ``reset_offsets`` here, which

* refuses while a driver of the pipeline runs (it takes the pipeline's running lock, as a driver
  does, and holds it to the end),
* moves only the partitions whose stored offset Kafka no longer holds, unless forced,
* and in ONE transaction bumps the pipeline's epoch (a driver that started meanwhile is fenced,
  as by a recovery), moves the stored offsets and records each skipped range, with the reason,
  who and when, in ``accepted_gaps``; the audit reports those ranges as an accepted gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import connection as PgConnection
from psycopg2.extras import execute_values

from spark_apps.eos_stream.kafka import lost_data
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.offsets_store import OffsetsStore
from spark_apps.eos_stream.state import fencing, meta_tables
from spark_apps.eos_stream.state.control import hold_running_lock

TARGETS = ("earliest", "latest")


class ResetRefused(RuntimeError):
    """The reset was refused (nothing changed): a missing reason, an unknown partition."""


@dataclass(frozen=True)
class Move:
    """One partition's stored offset moved from ``from_offset`` to ``to_offset``: the records in
    between are skipped (or, moving back, read again)."""

    topic: str
    partition: int
    from_offset: int
    to_offset: int
    log_start: int
    log_end: int
    lost: bool

    def describe(self) -> str:
        what = "lost" if self.lost else "held by Kafka, forced"
        return (f"{self.topic}[{self.partition}]: {self.from_offset} -> {self.to_offset} (log start {self.log_start}, "
                f"log end {self.log_end}; stored offset {what})")


def plan_moves(stored: Mapping[TopicPartition, int], bounds: Mapping[TopicPartition, tuple[int, int]],
               to: str, only: set[TopicPartition] | None = None, force: bool = False) -> list[Move]:
    """The moves a reset makes: each stored partition (of ``only``, when given) whose stored
    offset Kafka no longer holds, or any stored one with ``force``, to the log start (``earliest``)
    or end (``latest``). A partition never applied, or already there, does not move.

    :raises ResetRefused: ``to`` is neither, or ``only`` names a partition Kafka does not have."""
    if to not in TARGETS:
        raise ResetRefused(f"--to must be one of {', '.join(TARGETS)}, not {to!r}")
    unknown = sorted((only or set()) - set(bounds))
    if unknown:
        raise ResetRefused("no such partition in Kafka: " + ", ".join(f"{t}:{p}" for t, p in unknown))
    lost = {(p.topic, p.partition) for p in lost_data.lost_partitions(stored, bounds)}
    moves = []
    for tp, (start, end) in sorted(bounds.items()):
        offset = stored.get(tp)
        if offset is None or (only is not None and tp not in only) or (tp not in lost and not force):
            continue
        target = start if to == "earliest" else end
        if target != offset:
            moves.append(Move(tp[0], tp[1], offset, target, start, end, tp in lost))
    return moves


def _record(conn: PgConnection, meta_schema: str, pipeline: str, moves: list[Move], reason: str, who: str) -> int:
    """The epoch bump, the offsets and the accepted gaps, committed together; the new epoch."""
    offsets = meta_tables.table(meta_schema, meta_tables.OFFSETS)
    gaps = meta_tables.table(meta_schema, meta_tables.ACCEPTED_GAPS)
    with conn.cursor() as cur:
        fencing.lock_pipeline(cur, pipeline)  # first: a batch in flight ends before anything changes
        cur.execute(fencing.bump_epoch_statement(meta_schema),
                    {"pipeline": pipeline, "by": who, "reason": f"offsets reset: {reason}"})
        row = cur.fetchone()
        for m in moves:
            cur.execute(sql.SQL("UPDATE {} SET next_offset = %s, batch_id = NULL, updated_at = now()"
                                " WHERE pipeline = %s AND topic = %s AND partition = %s").format(offsets),
                        (m.to_offset, pipeline, m.topic, m.partition))
        execute_values(cur, sql.SQL(
            "INSERT INTO {} (pipeline, topic, partition, from_offset, to_offset, log_start, log_end, reason,"
            " accepted_by) VALUES %s").format(gaps).as_string(cur),
            [(pipeline, m.topic, m.partition, m.from_offset, m.to_offset, m.log_start, m.log_end, reason, who)
             for m in moves])
    conn.commit()
    assert row is not None
    return int(row[0])


def reset_offsets(connect: Any, meta_schema: str, pipeline: str, kafka: tuple[str, Mapping[str, str]], *,
                  to: str, reason: str, who: str, only: set[TopicPartition] | None = None,
                  force: bool = False, apply: bool = True) -> dict[str, Any]:
    """Plans, and with ``apply`` makes, the reset of ``pipeline``'s stored offsets.

    :param connect: opens a new connection to the target database (two are used: one holds the
        running lock, the other writes).
    :param kafka: bootstrap servers and librdkafka options.
    :return: ``moves`` (``Move`` as dicts), ``epoch`` (the new one, None when nothing changed),
        ``applied``.
    :raises AlreadyRunning: a driver of the pipeline runs.
    """
    if not reason.strip():
        raise ResetRefused("a reset needs --reason: it is recorded with each skipped range")
    guard, conn = connect(), connect()
    try:
        hold_running_lock(guard, pipeline, wait_seconds=5)
        preflight.ensure_meta_tables(conn, meta_schema)
        stored = OffsetsStore(meta_schema, pipeline).load(conn)
        conn.rollback()
        topics = sorted({t for t, _p in stored} | {t for t, _p in only or set()})
        bounds = lost_data.log_bounds(kafka[0], kafka[1], _partitions(kafka, topics))
        moves = plan_moves(stored, bounds, to, only, force)
        epoch = _record(conn, meta_schema, pipeline, moves, reason, who) if apply and moves else None
        return {"moves": [asdict(m) for m in moves], "epoch": epoch, "applied": epoch is not None}
    finally:
        for c in (conn, guard):  # closing the guard frees the running lock
            c.close()


def _partitions(kafka: tuple[str, Mapping[str, str]], topics: list[str]) -> list[TopicPartition]:
    found = preflight.kafka_partitions(kafka[0], topics, dict(kafka[1]))
    return [(t, p) for t, ps in found.items() for p in ps]
