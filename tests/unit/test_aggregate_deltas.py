"""The merge of per-task aggregate deltas (``aggregate_deltas``): pure logic. What the deltas
mean against the database's own apply is held in ``tests/integration/test_prepared_parts.py``."""

from __future__ import annotations

import json

import pyarrow as pa

from spark_apps.eos_stream.records import aggregate_deltas
from spark_apps.eos_stream.records.spec import AggregateTarget, Field, PipelineSpec, RowTarget
from spark_apps.eos_stream.sink import parts
from spark_apps.eos_stream.sink.part_writer import part_result

TARGET = AggregateTarget("agg", group_by=("k",), increments={"total": "v", "n": None}, latest={"last": "s"})
SPEC = PipelineSpec("t", (Field("k", "text"), Field("v", "bigint", required=False),
                          Field("s", "bigint", required=False)), (RowTarget("ev", ("k", "v")), TARGET))


def _table(partition: int, rows: list[tuple]) -> pa.Table:
    return pa.table({"k": [r[0] for r in rows], "v": pa.array([r[1] for r in rows], pa.int64()),
                     "s": pa.array([r[2] for r in rows], pa.int64()),
                     "_partition": pa.array([partition] * len(rows), pa.int32()),
                     "_offset": pa.array([r[3] for r in rows], pa.int64())})


def test_sums_add_counts_count_and_the_later_position_wins() -> None:
    first, second = aggregate_deltas.empty([TARGET]), aggregate_deltas.empty([TARGET])
    aggregate_deltas.add_table(first, [TARGET], _table(1, [("a", 2**62, 7, 10), ("a", 2**62, None, 11),
                                                           ("b", None, 3, 12)]))
    aggregate_deltas.add_table(second, [TARGET], _table(0, [("a", 1, 99, 500), ("b", 5, 4, 501)]))
    aggregate_deltas.merge(first, aggregate_deltas.from_wire(aggregate_deltas.to_wire(second)), [TARGET])
    # partition 1 is after partition 0 whatever the offsets: a's last value is partition 1's NULL
    assert first[0][("a",)] == [(1, 11), 2**63 + 1, 3, None]
    assert first[0][("b",)] == [(1, 12), 5, 2, 3]


def test_merge_order_does_not_matter() -> None:
    tables = [_table(0, [("a", 1, 1, 1), ("a", 2, 2, 2)]), _table(1, [("a", 3, 3, 0)]), _table(0, [("a", 4, 4, 3)])]
    results = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        merged = aggregate_deltas.empty([TARGET])
        for index in order:
            one = aggregate_deltas.empty([TARGET])
            aggregate_deltas.add_table(one, [TARGET], tables[index])
            aggregate_deltas.merge(merged, one, [TARGET])
        results.append(merged)
    assert results[0] == results[1] == results[2]
    assert results[0][0][("a",)] == [(1, 0), 10, 4, 3]


def test_the_recordset_names_the_target_columns() -> None:
    rows = json.loads(aggregate_deltas.recordset_json(TARGET, {("a",): [(0, 1), 2**64, 3, None]}))
    assert rows == [{"k": "a", "total": 2**64, "n": 3, "last": None}]


def test_one_refusal_sends_the_whole_batch_to_staging() -> None:
    deltas = aggregate_deltas.empty([TARGET])
    aggregate_deltas.add_table(deltas, [TARGET], _table(0, [("a", 1, 1, 1)]))
    good = part_result("eos-part:p:1:0:0:7", 1, deltas)
    assert parts.gather([good, part_result(None, 0)], SPEC, "eos-part:p:1:0:", 5) == parts.WrittenParts(
        ("eos-part:p:1:0:0:7",), 1, deltas, 5, "eos-part:p:1:0:")
    assert parts.gather([good, part_result(None, 3, refused="no")], SPEC, "x", 5) == ["no"]


def test_part_ids_of_one_pipeline_never_prefix_another_kind() -> None:
    from spark_apps.eos_stream.sink.in_doubt import gid_prefix

    assert not parts.batch_prefix("p", 3, 4).startswith(gid_prefix("p"))
    assert parts.batch_prefix("p", 3, 4).startswith(parts.pipeline_prefix("p"))
    assert not parts.batch_prefix("p", 3, 40).startswith(parts.batch_prefix("p", 3, 4))
