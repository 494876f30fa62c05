"""A mirror's subscription regex on the real broker: the driver's claim (``preflight.kafka_partitions``)
and the provider's Kafka reads (``KafkaOffsetsHook``: the sensors, the recovery's retention
checks) take every topic it matches when they run, a topic created later included, and no
other."""

from __future__ import annotations

import pytest

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from spark_apps.eos_stream.cdc.pipeline import mirror_spec
from spark_apps.eos_stream.run import preflight
from tests.helpers.kafka import create_topic, delete_topics, kafka_conn_uri_env

pytestmark = pytest.mark.integration

CONN_ID = "eos_pattern_topics"


def test_the_claim_and_the_hook_read_every_topic_the_subscription_matches_now(
        kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"pt{unique_name}"
    listed, first, later, other = (f"{prefix}.pub.x", f"{prefix}.inv.a", f"{prefix}.inv.b", f"{prefix}.pub.y")
    definition = {"topic_prefix": prefix, "tables": [
        {"source": "pub.x", "key": ["id"], "columns": {"id": "bigint"}}, {"source_pattern": "inv.*"}]}
    pattern = mirror_spec(definition).subscription([listed])
    assert pattern is not None
    monkeypatch.setenv(*kafka_conn_uri_env(CONN_ID, kafka_bootstrap))
    create_topic(kafka_bootstrap, listed)
    create_topic(kafka_bootstrap, first, partitions=2)
    create_topic(kafka_bootstrap, other)
    try:
        claimed = preflight.kafka_partitions(kafka_bootstrap, [listed], {}, pattern=pattern)
        assert claimed == {listed: [0], first: [0, 1]}
        hook = KafkaOffsetsHook(kafka_config_id=CONN_ID)
        assert sorted(hook.partition_offsets([listed, pattern])) == [(first, 0), (first, 1), (listed, 0)]
        create_topic(kafka_bootstrap, later)
        assert hook.resolve_topics([listed, pattern]) == [listed, first, later]
        assert sorted(hook.partition_offsets([listed, pattern], include_earliest=False)) == [
            (first, 0), (first, 1), (later, 0), (listed, 0)]
        assert preflight.kafka_partitions(kafka_bootstrap, [listed], {}, pattern=pattern) == {
            listed: [0], first: [0, 1], later: [0]}
        hook.close()
    finally:
        delete_topics(kafka_bootstrap, listed, first, later, other)
