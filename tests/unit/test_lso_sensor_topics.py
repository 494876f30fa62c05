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
        # A mirror's subscription regex is one entry, commas and all (topic names have none).
        (["shop.shop.customers", r"shop\.shop\.t_[a-z]{1,3}"], ["shop.shop.customers", r"shop\.shop\.t_[a-z]{1,3}"]),
        (r"shop\.(a|b),c", [r"shop\.(a|b),c"]),
    ],
)
def test_topic_list_flattens_rendered_values(topics: object, expected: list[str]) -> None:
    sensor = LastStableOffsetLagSensor(task_id="t", topics=topics)  # type: ignore[arg-type]
    assert sensor.topic_list() == expected


def test_the_caught_up_sensor_reads_topics_the_same_way() -> None:
    from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor

    sensor = StreamCaughtUpSensor(task_id="t", pipeline="p", topics=["a, b", r"x\.y{1,2}"])
    assert sensor._topics() == ["a", "b", r"x\.y{1,2}"]
