"""Tables a mirror names by pattern, through the sink on the real PostgreSQL (no Kafka: the
stage is filled as the executors fill it, from records of several topics).

One batch carries changes of two tables a pattern matches and of a listed one: the batch's
transaction creates both pattern targets from the change events' schemas (key: the record
key's fields, columns and types: the value schema's) and applies every change; a value
PostgreSQL refuses is isolated and dead-lettered alone, as for a listed table. Applied again,
nothing moves. A later batch whose schema carries a new column adds it. A batch that also
holds a pattern table's record without schemas fails at once, naming the table and the fix,
and leaves neither the other target it would have created nor any row or offset. Two source
tables a pattern would mirror into one target fail the batch too."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.cdc.schema_changes import SchemaChangeRefused
from spark_apps.eos_stream.records.spec import StageCount
from tests.helpers.cdc_typed_records import typed_record, untyped_record
from tests.helpers.mirror_sink import MirrorSink

SECTION = {"topic_prefix": "app", "tables": [
    {"source": "public.accounts", "key": ["id"], "columns": {"id": "bigint", "owner": "text"}},
    {"source_pattern": "inventory.*", "target": "inv_{table}"}]}
STOCK = {"warehouse": "INT4", "sku": "VARCHAR(40)", "qty": "INT8", "price": "NUMERIC(12,2)"}
BINS = {"id": "INT8", "label": "TEXT"}
Record = tuple[str, bytes, bytes | None]  # topic, key, value


def _stock(op: str, warehouse: int, sku: str, qty: int, price: str, types: dict[str, str] = STOCK,
           **more: Any) -> Record:
    row = {"warehouse": warehouse, "sku": sku, "qty": qty, "price": price, **more}
    return ("app.inventory.stock", *typed_record("inventory", "stock", op, {"warehouse": warehouse, "sku": sku},
                                                 row, types))


def _bin(op: str, key: int, label: str) -> Record:
    return ("app.inventory.bins", *typed_record("inventory", "bins", op, {"id": key}, {"id": key, "label": label},
                                                BINS))


def _account(key: int, owner: str) -> Record:
    return ("app.public.accounts", *untyped_record("public", "accounts", {"id": key}, {"id": key, "owner": owner}))


class _PatternMirror(MirrorSink):
    """A mirror pipeline's sink over fresh schemas; each batch's records at offsets counted per topic."""

    def __init__(self, stack: dict[str, str], unique_name: str, section: dict[str, Any] = SECTION) -> None:
        super().__init__(stack, section, f"t_pat_{unique_name}", f"m_pat_{unique_name}", f"p_{unique_name}")
        self.next: dict[tuple[str, int], int] = {}

    def apply(self, batch_id: int, records: list[Record], replay_from: dict[tuple[str, int], int] | None = None) -> Any:
        """Applies ``records`` as one batch, each topic's from its next offset (or ``replay_from``)."""
        start = dict(replay_from if replay_from is not None else self.next)
        end, offsets = dict(start), []
        for topic, _, _ in records:
            offsets.append(end.get((topic, 0), 0))
            end[(topic, 0)] = offsets[-1] + 1
        batch = pa.record_batch([pa.array([t for t, _, _ in records]), pa.array([0] * len(records), pa.int32()),
                                 pa.array(offsets, pa.int64()), pa.array([k for _, k, _ in records], pa.binary()),
                                 pa.array([v for _, _, v in records], pa.binary())],
                                names=["topic", "partition", "offset", "key", "value"])

        def fill_stage(stage_name: str, keep_raw: bool) -> StageCount:
            return self.stage(stage_name, keep_raw, batch)

        result = self.sink.process(batch_id, start, end, fill_stage)
        self.next = {**self.next, **end}
        return result

    def query(self, statement: str, *identifiers: str, params: tuple = ()) -> list[tuple]:
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL(statement).format(*[sql.Identifier(i) for i in identifiers]), params)
            found = cur.fetchall()
        self.conn.commit()
        return found

    def table_shape(self, table: str) -> tuple[list[tuple[str, str]], list[str]]:
        """(column, type) in order, and the primary key's columns in key order."""
        relation = sql.Identifier(self.target, table).as_string(self.conn)
        columns = self.query("SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
                             " WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped"
                             " ORDER BY a.attnum", params=(relation,))
        key = self.query("SELECT a.attname::text FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
                         " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary"
                         " ORDER BY array_position(i.indkey::int[], a.attnum::int)", params=(relation,))
        return columns, [k for (k,) in key]

    def tables(self) -> list[str]:
        found = self.query("SELECT tablename::text FROM pg_tables WHERE schemaname = %s ORDER BY 1",
                           params=(self.target,))
        return [t for (t,) in found]

    def offsets(self) -> dict[tuple[str, int], int]:
        found = self.query("SELECT topic, partition, next_offset FROM {}.kafka_offsets WHERE pipeline = %s",
                           self.meta, params=(self.name,))
        return {(t, p): n for t, p, n in found}


def test_one_batch_creates_both_pattern_targets_from_the_schemas_and_applies(stack: dict[str, str],
                                                                             unique_name: str) -> None:
    mirror = _PatternMirror(stack, unique_name)
    try:
        assert mirror.tables() == ["accounts"]
        first = [_stock("c", 1, "a", 5, "9.50"), _bin("c", 1, "top"), _account(1, "ann"), _bin("c", 2, "low"),
                 _stock("c", 1, "b", 7, "1.25"), _stock("u", 1, "a", 6, "9.75"),
                 _stock("u", 1, "b", 8, "123456789012"),  # numeric(12,2) cannot hold it: 22003, isolated
                 _bin("d", 2, "low")]
        result = mirror.apply(0, first)
        assert result.record_by_record and (result.applied, result.dead_lettered) == (7, 1), result
        assert mirror.tables() == ["accounts", "inv_bins", "inv_stock"]
        assert mirror.table_shape("inv_stock") == (
            [("warehouse", "integer"), ("sku", "character varying(40)"), ("qty", "bigint"),
             ("price", "numeric(12,2)")], ["warehouse", "sku"])
        assert mirror.table_shape("inv_bins") == ([("id", "bigint"), ("label", "text")], ["id"])
        stock = "SELECT warehouse, sku, qty, price::text FROM {}.inv_stock ORDER BY 1, 2"
        assert mirror.query(stock, mirror.target) == [(1, "a", 6, "9.75"), (1, "b", 7, "1.25")]
        assert mirror.query("SELECT id, label FROM {}.inv_bins", mirror.target) == [(1, "top")]
        assert mirror.query("SELECT id, owner FROM {}.accounts", mirror.target) == [(1, "ann")]
        dead = mirror.query('SELECT topic, "offset", sqlstate FROM {}.dead_letters', mirror.meta)
        assert dead == [("app.inventory.stock", 3, "22003")]
        assert mirror.offsets() == {("app.inventory.stock", 0): 4, ("app.inventory.bins", 0): 3,
                                    ("app.public.accounts", 0): 1}

        again = mirror.apply(1, first, replay_from={tp: 0 for tp in mirror.next})
        assert (again.applied, again.dead_lettered) == (0, 0), again
        assert mirror.query(stock, mirror.target) == [(1, "a", 6, "9.75"), (1, "b", 7, "1.25")]

        grown = {**STOCK, "note": "TEXT"}
        later = mirror.apply(2, [_stock("u", 1, "a", 9, "9.75", grown, note="new"), _stock("d", 1, "b", 7, "1.25")])
        assert (later.applied, later.dead_lettered) == (2, 0), later
        assert mirror.table_shape("inv_stock")[0][-1] == ("note", "text")
        assert mirror.query("SELECT warehouse, sku, qty, note FROM {}.inv_stock", mirror.target) == [(1, "a", 9, "new")]
    finally:
        mirror.close()


def test_a_pattern_table_without_schemas_fails_the_batch_leaving_no_table_row_or_offset(
        stack: dict[str, str], unique_name: str) -> None:
    mirror = _PatternMirror(stack, unique_name)
    try:
        schemaless = ("app.inventory.bins", *untyped_record("inventory", "bins", {"id": 1}, {"id": 1, "label": "x"}))
        with pytest.raises(SchemaChangeRefused, match=r"inventory\.bins: a table mirrored by pattern 'inventory\.\*' "
                                                      r"needs change events with schemas.*list the table under tables"):
            mirror.apply(0, [_stock("c", 1, "a", 5, "9.50"), _account(1, "ann"), schemaless])
        assert mirror.tables() == ["accounts"]  # inv_stock's CREATE rolled back with the batch
        assert mirror.query("SELECT count(*) FROM {}.accounts", mirror.target) == [(0,)]
        assert mirror.offsets() == {}
    finally:
        mirror.close()


def test_two_source_tables_one_pattern_target_name_fail_the_batch_naming_both(
        stack: dict[str, str], unique_name: str) -> None:
    section = {"topic_prefix": "app", "tables": [{"source_pattern": "*.stock"}]}  # target {table}: both "stock"
    mirror = _PatternMirror(stack, unique_name, section)
    try:
        other = ("app.archive.stock", *typed_record("archive", "stock", "c", {"warehouse": 1, "sku": "a"},
                                                    {"warehouse": 1, "sku": "a", "qty": 1, "price": "1"}, STOCK))
        with pytest.raises(SchemaChangeRefused, match=r"target table 'stock' would mirror \['archive\.stock', "
                                                      r"'inventory\.stock'\].*\{schema\}_\{table\}"):
            mirror.apply(0, [_stock("c", 1, "a", 5, "9.50"), other])
        assert mirror.tables() == [] and mirror.offsets() == {}
    finally:
        mirror.close()
