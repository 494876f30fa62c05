"""The offsets-only audit of a mirror pipeline (spark_apps/eos_stream/audit/mirror.py): green only
when the stored offsets are where a caught-up or replayed mirror's must be."""

from __future__ import annotations

from spark_apps.eos_stream.audit.mirror import offsets_findings
from spark_apps.eos_stream.audit.rules import PartitionRange

A, B = ("shop.public.customers", 0), ("shop.public.lines", 0)


def _ranges(**stored: int | None) -> dict:
    # earliest 10, LSO 100 on both partitions.
    return {A: PartitionRange(10, 100, stored.get("a"), True), B: PartitionRange(10, 100, stored.get("b"), True)}


def test_caught_up_offsets_are_green_and_say_the_rows_were_not_compared() -> None:
    mismatches, summary = offsets_findings(_ranges(a=100, b=100), {A: 100, B: 100}, {A: 100, B: 100}, False)
    assert mismatches == []
    assert summary["rows"] == "not compared" and summary["offsets_applied"] == 180


def test_each_wrong_offset_is_named() -> None:
    # a: short of the goal, and below Kafka's earliest (changes lost to retention); b: ahead of the LSO.
    mismatches, summary = offsets_findings(_ranges(a=5, b=120), {A: 5, B: 120}, {A: 100, B: 100}, False)
    assert mismatches == [f"retention_gap:{A[0]}:0", f"offsets_ahead:{B[0]}:0", f"goal_not_reached:{A[0]}:0"]
    assert (summary["retention_gap_offsets"], summary["offsets_ahead"], summary["goal_short_by"]) == (5, 20, 95)


def test_the_tail_is_missing_only_when_nothing_will_apply_it() -> None:
    ranges, stored = _ranges(a=60, b=100), {A: 60, B: 100}
    assert offsets_findings(ranges, stored, None, True)[0] == [f"missing:{A[0]}:0"]
    mismatches, summary = offsets_findings(ranges, stored, {A: 60}, False)  # a replay's goal, reached
    assert mismatches == [] and summary["offsets_above_stored"] == 40
