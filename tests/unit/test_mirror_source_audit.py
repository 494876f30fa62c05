"""The mirror audit's merge of two key-ordered sides (pure logic; the SQL side is in
tests/integration/test_mirror_source_audit.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

from spark_apps.eos_stream.audit.mirror_source import Comparison, merge


def keyed(*rows: tuple) -> list:
    return [(((True, str(key)),), values) for key, values in rows]


def test_equal_sides_are_ok_whatever_the_representation() -> None:
    instant = datetime(2026, 1, 1, 12, tzinfo=UTC)
    source = keyed(("1", (Decimal("1.50"), {"a": 1, "b": [1, 2]}, instant, memoryview(b"\x00"))))
    target = keyed(("1", (Decimal("1.5"), {"b": [1, 2], "a": 1}, instant.astimezone(timezone(timedelta(hours=9))),
                          b"\x00")))
    result = merge(Comparison("t"), iter(source), iter(target))
    assert result.ok and (result.source_rows, result.target_rows) == (1, 1)


def test_each_kind_of_difference_is_counted_with_its_key() -> None:
    source = keyed(("1", (1,)), ("2", (2,)), ("4", (4,)))
    target = keyed(("1", (1,)), ("2", (20,)), ("3", (3,)))
    result = merge(Comparison("t"), iter(source), iter(target))
    assert (result.missing, result.extra, result.differing) == (1, 1, 1)
    assert result.examples == {"differing": [["2"]], "extra": [["3"]], "missing": [["4"]]}
    assert not result.ok and result.as_dict()["rows_that_differ"] == 3


def test_one_empty_side_is_all_missing_or_all_extra() -> None:
    rows = keyed(("a", (1,)), ("b", (2,)))
    assert merge(Comparison("t"), iter(rows), iter([])).missing == 2
    assert merge(Comparison("t"), iter([]), iter(rows)).extra == 2
    assert merge(Comparison("t"), iter([]), iter([])).ok


def test_a_null_group_sorts_first_and_is_not_the_empty_string() -> None:
    null_group, empty_group = ((False, ""),), ((True, ""),)
    source = [(null_group, (2,)), (empty_group, (1,))]
    assert merge(Comparison("t"), iter(source), iter(source)).ok
    swapped = merge(Comparison("t"), iter(source), iter([(null_group, (1,)), (empty_group, (2,))]))
    assert swapped.differing == 2 and swapped.examples["differing"] == [[None], [""]]
