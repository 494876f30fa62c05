"""The LSO sensor accepts topics however a template renders them."""

from __future__ import annotations

import pytest

from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor


@pytest.mark.parametrize(
    ("topics", "expected"),
    [
        ("a", ["a"]),
        ("a, b", ["a", "b"]),
        (["a", "b"], ["a", "b"]),
        ([["a", "b"]], ["a", "b"]),  # a template rendered natively to a list, inside the list given
        (("a", ["b", "c,d"]), ["a", "b", "c", "d"]),
    ],
)
def test_topic_list_flattens_rendered_values(topics: object, expected: list[str]) -> None:
    sensor = LastStableOffsetLagSensor(task_id="t", topics=topics)  # type: ignore[arg-type]
    assert sensor.topic_list() == expected
