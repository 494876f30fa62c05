"""The replay engine a recovery takes: ``auto`` by the records to replay against the threshold."""

from __future__ import annotations

import pytest

from airflow_provider_eos.utils.replay_engine import DEFAULT_DIRECT_MAX_RECORDS, choose_replay_engine


@pytest.mark.parametrize(("records", "threshold", "engine"), [
    (0, 0, "direct"),  # nothing to replay: nothing to start a cluster for
    (1, 0, "spark"),  # 0 means always spark for a replay that has records
    (20_000, DEFAULT_DIRECT_MAX_RECORDS, "direct"),
    (DEFAULT_DIRECT_MAX_RECORDS, DEFAULT_DIRECT_MAX_RECORDS, "direct"),  # "at most": the bound is direct's
    (DEFAULT_DIRECT_MAX_RECORDS + 1, DEFAULT_DIRECT_MAX_RECORDS, "spark"),
    (None, DEFAULT_DIRECT_MAX_RECORDS, "spark"),  # unknown: the engine that is never badly wrong
])
def test_auto_chooses_by_the_records_to_replay(records, threshold, engine) -> None:
    choice = choose_replay_engine("auto", records, threshold)
    assert choice.engine == engine
    assert choice.as_dict() == {"engine": engine, "asked": "auto", "records_to_replay": records,
                                "direct_max_records": threshold, "reason": choice.reason}
    assert (str(records) if records is not None else "unknown") in choice.reason


@pytest.mark.parametrize("asked", ["spark", "direct"])
def test_an_explicit_engine_is_taken_whatever_the_size(asked) -> None:
    for records in (0, 10**9, None):
        assert choose_replay_engine(asked, records, 100).engine == asked


def test_an_unknown_engine_or_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown replay engine 'flink'; choose one of auto, spark, direct"):
        choose_replay_engine("flink", 1, 1)
    with pytest.raises(ValueError, match="direct_max_records must be >= 0"):
        choose_replay_engine("auto", 1, -1)
