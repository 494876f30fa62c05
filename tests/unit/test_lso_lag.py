"""Unit tests of the LSO lag logic (pure, no broker)."""

from __future__ import annotations

import json

import pytest

from airflow_provider_eos.utils.lso_watch import (
    HANGING,
    LAGGING,
    OK,
    OPEN,
    LsoReport,
    LsoWatch,
    PartitionOffsets,
    StoredPartition,
    lso_lag,
)

T = "orders"


def offs(hw: int, lso: int, earliest: int | None = 0) -> PartitionOffsets:
    return PartitionOffsets(high_watermark=hw, last_stable=lso, earliest=earliest)


def classes(report: LsoReport) -> dict[tuple[str, int], str]:
    return {(p.topic, p.partition): p.classification for p in report.partitions}


def test_lag_is_hw_minus_lso_never_negative():
    assert lso_lag(offs(10, 4)) == 6
    assert offs(0, 0).lag == 0
    assert offs(3, 5).lag == 0  # defensive: an LSO read after the HW


def test_empty_partitions_are_ok_and_never_stuck():
    watch = LsoWatch(stuck_after=5)
    for t in (0, 10, 100, 10_000):
        report = watch.observe(t, {(T, 0): offs(0, 0), (T, 1): offs(0, 0)})
        assert set(classes(report).values()) == {OK}
        assert report.all_caught_up
        assert not report.stuck


def test_only_aborted_data_partition_is_ok():
    # 5 aborted records + 1 abort marker: offsets 0..5 are used, HW == LSO == 6,
    # nothing is readable by read_committed, but nothing is pending either.
    watch = LsoWatch(stuck_after=5)
    report = watch.observe(0, {(T, 0): offs(6, 6, earliest=0)})
    row = report.partitions[0]
    assert (row.lag, row.classification, row.earliest) == (0, OK, 0)
    report = watch.observe(1000, {(T, 0): offs(6, 6, earliest=0)})
    assert report.partitions[0].stuck_seconds == 0


def test_lagging_while_lso_moves_then_open_when_it_stops():
    watch = LsoWatch(stuck_after=10)
    assert classes(watch.observe(0, {(T, 0): offs(5, 0)}))[(T, 0)] == LAGGING
    # LSO moves (transactions commit) but new ones keep the lag > 0: still lagging.
    assert classes(watch.observe(8, {(T, 0): offs(12, 6)}))[(T, 0)] == LAGGING
    assert classes(watch.observe(16, {(T, 0): offs(20, 13)}))[(T, 0)] == LAGGING
    # LSO stops at 13 (observed since t=16).
    report = watch.observe(25.9, {(T, 0): offs(30, 13)})
    assert classes(report)[(T, 0)] == LAGGING
    assert report.partitions[0].stuck_seconds == pytest.approx(9.9)
    report = watch.observe(26, {(T, 0): offs(30, 13)})
    assert classes(report)[(T, 0)] == OPEN
    assert [p.partition for p in report.stuck] == [0]


def test_classification_boundaries():
    watch = LsoWatch(stuck_after=30, txn_max_timeout_ms=900_000, margin=60)
    assert watch.hanging_after == 960
    assert watch.classify(0, 10_000) == OK
    assert watch.classify(1, 0) == LAGGING
    assert watch.classify(1, 29.999) == LAGGING
    assert watch.classify(1, 30) == OPEN
    assert watch.classify(1, 959.999) == OPEN
    assert watch.classify(1, 960) == HANGING
    assert watch.classify(1, 10**7) == HANGING


def test_hanging_after_txn_max_timeout_plus_margin():
    watch = LsoWatch(stuck_after=5, txn_max_timeout_ms=20_000, margin=2)
    key = (T, 0)
    watch.observe(100, {key: offs(3, 1)})
    assert classes(watch.observe(121.9, {key: offs(3, 1)}))[key] == OPEN
    report = watch.observe(122, {key: offs(4, 1)})  # HW may grow, the LSO does not
    assert classes(report)[key] == HANGING
    assert report.hanging and report.hanging[0].stuck_seconds == 22


def test_lag_cleared_resets_the_stuck_clock():
    watch = LsoWatch(stuck_after=5)
    key = (T, 0)
    watch.observe(0, {key: offs(3, 1)})
    assert classes(watch.observe(6, {key: offs(3, 1)}))[key] == OPEN
    assert classes(watch.observe(7, {key: offs(4, 4)}))[key] == OK  # aborted/committed
    # A new transaction at the same LSO value counts from its first observation.
    assert classes(watch.observe(8, {key: offs(6, 4)}))[key] == LAGGING
    assert classes(watch.observe(12.5, {key: offs(6, 4)}))[key] == LAGGING
    assert classes(watch.observe(13, {key: offs(6, 4)}))[key] == OPEN


def test_partitions_added_while_watching_start_fresh():
    watch = LsoWatch(stuck_after=5)
    watch.observe(0, {(T, 0): offs(2, 1)})
    report = watch.observe(10, {(T, 0): offs(2, 1), (T, 1): offs(7, 3), ("other", 0): offs(0, 0)})
    c = classes(report)
    assert c == {(T, 0): OPEN, (T, 1): LAGGING, ("other", 0): OK}
    assert report.watched_seconds == 10
    report = watch.observe(15, {(T, 0): offs(2, 1), (T, 1): offs(7, 3), ("other", 0): offs(0, 0)})
    assert classes(report)[(T, 1)] == OPEN
    # A partition that disappears (topic deleted) is forgotten.
    report = watch.observe(16, {(T, 1): offs(7, 3)})
    assert [(p.topic, p.partition) for p in report.partitions] == [(T, 1)]


def test_report_format_is_readable():
    watch = LsoWatch(stuck_after=5)
    watch.observe(0, {(T, 0): offs(9, 4), (T, 1): offs(2, 2)})
    report = watch.observe(6, {(T, 0): offs(9, 4), (T, 1): offs(2, 2)})
    text = report.format()
    lines = text.splitlines()
    assert "1 stuck" in lines[0]
    assert lines[1].split() == ["topic", "partition", "HW", "LSO", "lag", "stuck_s", "classification"]
    assert lines[2].split() == [T, "0", "9", "4", "5", "6.0", "open"]
    assert lines[3].split() == [T, "1", "2", "2", "0", "0.0", "ok"]
    assert "(no partitions with lag)" not in report.format(only_with_lag=True)
    assert LsoReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_watch_state_json_round_trip_keeps_stuck_clock():
    watch = LsoWatch(stuck_after=5, txn_max_timeout_ms=60_000, margin=1.5)
    watch.observe(100, {(T, 0): offs(9, 4), (T, 1): offs(0, 0)})
    state = json.loads(json.dumps(watch.to_json()))
    restored = LsoWatch.from_json(state)
    assert restored.to_json() == watch.to_json()
    report = restored.observe(105, {(T, 0): offs(9, 4), (T, 1): offs(0, 0)})
    assert classes(report)[(T, 0)] == OPEN
    assert report.watched_seconds == 5


def advancing(report: LsoReport) -> dict[int, bool]:
    return {p.partition: p.advancing for p in report.partitions}


def test_advancing_needs_an_observed_lso_move_or_a_lag_that_appeared():
    watch = LsoWatch(stuck_after=10)
    first = watch.observe(0, {(T, 0): offs(5, 2), (T, 1): offs(3, 3), (T, 2): offs(9, 4)})
    # Lag at first sight: its age is unknown, so not advancing (the gate waits).
    assert advancing(first) == {0: False, 1: True, 2: False}
    assert not first.gate_ready and [p.partition for p in first.unconfirmed] == [0, 2]
    # 0: LSO moved; 1: a transaction began after the LSO had caught up; 2: unchanged.
    second = watch.observe(1, {(T, 0): offs(8, 4), (T, 1): offs(6, 3), (T, 2): offs(12, 4)})
    assert advancing(second) == {0: True, 1: True, 2: False}
    assert not second.gate_ready
    third = watch.observe(2, {(T, 0): offs(8, 4), (T, 1): offs(6, 3), (T, 2): offs(12, 7)})
    assert advancing(third) == {0: True, 1: True, 2: True}
    assert third.gate_ready and not third.all_caught_up
    assert third.gate_summary().startswith("gate open: no partition stuck (3 with open transactions)")
    # An advancing partition whose LSO then stops is stuck after stuck_after, not open forever.
    later = watch.observe(11, {(T, 0): offs(9, 4), (T, 1): offs(6, 6), (T, 2): offs(12, 8)})
    assert classes(later)[(T, 0)] == OPEN and not later.gate_ready
    assert "stuck (LSO not moved for stuck_after or longer): orders[0] LSO 4 lag 5 for 10.0s (open)" in (
        later.gate_summary()
    )


def test_lso_that_goes_back_is_not_advancing():
    watch = LsoWatch(stuck_after=10)
    watch.observe(0, {(T, 0): offs(50, 40)})
    watch.observe(1, {(T, 0): offs(52, 45)})
    report = watch.observe(2, {(T, 0): offs(6, 2)})  # topic recreated under the same name
    assert advancing(report) == {0: False}


def test_advancing_survives_json_and_old_state_without_it_loads():
    watch = LsoWatch(stuck_after=10)
    watch.observe(0, {(T, 0): offs(5, 2)})
    watch.observe(1, {(T, 0): offs(6, 3)})
    state = json.loads(json.dumps(watch.to_json()))
    assert state["partitions"][0]["advancing"] is True
    assert advancing(LsoWatch.from_json(state).observe(2, {(T, 0): offs(7, 3)})) == {0: True}
    del state["partitions"][0]["advancing"]  # a trigger serialized before the field existed
    assert advancing(LsoWatch.from_json(state).observe(2, {(T, 0): offs(7, 3)})) == {0: False}


@pytest.mark.parametrize(
    "kwargs", [{"stuck_after": 0}, {"stuck_after": 1, "txn_max_timeout_ms": 0}, {"stuck_after": 1, "margin": -1}]
)
def test_invalid_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        LsoWatch(**kwargs)


# ---------------------------------------------------------------- stuck-since across runs
def run_once(stored, now, frame, stuck_after=3, hanging_after=20):
    """One health-check run: a fresh watch seeded with what the last run stored, one observation,
    and what it stores for the next run (ages as of ``now``)."""
    watch = LsoWatch(stuck_after=stuck_after, hanging_after=hanging_after)
    watch.resume(stored, now)
    report = watch.observe(now, frame)
    return report, watch.to_stored(now)


def test_stuck_time_accumulates_across_runs_until_hanging():
    frame = {(T, 0): offs(9, 4), (T, 1): offs(0, 0)}
    report, stored = run_once([], 100, frame)
    assert classes(report) == {(T, 0): LAGGING, (T, 1): OK}
    assert stored == [StoredPartition(T, 0, 9, 4, 0.0)]  # lag-free partitions are not kept
    # The next run reads the row back 12 s later (the store ages it), and observes the same LSO.
    aged = [StoredPartition(s.topic, s.partition, s.high_watermark, s.last_stable, s.stuck_for + 12) for s in stored]
    report, stored = run_once(aged, 500, {(T, 0): offs(11, 4), (T, 1): offs(0, 0)})
    assert classes(report)[(T, 0)] == OPEN and report.partitions[0].stuck_seconds == 12
    assert stored == [StoredPartition(T, 0, 11, 4, 12.0)]
    aged = [StoredPartition(T, 0, 11, 4, 21.5)]
    report, _ = run_once(aged, 900, {(T, 0): offs(11, 4), (T, 1): offs(0, 0)})
    assert classes(report)[(T, 0)] == HANGING and report.partitions[0].stuck_seconds == 21.5
    assert report.hanging_after == 20 and [p.name for p in report.hanging] == [f"{T}[0]"]


@pytest.mark.parametrize(
    ("now", "expected_stuck", "expected_class"),
    [
        (offs(12, 6), 0.0, LAGGING),  # the LSO moved: a new episode
        (offs(4, 4), 0.0, OK),  # lag 0: nothing to keep
        (offs(3, 4), 0.0, OK),  # recreated, empty
        (offs(8, 4), 0.0, LAGGING),  # same LSO but a lower HW: the topic was recreated
    ],
)
def test_stored_stuck_since_resets_when_the_partition_changed(now, expected_stuck, expected_class):
    report, stored = run_once([StoredPartition(T, 0, 9, 4, 30.0)], 50, {(T, 0): now})
    assert report.partitions[0].stuck_seconds == expected_stuck
    assert classes(report)[(T, 0)] == expected_class
    assert stored == ([] if expected_class == OK else [StoredPartition(T, 0, now.high_watermark, now.last_stable, 0.0)])


def test_stored_partitions_that_vanished_are_dropped_and_are_not_advancing():
    report, stored = run_once([StoredPartition("gone", 0, 9, 4, 30.0), StoredPartition(T, 0, 9, 4, 1.0)], 10,
                              {(T, 0): offs(9, 4)})
    assert [p.name for p in report.partitions] == [f"{T}[0]"]
    assert report.partitions[0].advancing is False  # the gate still waits to see it move
    assert stored == [StoredPartition(T, 0, 9, 4, 1.0)]


def test_resume_only_before_the_first_observation_and_hanging_after_round_trips():
    watch = LsoWatch(stuck_after=3, hanging_after=20)
    assert watch.hanging_after == 20
    assert LsoWatch(stuck_after=3, txn_max_timeout_ms=10_000, margin=1).hanging_after == 11
    watch.observe(0, {(T, 0): offs(1, 0)})
    with pytest.raises(ValueError, match="before the first observe"):
        watch.resume([], 1)
    again = LsoWatch.from_json(json.loads(json.dumps(watch.to_json())))
    assert again.hanging_after == 20 and classes(again.observe(20, {(T, 0): offs(1, 0)})) == {(T, 0): HANGING}
    with pytest.raises(ValueError, match="hanging_after"):
        LsoWatch(stuck_after=3, hanging_after=0)
