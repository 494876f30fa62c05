"""The exactly-once oracle: what Kafka committed against what the database holds.

Green only when the target is right, red only when it is wrong. The rules
(also in ``docs/audit.md``; the pure ones live in ``audit_rules.py``):

* **One snapshot.** The database is read in one REPEATABLE READ, READ ONLY
  transaction: rows, aggregates, dead letters and the stored offsets all come
  from the same instant, and since every batch commits its data with its
  offsets, the snapshot is a consistent cut of the pipeline. Kafka is read
  *after* the snapshot, so every stored offset is at or below the LSO the
  audit sees.
* **Compared up to the stored offsets.** For delivery modes that store
  offsets (``exactly_once``, ``two_phase``) every committed record below the
  stored ``next_offset`` must be in the target; committed records above it
  are the *tail*. While a driver holds the pipeline's running lock (at the
  snapshot or when the read ends) the tail is "not yet applied", reported
  but not a mismatch, so an audit of a running stream does not false-alarm.
  With no driver running the tail counts as missing, as a stopped pipeline
  must have applied everything (``pending`` overrides this: ``missing`` or
  ``allowed``). Rows or dead letters at or above the stored offset are a
  mismatch (``beyond_offsets``): a restart would apply them again. Modes that
  store no offsets are compared up to the LSO and have no consistent cut.
* **What Kafka no longer holds.** Rows below a partition's earliest offset
  (retention, ``delete_records``) are not "unexpected": they are counted as
  ``rows_below_earliest`` and checked for duplicates only. A stored offset
  below the earliest offset is a ``retention_gap``: records the pipeline never
  applied are gone. A stored offset above the LSO is ``offsets_ahead``.
* **Aggregates.** Per key, the expected totals are Kafka's valid, not
  dead-lettered committed records in the compared range, plus the rows of a
  *carrier* row target (one whose columns hold the aggregate's key and
  increment fields) below the earliest offset, where Kafka's copy is gone.
  Without a carrier, an aggregate whose inputs are partly gone from Kafka
  (some partition's earliest offset above 0) cannot be recomputed: it is
  reported under ``unverified`` with the reason, neither ok nor a mismatch.
  A latest column holds the key's last record in Kafka order; for a key whose
  records sit in several partitions the apply's value depends on where batches
  end, and any one partition's last record is accepted (``_expected_latest``).
* **Dead letters** are grouped by ``errors.dead_letter_class``. One whose
  SQLSTATE is not a data error (class 22 or 23) is a mismatch. Every other
  one is judged by PostgreSQL: ``try_dead_letters`` tries the record's own
  insert into the targets (the sink's staging and apply SQL) and rolls it
  back; one that applies is a valid record wrongly quarantined. The value
  tried is Kafka's while Kafka holds the record, the stored raw value after
  that. A dead letter at an offset where Kafka holds no committed record is a
  mismatch too; a malformed record not quarantined is one.
* **After a replay** (``goal``: its ``lso_at_start``) the tail is the resumed
  stream's work even with no driver running, and the stored offsets must
  have reached the goal (``goal_not_reached`` otherwise).
* **Compacted topics** are refused; topics no longer in the definition are
  ``retired_topics``: reported, not compared (their carrier rows still count
  in the aggregates).
* **Bounded reads.** A partition is finished by offset (record, position or
  end-of-partition), never by waiting for a record, so trailing markers or a
  fully deleted partition cannot hang the read; an overall ``timeout`` ends
  it anyway, naming the partitions that did not finish. If retention deletes
  records inside the range while it is read, the audit starts over.
* **Parallel reads.** A big read of Kafka is dealt out to worker processes,
  one per core (``audit_readers``), while this process reads the rest of the
  snapshot; their merged sides are the side one process builds, so the
  report is the same.

    python -m spark_apps.eos_stream.audit --config pipeline.json [--timeout S] [--pending auto|missing|allowed]
        [--goal '{"topic": {"0": 1234}}'] [--workers N]

Prints one JSON report; exits 1 on any mismatch, 0 when exact, 2 when the
read of Kafka timed out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg2
from psycopg2 import sql
from psycopg2.extensions import ISOLATION_LEVEL_REPEATABLE_READ

from spark_apps.eos_stream.audit.kafka import KafkaOffsets, KafkaSide, ReadTask
from spark_apps.eos_stream.audit.readers import PARALLEL_MIN_RECORDS, KafkaRead
from spark_apps.eos_stream.audit.rules import (
    APPLIES,
    PENDING_POLICIES,
    REFUSED,
    UNPARSABLE,
    AuditTimeout,
    PartitionRange,
    Position,
    as_number,
    carrier_for,
    compare_rows,
    dead_letter_verdict,
    goal_offsets,
    goal_shortfall,
    keep_latest,
    retired_topics,
    tail_counts_as_missing,
    wrong_keys,
)
from spark_apps.eos_stream.errors import dead_letter_class
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.parsing import parse_record, staging_columns, staging_lines
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec, RowTarget, load_spec
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig, parse_args
from spark_apps.eos_stream.sink import apply_sql, staging
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.parts import pending_decided
from spark_apps.eos_stream.sink.postgres import connect
from spark_apps.eos_stream.state import meta_tables
from spark_apps.eos_stream.state.control import driver_running

DEFAULT_TIMEOUT = 900.0
# Starts over when retention deletes records in the range while it is read.
ATTEMPTS = 3
SAMPLE = 20  # entries of a list the report spells out
# Above any Kafka offset: a retired topic's carrier rows all count as "below the earliest offset".
ALL_OFFSETS = 2**63 - 1
# Shifts a retired topic's partitions below every current one in the order behind `latest`.
RETIRED_FIRST = 2**31
# A dead letter's trial waits at most this long for a row lock a running stream's batch holds.
TRIAL_LOCK_TIMEOUT = "10s"
TRIAL_ATTEMPTS = 3


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


def _fetch(conn, query: sql.Composable, params: tuple = ()) -> list[tuple]:
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
    return _fetch(conn, query, tuple(x for bound in gone for x in bound))


# How long the audit waits for a live driver to commit the parts of a batch it decided.
DECIDED_PARTS_WAIT = 10.0


@dataclass
class _Cut:
    """The snapshot's first reads: what the read of Kafka needs (the stored offsets split it,
    the dead letters are kept aside), read before it starts."""

    running: bool
    stored: dict[TopicPartition, int]
    dead: dict[tuple[str, int, int], tuple[str, str | None, bytes | None, bytes | None]]


def _read_cut(conn, config: PipelineConfig) -> _Cut:
    """Opens the audit's REPEATABLE READ, READ ONLY transaction and reads the running lock, the
    stored offsets and the dead letters; ``_read_snapshot`` reads the rest in the same one."""
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
        stored = {(t, p): int(o) for t, p, o in _fetch(conn, sql.SQL(
            "SELECT topic, partition, next_offset FROM {} WHERE pipeline = %s").format(
            meta_tables.table(config.meta_schema, meta_tables.OFFSETS)), (config.pipeline,))}
    # Dead-letter tables made before the sqlstate column get it only when the app next starts.
    has_sqlstate = bool(_fetch(conn, sql.SQL(
        "SELECT 1 FROM information_schema.columns WHERE table_schema = %s AND table_name = %s"
        " AND column_name = 'sqlstate'"), (config.meta_schema, meta_tables.DEAD_LETTERS)))
    dead = {
        (t, p, int(o)): (error, code, None if key is None else bytes(key), None if value is None else bytes(value))
        for t, p, o, error, code, key, value in _fetch(conn, sql.SQL(
            'SELECT topic, partition, "offset", error, {}, key, value FROM {} WHERE pipeline = %s').format(
            sql.Identifier("sqlstate") if has_sqlstate else sql.SQL("NULL::text"),
            meta_tables.table(config.meta_schema, meta_tables.DEAD_LETTERS)), (config.pipeline,))
    }
    return _Cut(running, stored, dead)


def _read_snapshot(conn, config: PipelineConfig, spec: PipelineSpec, aggregates: list[AggregateTarget],
                   earliest: dict[TopicPartition, int], cut: _Cut) -> Snapshot:
    """The rest of the database's side, in the transaction ``_read_cut`` opened: the same snapshot,
    however long after the cut it is read (the first statement fixed it)."""
    stored, dead = cut.stored, cut.dead
    rows: dict[str, dict[TopicPartition, Counter]] = {}
    for row_target in (t for t in spec.targets if isinstance(t, RowTarget)):
        # Each partition's offsets as one array, counted here: a million rows cost one value
        # each to fetch and count, not a tuple and a dict entry apiece.
        present: dict[TopicPartition, Counter] = defaultdict(Counter)
        for t, p, offsets in _fetch(conn, sql.SQL(
                "SELECT kafka_topic, kafka_partition, array_agg(kafka_offset) FROM {} GROUP BY 1, 2").format(
                _target(config, row_target.table))):
            present[(t, p)] = Counter(map(int, offsets))
        rows[row_target.table] = present
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
        columns, width = target.columns, len(target.group_by)
        actual.append({
            tuple(row[:width]): dict(zip(columns, row[width:], strict=True))
            for row in _fetch(conn, sql.SQL("SELECT {}, {} FROM {}").format(
                sql.SQL(", ").join(map(sql.Identifier, target.group_by)),
                sql.SQL(", ").join(map(sql.Identifier, columns)), _target(config, target.table)))
        })
        carrier = carrier_for(spec, target)
        sums: dict[tuple, Counter] = defaultdict(Counter)
        latest: dict[tuple, dict[str, tuple[Position, Any]]] = defaultdict(dict)
        if carrier is not None and gone:
            keys = sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(k)) for k in target.group_by)
            totals = sql.SQL(", ").join(
                sql.SQL("count(*)") if source is None else sql.SQL("sum(r.{})").format(sql.Identifier(source))
                for source in target.increments.values())
            increments = list(target.increments)
            for row in (_below_earliest(conn, config, carrier, gone, sql.SQL("{keys}, {totals}"),
                                        sql.SQL(" GROUP BY {keys}"), keys=keys, totals=totals)
                        if increments else []):
                sums[tuple(row[:width])] = Counter(
                    {c: as_number(v) for c, v in zip(increments, row[width:], strict=True)})
            if target.latest:
                # Each key's last row below the earliest offsets, per partition: kept only where
                # Kafka holds no later record of the key (keep_latest compares positions).
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
        below_latest.append(latest)
        below.append(None if carrier is None else sums)
    return Snapshot(cut.running, stored, dead, rows, actual, below, below_latest, retired)


def latest_position(topic: str, partition: int, offset: int, retired: set[TopicPartition]) -> Position:
    """Where a carrier row stands in the order behind ``latest``. A retired topic's rows come
    before every record of the current topics: the stream has applied none of its records
    since the topic left the definition, so its values can only be older."""
    return (partition - RETIRED_FIRST, offset) if (topic, partition) in retired else (partition, offset)


def _as_the_database_reads(conn, spec: PipelineSpec, aggregates: list[AggregateTarget], side: KafkaSide) -> None:
    """Timestamps compare as timestamps: each timestamptz key or latest value read from Kafka
    (a string) becomes what PostgreSQL's cast makes of it, the cast the apply does, so
    ``2026-01-01T00:00:00Z`` and ``2026-01-01 01:00:00+01`` are one key and one value, as in
    the target. A string the database refuses stays a string (and matches nothing)."""
    types = {f.name: f.pg_type for f in spec.fields}
    plans = [([i for i, k in enumerate(t.group_by) if types[k] == "timestamptz"],
              {c for c, source in t.latest.items() if types[source] == "timestamptz"}) for t in aggregates]
    texts: set[str] = set()
    for index, (key_at, columns) in enumerate(plans):
        for region in (0, 1):
            texts.update(group[i] for group in side.sums[region][index] for i in key_at)
            for (group, _tp), values in side.latest[region][index].items():
                texts.update(group[i] for i in key_at)
                texts.update(value for column, (_, value) in values.items() if column in columns)
    texts = {text for text in texts if isinstance(text, str)}  # NULLs stay NULL
    if not texts:
        return
    cast = _timestamps(conn, sorted(texts))

    def key_of(group: tuple, key_at: list[int]) -> tuple:
        return tuple(cast.get(v, v) if i in key_at else v for i, v in enumerate(group))

    for index, (key_at, columns) in enumerate(plans):
        for region in (0, 1):
            sums: dict[tuple, Counter] = defaultdict(Counter)
            for group, counter in side.sums[region][index].items():
                sums[key_of(group, key_at)].update(counter)  # two spellings of one instant: one key
            side.sums[region][index] = sums
            latest: dict[tuple, dict[str, tuple[Position, Any]]] = defaultdict(dict)
            for (group, tp), values in side.latest[region][index].items():
                for column, (position, value) in values.items():
                    keep_latest(latest[(key_of(group, key_at), tp)], column, position,
                                cast.get(value, value) if column in columns else value)
            side.latest[region][index] = latest


def _timestamps(conn, texts: list[str]) -> dict[str, Any]:
    """PostgreSQL's timestamptz for each text it accepts, in the audit's read-only session."""
    query = "SELECT t, t::timestamptz FROM unnest(%s::text[]) AS t"
    try:
        return dict(_fetch(conn, query, (texts,)))
    except psycopg2.DataError:
        conn.rollback()
    cast: dict[str, Any] = {}
    for text in texts:  # one refused text spoils a whole array: cast the others one by one
        try:
            cast.update(_fetch(conn, query, ([text],)))
        except psycopg2.DataError:
            conn.rollback()
    return cast


DeadLetterKey = tuple[str, int, int]


def try_dead_letters(config: PipelineConfig, spec: PipelineSpec,
                     records: Mapping[DeadLetterKey, tuple[bytes | None, bytes | None]]) -> dict[DeadLetterKey, str]:
    """Asks PostgreSQL whether each dead letter is really poison: its own insert into the targets.

    On a connection of its own (the audit's snapshot is READ ONLY), in one transaction that is
    rolled back: a staging table built like a batch's (``staging.stage_column_types`` and
    ``create_table``), then per record, inside a savepoint, its COPY line (``records.staging_lines``)
    and the batch's apply statement restricted to it (``apply_sql.apply_batch_statement``,
    ``only_record``). The sink's own SQL, so what "applies" means cannot drift from the sink.
    A record whose value does not parse is not tried: nothing of it can reach a target.

    :param records: (topic, partition, offset) -> (key, value) to try.
    :return: per record ``APPLIES``, ``UNPARSABLE`` or ``REFUSED`` + the SQLSTATE.
    :raises RuntimeError: a trial failed, ``TRIAL_ATTEMPTS`` times, with an error that says nothing
        of the record (a lock timeout, a lost connection): the audit cannot decide, so it says so.
    """
    import psycopg2

    outcomes: dict[DeadLetterKey, str] = {}
    tried = {}
    for coordinates, (key, value) in sorted(records.items()):
        try:
            parse_record(spec, value)
        except Exception:  # any exception of the parser on a record's bytes is that record's fault
            outcomes[coordinates] = UNPARSABLE
        else:
            tried[coordinates] = (key, value)
    if not tried:
        return outcomes
    conn = connect(config.postgres.dsn_kwargs(), describe=config.postgres.describe(),
                   application_name="eos-audit-trial")
    try:
        with conn.cursor() as cur:
            # A running stream's batch may hold a target row's lock; wait for it, a while.
            cur.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(TRIAL_LOCK_TIMEOUT)))
            stage = staging.create_table(cur, config.meta_schema, f"eos_audit_trial_{uuid.uuid4().hex[:12]}",
                                         staging.stage_column_types(spec))
            statement = apply_sql.apply_batch_statement(
                spec, stage=stage, target_schema=config.target_schema, meta_schema=config.meta_schema,
                skip_applied=False, dedupe=False, upsert_rows=False, only_record=True)
            for (topic, partition, offset), (key, value) in tried.items():
                lines = "".join(staging_lines(spec, [(topic, partition, offset, key, value)], keep_raw=True))
                for attempt in range(1, TRIAL_ATTEMPTS + 1):
                    cur.execute("SAVEPOINT eos_audit_trial")
                    try:
                        staging.copy_from_chunks(cur, stage, staging_columns(spec), iter([lines.encode()]))
                        cur.execute(statement, {"pipeline": config.pipeline, "topic": topic,
                                                "partition": partition, "offset": offset})
                        outcome = APPLIES
                    except psycopg2.Error as exc:
                        if dead_letter_class(exc.pgcode, "").startswith(("not_data", "parse")):
                            if attempt < TRIAL_ATTEMPTS:
                                cur.execute("ROLLBACK TO SAVEPOINT eos_audit_trial")
                                time.sleep(attempt)
                                continue
                            raise RuntimeError(
                                f"audit: cannot decide whether dead letter {topic}[{partition}]@{offset} is poison: "
                                f"its trial insert failed {TRIAL_ATTEMPTS} times with SQLSTATE {exc.pgcode}, not a "
                                f"data error ({str(exc).strip().splitlines()[0]}); rerun the audit") from exc
                        outcome = REFUSED + str(exc.pgcode)
                    cur.execute("ROLLBACK TO SAVEPOINT eos_audit_trial")
                    outcomes[(topic, partition, offset)] = outcome
                    break
    finally:
        if not conn.closed:  # a lost connection rolled back by itself; its error is the one to raise
            conn.rollback()  # the stage, and every trial insert, never existed
        conn.close()
    return outcomes


def audit(config: PipelineConfig, spec: PipelineSpec, *, timeout: float = DEFAULT_TIMEOUT,
          pending: str = "auto", goal: Mapping[TopicPartition, int] | None = None,
          workers: int | None = None) -> dict[str, Any]:
    """Compares the pipeline's target with what Kafka committed (rules in the module docstring).

    :param config: the pipeline's config.
    :param spec: the pipeline's spec.
    :param timeout: seconds from the audit's start after which the read of
        Kafka gives up; AuditTimeout then names the partitions that did not finish.
    :param pending: how committed records above the stored offsets count:
        ``auto`` (not yet applied while a driver runs or a ``goal`` is given, missing
        otherwise), ``missing`` or ``allowed``.
    :param goal: ``{(topic, partition): offset}`` the stored offsets must have reached (a
        replay's ``lso_at_start``); a partition short of it is a ``goal_not_reached`` mismatch.
    :param workers: processes reading Kafka (``audit_readers``): None for one per core when
        the read is big, 1 for this process alone. The report is the same either way.
    :raises AuditTimeout: the read of Kafka did not finish in ``timeout``.
    :raises ConfigError: a topic is compacted (``preflight.refuse_compacted``).
    """
    if pending not in PENDING_POLICIES:
        raise ValueError(f"pending must be one of {PENDING_POLICIES}, got {pending!r}")
    deadline = time.monotonic() + timeout
    moved = ""
    for _attempt in range(ATTEMPTS):
        report, moved = _audit_once(config, spec, timeout=timeout, deadline=deadline, pending=pending,
                                    goal=goal, workers=workers)
        if report is not None:
            return report
    raise RuntimeError(f"audit: retention deleted records inside the audited range during each of {ATTEMPTS} "
                       f"attempts ({moved}); rerun it")


def _audit_once(config: PipelineConfig, spec: PipelineSpec, *, timeout: float, deadline: float,
                pending: str, goal: Mapping[TopicPartition, int] | None,
                workers: int | None) -> tuple[dict[str, Any] | None, str]:
    kafka = KafkaOffsets(config.kafka_bootstrap, config.librdkafka_options())
    partitions = kafka.partitions(config.topics)
    preflight.refuse_compacted(kafka.admin, list(config.topics), "audit")
    earliest = kafka.offsets(partitions, "earliest")
    aggregates = [t for t in spec.targets if isinstance(t, AggregateTarget)]
    stores = MODES[config.delivery].stores_offsets
    conn = connect(config.postgres.dsn_kwargs(), describe=config.postgres.describe(), application_name="eos-audit")
    try:
        cut = _read_cut(conn, config)
        # Read after the snapshot was fixed: every stored offset in it is at or below this LSO.
        lso = kafka.offsets(partitions, "lso")
        ranges = {tp: PartitionRange(earliest[tp], lso[tp], cut.stored.get(tp), stores) for tp in partitions}
        task = ReadTask(config.kafka_bootstrap, config.librdkafka_options(), spec, aggregates, ranges,
                        frozenset(cut.dead), timeout, deadline)
        # Workers read Kafka while this process reads the rest of the snapshot (one read: Kafka after it).
        with KafkaRead(task, workers) as reading:
            snap = _read_snapshot(conn, config, spec, aggregates, earliest, cut)
            conn.commit()
            side = reading.side()
        _as_the_database_reads(conn, spec, aggregates, side)
        running_after = driver_running(conn, config.pipeline)
        conn.commit()
    finally:
        conn.close()
    after = kafka.offsets(partitions, "earliest")
    moved = [f"{t}[{p}] {earliest[(t, p)]}->{after[(t, p)]}" for t, p in partitions
             if earliest[(t, p)] < after[(t, p)] and earliest[(t, p)] < lso[(t, p)]]
    if moved:
        return None, ", ".join(moved)
    running = snap.running or running_after
    # Kafka's copy while Kafka holds it, the stored one after that; a not_data class is wrong whatever it holds.
    trials = try_dead_letters(config, spec, {
        k: (key, side.dead_seen[k] if k in side.dead_seen else value)
        for k, (error, code, key, value) in snap.dead.items()
        if (k[0], k[1]) not in snap.retired and not dead_letter_class(code, error).startswith("not_data:")})
    return _report(config, spec, aggregates, snap, ranges, side, trials, running=running, pending=pending,
                   goal=goal), ""


@dataclass
class _Counted:
    """What Kafka holds that the report compares with: the applied range, and the tail too when it
    counts as missing (``tail_missing``); the tail is otherwise only ``not_yet_applied``."""

    tail_missing: bool
    regions: tuple[int, ...]
    valid: dict[TopicPartition, set[int]]
    malformed: dict[TopicPartition, set[int]]
    committed: Counter
    not_yet_applied: Counter


def _counted(side: KafkaSide, tail_missing: bool) -> _Counted:
    """:param side: Kafka's records, split at the stored offsets.
    :param tail_missing: whether the tail counts as missing (``tail_counts_as_missing``)."""
    regions = (0, 1) if tail_missing else (0,)
    return _Counted(tail_missing=tail_missing, regions=regions, valid=_merged(side.valid, regions),
                    malformed=_merged(side.malformed, regions),
                    committed=sum((side.committed[r] for r in regions), Counter()),
                    not_yet_applied=Counter() if tail_missing else side.committed[1])


def _merged(parts: tuple[dict, dict], regions: tuple[int, ...]) -> dict[TopicPartition, set[int]]:
    """The offsets per partition of ``parts``' ``regions`` (0: applied, 1: tail), merged."""
    out: dict[TopicPartition, set[int]] = defaultdict(set)
    for region in regions:
        for tp, offsets in parts[region].items():
            out[tp] |= offsets
    return out


@dataclass
class _Section:
    """One part of the report and the mismatches it found, in the order it found them."""

    part: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)


def _kafka_section(ranges: dict[TopicPartition, PartitionRange], counted: _Counted) -> _Section:
    """Per partition, the range of Kafka compared; a retention gap or stored offsets ahead of the LSO
    is a mismatch.

    :param ranges: per partition, Kafka's range and the stored offset.
    :param counted: what the report compares with."""
    section = _Section({})
    for (t, p), rng in sorted(ranges.items()):
        section.part[f"{t}:{p}"] = {
            "earliest": rng.earliest, "lso": rng.lso, "stored_offset": rng.stored,
            "checked_to": rng.check_end(counted.tail_missing), "not_yet_applied": counted.not_yet_applied[(t, p)],
            "retention_gap": rng.retention_gap, "offsets_ahead": rng.offsets_ahead,
        }
        if rng.retention_gap:
            section.mismatches.append(f"retention_gap:{t}:{p}")
        if rng.offsets_ahead:
            section.mismatches.append(f"offsets_ahead:{t}:{p}")
    return section


def _rows_section(snap: Snapshot, ranges: dict[TopicPartition, PartitionRange], counted: _Counted,
                  stores: bool) -> _Section:
    """Per row target and partition, its rows against Kafka's valid records (``compare_rows``).

    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param counted: what the report compares with.
    :param stores: whether the delivery mode stores offsets."""
    section = _Section({})
    dead_per_partition = Counter((t, p) for t, p, _o in snap.dead)
    for table, present in snap.rows.items():
        for tp in sorted((set(ranges) | set(present)) - snap.retired):
            # A partition the target names but Kafka does not have: nothing in it is expected.
            rng = ranges.get(tp) or PartitionRange(0, 0, snap.stored.get(tp), stores)
            end = rng.check_end(counted.tail_missing)
            expected = {o for o in counted.valid.get(tp, ()) if rng.earliest <= o < end}
            result = compare_rows(expected, present.get(tp, Counter()), rng, counted.tail_missing)
            name = f"{table}:{tp[0]}:{tp[1]}"
            section.part[name] = {
                "expected": result.expected, "rows": result.rows, "duplicated": result.duplicated,
                "missing": result.missing, "unexpected": result.unexpected, "lso": rng.lso if tp in ranges else None,
                "dead_lettered": dead_per_partition[tp], "earliest": rng.earliest, "stored_offset": rng.stored,
                "checked_to": end, "rows_below_earliest": result.rows_below_earliest,
                "beyond_offsets": result.beyond_offsets, "not_yet_applied": counted.not_yet_applied[tp],
            }
            if result.duplicated or result.missing or result.unexpected or result.beyond_offsets:
                section.mismatches.append(name)
    return section


@dataclass
class _DeadLetters:
    """The dead letters of the current topics, judged."""

    by_class: Counter = field(default_factory=Counter)
    wrongly: list[dict[str, Any]] = field(default_factory=list)
    not_in_kafka: list[dict[str, Any]] = field(default_factory=list)
    beyond_offsets: int = 0
    # Malformed records Kafka committed that no dead letter holds.
    not_quarantined: int = 0

    @property
    def mismatches(self) -> list[str]:
        return [name for failed, name in (
            (self.not_quarantined, "dead_letters"), (self.wrongly, "dead_letters:wrongly_quarantined"),
            (self.not_in_kafka, "dead_letters:not_in_kafka"), (self.beyond_offsets, "dead_letters:beyond_offsets"),
        ) if failed]


def _dead_letter_section(snap: Snapshot, ranges: dict[TopicPartition, PartitionRange], side: KafkaSide,
                         trials: Mapping[DeadLetterKey, str], counted: _Counted, stores: bool) -> _DeadLetters:
    """Each dead letter by its class and its trial (``dead_letter_verdict``), whether Kafka holds
    its record, and whether it lies at or above the stored offset.

    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param side: Kafka's records (``dead_seen``: the dead-lettered offsets it still holds).
    :param trials: each dead letter's trial outcome (``try_dead_letters``).
    :param counted: what the report compares with.
    :param stores: whether the delivery mode stores offsets."""
    dead = _DeadLetters(not_quarantined=sum(len(v) for v in counted.malformed.values()))
    for (t, p, o), (error, code, _key, _value) in sorted(snap.dead.items()):
        if (t, p) in snap.retired:
            continue
        error_class = dead_letter_class(code, error)
        dead.by_class[error_class] += 1
        trial = trials.get((t, p, o))
        reason = dead_letter_verdict(error_class, trial)
        entry = {"topic": t, "partition": p, "offset": o, "class": error_class, "sqlstate": code,
                 "error": error[:200], "trial": trial}
        if reason:
            dead.wrongly.append({**entry, "reason": reason})
        held = ranges.get((t, p))
        if (t, p, o) not in side.dead_seen and (held is None or o >= held.earliest):
            dead.not_in_kafka.append(entry)
        if stores and o >= (snap.stored.get((t, p)) or 0):
            dead.beyond_offsets += 1
    return dead


def _keep_all_latest(into: dict[tuple, dict[str, tuple[Position, Any]]],
                     source: Mapping[tuple, Mapping[str, tuple[Position, Any]]]) -> None:
    """Folds ``source``'s latest values per key and column into ``into`` (``keep_latest``)."""
    for group, values in source.items():
        for column, (position, value) in values.items():
            keep_latest(into[group], column, position, value)


@dataclass
class _Aggregates:
    """Per aggregate target, its totals against the expected ones; those that cannot be recomputed."""

    totals: dict[str, Any] = field(default_factory=dict)
    unverified: list[dict[str, str]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def _aggregate_section(spec: PipelineSpec, aggregates: list[AggregateTarget], snap: Snapshot,
                       ranges: dict[TopicPartition, PartitionRange], side: KafkaSide,
                       counted: _Counted) -> _Aggregates:
    """Each aggregate target against Kafka's records in the compared range, plus its carrier's rows
    below the earliest offsets where Kafka deleted records; unverified without a carrier.

    :param spec: the pipeline's spec.
    :param aggregates: its aggregate targets, in the order of ``snap.actual``.
    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param side: Kafka's records (``sums`` and ``latest`` per region and aggregate).
    :param counted: what the report compares with."""
    section = _Aggregates()
    gone = sorted(f"{t}[{p}]" for (t, p), rng in ranges.items() if rng.earliest > 0)
    gone += [f"{t}[{p}] (retired)" for t, p in sorted(snap.retired)]
    for index, target in enumerate(aggregates):
        expected_totals: dict[tuple, Counter] = defaultdict(Counter)
        # (key, (topic, partition)) -> column -> (position, value) of the key's last record there
        last_per_partition: dict[tuple, dict[str, tuple[Position, Any]]] = defaultdict(dict)
        for region in counted.regions:
            for group, counter in side.sums[region][index].items():
                expected_totals[group].update(counter)
            _keep_all_latest(last_per_partition, side.latest[region][index])
        carrier, below = carrier_for(spec, target), snap.below_earliest[index]
        checked_against = "kafka"
        if gone and below is None:
            reason = (f"records below the earliest offset of {', '.join(gone)} are gone from Kafka and no row "
                      f"target carries the inputs of {target.table} ({', '.join(target.group_by)}, "
                      f"{', '.join(sorted(target.inputs - set(target.group_by))) or 'counts'})")
            section.unverified.append({"target": target.table, "reason": reason})
        elif gone and carrier is not None and below is not None:
            checked_against = f"kafka, and {carrier.table} below the earliest offsets"
            for group, counter in below.items():
                expected_totals[group].update(counter)
            _keep_all_latest(last_per_partition, snap.below_latest[index])
        actual = snap.actual[index]
        latest_values, spread = _expected_latest(last_per_partition, actual, target.latest)
        verified = not (gone and below is None)
        wrong = (wrong_keys(actual, expected_totals, target.increments, latest_values, target.latest)
                 if verified else [])
        section.totals[target.table] = {
            "keys": len(actual),
            "keys_wrong": len(wrong) if verified else None,
            "verified": verified,
            "checked_against": checked_against if verified else None,
            "wrong_keys": [list(k) for k in wrong[:SAMPLE]],
            "keys_spread_over_partitions": spread,
            **{f"expected_{c}": sum(g[c] for g in expected_totals.values()) for c in target.increments},
            **{f"actual_{c}": sum(as_number(v.get(c)) for v in actual.values()) for c in target.increments},
        }
        if wrong:
            section.mismatches.append(target.table)
    return section


def _expected_latest(per_partition: Mapping[tuple, Mapping[str, tuple[Position, Any]]],
                     actual: Mapping[tuple, Mapping[str, Any]], columns: Mapping[str, str]
                     ) -> tuple[dict[tuple, dict[str, Any]], int]:
    """Each key's expected latest values, from its last record in each partition it has records in.

    In one partition: that record's values, the in-order fold. Spread over partitions (an unkeyed
    producer, partitions added): the apply overwrites with each batch's highest (partition, offset),
    so the stored values are those of the key's last record in the highest partition of the last
    batch that touched the key, and no later batch holds the key's records: whatever the batches,
    they are the key's last record of one of its partitions. A stored row equal to one of those is
    expected as it is; any other is compared with the fold over all of them (and is wrong).

    :param per_partition: (key, (topic, partition)) -> column -> (position, value).
    :param actual: the stored rows, key -> column -> value.
    :param columns: the target's latest columns.
    :returns: key -> column -> expected value, and how many keys are spread over partitions."""
    by_key: dict[tuple, list[Mapping[str, tuple[Position, Any]]]] = defaultdict(list)
    for (group, _tp), values in per_partition.items():
        by_key[group].append(values)
    expected: dict[tuple, dict[str, Any]] = {}
    spread = 0
    for group, parts in by_key.items():
        folded: dict[str, tuple[Position, Any]] = {}
        for values in parts:
            for column, (position, value) in values.items():
                keep_latest(folded, column, position, value)
        expected[group] = {column: value for column, (_, value) in folded.items()}
        if len(parts) > 1:
            spread += 1
            stored = actual.get(group)
            for values in parts:
                candidate = {column: value for column, (_, value) in values.items()}
                if stored is not None and all(stored.get(c) == candidate.get(c) for c in columns):
                    expected[group] = candidate
                    break
    return expected, spread


def _retired_section(snap: Snapshot) -> dict[str, dict[str, Any]]:
    """Per retired topic: its stored offsets, rows and dead letters, kept as they are.

    :param snap: the database side."""
    retired: dict[str, dict[str, Any]] = {}
    for t, p in sorted(snap.retired):
        gone_topic = retired.setdefault(t, {"stored_offsets": {}, "rows": Counter(), "dead_letters": 0})
        if (t, p) in snap.stored:
            gone_topic["stored_offsets"][str(p)] = snap.stored[(t, p)]
        for table, present in snap.rows.items():
            gone_topic["rows"][table] += sum(present.get((t, p), Counter()).values())
        gone_topic["dead_letters"] += sum(1 for dt, dp, _o in snap.dead if (dt, dp) == (t, p))
    return retired


def _report(config: PipelineConfig, spec: PipelineSpec, aggregates: list[AggregateTarget], snap: Snapshot,
            ranges: dict[TopicPartition, PartitionRange], side: KafkaSide, trials: Mapping[DeadLetterKey, str], *,
            running: bool, pending: str, goal: Mapping[TopicPartition, int] | None = None) -> dict[str, Any]:
    """The report from what the audit read: its sections (Kafka's ranges, the row targets, the dead
    letters, the aggregates, the goal, the retired topics) and a summary of them. Its mismatches are
    the sections' own, in that order.

    :param config: the pipeline's config.
    :param spec: the pipeline's spec.
    :param aggregates: its aggregate targets, in the order of ``snap.actual``.
    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param side: Kafka's records, split at the stored offsets.
    :param trials: each dead letter's trial outcome (``try_dead_letters``).
    :param running: whether a driver ran at the snapshot or when the read ended.
    :param pending: how the tail counts (``PENDING_POLICIES``).
    :param goal: the offsets the stored ones must have reached, if any."""
    stores = MODES[config.delivery].stores_offsets
    counted = _counted(side, tail_counts_as_missing(pending, running, has_goal=goal is not None))
    kafka = _kafka_section(ranges, counted)
    partitions = _rows_section(snap, ranges, counted, stores)
    dead = _dead_letter_section(snap, ranges, side, trials, counted, stores)
    aggregate = _aggregate_section(spec, aggregates, snap, ranges, side, counted)
    shortfall = goal_shortfall(snap.stored, goal or {})
    mismatches = [*kafka.mismatches, *partitions.mismatches, *dead.mismatches, *aggregate.mismatches,
                  *(f"goal_not_reached:{t}:{p}" for t, p in shortfall)]
    retired = _retired_section(snap)
    rows = partitions.part.values()
    summary = {
        "committed_records": sum(counted.committed.values()),
        "duplicated": sum(p["duplicated"] for p in rows),
        "missing": sum(p["missing"] for p in rows),
        "unexpected": sum(p["unexpected"] for p in rows),
        "dead_lettered": sum(1 for t, p, _o in snap.dead if (t, p) not in snap.retired),
        "malformed_not_quarantined": dead.not_quarantined,
        "wrongly_quarantined": len(dead.wrongly),
        "dead_letters_not_in_kafka": len(dead.not_in_kafka),
        "dead_letters_by_class": dict(sorted(dead.by_class.items())),
        # What each dead letter's own insert did when tried (and rolled back): applies, refused:<SQLSTATE>...
        "dead_letter_trials": dict(sorted(Counter(trials.values()).items())),
        "rows_below_earliest": sum(p["rows_below_earliest"] for p in rows),
        "beyond_offsets": sum(p["beyond_offsets"] for p in rows) + dead.beyond_offsets,
        "not_yet_applied": sum(counted.not_yet_applied.values()),
        "retention_gap_offsets": sum(r.retention_gap for r in ranges.values()),
        "offsets_ahead": sum(r.offsets_ahead for r in ranges.values()),
        "unverified_aggregates": len(aggregate.unverified),
        "goal_shortfall": sum(shortfall.values()),
        "retired_topics": len(retired),
    }
    return {
        "pipeline": config.pipeline, "ok": not mismatches, "mismatches": mismatches, "summary": summary,
        "aggregates": aggregate.totals, "partitions": partitions.part, "kafka": kafka.part,
        "unverified": aggregate.unverified,
        "goal": None if goal is None else {
            f"{t}:{p}": {"goal": want, "stored_offset": snap.stored.get((t, p)), "short": shortfall.get((t, p), 0)}
            for (t, p), want in sorted(goal.items())},
        "retired_topics": {t: {**e, "rows": dict(e["rows"])} for t, e in retired.items()},
        "dead_letters": {"by_class": summary["dead_letters_by_class"], "wrongly_quarantined": dead.wrongly[:SAMPLE],
                         "not_in_kafka": dead.not_in_kafka[:SAMPLE]},
        "snapshot": {
            "isolation": "repeatable read, read only", "delivery": config.delivery, "stores_offsets": stores,
            "driver_running": running, "pending": pending,
            "records_above_stored_offsets": "missing" if counted.tail_missing else "not_yet_applied",
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Audit a pipeline's target against Kafka", add_help=False)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds the read of Kafka may take (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--pending", choices=PENDING_POLICIES, default="auto",
                        help="records above the stored offsets: auto (not yet applied while a driver runs "
                        "or --goal is given, missing otherwise), missing, allowed")
    parser.add_argument("--goal", type=json.loads, default=None,
                        help='offsets the stored ones must have reached, {"topic": {"partition": offset}} '
                        "(a replay's lso_at_start)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes reading Kafka (default: one per core for a read of "
                        f"{PARALLEL_MIN_RECORDS:,} offsets or more, else 1: this process)")
    args, rest = parser.parse_known_args(argv)
    config = parse_args(rest)
    try:
        report = audit(config, load_spec(config.spec), timeout=args.timeout, pending=args.pending,
                       goal=None if args.goal is None else goal_offsets(args.goal), workers=args.workers)
    except AuditTimeout as exc:
        print(str(exc), file=sys.stderr)
        print(json.dumps({"pipeline": config.pipeline, "ok": False, "error": str(exc),
                          "unfinished": exc.unfinished}, indent=2, sort_keys=True))
        return 2
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
