"""The database side of the audit: one REPEATABLE READ, READ ONLY snapshot (rules in ``oracle``)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from psycopg2 import sql
from psycopg2.extensions import ISOLATION_LEVEL_REPEATABLE_READ

from spark_apps.eos_stream.audit.rules import (
    Position,
    as_number,
    carrier_for,
    keep_latest,
    retired_topics,
)
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec, RowTarget
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.parts import pending_decided
from spark_apps.eos_stream.state import meta_tables
from spark_apps.eos_stream.state.control import driver_running

# Above any Kafka offset: a retired topic's carrier rows all count as "below the earliest offset".
ALL_OFFSETS = 2**63 - 1
# Shifts a retired topic's partitions below every current one in the order behind `latest`.
RETIRED_FIRST = 2**31


@dataclass
class Snapshot:
    """The database side of the audit, read in one REPEATABLE READ, READ ONLY transaction."""

    running: bool
    stored: dict[TopicPartition, int]
    # (topic, partition, offset) -> (error, sqlstate, raw key, raw value)
    dead: dict[tuple[str, int, int], tuple[str, str | None, bytes | None, bytes | None]]
    # row target -> partition -> offset -> row count
    rows: dict[str, dict[TopicPartition, Counter]]
    # per aggregate target: key -> column -> stored total
    actual: list[dict[tuple, dict[str, Any]]]
    # per aggregate target: totals of its carrier's rows below the earliest offsets (None: no carrier)
    below_earliest: list[dict[tuple, Counter] | None]
    # per aggregate target: (key, (topic, partition)) -> latest column -> (position, value) among those rows
    below_latest: list[dict[tuple, dict[str, tuple[Position, Any]]]]
    # partitions of topics no longer in the definition that hold offsets, rows or dead letters
    retired: set[TopicPartition] = field(default_factory=set)
    # ranges skipped on purpose by ``eos offsets reset`` (``read_accepted_gaps``)
    accepted_gaps: list[dict[str, Any]] = field(default_factory=list)


def fetch(conn, query: sql.Composable, params: tuple = ()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall()


def _target(config: PipelineConfig, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(config.target_schema), sql.Identifier(table))


def _below_earliest(conn, config: PipelineConfig, carrier: RowTarget, gone: list[tuple[str, int, int]],
                    select: sql.SQL, tail: sql.SQL, **parts: sql.Composable) -> list[tuple]:
    """``SELECT <select> FROM <carrier> r ... <tail>`` over the carrier's rows below each
    partition's earliest offset (``gone``: topic, partition, earliest), where Kafka's copy is gone."""
    query = sql.SQL(
        "SELECT {select} FROM {table} r JOIN (VALUES {bounds}) AS e(topic, partition, earliest)"
        " ON r.kafka_topic = e.topic AND r.kafka_partition = e.partition WHERE r.kafka_offset < e.earliest{tail}"
    ).format(select=select.format(**parts), tail=tail.format(**parts), table=_target(config, carrier.table),
             bounds=sql.SQL(", ").join(sql.SQL("(%s::text, %s::integer, %s::bigint)") for _ in gone))
    return fetch(conn, query, tuple(x for bound in gone for x in bound))


# How long the audit waits for a live driver to commit the parts of a batch it decided.
DECIDED_PARTS_WAIT = 10.0


@dataclass
class _Cut:
    """The snapshot's first reads: what the read of Kafka needs (the stored offsets split it,
    the dead letters are kept aside), read before it starts."""

    running: bool
    stored: dict[TopicPartition, int]
    dead: dict[tuple[str, int, int], tuple[str, str | None, bytes | None, bytes | None]]


def read_cut(conn, config: PipelineConfig) -> _Cut:
    """Opens the audit's REPEATABLE READ, READ ONLY transaction and reads the running lock, the
    stored offsets and the dead letters; ``read_snapshot`` reads the rest in the same one."""
    conn.set_session(isolation_level=ISOLATION_LEVEL_REPEATABLE_READ, readonly=True)
    deadline = time.monotonic() + DECIDED_PARTS_WAIT
    while True:
        # The first statement fixes the snapshot; the running lock is looked at beside it.
        running = driver_running(conn, config.pipeline)
        # A batch decided and not yet committed part by part (``sink.parts``, P4) has its offsets and
        # aggregates in the snapshot without all its rows: a live driver commits them within
        # milliseconds, so a later snapshot is a consistent cut. One a dead driver left (no driver
        # runs) stays until the next start or stop: the audit reads it as it is, rows missing.
        with conn.cursor() as cur:
            pending = pending_decided(cur, config.meta_schema, config.pipeline)
        if not pending or not running or time.monotonic() > deadline:
            break
        conn.rollback()
        time.sleep(0.05)
    stored: dict[TopicPartition, int] = {}
    if MODES[config.delivery].stores_offsets:
        stored = {(t, p): int(o) for t, p, o in fetch(conn, sql.SQL(
            "SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s").format(
            meta_tables.table(config.meta_schema, meta_tables.OFFSETS)), (config.pipeline,))}
    # Dead-letter tables made before the sqlstate column get it only when the app next starts.
    has_sqlstate = bool(fetch(conn, sql.SQL(
        "SELECT 1 FROM information_schema.columns WHERE table_schema = %s AND table_name = %s"
        " AND column_name = 'sqlstate'"), (config.meta_schema, meta_tables.DEAD_LETTERS)))
    dead = {
        (t, p, int(o)): (error, code, None if key is None else bytes(key), None if value is None else bytes(value))
        for t, p, o, error, code, key, value in fetch(conn, sql.SQL(
            'SELECT topic, partition, "offset", error, {}, key, value FROM {} WHERE pipeline = %s').format(
            sql.Identifier("sqlstate") if has_sqlstate else sql.SQL("NULL::text"),
            meta_tables.table(config.meta_schema, meta_tables.DEAD_LETTERS)), (config.pipeline,))
    }
    return _Cut(running, stored, dead)


def read_accepted_gaps(conn, config: PipelineConfig) -> list[dict[str, Any]]:
    """The pipeline's accepted gaps (``meta_tables.ACCEPTED_GAPS``), oldest first; none when the
    table predates this version."""
    gaps = meta_tables.table(config.meta_schema, meta_tables.ACCEPTED_GAPS)
    if fetch(conn, sql.SQL("SELECT to_regclass(%s)"), (gaps.as_string(conn),)) == [(None,)]:
        return []
    columns = ("topic", "partition", "from_offset", "to_offset", "log_start", "log_end", "reason", "accepted_by",
               "accepted_at")
    rows = fetch(conn, sql.SQL("SELECT {} FROM {} WHERE pipeline = %s ORDER BY id").format(
        sql.SQL(", ").join(map(sql.Identifier, columns)), gaps), (config.pipeline,))
    return [{**dict(zip(columns, row, strict=True)), "accepted_at": str(row[-1])} for row in rows]


def read_snapshot(conn, config: PipelineConfig, spec: PipelineSpec, aggregates: list[AggregateTarget],
                   earliest: dict[TopicPartition, int], cut: _Cut) -> Snapshot:
    """The rest of the database's side, in the transaction ``read_cut`` opened: the same snapshot,
    however long after the cut it is read (the first statement fixed it)."""
    stored, dead = cut.stored, cut.dead
    rows = {target.table: _row_offsets(conn, config, target.table)
            for target in spec.targets if isinstance(target, RowTarget)}
    retired = retired_topics(config.topics, [*stored, *((t, p) for t, p, _o in dead),
                                             *(tp for present in rows.values() for tp in present)])
    actual: list[dict[tuple, dict[str, Any]]] = []
    below: list[dict[tuple, Counter] | None] = []
    below_latest: list[dict[tuple, dict[str, tuple[Position, Any]]]] = []
    # Where Kafka's copy is not read, the carrier's rows stand in: below each partition's
    # earliest offset, and all of a retired topic's rows (its records still count in the aggregates).
    gone = [(t, p, e) for (t, p), e in sorted(earliest.items()) if e > 0]
    gone += [(t, p, ALL_OFFSETS) for t, p in sorted(retired)]
    for target in aggregates:
        actual.append(_aggregate_rows(conn, config, target))
        carrier = carrier_for(spec, target)
        sums: dict[tuple, Counter] = defaultdict(Counter)
        latest: dict[tuple, dict[str, tuple[Position, Any]]] = defaultdict(dict)
        if carrier is not None and gone:
            sums = _sums_below_earliest(conn, config, carrier, target, gone)
            latest = _latest_below_earliest(conn, config, carrier, target, gone, retired)
        below_latest.append(latest)
        below.append(None if carrier is None else sums)
    return Snapshot(cut.running, stored, dead, rows, actual, below, below_latest, retired)


def _row_offsets(conn, config: PipelineConfig, table: str) -> dict[TopicPartition, Counter]:
    """How many rows a row target holds of each offset, per partition."""
    # Each partition's offsets as one array, counted here: a million rows cost one value
    # each to fetch and count, not a tuple and a dict entry apiece.
    present: dict[TopicPartition, Counter] = defaultdict(Counter)
    for t, p, offsets in fetch(conn, sql.SQL(
            "SELECT kafka_topic, kafka_partition, array_agg(kafka_offset) FROM {} GROUP BY 1, 2").format(
            _target(config, table))):
        present[(t, p)] = Counter(map(int, offsets))
    return present


def _aggregate_rows(conn, config: PipelineConfig, target: AggregateTarget) -> dict[tuple, dict[str, Any]]:
    """An aggregate table as it is: its columns per key."""
    columns, width = target.columns, len(target.group_by)
    return {
        tuple(row[:width]): dict(zip(columns, row[width:], strict=True))
        for row in fetch(conn, sql.SQL("SELECT {}, {} FROM {}").format(
            sql.SQL(", ").join(map(sql.Identifier, target.group_by)),
            sql.SQL(", ").join(map(sql.Identifier, columns)), _target(config, target.table)))
    }


def _carrier_keys(target: AggregateTarget) -> sql.Composed:
    return sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(k)) for k in target.group_by)


def _sums_below_earliest(conn, config: PipelineConfig, carrier: RowTarget, target: AggregateTarget,
                         gone: list[tuple[str, int, int]]) -> dict[tuple, Counter]:
    """Each key's increments summed over the carrier's rows that Kafka no longer holds."""
    sums: dict[tuple, Counter] = defaultdict(Counter)
    increments, width = list(target.increments), len(target.group_by)
    if not increments:
        return sums
    totals = sql.SQL(", ").join(
        sql.SQL("count(*)") if source is None else sql.SQL("sum(r.{})").format(sql.Identifier(source))
        for source in target.increments.values())
    for row in _below_earliest(conn, config, carrier, gone, sql.SQL("{keys}, {totals}"),
                               sql.SQL(" GROUP BY {keys}"), keys=_carrier_keys(target), totals=totals):
        sums[tuple(row[:width])] = Counter({c: as_number(v) for c, v in zip(increments, row[width:], strict=True)})
    return sums


def _latest_below_earliest(conn, config: PipelineConfig, carrier: RowTarget, target: AggregateTarget,
                           gone: list[tuple[str, int, int]],
                           retired: set[TopicPartition]) -> dict[tuple, dict[str, tuple[Position, Any]]]:
    """Each key's last row below the earliest offsets, per partition: kept only where Kafka holds
    no later record of the key (keep_latest compares positions)."""
    latest: dict[tuple, dict[str, tuple[Position, Any]]] = defaultdict(dict)
    if not target.latest:
        return latest
    width, keys = len(target.group_by), _carrier_keys(target)
    values = sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(v)) for v in target.latest.values())
    for row in _below_earliest(
            conn, config, carrier, gone,
            sql.SQL("DISTINCT ON ({keys}, r.kafka_topic, r.kafka_partition) {keys}, r.kafka_topic,"
                    " r.kafka_partition, r.kafka_offset, {values}"),
            sql.SQL(" ORDER BY {keys}, r.kafka_topic, r.kafka_partition, r.kafka_offset DESC"),
            keys=keys, values=values):
        topic, partition, offset = row[width], int(row[width + 1]), int(row[width + 2])
        for column, value in zip(target.latest, row[width + 3:], strict=True):
            keep_latest(latest[(tuple(row[:width]), (topic, partition))], column,
                        latest_position(topic, partition, offset, retired), value)
    return latest


def latest_position(topic: str, partition: int, offset: int, retired: set[TopicPartition]) -> Position:
    """Where a carrier row stands in the order behind ``latest``. A retired topic's rows come
    before every record of the current topics: the stream has applied none of its records
    since the topic left the definition, so its values can only be older."""
    return (partition - RETIRED_FIRST, offset) if (topic, partition) in retired else (partition, offset)
