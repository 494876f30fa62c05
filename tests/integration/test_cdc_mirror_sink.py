"""A mirror's batches through the sink on the real PostgreSQL (no Kafka: the stage is filled as
the executors fill it).

Poison: a change whose value
PostgreSQL refuses fails the batch's apply statement; once its attempts are spent the batch is
isolated (transition 6, ranges with ``only_range``), and only that change goes to the dead letters,
with its coordinates, raw bytes and SQLSTATE, while the key's earlier change and every other change
apply and the offsets advance in the same transaction. A record that is no change event is
dead-lettered by the executors' decoding. Applied again, the batch moves nothing.

Schema changes: a column the events' schema types (``column.propagate.source.type``) is added in
the batch's transaction and filled; a later batch finds it in the table; a change lacking it keeps
NULL; a new column no schema types fails the run at once, naming the column and the fix."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest
from psycopg2 import sql

from spark_apps.eos_stream.cdc.schema_changes import SchemaChangeRefused
from spark_apps.eos_stream.records.spec import StageCount
from tests.helpers.mirror_sink import MirrorSink

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


class _Mirror(MirrorSink):
    """A mirror pipeline's sink over fresh schemas, and a stage filler for Arrow batches."""

    def __init__(self, stack: dict[str, str], unique_name: str, max_batch_attempts: int = 1) -> None:
        super().__init__(stack, SECTION, f"t_mirror_{unique_name}", f"m_mirror_{unique_name}", f"m_{unique_name}",
                         max_batch_attempts)
        self.staged_raw: list[bool] = []

    def apply(self, batch_id: int, records: list[tuple[bytes, bytes | None]], start: int = 0) -> Any:
        """Applies ``records`` at offsets ``start``... as one batch."""
        offsets = range(start, start + len(records))
        batch = pa.record_batch([pa.array([TOPIC] * len(records)), pa.array([0] * len(records), pa.int32()),
                                 pa.array(offsets, pa.int64()), pa.array([k for k, _ in records], pa.binary()),
                                 pa.array([v for _, v in records], pa.binary())],
                                names=["topic", "partition", "offset", "key", "value"])

        def fill_stage(stage_name: str, keep_raw: bool) -> StageCount:
            self.staged_raw.append(keep_raw)
            return self.stage(stage_name, keep_raw, batch)

        return self.sink.process(batch_id, {(TOPIC, 0): start}, {(TOPIC, 0): start + len(records)}, fill_stage)


def test_a_refused_change_is_isolated_and_dead_lettered_alone(stack: dict[str, str], unique_name: str) -> None:
    mirror = _Mirror(stack, unique_name)
    conn, target, meta, name = mirror.conn, mirror.target, mirror.meta, mirror.name
    try:
        result = mirror.apply(0, RECORDS)
        assert mirror.staged_raw == [False, True]  # the failed attempt, then the isolating one with raw bytes
        assert result.record_by_record and (result.applied, result.dead_lettered) == (5, 2), result
        assert _rows(conn, target) == [(1, "ann", "7.250000"), (2, "bob", "2.000000"), (3, "cy", "4.000000")]
        dead = _dead_letters(conn, meta)
        assert [(d[0], d[1], d[2]) for d in dead] == [(TOPIC, 0, 3), (TOPIC, 0, 6)], dead
        assert dead[0][3] == "22003" and bytes(dead[0][4]) == RECORDS[3][1], dead[0]
        assert "malformed value JSON" in dead[1][5]
        assert _offsets(conn, meta, name) == {(TOPIC, 0): len(RECORDS)}

        again = mirror.apply(1, RECORDS)
        assert (again.applied, again.dead_lettered) == (0, 0), again
        assert _rows(conn, target)[0] == (1, "ann", "7.250000") and len(_dead_letters(conn, meta)) == 2
    finally:
        mirror.close()


def _typed(op: str, key: int, row: dict[str, Any], types: dict[str, str]) -> tuple[bytes, bytes]:
    """A change event with its Connect schema, each column's source type propagated."""
    fields = [{"field": c, "type": "int64" if t == "BIGINT" else "string", "optional": c != "id",
               "parameters": {"__debezium.source.column.type": t}} for c, t in types.items()]
    value = {"schema": {"type": "struct", "fields": [{"field": "after", "type": "struct", "fields": fields}]},
             "payload": {"op": op, "before": None, "after": row, "source": {"schema": "public", "table": "accounts"}}}
    return json.dumps({"id": key}).encode(), json.dumps(value).encode()


def test_a_typed_new_column_is_added_in_the_batch_and_an_untyped_one_is_refused(
        stack: dict[str, str], unique_name: str) -> None:
    mirror = _Mirror(stack, unique_name, max_batch_attempts=3)
    types = {"id": "BIGINT", "owner": "TEXT", "balance": "NUMERIC", "email": "VARCHAR"}
    try:
        first = mirror.apply(0, [_typed("c", 1, {"id": 1, "owner": "ann", "balance": "1", "email": "a@x"}, types),
                                 _change("c", 2, "bob", "2")])
        assert (first.applied, first.dead_lettered) == (2, 0), first
        assert _columns(mirror.conn, mirror.target) == ["id", "owner", "balance", "email"]
        second = mirror.apply(1, [_typed("u", 1, {"id": 1, "owner": "ann", "balance": "3", "email": "b@x"}, types),
                                  _change("u", 2, "bob", "5")], start=2)
        assert (second.applied, second.dead_lettered) == (2, 0), second
        with mirror.conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT id, balance::text, email FROM {}.accounts ORDER BY id").format(
                sql.Identifier(mirror.target)))
            assert cur.fetchall() == [(1, "3.000000", "b@x"), (2, "5.000000", None)]
        mirror.conn.commit()
        untyped = json.loads(_change("c", 3, "cy", "1")[1])
        untyped["after"]["phone"] = "555"
        with pytest.raises(SchemaChangeRefused, match=r"column 'phone' of public\.accounts is new"):
            mirror.apply(2, [(json.dumps({"id": 3}).encode(), json.dumps(untyped).encode())], start=4)
        assert _offsets(mirror.conn, mirror.meta, mirror.name) == {(TOPIC, 0): 4}  # nothing of it applied
    finally:
        mirror.close()


def _columns(conn: Any, schema: str) -> list[str]:
    with conn.cursor() as cur:
        cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
                    " AND table_name = 'accounts' ORDER BY ordinal_position", (schema,))
        found = [row[0] for row in cur.fetchall()]
    conn.commit()
    return found


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
