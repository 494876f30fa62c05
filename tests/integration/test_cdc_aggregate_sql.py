"""Aggregates fed by a mirror (spark_apps/eos_stream/cdc/aggregate_sql.py) on the real PostgreSQL:
random Debezium change streams (inserts, updates of the summed and of the group column,
primary-key changes, deletes, repeated snapshot reads, updates leaving a TOASTed column
unread) applied batch by batch through the mirror's one statement; after every batch the
mirror equals the source and the aggregate equals GROUP BY over the source, empty groups
removed, and a replay of the whole batch moves neither. Negative control: the same batches
with the aggregate taken from Debezium's ``before`` of every change (deltas_from_changes)
count the repeated snapshot reads twice."""

from __future__ import annotations

import random
from decimal import Decimal

import psycopg2
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.cdc.aggregate_sql import aggregate_ddl, prune_empty_groups
from spark_apps.eos_stream.cdc.deltas import ChangeAggregate, apply_deltas, deltas_from_changes, group_by
from spark_apps.eos_stream.cdc.envelope import decoder
from spark_apps.eos_stream.cdc.mirror import STAGE_COLUMNS, MirrorTarget, stage_column_types, staging_lines
from spark_apps.eos_stream.cdc.mirror_sql import apply_mirror_statement, target_ddl
from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_table
from tests.helpers.cdc_schemas import cdc_schemas
from tests.unit.cdc_samples import PLACEHOLDER, key, value

pytestmark = pytest.mark.integration

ORDERS = MirrorTarget("public.orders", "orders", ("id",),
                      {"id": "bigint", "region": "text", "amount": "numeric(12,2)", "memo": "text"})
TOTALS = ChangeAggregate("public.orders", "region_totals", ("region",), {"amount_total": "amount"}, "orders")
TOPIC = "app.public.orders"


def record(offset: int, op: str, id_: int, before: dict | None, after: dict | None):
    wire = {c: (str(v) if isinstance(v, Decimal) else v) for c, v in (after or {}).items()} if after else None
    old = {c: (str(v) if isinstance(v, Decimal) else v) for c, v in before.items()} if before else None
    return (TOPIC, 0, offset, key(id=id_), value(op, old, wire, table="orders"))


def next_batch(rng: random.Random, source: dict[int, dict], offset: int) -> list:
    """Changes a source with REPLICA IDENTITY FULL would emit, applied to ``source`` as they go."""
    records: list = []
    for _ in range(rng.randint(5, 40)):
        kind = rng.choice("iiuugdkrt")
        if kind == "i" or not source:
            id_ = rng.randint(1, 80)
            if id_ in source:
                continue
            source[id_] = {"id": id_, "region": rng.choice("NSEW"), "amount": Decimal(rng.randint(-9999, 9999)) / 100,
                           "memo": rng.choice([None, "m" * rng.randint(1, 3000)])}
            records.append(record(offset + len(records), "c", id_, None, source[id_]))
            continue
        id_ = rng.choice(sorted(source))
        old = dict(source[id_])
        if kind == "d":
            del source[id_]
            records += [record(offset + len(records), "d", id_, old, None), (TOPIC, 0, offset + len(records) + 1,
                                                                             key(id=id_), None)]
        elif kind == "k":
            new_id = rng.randint(81, 9999)
            if new_id in source:
                continue
            del source[id_]
            source[new_id] = {**old, "id": new_id}
            records.append(record(offset + len(records), "d", id_, old, None))
            records.append(record(offset + len(records), "c", new_id, None, source[new_id]))
        elif kind == "r":  # an incremental snapshot reads the row again
            records.append(record(offset + len(records), "r", id_, None, old))
        else:
            new = {**old, "region": rng.choice("NSEW")} if kind == "g" else {**old, "amount": old["amount"] + 1}
            source[id_] = new
            shown = {**new, "memo": PLACEHOLDER} if kind == "t" else new  # memo unchanged, not sent
            records.append(record(offset + len(records), "u", id_, old, shown))
    return records


@pytest.fixture
def schemas(pg_conn, unique_name: str):
    def tables(schema: sql.Identifier) -> list[sql.Composable]:
        return [target_ddl(ORDERS, schema.string), aggregate_ddl(TOTALS, ORDERS, schema.string)]

    with cdc_schemas(pg_conn, f"cdc_a_{unique_name}", f"cdc_am_{unique_name}", tables) as names:
        yield names


def decode(k, v):
    return decoder(lambda table: dict(ORDERS.columns) if table == ORDERS.source else None)(k, v)


def apply(conn, target: str, meta: str, records: list) -> None:
    with conn, conn.cursor() as cur:
        stage = create_table(cur, meta, "stage_agg", stage_column_types())
        lines = "".join(staging_lines(lambda source: ORDERS, decode, records, keep_raw=False))
        copy_from_chunks(cur, stage, STAGE_COLUMNS, iter([lines.encode()]))
        cur.execute(apply_mirror_statement([ORDERS], stage=stage, target_schema=target, meta_schema=meta,
                                           skip_applied=False, dedupe=False, aggregates=[TOTALS]), {"pipeline": "p"})
        assert cur.fetchone()[1] == 0  # nothing dead-lettered in a consistent stream
        cur.execute(prune_empty_groups(TOTALS, target))


def read(conn, target: str) -> tuple[dict, dict]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT id, region, amount, memo FROM {}.orders").format(sql.Identifier(target)))
        mirror = {r[0]: dict(zip(("id", "region", "amount", "memo"), r, strict=True)) for r in cur.fetchall()}
        cur.execute(sql.SQL("SELECT region, orders, amount_total FROM {}.region_totals").format(sql.Identifier(target)))
        totals = {(r[0],): [r[1], r[2]] for r in cur.fetchall()}
    return mirror, totals


@pytest.mark.parametrize("seed", range(3))
def test_the_aggregate_equals_group_by_over_the_source_after_every_batch(pg_dsn: str, schemas, seed: int) -> None:
    target, meta = schemas
    rng = random.Random(seed)
    source: dict[int, dict] = {}
    from_every_change: dict = {}
    offset = reads = 0
    conn = psycopg2.connect(pg_dsn)
    try:
        for _ in range(12):
            records = next_batch(rng, source, offset)
            offset += len(records) + 2
            apply(conn, target, meta, records)
            changes = [c for c in (decode(k, v) for _t, _p, _o, k, v in records) if c is not None]
            reads += sum(c.op == "r" for c in changes)
            from_every_change = apply_deltas(from_every_change, deltas_from_changes(TOTALS, changes))
            mirror, totals = read(conn, target)
            assert mirror == source
            assert totals == group_by(TOTALS, source.values())
            # The whole batch again (a replay the stored offsets would have skipped): the rows it
            # writes are the rows already stored, so neither the mirror nor a total moves.
            apply(conn, target, meta, records)
            assert read(conn, target) == (mirror, totals)
        assert reads > 0
        # The negative control: Debezium's before of every change counts the snapshot reads twice.
        assert from_every_change != group_by(TOTALS, source.values())
    finally:
        conn.close()
