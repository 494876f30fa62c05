"""What the database makes of Kafka's values: timestamps cast as the apply casts them, and each
dead letter's own insert tried and rolled back (rules in ``oracle``)."""

from __future__ import annotations

import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

import psycopg2
from psycopg2 import sql

from spark_apps.eos_stream.audit.kafka import KafkaSide
from spark_apps.eos_stream.audit.rules import (
    APPLIES,
    REFUSED,
    UNPARSABLE,
    Position,
    keep_latest,
)
from spark_apps.eos_stream.audit.snapshot import fetch
from spark_apps.eos_stream.errors import dead_letter_class
from spark_apps.eos_stream.records.parsing import parse_record, staging_columns, staging_lines
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink import apply_sql, staging
from spark_apps.eos_stream.sink.postgres import connect

# A dead letter's trial waits at most this long for a row lock a running stream's batch holds.
TRIAL_LOCK_TIMEOUT = "10s"
TRIAL_ATTEMPTS = 3


def as_the_database_reads(conn, spec: PipelineSpec, aggregates: list[AggregateTarget], side: KafkaSide) -> None:
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
        return dict(fetch(conn, query, (texts,)))
    except psycopg2.DataError:
        conn.rollback()
    cast: dict[str, Any] = {}
    for text in texts:  # one refused text spoils a whole array: cast the others one by one
        try:
            cast.update(fetch(conn, query, ([text],)))
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
            for coordinates, (key, value) in tried.items():
                outcomes[coordinates] = _try_one(cur, spec, stage, statement, config.pipeline, coordinates,
                                                 key, value)
    finally:
        if not conn.closed:  # a lost connection rolled back by itself; its error is the one to raise
            conn.rollback()  # the stage, and every trial insert, never existed
        conn.close()
    return outcomes


def _try_one(cur: Any, spec: PipelineSpec, stage: sql.Composed, statement: sql.Composed, pipeline: str,
             coordinates: DeadLetterKey, key: bytes | None, value: bytes | None) -> str:
    """One record's trial inside a savepoint, rolled back after it: its COPY line into the
    stage, then the apply statement restricted to it; retried while the error says nothing of
    the record."""
    topic, partition, offset = coordinates
    lines = "".join(staging_lines(spec, [(topic, partition, offset, key, value)], keep_raw=True))
    for attempt in range(1, TRIAL_ATTEMPTS + 1):
        cur.execute("SAVEPOINT eos_audit_trial")
        try:
            staging.copy_from_chunks(cur, stage, staging_columns(spec), iter([lines.encode()]))
            cur.execute(statement, {"pipeline": pipeline, "topic": topic, "partition": partition, "offset": offset})
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
        return outcome
    raise AssertionError("unreachable: the last attempt returns or raises")
