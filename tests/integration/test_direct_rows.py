"""Differential test of the direct write path against the staged path, on the real database.

The same records, split into tasks by Kafka partition as Spark splits them,
go once through staging + ``apply_batch_statement`` and once through
the tasks' ``task_chunks`` + ``DirectRows``, into two copies of the same targets holding
the same earlier state. Every target row and every dead letter must be equal.

The corpus is built to catch a partial that is not the aggregate of its
records: NULLs in summed and latest fields (a key whose every value is NULL
too), keys spread over partitions and topics, counts, floats, malformed
records, and aggregate rows that existed before the batch.
"""

from __future__ import annotations

import json
import random

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.records import staging_columns, staging_lines
from spark_apps.eos_stream.sink.apply_sql import apply_batch_statement
from spark_apps.eos_stream.sink.direct_rows import DirectRows
from spark_apps.eos_stream.sink.poison_guard import batch_key
from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_stage
from spark_apps.eos_stream.spec import AggregateTarget, Field, PipelineSpec, RowTarget
from tests.sink_harness import LedgerSink, direct_chunks
from tests.streaming import pg_connect

SPEC = PipelineSpec(
    name="direct-differential",
    fields=(Field("k", "text"), Field("v", "bigint", required=False), Field("f", "numeric", required=False),
            Field("ts", "timestamptz"), Field("seq", "bigint")),
    targets=(
        RowTarget("rows", columns=("k", "v", "ts", "seq")),
        AggregateTarget("totals", group_by=("k",), increments={"total": "v", "n": None, "fsum": "f"},
                        latest={"last_seq": "seq", "last_v": "v"}),
        RowTarget("rows_narrow", columns=("seq",)),
    ),
)


def _ddl(schema: str) -> list[sql.Composed]:
    s = sql.Identifier(schema)
    return [
        sql.SQL("CREATE SCHEMA {}").format(s),
        sql.SQL("CREATE TABLE {}.rows (kafka_topic text, kafka_partition int, kafka_offset bigint, k text,"
                " v bigint, ts timestamptz, seq bigint)").format(s),
        sql.SQL("CREATE TABLE {}.rows_narrow (kafka_topic text, kafka_partition int, kafka_offset bigint,"
                " seq bigint)").format(s),
        sql.SQL("CREATE TABLE {}.totals (k text PRIMARY KEY, total bigint, n bigint NOT NULL, fsum numeric,"
                " last_seq bigint, last_v bigint)").format(s),
        # Earlier state: NULL and non-NULL running totals the batch adds to.
        sql.SQL("INSERT INTO {}.totals VALUES ('k1', 100, 3, 0.5, 7, 1), ('k2', NULL, 1, NULL, 1, NULL),"
                " ('k3', 5, 1, 1.0, 2, 2)").format(s),
    ]


def _corpus(seed: int) -> list[tuple[str, int, int, bytes | None, bytes | None]]:
    rng = random.Random(seed)
    records = []
    for topic in ("a", "b"):
        for partition in range(3):
            for offset in range(rng.randrange(50, 120)):
                roll = rng.random()
                if roll < 0.05:
                    value: bytes | None = b"{not json"
                elif roll < 0.07:
                    value = None  # a tombstone
                else:
                    k = "k-null-only" if roll < 0.1 else f"k{rng.randrange(8)}"
                    v = None if (k == "k-null-only" or rng.random() < 0.2) else rng.randrange(-10**6, 10**6)
                    f = None if rng.random() < 0.3 else rng.uniform(-100, 100)
                    payload = {"k": k, "v": v, "f": f, "ts": f"2026-01-01T00:00:{offset % 60:02d}+00:00",
                               "seq": rng.randrange(10**9)}
                    value = json.dumps(payload).encode()
                records.append((topic, partition, offset, f"key{offset}".encode(), value))
    return records


def _contents(cur, schema: str, meta: str, pipeline: str) -> dict[str, list]:
    out = {}
    for table in ("rows", "rows_narrow", "totals"):
        cur.execute(sql.SQL("SELECT * FROM {} ORDER BY 1, 2, 3").format(sql.Identifier(schema, table)))
        # Floats summed in another order may differ in their last bits, as any two runs of sum() may.
        out[table] = [tuple(round(c, 6) if isinstance(c, float) else c for c in row) for row in cur.fetchall()]
    cur.execute(sql.SQL("SELECT topic, partition, \"offset\", key, value, error FROM {}.dead_letters"
                        " WHERE pipeline = %s ORDER BY 1, 2, 3").format(sql.Identifier(meta)), (pipeline,))
    out["dead_letters"] = [tuple(bytes(c) if isinstance(c, memoryview) else c for c in row) for row in cur.fetchall()]
    return out


def _both_paths(stack: dict, unique_name: str, records, chunks) -> tuple[dict, dict, tuple, tuple]:
    """Applies ``records`` staged and ``chunks`` directly to two copies of the
    same targets; returns both contents and both (applied, dead-lettered)."""
    from spark_apps.eos_stream import preflight

    conn = pg_connect(stack)
    conn.autocommit = False
    meta, staged, direct = f"m_dr{unique_name}", f"t_staged{unique_name}", f"t_direct{unique_name}"
    try:
        preflight.ensure_meta_tables(conn, meta)
        with conn.cursor() as cur:
            for schema in (staged, direct):
                for statement in _ddl(schema):
                    cur.execute(statement)
        conn.commit()

        stage = create_stage(conn, SPEC, meta, "stage_differential")
        with conn.cursor() as cur:
            copy_from_chunks(cur, stage, staging_columns(SPEC),
                             iter(["".join(staging_lines(SPEC, records, keep_raw=False)).encode()]))
            cur.execute(apply_batch_statement(SPEC, stage=stage, target_schema=staged, meta_schema=meta,
                                              skip_applied=False, dedupe=False, upsert_rows=False),
                        {"pipeline": "staged"})
            staged_counts = tuple(cur.fetchone())
        conn.commit()

        with conn.cursor() as cur:
            written = DirectRows(SPEC, direct, meta, "stage_direct_").write(cur, 0, chunks, "direct")
        conn.commit()

        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename LIKE 'stage_direct_%%'",
                        (meta,))
            assert cur.fetchone()[0] == 0, "the side tables go with the batch's transaction"
            return (_contents(cur, staged, meta, "staged"), _contents(cur, direct, meta, "direct"), staged_counts,
                    (written.applied, written.dead_lettered))
    finally:
        conn.rollback()
        with conn.cursor() as cur:
            for schema in (meta, staged, direct):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.commit()
        conn.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_the_direct_path_writes_what_the_staged_path_writes(stack: dict, unique_name: str, seed: int) -> None:
    records = _corpus(seed)
    expected, got, staged_counts, direct_counts = _both_paths(stack, unique_name, records,
                                                              direct_chunks(SPEC, records))
    assert direct_counts == staged_counts
    assert got == expected
    assert len(got["rows"]) > 300 and len(got["dead_letters"]) > 10
    nulls = [row for row in got["totals"] if row[0] == "k-null-only"]
    assert nulls and nulls[0][1] == 0, "a key whose every summed value is NULL sums to 0, never NULL"


def test_the_comparison_sees_a_lost_partial(stack: dict, unique_name: str) -> None:
    """The differential test can fail: one task's partials for one key, lost, show in the totals."""
    records = _corpus(1)
    chunks = list(direct_chunks(SPEC, records))
    index = next(i for i, (what, _, _) in enumerate(chunks) if what == 1)  # the first task's partials
    what, count, text = chunks[index]
    chunks[index] = (what, count - 1, b"".join(text.splitlines(keepends=True)[1:]))
    expected, got, _, _ = _both_paths(stack, unique_name, records, chunks)
    assert got["rows"] == expected["rows"]
    assert got["totals"] != expected["totals"]


@pytest.fixture
def ledger_sink(stack: dict, unique_name: str):
    with LedgerSink(stack, unique_name) as sink:
        yield sink


def test_a_batch_with_applied_records_falls_back_to_the_staged_skip(ledger_sink: LedgerSink) -> None:
    """Failure transition 4d: the first batch goes direct; the same records
    again (a replay after a commit Spark never checkpointed) find the stored
    offset above their start, write nothing directly, and the staged path skips them."""
    s = ledger_sink
    first = s.sink.process(0, {("t", 0): 0}, {("t", 0): 10}, s.fill_stage, s.stream_rows)
    assert first.applied == 10 and "rows" in first.timings_ms and "stage" not in first.timings_ms
    again = s.sink.process(1, {("t", 0): 0}, {("t", 0): 10}, s.fill_stage, s.stream_rows)
    assert again.applied == 0 and "stage" in again.timings_ms
    assert s.events_and_count() == ((10, 10), 10)


def test_a_task_failing_mid_batch_rolls_back_and_is_not_retried(ledger_sink: LedgerSink) -> None:
    """Failure transition 2d: a task fails after some of the batch's rows are
    COPYed into the targets. Everything rolls back, and the task's own error
    is raised at once: not retried as the transient database error psycopg2's
    wrapping of a failed read would claim (QueryCanceled), not counted as
    poison. The rerun writes the batch once."""
    s = ledger_sink

    class TaskLost(Exception):
        pass

    def failing_rows():
        for number, chunk in enumerate(s.stream_rows()):
            if number == 1:
                raise TaskLost("task 0 lost its executor")
            yield chunk

    with pytest.raises(TaskLost):
        s.sink.process(0, {("t", 0): 0}, {("t", 0): 10}, s.fill_stage, failing_rows)
    assert s.sink.guard.failed_attempts(batch_key({("t", 0): 0})) == 0
    assert s.events_and_count() == ((0, 0), None)
    again = s.sink.process(0, {("t", 0): 0}, {("t", 0): 10}, s.fill_stage, s.stream_rows)
    assert again.applied == 10 and again.transient_retries == 0 and "rows" in again.timings_ms
    assert s.events_and_count() == ((10, 10), 10)
