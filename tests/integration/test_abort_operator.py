"""HangingTransactionsOperator against the real broker: it only reports unless confirmed,
and with confirm_abort=True it aborts the transaction so the LSO reaches the HW. All of it
through kafka-python's admin client: no child process (no ``java``) is started."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.operators.hanging_transactions import HangingTransactionsOperator
from tests.helpers.kafka import (
    create_topic,
    delete_topics,
    kafka_conn_uri_env,
    open_transaction,
    python_admin_only,
)

pytestmark = pytest.mark.integration

CONN_ID = "eos_abort_test"


@pytest.fixture
def topic(kafka_bootstrap, unique_name, monkeypatch, stack):
    name = f"eos_abort_{unique_name}"
    create_topic(kafka_bootstrap, name, partitions=1)
    monkeypatch.setenv(*kafka_conn_uri_env(CONN_ID, kafka_bootstrap))
    yield name
    delete_topics(kafka_bootstrap, name)


def test_abort_only_with_confirmation(kafka_bootstrap, topic):
    hook = KafkaOffsetsHook(kafka_config_id=CONN_ID)
    key = (topic, 0)
    # 600 s is below the broker's transaction.max.timeout.ms (900 s), so the coordinator
    # would abort it only after the test is long over.
    with open_transaction(kafka_bootstrap, topic, partition=0, count=4, txn_timeout_ms=600_000):
        pass
    before = hook.partition_offsets([topic])[key]
    assert (before.high_watermark, before.last_stable) == (4, 0)

    [broker_id] = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).brokers
    with python_admin_only() as seen:
        described = HangingTransactionsOperator(
            task_id="describe", action="describe-producers", kafka_config_id=CONN_ID, topic=topic, partition=0
        ).execute({})
        open_rows = [r for r in described["rows"] if r["CurrentTransactionStartOffset"] is not None]
        assert len(open_rows) == 1, described
        assert set(open_rows[0]) == {"ProducerId", "ProducerEpoch", "LatestCoordinatorEpoch", "LastSequence",
                                     "LastTimestamp", "CurrentTransactionStartOffset"}
        start_offset = open_rows[0]["CurrentTransactionStartOffset"]
        assert start_offset == 0

        # Not a hanging transaction yet: its coordinator still knows it.
        found = HangingTransactionsOperator(
            task_id="find", action="find-hanging", kafka_config_id=CONN_ID, topic=topic, partition=0
        ).execute({})
        assert found["rows"] == [] and found["aborted"] == []
        # Partition side, with no age limit, it is a candidate; its coordinator still has it open
        # on this partition, so it is not hanging either.
        found_any_age = HangingTransactionsOperator(
            task_id="find_any_age", action="find-hanging", kafka_config_id=CONN_ID, topic=topic,
            max_transaction_timeout_minutes=0,
        ).execute({})
        assert found_any_age["rows"] == [] and found_any_age["would_abort"] == []
        # The same over every partition with a replica on the broker (asked there): other tests'
        # transactions may show up on this shared broker, never this one.
        by_broker = HangingTransactionsOperator(
            task_id="find_on_broker", action="find-hanging", kafka_config_id=CONN_ID, broker_id=broker_id,
            max_transaction_timeout_minutes=0,
        ).execute({})
        assert [r for r in by_broker["rows"] if r["Topic"] == topic] == [] and by_broker["aborted"] == []

        report = HangingTransactionsOperator(
            task_id="abort_unconfirmed",
            action="abort",
            kafka_config_id=CONN_ID,
            topic=topic,
            partition=0,
            start_offset=start_offset,
        ).execute({})
        assert report["aborted"] == []
        assert report["would_abort"] == [{"topic": topic, "partition": 0, "start_offset": start_offset}]
        assert hook.partition_offsets([topic])[key].last_stable == 0  # untouched

        done = HangingTransactionsOperator(
            task_id="abort_confirmed",
            action="abort",
            kafka_config_id=CONN_ID,
            topic=topic,
            partition=0,
            start_offset=start_offset,
            confirm_abort=True,
        ).execute({})
        assert done["aborted"] == [{"topic": topic, "partition": 0, "start_offset": start_offset}]
        after = hook.partition_offsets([topic])[key]
        assert after.lag == 0
        assert after.last_stable == after.high_watermark == 5  # 4 records + abort marker
    assert seen["spawn_attempts"] == [] and seen["admin_clients"] == 11


def test_abort_of_unknown_transaction_fails_clearly(kafka_bootstrap, topic):
    op = HangingTransactionsOperator(
        task_id="abort_nothing",
        action="abort",
        kafka_config_id=CONN_ID,
        topic=topic,
        partition=0,
        start_offset=0,
        confirm_abort=True,
    )
    with pytest.raises(Exception, match="Could not find any open transactions"):
        op.execute({})


def test_sasl_settings_reach_the_python_admin_client_only(monkeypatch):
    """The connection's SASL settings (librdkafka names) become the kafka-python client's
    options, the password unchanged; nothing runs in a child process, so no secret can be on a
    command line (checked with a stand-in for kafka-python's KafkaAdminClient)."""
    import json

    import kafka
    from kafka.admin import PartitionProducerState, ProducerState

    started: list[dict] = []

    class _Admin:
        def __init__(self, **configs):
            started.append(configs)

        def describe_producers(self, partitions, broker_id=None):
            return {tp: PartitionProducerState(active_producers=[ProducerState(7, 0, 3, 1700000000000, -1, 42)])
                    for tp in partitions}

        def close(self):
            started.append({"closed": True})

    monkeypatch.setattr(kafka, "KafkaAdminClient", _Admin)
    extra = {
        "bootstrap.servers": "broker.example:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "eos",
        "sasl.password": 's3cr"et',
    }
    monkeypatch.setenv("AIRFLOW_CONN_EOS_SASL_TEST", json.dumps({"conn_type": "kafka", "extra": extra}))
    with python_admin_only() as seen:
        result = HangingTransactionsOperator(
            task_id="describe_sasl", action="describe-producers", kafka_config_id="eos_sasl_test", topic="t",
            partition=3,
        ).execute({})
    assert result["rows"] == [{"ProducerId": 7, "ProducerEpoch": 0, "LatestCoordinatorEpoch": -1, "LastSequence": 3,
                               "LastTimestamp": 1700000000000, "CurrentTransactionStartOffset": 42}]
    assert seen["spawn_attempts"] == []
    config, closed = started
    assert closed == {"closed": True}
    assert config["bootstrap_servers"] == ["broker.example:9093"]
    assert config["security_protocol"] == "SASL_SSL" and config["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (config["sasl_plain_username"], config["sasl_plain_password"]) == ("eos", 's3cr"et')
    assert config["ssl_check_hostname"] is True
