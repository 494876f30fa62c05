"""The direct path's encoding (``target_lines``): per-target lines and partials, without Spark."""

from __future__ import annotations

import json

import pytest

from spark_apps.eos_stream.records import staging_lines
from spark_apps.eos_stream.spec import AggregateTarget, Field, PipelineSpec, RowTarget, SpecError
from spark_apps.eos_stream.target_lines import TargetLines, partial_columns

SPEC = PipelineSpec(
    name="t",
    fields=(Field("k", "text"), Field("v", "bigint", required=False), Field("s", "text", required=False)),
    targets=(RowTarget("rows", columns=("k", "v")),
             AggregateTarget("agg", group_by=("k",), increments={"total": "v", "n": None}, latest={"last": "s"})),
)


def _record(offset: int, partition: int = 0, **value) -> tuple:
    return ("topic", partition, offset, b"key", json.dumps(value).encode())


def test_row_lines_are_the_coordinates_and_the_targets_columns() -> None:
    lines = TargetLines(SPEC)
    out = lines.add([_record(5, k="a\tb", v=3), _record(6, k="c", v=None)])
    assert out == {0: ["topic\t0\t5\ta\\tb\t3\n", "topic\t0\t6\tc\t\\N\n"]}
    assert lines.valid == 2 and lines.dead_letters == []


def test_a_bad_record_becomes_the_staged_paths_dead_letter_line() -> None:
    lines = TargetLines(SPEC)
    bad = ("topic", 1, 9, b"key", b"{nope")
    assert lines.add([bad]) == {0: []}
    assert lines.dead_letters == list(staging_lines(SPEC, [bad], keep_raw=False))
    assert lines.valid == 0 and lines.partial_lines() == {1: []}


def test_partials_sum_skip_nulls_count_every_record_and_keep_the_last() -> None:
    lines = TargetLines(SPEC)
    lines.add([_record(1, k="a", v=2, s="first"), _record(2, k="a", v=None, s="second"),
               _record(3, k="b", v=None), _record(4, k="a", v=5, s=None)])
    # key, sum(v), count(*), last partition and offset, last s (NULL: the last record's value is NULL)
    assert sorted(lines.partial_lines()[1]) == ["a\t7\t3\t0\t4\t\\N\n", "b\t\\N\t1\t0\t3\t\\N\n"]


def test_the_last_record_is_the_highest_partition_and_offset() -> None:
    lines = TargetLines(SPEC)
    lines.add([_record(9, partition=2, k="a", v=1, s="p2"), _record(3, partition=1, k="a", v=1, s="p1")])
    assert lines.partial_lines()[1] == ["a\t2\t2\t2\t9\tp2\n"]


def test_partial_columns_follow_the_line_order() -> None:
    assert partial_columns(SPEC, SPEC.targets[1]) == [
        ("k", "text"), ("_sum_0", "numeric"), ("_sum_1", "numeric"),
        ("_last_partition", "integer"), ("_last_offset", "bigint"), ("_latest_0", "text")]


@pytest.mark.parametrize("summed", ["text", "double precision", "timestamptz"])
def test_a_spec_sums_only_exact_types(summed: str) -> None:
    """A text sum is no sum; a float sum depends on the order of its additions, so no audit could check it."""
    with pytest.raises(SpecError, match="not of an exact type"):
        PipelineSpec(name="x", fields=(Field("k", "text"), Field("s", summed)),
                     targets=(AggregateTarget("a", group_by=("k",), increments={"t": "s"}),))
    PipelineSpec(name="x", fields=(Field("k", "text"), Field("s", "numeric")),
                 targets=(AggregateTarget("a", group_by=("k",), increments={"t": "s"}),))


def test_a_task_sends_row_lines_per_batch_then_partials_dead_letters_and_its_count_last() -> None:
    from spark_apps.eos_stream.sink.direct_rows import DEAD_LETTERS, VALID_RECORDS, task_chunks

    bad = ("topic", 0, 3, b"key", b"{nope")
    sent = list(task_chunks(SPEC, [[_record(1, k="a", v=1)], [bad], [_record(4, k="a", v=2)]]))
    assert [[(what, records) for what, records, _ in chunks] for chunks in sent] == [
        [(0, 1)], [(0, 1)], [(1, 1), (DEAD_LETTERS, 1), (VALID_RECORDS, 2)]]
    assert sent[2][0][2] == b"a\t3\t2\t0\t4\t\\N\n"
