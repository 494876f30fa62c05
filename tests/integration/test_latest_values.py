"""An aggregate target's latest values, as PostgreSQL computes them in the apply: the value of
the key's record with the highest (partition, offset), the order batches apply in, whichever
form the statement takes (``apply_sql._last_of_key``: a hashable ``max`` over an integer array
for integer fields, an ordered ``array_agg`` for the others). The ledger's keyed topic never puts
one key in two partitions; this does, in a shuffled stage."""

from __future__ import annotations

import json
import random

import pytest
from psycopg2 import sql

from spark_apps.eos_stream.records.parsing import staging_columns, staging_lines
from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.sink.apply_sql import apply_batch_statement
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_stage, stage_table
from tests.streaming import pg_connect

pytestmark = pytest.mark.integration


def _ddl(schema: str, unique_coordinates: bool = False) -> list:
    return [sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)),
            sql.SQL("CREATE TABLE IF NOT EXISTS {}.latest (k text PRIMARY KEY, n bigint NOT NULL, last_i bigint,"
                    " last_t text)").format(sql.Identifier(schema))]


SPEC = PipelineSpec(
    name="latest-values",
    fields=(Field("k", "text"), Field("i", "bigint", required=False), Field("t", "text", required=False)),
    targets=(AggregateTarget("latest", group_by=("k",), increments={"n": None},
                             latest={"last_i": "i", "last_t": "t"}),),
    target_ddl=_ddl,
)


def test_latest_values_are_the_last_records_in_partition_and_offset_order(stack, unique_name) -> None:
    rng = random.Random(11)
    records, expected = [], {}
    for key in ("a", "b", "c"):
        coordinates = rng.sample([(p, o) for p in range(3) for o in range(40)], 25)
        for partition, offset in coordinates:
            i = rng.choice([None, rng.randrange(-10**12, 10**12)])
            t = rng.choice([None, f"text {rng.random()}"])
            records.append(("t", partition, offset, None, json.dumps({"k": key, "i": i, "t": t}).encode()))
        last = max(coordinates)
        expected[key] = next((25, json.loads(r[4])["i"], json.loads(r[4])["t"]) for r in records
                             if json.loads(r[4])["k"] == key and (r[1], r[2]) == last)
    rng.shuffle(records)
    target, meta = f"t_lv{unique_name}", f"m_lv{unique_name}"
    conn = pg_connect(stack)
    try:
        preflight.ensure_meta_tables(conn, meta)
        preflight.create_targets(conn, SPEC, target, MODES["exactly_once"])
        create_stage(conn, SPEC, meta, "stage_latest")
        with conn.cursor() as cur:
            copy_from_chunks(cur, stage_table(meta, "stage_latest"), staging_columns(SPEC),
                             iter(["".join(staging_lines(SPEC, records, keep_raw=False)).encode()]))
            statement = apply_batch_statement(SPEC, stage=stage_table(meta, "stage_latest"), target_schema=target,
                                              meta_schema=meta, skip_applied=False, dedupe=False, upsert_rows=False)
            assert "max(ARRAY[" in statement.as_string(conn) and "array_agg(" in statement.as_string(conn)
            cur.execute(statement, {"pipeline": "lv"})
            assert cur.fetchone() == (75, 0)
            cur.execute(sql.SQL("SELECT k, n, last_i, last_t FROM {}.latest").format(sql.Identifier(target)))
            assert {k: (n, i, t) for k, n, i, t in cur.fetchall()} == expected
        conn.rollback()
    finally:
        with conn.cursor() as cur:
            for schema in (meta, target):
                cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.commit()
        conn.close()
