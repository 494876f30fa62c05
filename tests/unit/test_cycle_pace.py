"""A whole mirror's continuous cycles take each partition's share of a backlog (``cycle_pace``)."""

from __future__ import annotations

from spark_apps.eos_stream.engines.cycle_pace import SHARE_SLACK, Pace, cycle_records, shares

CHANGES, OTHER, TX = ("app.public.t", 0), ("app.public.t", 1), ("app.transaction", 0)


def test_a_cycle_expects_what_its_byte_bound_holds_at_the_records_seen() -> None:
    assert cycle_records(50_000, 32 << 20, 0) == 50_000  # nothing seen yet: the record bound
    assert cycle_records(50_000, 32 << 20, 2_800) == 11_983
    assert cycle_records(50_000, 32 << 20, 100) == 50_000
    assert cycle_records(50_000, 10, 1e9) == 1


def test_shares_follow_the_lags_and_a_cycle_that_holds_them_all_is_not_paced() -> None:
    lags = {CHANGES: 172_000, OTHER: 172_000, TX: 133_000}
    limits = shares(lags, 12_000)
    assert limits is not None
    assert limits[CHANGES] == limits[OTHER] == 4_328 + SHARE_SLACK and limits[TX] == 3_346 + SHARE_SLACK
    led = shares(lags, 12_000, leading=TX[0])  # the transaction topic leads by LEAD
    assert led is not None and led[TX] == 4_183 + SHARE_SLACK and led[CHANGES] == limits[CHANGES]
    assert shares({CHANGES: 10, TX: 4}, 12_000) is None  # a stream that keeps up
    assert shares({CHANGES: 20_000, TX: 0}, 12_000) == {CHANGES: 12_000 + SHARE_SLACK, TX: SHARE_SLACK}


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
