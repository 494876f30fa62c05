"""HangingTransactionsOperator against the real broker: it only reports unless confirmed,
and with confirm_abort=True it aborts the transaction so the LSO reaches the HW."""

from __future__ import annotations

import os

import pytest

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.operators.hanging_transactions import HangingTransactionsOperator
from tests.helpers.kafka import create_topic, delete_topics, kafka_conn_uri_env, open_transaction

pytestmark = pytest.mark.integration

CONN_ID = "eos_abort_test"


@pytest.fixture
def topic(kafka_bootstrap, unique_name, monkeypatch, stack):
    if not os.environ.get("EOS_KAFKA_TOOLS_CLASSPATH"):
        pytest.fail("EOS_KAFKA_TOOLS_CLASSPATH is not set by the stack")
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

    described = HangingTransactionsOperator(
        task_id="describe", action="describe-producers", kafka_config_id=CONN_ID, topic=topic, partition=0
    ).execute({})
    open_rows = [r for r in described["rows"] if r["CurrentTransactionStartOffset"] is not None]
    assert len(open_rows) == 1, described
    start_offset = open_rows[0]["CurrentTransactionStartOffset"]
    assert start_offset == 0

    # Not a hanging transaction yet: its coordinator still knows it.
    found = HangingTransactionsOperator(
        task_id="find", action="find-hanging", kafka_config_id=CONN_ID, topic=topic, partition=0
    ).execute({})
    assert found["rows"] == [] and found["aborted"] == []

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


def test_sasl_settings_go_to_a_private_command_config(tmp_path, monkeypatch):
    """No secret on the command line: SASL settings are written to a mode-600 properties
    file passed with --command-config (checked with a stand-in for kafka-transactions.sh)."""
    import json
    import stat

    seen = tmp_path / "seen.json"
    script = tmp_path / "kafka-transactions.sh"
    script.write_text(
        "#!/usr/bin/env python3\n"
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "cfg = args[args.index('--command-config') + 1]\n"
        "out = {'args': args, 'mode': os.stat(cfg).st_mode, 'props': open(cfg).read()}\n"
        f"json.dump(out, open({str(seen)!r}, 'w'))\n"
        "print('ProducerId\\tProducerEpoch\\tCurrentTransactionStartOffset\\t')\n"
        "print('7         \\t0            \\t42                           \\t')\n"
    )
    script.chmod(0o755)
    extra = {
        "bootstrap.servers": "broker.example:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "eos",
        "sasl.password": 's3cr"et',
    }
    monkeypatch.setenv("AIRFLOW_CONN_EOS_SASL_TEST", json.dumps({"conn_type": "kafka", "extra": extra}))
    result = HangingTransactionsOperator(
        task_id="describe_sasl",
        action="describe-producers",
        kafka_config_id="eos_sasl_test",
        topic="t",
        partition=3,
        kafka_transactions_script=str(script),
    ).execute({})
    assert result["rows"] == [{"ProducerId": 7, "ProducerEpoch": 0, "CurrentTransactionStartOffset": 42}]
    data = json.loads(seen.read_text())
    assert "s3cr" not in " ".join(data["args"])
    assert data["args"][:2] == ["--bootstrap-server", "broker.example:9093"]
    assert data["args"][-5:] == ["describe-producers", "--topic", "t", "--partition", "3"]
    assert stat.S_IMODE(data["mode"]) == 0o600
    assert "security.protocol=SASL_SSL" in data["props"]
    assert "sasl.mechanism=SCRAM-SHA-512" in data["props"]
    assert 'ScramLoginModule required username="eos" password="s3cr\\\\"et";' in data["props"]
