"""What a recovery does with the topics it is given (pure, no broker): the offsets of a topic
removed from the definition are retired, not needed; a compacted topic is refused before
anything is restored; the audit's goal is read from what the template rendered."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from airflow_provider_eos.operators.audit import AuditOperator
from airflow_provider_eos.operators.replay import RetentionCheckOperator
from airflow_provider_eos.recovery.retention import CompactedTopicError
from airflow_provider_eos.utils.lso_watch import PartitionOffsets


class _Entry:
    def __init__(self, value: str) -> None:
        self.value = value


class _Admin:
    def __init__(self, policies: dict[str, str]) -> None:
        self.policies = policies

    def describe_configs(self, resources: list, request_timeout: float) -> dict:
        out = {}
        for resource in resources:
            future: Future = Future()
            future.set_result({"cleanup.policy": _Entry(self.policies[resource.name])})
            out[resource] = future
        return out


class _Hook:
    """KafkaOffsetsHook on a fake cluster: topic "t" (2 partitions, records from offset 0 to 10)."""

    policies: dict[str, str] = {"t": "delete"}

    def __init__(self, kafka_config_id: str = "kafka_default", timeout: float = 10.0) -> None:
        pass

    def get_admin_client(self) -> _Admin:
        return _Admin(self.policies)

    def resolve_topics(self, topics: list[str]) -> list[str]:
        return list(topics)  # names only here: no subscription regex

    def partition_offsets(self, topics: list[str], include_earliest: bool = False) -> dict:
        return {(t, p): PartitionOffsets(high_watermark=10, last_stable=10, earliest=0) for t in topics for p in (0, 1)}

    def close(self) -> None:
        pass


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> type[_Hook]:
    monkeypatch.setattr("airflow_provider_eos.hooks.kafka_offsets.KafkaOffsetsHook", _Hook)
    _Hook.policies = {"t": "delete"}
    return _Hook


def _check(needed: dict[tuple[str, int], int]) -> dict[str, Any]:
    return RetentionCheckOperator(task_id="retention", pipeline_config={}).check_retention(needed, ["t"], "replay")


def test_a_removed_topics_offsets_are_retired_not_a_retention_gap(hook: type[_Hook]) -> None:
    report = _check({("t", 0): 4, ("t", 1): 10, ("gone", 0): 7})
    assert report["gaps"] == [] and report["records_to_replay"] == 6
    assert report["retired_topics"] == {"gone": {"0": 7}}
    assert report["needed"] == {"t": {"0": 4, "1": 10}}


def test_a_compacted_topic_is_refused_before_anything_is_restored(hook: type[_Hook]) -> None:
    hook.policies = {"t": "compact,delete"}
    with pytest.raises(CompactedTopicError, match=r"replay refused: Kafka topic\(s\) \['t'\] have cleanup.policy"):
        _check({("t", 0): 4})


@pytest.mark.parametrize(("rendered", "goal"), [
    ({"t": {"0": 5, "1": 7}}, {("t", 0): 5, ("t", 1): 7}),  # native rendering
    ('{"t": {"0": 5}}', {("t", 0): 5}),  # a JSON string
    (None, None), ("None", None), ("", None),  # no replay XCom: no goal, everything up to the LSO demanded
])
def test_the_audit_reads_its_goal_from_what_the_template_rendered(rendered: Any, goal: Any) -> None:
    assert AuditOperator(task_id="audit", pipeline_config={}, goal_offsets=rendered).goal() == goal
