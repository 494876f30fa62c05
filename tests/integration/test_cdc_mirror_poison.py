"""Poison in a mirror batch, through the sink on the real PostgreSQL: a change whose value
PostgreSQL refuses fails the batch's apply statement; once its attempts are spent the batch is
isolated (transition 6, ranges with ``only_range``), and only that change goes to the dead letters,
with its coordinates, raw bytes and SQLSTATE, while the key's earlier change and every other change
apply and the offsets advance in the same transaction. A record that is no change event is
dead-lettered by the executors' decoding. Applied again, the batch moves nothing."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from psycopg2 import sql

from spark_apps.eos_stream.records.spec import load_spec
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.batch_sink import BatchSink
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.staging import copy_from_chunks, stage_column_types, stage_table
from spark_apps.eos_stream.state.ddl import run_ddl
from tests.streaming import pg_connect

TOPIC = "app.public.accounts"
SECTION = {"topic_prefix": "app", "tables": [
    {"source": "public.accounts", "key": ["id"], "columns": {"id": "bigint", "owner": "text",
                                                            "balance": "numeric(20,6)"}}]}


def _change(op: str, key: int, owner: str, balance: str) -> tuple[bytes, bytes]:
    value = {"op": op, "before": None, "after": {"id": key, "owner": owner, "balance": balance},
             "source": {"schema": "public", "table": "accounts"}}
    return json.dumps({"id": key}).encode(), json.dumps(value).encode()


RECORDS = [
    _change("c", 1, "ann", "1.5"),
    _change("c", 2, "bob", "2"),
    _change("c", 3, "cy", "4"),
    _change("u", 2, "bob", "123456789012345678901234"),  # numeric(20,6) cannot hold it: 22003
    (json.dumps({"id": 3}).encode(), None),  # a tombstone
    _change("u", 1, "ann", "7.25"),
    (json.dumps({"id": 9}).encode(), b"not json"),  # no change event: refused while staging
]


def test_a_refused_change_is_isolated_and_dead_lettered_alone(stack: dict[str, str], unique_name: str) -> None:
    spec = load_spec("mirror:" + json.dumps(SECTION))
    assert spec.mirror is not None
    target, meta, name = f"t_poison_{unique_name}", f"m_poison_{unique_name}", f"poison_{unique_name}"
    conn, guard = pg_connect(stack), pg_connect(stack)
    conn.autocommit = False
    preflight.ensure_meta_tables(conn, meta)
    with conn.cursor() as cur:
        assert spec.target_ddl is not None
        run_ddl(cur, spec.target_ddl(target, False))
    conn.commit()
    batch = pa.record_batch([pa.array([TOPIC] * len(RECORDS)), pa.array([0] * len(RECORDS), pa.int32()),
                             pa.array(range(len(RECORDS)), pa.int64()),
                             pa.array([k for k, _ in RECORDS], pa.binary()),
                             pa.array([v for _, v in RECORDS], pa.binary())],
                            names=["topic", "partition", "offset", "key", "value"])
    staged_raw: list[bool] = []

    def fill_stage(stage_name: str, keep_raw: bool) -> int:
        staged_raw.append(keep_raw)
        stager = pg_connect(stack)
        try:
            with stager.cursor() as cur:
                copy_from_chunks(cur, stage_table(meta, stage_name), [c for c, _ in stage_column_types(spec)],
                                 spec.mirror.staging_chunks([batch], keep_raw))  # type: ignore[union-attr]
        finally:
            stager.close()
        return len(RECORDS)

    sink = BatchSink(conn=conn, guard_conn=guard, spec=spec, mode=MODES["exactly_once"], pipeline=name,
                     target_schema=target, meta_schema=meta, max_batch_attempts=1, transient_retry_seconds=0)
    try:
        result = sink.process(0, {(TOPIC, 0): 0}, {(TOPIC, 0): len(RECORDS)}, fill_stage)
        assert staged_raw == [False, True]  # the failed attempt, then the isolating one with raw bytes
        assert result.record_by_record and (result.applied, result.dead_lettered) == (5, 2), result
        assert _rows(conn, target) == [(1, "ann", "7.250000"), (2, "bob", "2.000000"), (3, "cy", "4.000000")]
        dead = _dead_letters(conn, meta)
        assert [(d[0], d[1], d[2]) for d in dead] == [(TOPIC, 0, 3), (TOPIC, 0, 6)], dead
        assert dead[0][3] == "22003" and bytes(dead[0][4]) == RECORDS[3][1], dead[0]
        assert "malformed value JSON" in dead[1][5]
        assert _offsets(conn, meta, name) == {(TOPIC, 0): len(RECORDS)}

        again = sink.process(1, {(TOPIC, 0): 0}, {(TOPIC, 0): len(RECORDS)}, fill_stage)
        assert (again.applied, again.dead_lettered) == (0, 0), again
        assert _rows(conn, target)[0] == (1, "ann", "7.250000") and len(_dead_letters(conn, meta)) == 2
    finally:
        conn.rollback()
        with conn.cursor() as cur:
            for schema in (target, meta):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.commit()
        conn.close()
        guard.close()


def _rows(conn: Any, schema: str) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT id, owner, balance::text FROM {}.accounts ORDER BY id").format(
            sql.Identifier(schema)))
        found = cur.fetchall()
    conn.commit()
    return found


def _dead_letters(conn: Any, meta: str) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL('SELECT topic, partition, "offset", sqlstate, value, error FROM {}.dead_letters'
                            ' ORDER BY "offset"').format(sql.Identifier(meta)))
        found = cur.fetchall()
    conn.commit()
    return found


def _offsets(conn: Any, meta: str, pipeline: str) -> dict[tuple[str, int], int]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT topic, partition, next_offset FROM {}.kafka_offsets WHERE pipeline = %s").format(
            sql.Identifier(meta)), (pipeline,))
        found = {(t, p): n for t, p, n in cur.fetchall()}
    conn.commit()
    return found
