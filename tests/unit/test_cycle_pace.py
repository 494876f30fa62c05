"""A whole mirror's continuous cycles take each partition's share of a backlog (``cycle_pace``)."""

from __future__ import annotations

from spark_apps.eos_stream.engines.cycle_pace import SHARE_SLACK, CycleBounds, Pace, shares

CHANGES, OTHER, TX = ("app.public.t", 0), ("app.public.t", 1), ("app.transaction", 0)


BOUNDS = CycleBounds(records=20_000, bytes=1 << 40)  # shares fill PACE_FILL of it: 18,000 records


def test_shares_follow_the_lags_and_a_cycle_that_holds_them_all_is_not_paced() -> None:
    lags = {CHANGES: 172_000, OTHER: 172_000, TX: 133_000}
    limits = shares(lags, BOUNDS, {})
    assert limits is not None
    assert limits[CHANGES] == limits[OTHER] == 6_491 + SHARE_SLACK and limits[TX] == 5_019 + SHARE_SLACK
    led = shares(lags, BOUNDS, {}, leading=TX[0])  # the transaction topic leads by a quarter of its share
    assert led is not None and led[CHANGES] == led[OTHER] == 6_039 + SHARE_SLACK and led[TX] == 5_924 + SHARE_SLACK
    assert sum(led.values()) - 3 * SHARE_SLACK in range(18_000, 18_003)
    assert shares({CHANGES: 10, TX: 4}, BOUNDS, {}) is None  # a stream that keeps up
    assert shares({CHANGES: 20_000, TX: 0}, BOUNDS, {}) == {CHANGES: 18_000 + SHARE_SLACK, TX: SHARE_SLACK}


def test_shares_fill_the_byte_bound_at_each_partition_s_record_size() -> None:
    lags = {CHANGES: 172_000, OTHER: 172_000, TX: 133_000}
    sizes = {CHANGES: 2_600.0, OTHER: 2_600.0, TX: 300.0}
    limits = shares(lags, CycleBounds(records=50_000, bytes=32 << 20), sizes)
    assert limits is not None and limits[CHANGES] == limits[OTHER]
    filled = sum((n - SHARE_SLACK) * sizes[tp] for tp, n in limits.items())
    assert 0.89 * (32 << 20) < filled <= 0.9 * (32 << 20) + 3 * 2_600  # each share rounded up
    assert shares(lags, CycleBounds(records=600_000, bytes=1 << 40), sizes) is None


def test_a_partition_past_its_share_is_refused_from_its_first_refused_record_on() -> None:
    pace = Pace({TX: 2, CHANGES: 3}, {TX: 100, CHANGES: 100})
    assert [pace.admits(TX, offset) for offset in (10, 11, 12)] == [True, True, False]
    assert pace.stopped_at == {TX: 12}
    assert pace.admits(CHANGES, 5) and pace.admits(CHANGES, 6)
    assert not pace.admits(TX, 13)  # every later record of it too: its range stays whole
    assert pace.stopped_at == {TX: 12} and pace.taken == {TX: 2, CHANGES: 2}
    assert pace.admits(OTHER, 0)  # a partition without a limit is not paced


def test_a_paced_cycle_is_filled_once_each_partition_gave_its_share_or_its_lag() -> None:
    pace = Pace({TX: 2, CHANGES: 3}, {TX: 100, CHANGES: 1})  # CHANGES has 1 record left
    assert not pace.filled()
    pace.admits(CHANGES, 0)
    pace.admits(TX, 0)
    assert not pace.filled()
    pace.admits(TX, 1)
    assert pace.filled()  # TX gave its share, CHANGES its whole lag


SMALL = CycleBounds(records=6_667, bytes=1 << 40)  # 6,000 records a cycle


def test_a_partition_that_ran_ahead_waits_until_the_others_are_level_with_it() -> None:
    spans = {CHANGES: 172_000, OTHER: 172_000, TX: 133_000}
    # CHANGES read 4,000 records further into its span than OTHER (their records held).
    lags = {CHANGES: 150_000, OTHER: 154_000, TX: 119_000}
    limits = shares(lags, SMALL, {}, spans=spans)
    assert limits is not None and limits[CHANGES] < limits[OTHER] - 3_000
    far = shares({CHANGES: 150_000, OTHER: 160_000, TX: 124_000}, SMALL, {}, spans=spans)
    assert far is not None and far[CHANGES] == SHARE_SLACK  # nothing until OTHER caught up
    # Level again, they move on together; a partition without a span takes its lag's part.
    level = shares({CHANGES: 150_000, OTHER: 150_000, TX: 116_000}, SMALL, {}, spans=spans)
    assert level is not None and level[CHANGES] == level[OTHER]
    assert shares({CHANGES: 100, OTHER: 50}, CycleBounds(records=150, bytes=1 << 40), {},
                  spans={CHANGES: 0, OTHER: 1_000}) == {CHANGES: 100 + SHARE_SLACK, OTHER: 35 + SHARE_SLACK}
