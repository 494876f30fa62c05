"""Kafka transactions on the real broker: what read_committed readers see, and HW vs LSO
as read by KafkaOffsetsHook."""

from __future__ import annotations

import re
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from airflow_provider_eos.hooks.kafka_offsets import (
    KafkaOffsetsHook,
    KafkaTopicNotFoundError,
    KafkaUnreachableError,
)
from tests.helpers.kafka import create_topic, delete_topics, kafka_conn_uri_env, wait_for_markers

pytestmark = pytest.mark.integration


@pytest.fixture
def topic(kafka_bootstrap, unique_name, monkeypatch):
    name = f"eos_txn_{unique_name}"
    create_topic(kafka_bootstrap, name, partitions=1)
    monkeypatch.setenv(*kafka_conn_uri_env("eos_txn_test", kafka_bootstrap))
    yield name
    delete_topics(kafka_bootstrap, name)


def _producer(bootstrap: str) -> Producer:
    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"eos-txn-test-{uuid.uuid4().hex[:8]}",
            "transaction.timeout.ms": 60_000,
        }
    )
    p.init_transactions(30)
    return p


def _read_committed(bootstrap: str, topic: str, settle: float = 2.0) -> list[bytes]:
    """All values a read_committed consumer can read from partition 0 right now."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"eos-txn-test-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    deadline = time.monotonic() + settle
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    break
                raise AssertionError(msg.error())
            values.append(msg.value())
    finally:
        consumer.close()
    return values


def _produce(p: Producer, topic: str, prefix: str, n: int = 3) -> None:
    for i in range(n):
        p.produce(topic, value=f"{prefix}-{i}".encode(), partition=0)
    assert p.flush(10) == 0


def test_read_committed_sees_only_committed_batches(kafka_bootstrap, topic):
    p = _producer(kafka_bootstrap)
    p.begin_transaction()
    _produce(p, topic, "committed")
    p.commit_transaction(30)

    p.begin_transaction()
    _produce(p, topic, "aborted")
    p.abort_transaction(30)

    p.begin_transaction()
    _produce(p, topic, "open")
    assert _read_committed(kafka_bootstrap, topic) == [b"committed-0", b"committed-1", b"committed-2"]

    p.commit_transaction(30)
    wait_for_markers(kafka_bootstrap, topic)
    assert _read_committed(kafka_bootstrap, topic) == [
        b"committed-0",
        b"committed-1",
        b"committed-2",
        b"open-0",
        b"open-1",
        b"open-2",
    ]


def test_hook_reads_hw_and_lso(kafka_bootstrap, topic):
    hook = KafkaOffsetsHook(kafka_config_id="eos_txn_test")
    key = (topic, 0)
    assert hook.partition_offsets([topic])[key].lag == 0

    p = _producer(kafka_bootstrap)
    p.begin_transaction()
    _produce(p, topic, "open")
    during = hook.partition_offsets([topic])[key]
    # 3 records written, nothing committed: LSO stays at the transaction's first offset.
    assert (during.high_watermark, during.last_stable, during.earliest) == (3, 0, 0)
    assert during.lag == 3

    p.commit_transaction(30)
    wait_for_markers(kafka_bootstrap, topic)
    after = hook.partition_offsets([topic])[key]
    # The commit marker takes offset 3.
    assert after.high_watermark == after.last_stable == 4

    p.begin_transaction()
    _produce(p, topic, "aborted", n=2)
    p.abort_transaction(30)
    wait_for_markers(kafka_bootstrap, topic)
    aborted = hook.partition_offsets([topic])[key]
    # Only aborted records + marker after the commit: HW == LSO even though records exist.
    assert aborted.high_watermark == aborted.last_stable == 7
    assert aborted.lag == 0


def test_hook_clear_errors(kafka_bootstrap, topic, unique_name, monkeypatch):
    hook = KafkaOffsetsHook(kafka_config_id="eos_txn_test")
    with pytest.raises(KafkaTopicNotFoundError, match=f"eos_missing_{unique_name}"):
        hook.partition_offsets([topic, f"eos_missing_{unique_name}"])

    monkeypatch.setenv(*kafka_conn_uri_env("eos_dead_kafka", "127.0.0.1:9"))
    dead = KafkaOffsetsHook(kafka_config_id="eos_dead_kafka", timeout=2)
    started = time.monotonic()
    with pytest.raises(KafkaUnreachableError, match=re.escape("127.0.0.1:9")):
        dead.partition_offsets([topic])
    assert time.monotonic() - started < 10
