"""The mirror's compaction and staging (spark_apps/eos_stream/cdc/mirror.py) and its SQL's shape (mirror_sql.py).
The SQL itself runs against PostgreSQL in tests/integration/test_cdc_mirror_sql.py."""

from __future__ import annotations

import pytest

from spark_apps.eos_stream.cdc.envelope import Change
from spark_apps.eos_stream.cdc.mirror import MirrorError, MirrorTarget, apply_compacted, compact, staging_lines
from spark_apps.eos_stream.cdc.mirror_sql import apply_mirror_statement

T = MirrorTarget("public.customers", "customers", ("id",), {"id": "bigint", "name": "text", "notes": "text"})
LINES = MirrorTarget("public.lines", "lines", ("order_id", "line_no"),
                     {"order_id": "bigint", "line_no": "integer", "qty": "integer"})


def ch(op: str, key: dict, after: dict | None = None, unchanged: frozenset = frozenset(), table="public.customers"):
    return Change(table, op, key, None, after, unchanged)


def run(target: MirrorTarget, stored: dict, *changes: Change) -> tuple[dict, list]:
    rows = {k: dict(v) for k, v in stored.items()}
    quarantined = apply_compacted(rows, target, compact(target, [((0, i), c) for i, c in enumerate(changes)]))
    return rows, quarantined


def test_last_change_of_each_key_wins_in_kafka_order() -> None:
    merged = compact(T, [((0, 5), ch("u", {"id": 1}, {"id": 1, "name": "b", "notes": "n"})),
                         ((0, 3), ch("c", {"id": 1}, {"id": 1, "name": "a", "notes": "n"})),
                         ((1, 4), ch("c", {"id": 2}, {"id": 2, "name": "x", "notes": None}))])
    assert merged[(1,)].after == {"id": 1, "name": "b", "notes": "n"} and merged[(1,)].position == (0, 5)
    assert merged[(2,)].op == "c"


def test_primary_key_change_deletes_the_old_key_and_creates_the_new() -> None:
    stored = {(4,): {"id": 4, "name": "d", "notes": "big"}}
    rows, _ = run(T, stored, ch("d", {"id": 4}), ch("c", {"id": 40}, {"id": 40, "name": "d", "notes": "big"}))
    assert rows == {(40,): {"id": 40, "name": "d", "notes": "big"}}


def test_swap_of_two_keys_through_a_third() -> None:
    stored = {(1,): {"id": 1, "name": "a", "notes": None}, (2,): {"id": 2, "name": "b", "notes": None}}
    rows, _ = run(T, stored,
                  ch("d", {"id": 1}), ch("c", {"id": 3}, {"id": 3, "name": "a", "notes": None}),
                  ch("d", {"id": 2}), ch("c", {"id": 1}, {"id": 1, "name": "b", "notes": None}),
                  ch("d", {"id": 3}), ch("c", {"id": 2}, {"id": 2, "name": "a", "notes": None}))
    assert rows == {(1,): {"id": 1, "name": "b", "notes": None}, (2,): {"id": 2, "name": "a", "notes": None}}


def test_unchanged_toast_keeps_the_stored_value() -> None:
    stored = {(1,): {"id": 1, "name": "a", "notes": "big"}}
    rows, quarantined = run(T, stored, ch("u", {"id": 1}, {"id": 1, "name": "b"}, frozenset({"notes"})))
    assert rows[(1,)] == {"id": 1, "name": "b", "notes": "big"} and quarantined == []


def test_unchanged_toast_takes_the_value_an_earlier_change_of_the_batch_gave() -> None:
    rows, quarantined = run(T, {}, ch("c", {"id": 5}, {"id": 5, "name": "a", "notes": "fresh"}),
                            ch("u", {"id": 5}, {"id": 5, "name": "b"}, frozenset({"notes"})))
    assert rows[(5,)] == {"id": 5, "name": "b", "notes": "fresh"} and quarantined == []


def test_unchanged_toast_after_a_delete_and_create_does_not_resurrect_the_old_value() -> None:
    stored = {(6,): {"id": 6, "name": "old", "notes": "old notes"}}
    rows, _ = run(T, stored, ch("d", {"id": 6}), ch("c", {"id": 6}, {"id": 6, "name": "new", "notes": None}),
                  ch("u", {"id": 6}, {"id": 6, "name": "newer"}, frozenset({"notes"})))
    assert rows[(6,)] == {"id": 6, "name": "newer", "notes": None}


def test_an_update_that_cannot_be_completed_is_quarantined_never_written_with_null() -> None:
    rows, quarantined = run(T, {}, ch("u", {"id": 99}, {"id": 99, "name": "x"}, frozenset({"notes"})))
    assert rows == {} and quarantined == [(99,)]


def test_an_update_of_a_missing_row_with_every_value_is_an_insert() -> None:
    rows, quarantined = run(T, {}, ch("u", {"id": 98}, {"id": 98, "name": "x", "notes": None}))
    assert rows == {(98,): {"id": 98, "name": "x", "notes": None}} and quarantined == []


def test_composite_key() -> None:
    stored = {(1, 1): {"order_id": 1, "line_no": 1, "qty": 1}, (1, 2): {"order_id": 1, "line_no": 2, "qty": 2}}
    rows, _ = run(LINES, stored,
                  ch("u", {"order_id": 1, "line_no": 1}, {"order_id": 1, "line_no": 1, "qty": 7}, table="public.lines"),
                  ch("d", {"order_id": 1, "line_no": 2}, table="public.lines"),
                  ch("c", {"order_id": 1, "line_no": 3}, {"order_id": 1, "line_no": 3, "qty": 3}, table="public.lines"))
    assert rows == {(1, 1): {"order_id": 1, "line_no": 1, "qty": 7}, (1, 3): {"order_id": 1, "line_no": 3, "qty": 3}}


def test_a_target_needs_a_key_among_its_columns_and_plain_types() -> None:
    with pytest.raises(MirrorError, match="needs key columns"):
        MirrorTarget("public.t", "t", (), {"id": "bigint"})
    with pytest.raises(MirrorError, match="not among its columns"):
        MirrorTarget("public.t", "t", ("id",), {"name": "text"})
    with pytest.raises(MirrorError, match="not a PostgreSQL type name"):
        MirrorTarget("public.t", "t", ("id",), {"id": "bigint); DROP TABLE x; --"})
    ok = MirrorTarget("public.t", "t", ("id",), {"id": "BIGINT", "at": "timestamp(3) with time zone",
                                                 "amount": "numeric(20, 6)", "tags": "text[]"})
    assert ok.columns["id"] == "bigint"


def test_staging_lines_carry_changes_tombstones_and_errors() -> None:
    changes = {b"1": ch("u", {"id": 1}, {"id": 1, "name": "tab\there"}, frozenset({"notes"})), b"2": None}

    def decode(key, value):
        if value == b"bad":
            from spark_apps.eos_stream.cdc.envelope import EnvelopeError
            raise EnvelopeError("malformed value JSON")
        return changes[value]

    lines = list(staging_lines(lambda table: T, decode, [("app.public.customers", 0, 10, b"k", b"1"),
                                                         ("app.public.customers", 0, 11, b"k", b"2"),
                                                         ("app.public.customers", 0, 12, b"k", b"bad")], False))
    assert lines[0] == ('app.public.customers\t0\t10\t\\N\t\\N\t\\N\tcustomers\tu\t{"id":"1"}\t'
                        '{"id":"1","name":"tab\\\\there"}\t["notes"]\t\\N\t\\N\t\\N'
                        '\t\\N\tpublic.customers\n')  # JSON's \\t, escaped for COPY; no transaction, its table
    assert lines[1] == "app.public.customers\t0\t11\t\\N\t\\N\t\\N" + "\t\\N" * 10 + "\n"
    assert lines[2].startswith("app.public.customers\t0\t12\t\\\\x6b\t\\\\x626164\tmalformed value JSON\t")


def test_the_statement_quotes_identifiers() -> None:
    evil = MirrorTarget("public.t", 'x"; DROP TABLE y; --', ("id",), {"id": "bigint", 'n"m': "text"})
    text = repr(apply_mirror_statement([evil], stage=__import__("psycopg2").sql.Identifier("s"), target_schema="tgt",
                                       meta_schema="eos", skip_applied=True, dedupe=True))
    assert "DROP TABLE y" in text  # only inside quoted identifiers and literals
    assert "Identifier('x\"; DROP TABLE y; --')" in text


def test_a_dropped_column_keeps_its_stored_value_but_a_recreated_row_never_takes_the_deleted_ones() -> None:
    stored = {(1,): {"id": 1, "name": "a", "notes": "kept"}, (2,): {"id": 2, "name": "b", "notes": "gone"}}
    rows, _ = run(T, stored, ch("u", {"id": 1}, {"id": 1, "name": "a2"}),  # notes dropped at the source
                  ch("d", {"id": 2}), ch("c", {"id": 2}, {"id": 2, "name": "b2"}))
    assert rows == {(1,): {"id": 1, "name": "a2", "notes": "kept"}, (2,): {"id": 2, "name": "b2", "notes": None}}
