"""The mirror's apply SQL (spark_apps/eos_stream/cdc/mirror_sql.py) on the real PostgreSQL:
Debezium-shaped records decoded, staged by COPY as the executors would, and applied in one
statement; the targets must equal the reference model (``mirror.compact`` and
``apply_compacted``) applied to the same changes. Upsert, delete, TOAST keep, a composite key,
a primary-key change, a quarantined update of a missing row, every mapped type, and a batch
replayed below the stored offsets applying nothing."""

from __future__ import annotations

import datetime
import json
from decimal import Decimal

import psycopg2
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.cdc.envelope import decoder
from spark_apps.eos_stream.cdc.mirror import (
    STAGE_COLUMNS,
    MirrorTarget,
    apply_compacted,
    compact,
    stage_column_types,
    staging_lines,
)
from spark_apps.eos_stream.cdc.mirror_sql import apply_mirror_statement, target_ddl
from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_table
from spark_apps.eos_stream.state import meta_tables
from tests.helpers.cdc_schemas import cdc_schemas
from tests.unit.cdc_samples import FULL_ROW, PLACEHOLDER, ROW_TYPES, key, key_with_schema, value, with_schema

pytestmark = pytest.mark.integration

CUSTOMERS = MirrorTarget("public.customers", "customers", ("id",), ROW_TYPES)
LINES = MirrorTarget("public.lines", "lines", ("order_id", "line_no"),
                     {"order_id": "bigint", "line_no": "integer", "qty": "integer", "note": "text"})
TARGETS = {t.source: t for t in (CUSTOMERS, LINES)}
TOPIC = "app.public.customers"
LINES_TOPIC = "app.public.lines"
BIG = "toasted " * 2000  # past the 2 kB TOAST threshold: stored out of line


def row(id_: int, **changes):
    return {**FULL_ROW, "id": id_, **changes}


def line(order_id: int, line_no: int, qty: int, note: str | None = None) -> dict:
    return {"order_id": order_id, "line_no": line_no, "qty": qty, "note": note}


def batch_one() -> list[tuple[str, int, int, bytes | None, bytes | None]]:
    return [
        (TOPIC, 0, 0, key(id=1), value("c", None, row(1, notes=BIG))),
        (TOPIC, 0, 1, key_with_schema(key(id=2)), with_schema(value("c", None, row(2)))),
        (TOPIC, 0, 2, key(id=3), value("c", None, row(3))),
        (TOPIC, 0, 3, key(id=4), value("r", None, row(4, notes=BIG), snapshot="true")),
        (TOPIC, 0, 4, key(id=6), value("c", None, row(6, notes="old"))),
        (TOPIC, 0, 5, key(id=9), value("c", None, row(9, notes="old nine"))),
        (TOPIC, 0, 6, key(id=10), value("c", None, row(10, notes="ten"))),
        (LINES_TOPIC, 0, 0, key(order_id=1, line_no=1), value("c", None, line(1, 1, 1), table="lines")),
        (LINES_TOPIC, 0, 1, key(order_id=1, line_no=2), value("c", None, line(1, 2, 2), table="lines")),
    ]


def batch_two() -> list[tuple[str, int, int, bytes | None, bytes | None]]:
    return [
        # an update leaving the TOASTed notes unchanged: the stored value stays
        (TOPIC, 0, 7, key(id=1), value("u", None, row(1, name="Ada L.", notes=PLACEHOLDER))),
        # two updates of one key: the last wins
        (TOPIC, 0, 8, key(id=2), value("u", None, row(2, name="first"))),
        (TOPIC, 0, 9, key(id=2), value("u", None, row(2, name="second", balance="-0.000001", tags=[], prefs="[]"))),
        # a delete and its tombstone
        (TOPIC, 0, 10, key(id=3), value("d", row(3), None)),
        (TOPIC, 0, 11, key(id=3), None),
        # a primary-key change 4 -> 40: delete of the old key, tombstone, create of the new
        (TOPIC, 0, 12, key(id=4), value("d", row(4, notes=PLACEHOLDER), None)),
        (TOPIC, 0, 13, key(id=4), None),
        (TOPIC, 0, 14, key(id=40), value("c", None, row(40, notes=BIG))),
        # created and updated in one batch, the update leaving notes unread: the create's value
        (TOPIC, 0, 15, key(id=5), value("c", None, row(5, notes="fresh"))),
        (TOPIC, 0, 16, key(id=5), value("u", None, row(5, name="five", notes=PLACEHOLDER))),
        # deleted and created again, then updated with notes unread: never the old row's notes
        (TOPIC, 0, 17, key(id=6), value("d", row(6, notes="old"), None)),
        (TOPIC, 0, 18, key(id=6), value("c", None, row(6, notes=None))),
        (TOPIC, 0, 19, key(id=6), value("u", None, row(6, name="six", notes=PLACEHOLDER))),
        # an update of a row the mirror never had, its notes unread: quarantined
        (TOPIC, 0, 20, key(id=99), value("u", None, row(99, notes=PLACEHOLDER))),
        # NULLs everywhere but the key
        (TOPIC, 0, 21, key(id=7), value("c", None, {c: None for c in FULL_ROW} | {"id": 7})),
        # a record no decoder can read: dead-lettered with its bytes
        (TOPIC, 0, 22, key(id=8), b'{"op": "c"'),
        # a column dropped at the source (absent from after): an update keeps the stored value; a row
        # deleted and created again in the batch never takes the deleted row's value
        (TOPIC, 0, 23, key(id=10), value("u", None, {c: v for c, v in row(10, name="t").items() if c != "notes"})),
        (TOPIC, 0, 24, key(id=9), value("d", row(9, notes="old nine"), None)),
        (TOPIC, 0, 25, key(id=9), value("c", None, {c: v for c, v in row(9).items() if c != "notes"})),
        # composite key: update, delete, create
        (LINES_TOPIC, 0, 2, key(order_id=1, line_no=1), value("u", None, line(1, 1, 7, "x"), table="lines")),
        (LINES_TOPIC, 0, 3, key(order_id=1, line_no=2), value("d", line(1, 2, 2), None, table="lines")),
        (LINES_TOPIC, 0, 4, key(order_id=1, line_no=3), value("c", None, line(1, 3, 3), table="lines")),
    ]


@pytest.fixture
def schemas(pg_conn, unique_name: str):
    def tables(schema: sql.Identifier) -> list[sql.Composable]:
        return [target_ddl(t, schema.string) for t in (CUSTOMERS, LINES)]

    with cdc_schemas(pg_conn, f"cdc_t_{unique_name}", f"cdc_m_{unique_name}", tables) as names:
        yield names


def decode_record(k, v):
    return decoder(lambda table: dict(TARGETS[table].columns) if table in TARGETS else None)(k, v)


def apply(pg_dsn: str, target: str, meta: str, records, *, skip_applied: bool = True) -> tuple[int, int]:
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn, conn.cursor() as cur:
            stage = create_table(cur, meta, "stage_test", stage_column_types())
            lines = staging_lines(TARGETS.get, decode_record, records, keep_raw=True)
            copy_from_chunks(cur, stage, STAGE_COLUMNS, iter(["".join(lines).encode()]))
            cur.execute(apply_mirror_statement([CUSTOMERS, LINES], stage=stage, target_schema=target, meta_schema=meta,
                                               skip_applied=skip_applied, dedupe=True), {"pipeline": "p"})
            applied, dead = cur.fetchone()
            # The offsets the batch transaction stores with the data (OffsetsStore.advance in the sink).
            ends: dict = {}
            for topic, partition, offset, _k, _v in records:
                ends[(topic, partition)] = max(ends.get((topic, partition), 0), offset + 1)
            for (topic, partition), end in ends.items():
                cur.execute(sql.SQL(
                    "INSERT INTO {} (pipeline, topic, partition, next_offset) VALUES ('p', %s, %s, %s)"
                    " ON CONFLICT (pipeline, topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset"
                ).format(meta_tables.table(meta, meta_tables.OFFSETS)), (topic, partition, end))
        return int(applied), int(dead)
    finally:
        conn.close()


def stored(pg_conn, target: str, t: MirrorTarget) -> dict:
    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}.{}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in t.columns), sql.Identifier(target), sql.Identifier(t.table)))
        names = list(t.columns)
        return {tuple(r[names.index(k)] for k in t.key): dict(zip(names, r, strict=True)) for r in cur.fetchall()}


def as_stored(value_):
    """The reference model's decoded values as psycopg2 reads the columns back."""
    if isinstance(value_, str) and value_[:1] in "{[" and value_[-1:] in "}]":
        return json.loads(value_)
    return value_


def model(batches) -> tuple[dict, dict, list]:
    rows: dict = {CUSTOMERS.table: {}, LINES.table: {}}
    quarantined: list = []
    for records in batches:
        by_target: dict = {CUSTOMERS.table: [], LINES.table: []}
        for _topic, partition, offset, k, v in records:
            try:
                change = decode_record(k, v)
            except ValueError:
                continue
            if change is not None:
                by_target[TARGETS[change.table].table].append(((partition, offset), change))
        for t in (CUSTOMERS, LINES):
            quarantined += apply_compacted(rows[t.table], t, compact(t, by_target[t.table]))
    return rows[CUSTOMERS.table], rows[LINES.table], quarantined


def test_mirror_sql_matches_the_reference_model(pg_conn, pg_dsn: str, schemas) -> None:
    target, meta = schemas
    assert apply(pg_dsn, target, meta, batch_one()) == (9, 0)
    assert apply(pg_dsn, target, meta, batch_two()) == (20, 2)  # 22 records: 2 tombstones count as applied

    customers, lines, quarantined = model([batch_one(), batch_two()])
    assert quarantined == [(99,)]
    got = stored(pg_conn, target, CUSTOMERS)
    want = {k: {c: as_stored(v) if c == "prefs" else v for c, v in r.items()} for k, r in customers.items()}
    for r in want.values():  # timestamptz and time come back typed
        for c in ("updated_at", "wakes"):
            r[c] = got[(r["id"],)][c] if r[c] is not None else None
        r["balance"] = None if r["balance"] is None else Decimal(r["balance"])
        r["photo"] = None if r["photo"] is None else bytes(r["photo"])
    got = {k: {**r, "photo": None if r["photo"] is None else bytes(r["photo"])} for k, r in got.items()}
    assert got == want
    assert sorted(got) == [(1,), (2,), (5,), (6,), (7,), (9,), (10,), (40,)]
    assert got[(10,)]["notes"] == "ten" and got[(9,)]["notes"] is None  # a dropped column
    assert got[(1,)]["notes"] == BIG and got[(1,)]["name"] == "Ada L."  # TOAST kept
    assert got[(5,)]["notes"] == "fresh" and got[(6,)]["notes"] is None
    assert got[(40,)]["notes"] == BIG  # primary-key change
    assert got[(2,)]["name"] == "second" and got[(2,)]["balance"] == Decimal("-0.000001") and got[(2,)]["tags"] == []
    assert got[(1,)]["updated_at"] == datetime.datetime(2026, 11, 27, 9, 30, 0, 123456, tzinfo=datetime.timezone.utc)
    assert (got[(1,)]["born"], got[(1,)]["wakes"]) == (datetime.date(2022, 1, 8), datetime.time(7, 0))
    assert got[(1,)]["tags"] == ["a", "b,c", 'd"e', None] and got[(1,)]["prefs"] == {"theme": "dark", "n": [1, 2]}
    assert got[(7,)] == {"id": 7, **{c: None for c in FULL_ROW if c != "id"}}
    assert stored(pg_conn, target, LINES) == lines == {
        (1, 1): line(1, 1, 7, "x"), (1, 3): line(1, 3, 3)}

    with pg_conn.cursor() as cur:
        cur.execute(sql.SQL('SELECT "offset", error, value IS NOT NULL FROM {} ORDER BY 1').format(
            meta_tables.table(meta, meta_tables.DEAD_LETTERS)))
        letters = cur.fetchall()
    assert [o for o, _e, _v in letters] == [20, 22]
    assert "does not hold" in letters[0][1] and '"id": 99' in letters[0][1]
    assert "malformed value JSON" in letters[1][1] and letters[1][2]


def test_a_replayed_older_batch_applies_nothing(pg_conn, pg_dsn: str, schemas) -> None:
    target, meta = schemas
    apply(pg_dsn, target, meta, batch_one())
    apply(pg_dsn, target, meta, batch_two())
    before = stored(pg_conn, target, CUSTOMERS), stored(pg_conn, target, LINES)
    assert apply(pg_dsn, target, meta, batch_one()) == (0, 0)  # below the stored offsets
    assert (stored(pg_conn, target, CUSTOMERS), stored(pg_conn, target, LINES)) == before


def test_a_value_the_database_refuses_fails_the_statement_as_a_data_error(pg_dsn: str, schemas) -> None:
    target, meta = schemas
    records = [(TOPIC, 0, 0, key(id=1), value("c", None, row(1, born="2022-13-45")))]
    with pytest.raises(psycopg2.DataError):  # a data error: the sink's isolation finds the record
        apply(pg_dsn, target, meta, records)


def test_an_unchanged_toast_value_is_kept_by_its_pointer_not_rewritten(pg_conn, pg_dsn: str, schemas) -> None:
    """The upsert passes the stored value through, and PostgreSQL reuses its out-of-line copy:
    the TOAST relation does not grow over updates that leave the column unread (it does grow
    when a value is written again, the control below)."""
    target, meta = schemas
    incompressible = "".join(f"{i:08x}{(i * 2654435761) % 2**32:08x}" for i in range(40_000))  # 640 kB
    apply(pg_dsn, target, meta, [(TOPIC, 0, 0, key(id=1), value("c", None, row(1, notes=incompressible)))])

    def toast_bytes() -> int:
        with pg_conn.cursor() as cur:
            cur.execute("SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = %s::regclass",
                        (f"{target}.customers",))
            return int(cur.fetchone()[0])

    stored_once = toast_bytes()
    assert stored_once >= 300_000  # out of line (hex compresses to about 3/4)
    for offset in range(1, 11):
        apply(pg_dsn, target, meta, [(TOPIC, 0, offset, key(id=1),
                                      value("u", None, row(1, name=f"n{offset}", notes=PLACEHOLDER)))])
    assert toast_bytes() == stored_once
    assert stored(pg_conn, target, CUSTOMERS)[(1,)]["notes"] == incompressible
    apply(pg_dsn, target, meta, [(TOPIC, 0, 11, key(id=1), value("u", None, row(1, notes=incompressible + "!")))])
    assert toast_bytes() > stored_once  # the control: a value written again takes new TOAST space


def test_two_keys_swapped_through_a_third_in_one_batch(pg_conn, pg_dsn: str, schemas) -> None:
    """UPDATE ... SET id = 3 WHERE id = 1; SET id = 1 WHERE id = 2; SET id = 2 WHERE id = 3, as
    Debezium sends it: a delete and a create per key change, all in one statement's batch."""
    target, meta = schemas
    apply(pg_dsn, target, meta, [(TOPIC, 0, 0, key(id=1), value("c", None, row(1, name="one"))),
                                 (TOPIC, 0, 1, key(id=2), value("c", None, row(2, name="two")))])
    moves = [(1, 3, "one"), (2, 1, "two"), (3, 2, "one")]
    records: list = []
    for old, new, name in moves:
        records += [(TOPIC, 0, 2 + len(records), key(id=old), value("d", row(old, name=name), None)),
                    (TOPIC, 0, 3 + len(records), key(id=old), None),
                    (TOPIC, 0, 4 + len(records), key(id=new), value("c", None, row(new, name=name)))]
    assert apply(pg_dsn, target, meta, records) == (9, 0)
    assert {k: r["name"] for k, r in stored(pg_conn, target, CUSTOMERS).items()} == {(1,): "two", (2,): "one"}
