"""The Kafka connection's extras (librdkafka names) as kafka-python admin client options,
and the hook's find-hanging decision (partition side, then the coordinators) on a fake client."""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import pytest
from kafka import TopicPartition
from kafka.admin import PartitionProducerState, ProducerState, TransactionListing, TransactionState
from kafka.errors import TransactionalIdNotFoundError

from airflow_provider_eos.hooks import kafka_transactions
from airflow_provider_eos.hooks.kafka_admin_config import KafkaAdminConfigError, kafka_python_config
from airflow_provider_eos.hooks.kafka_transactions import KafkaTransactionsHook

SECRET = 's3cr"et-Pa55'
BOOT = {"bootstrap.servers": "b1:9093, b2:9093"}


def test_plaintext_and_ignored_librdkafka_settings():
    cfg = kafka_python_config({**BOOT, "group.id": "g", "client.id": "eos", "socket.timeout.ms": 5})
    assert cfg == {"bootstrap_servers": ["b1:9093", "b2:9093"], "client_id": "eos", "security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "scram-sha-512"])
@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
def test_sasl_with_username_and_password(protocol, mechanism):
    extra = {**BOOT, "security.protocol": protocol, "sasl.mechanism": mechanism,
             "sasl.username": "eos", "sasl.password": SECRET}
    if protocol == "SASL_SSL":
        extra["ssl.ca.location"] = "/etc/kafka/ca.pem"
    cfg = kafka_python_config(extra)
    assert cfg["security_protocol"] == protocol
    assert cfg["sasl_mechanism"] == mechanism.upper()
    assert (cfg["sasl_plain_username"], cfg["sasl_plain_password"]) == ("eos", SECRET)
    if protocol == "SASL_SSL":
        assert cfg["ssl_cafile"] == "/etc/kafka/ca.pem" and cfg["ssl_check_hostname"] is True
    else:
        assert "ssl_cafile" not in cfg and "ssl_check_hostname" not in cfg


def test_sasl_mechanisms_plural_is_librdkafkas_alias():
    cfg = kafka_python_config({**BOOT, "security.protocol": "sasl_ssl", "sasl.mechanisms": "SCRAM-SHA-256",
                               "sasl.username": "u", "sasl.password": SECRET})
    assert cfg["sasl_mechanism"] == "SCRAM-SHA-256" and cfg["security_protocol"] == "SASL_SSL"


def test_ssl_with_ca_client_certificate_and_key():
    cfg = kafka_python_config({**BOOT, "security.protocol": "SSL", "ssl.ca.location": "/p/ca.pem",
                               "ssl.certificate.location": "/p/client.pem", "ssl.key.location": "/p/client.key",
                               "ssl.key.password": SECRET, "ssl.endpoint.identification.algorithm": "none"})
    assert cfg == {
        "bootstrap_servers": ["b1:9093", "b2:9093"], "security_protocol": "SSL", "ssl_cafile": "/p/ca.pem",
        "ssl_certfile": "/p/client.pem", "ssl_keyfile": "/p/client.key", "ssl_password": SECRET,
        "ssl_check_hostname": False,
    }


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}, "sasl.mechanism=OAUTHBEARER"),
        ({"security.protocol": "SASL_SSL", "sasl.username": "u", "sasl.password": SECRET},
         "sasl.mechanism (unset: GSSAPI)"),
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u"}, "no sasl.password"),
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": SECRET,
          "sasl.oauthbearer.config": "x"}, "sasl.oauthbearer.config"),
        ({"security.protocol": "SSL", "ssl.keystore.location": "/p/ks.p12", "ssl.keystore.password": SECRET},
         "ssl.keystore.location, ssl.keystore.password"),
        ({"security.protocol": "SSL", "ssl.ca.pem": "-----BEGIN"}, "ssl.ca.pem"),
        ({"security.protocol": "SSL", "ssl.certificate.location": "/p/c.pem"}, "ssl.key.location"),
        ({"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "x"},
         "ssl.endpoint.identification.algorithm"),
        ({"security.protocol": "KERBEROS"}, "security.protocol=KERBEROS"),
        ({"sasl.username": "u", "sasl.password": SECRET}, "security.protocol=PLAINTEXT does not use SASL"),
        ({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "u",
          "sasl.password": SECRET, "ssl.ca.location": "/p/ca.pem"}, "ssl.ca.location given"),
        ({"bootstrap.servers": ""}, "no bootstrap.servers"),
    ],
)
def test_unsupported_security_settings_name_the_key_never_the_secret(extra, named):
    with pytest.raises(KafkaAdminConfigError) as err:
        kafka_python_config({**BOOT, **extra})
    assert named in str(err.value)
    assert SECRET not in str(err.value)


def test_unreachable_secured_cluster_fails_clearly_without_the_password(monkeypatch, caplog):
    """A real kafka-python client against a closed port: the error names the connection and the
    servers; neither it nor any log record (kafka-python's DEBUG included) holds the password."""
    extra = {"bootstrap.servers": "127.0.0.1:9", "security.protocol": "SASL_PLAINTEXT",
             "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "eos", "sasl.password": SECRET}
    monkeypatch.setenv("AIRFLOW_CONN_EOS_SASL_UNIT", json.dumps({"conn_type": "kafka", "extra": extra}))
    hook = KafkaTransactionsHook(kafka_config_id="eos_sasl_unit", request_timeout=1)
    # A deployment that turns kafka-python's logger up to DEBUG still sees no password.
    with caplog.at_level(logging.DEBUG, logger="kafka"), pytest.raises(Exception) as err:
        hook.describe_producers("t", 0)
    # The failed client's IO thread was stopped, not left behind.
    assert not [t for t in threading.enumerate() if t.name.startswith("kafka-io-")]
    assert "'eos_sasl_unit'" in str(err.value) and "127.0.0.1:9" in str(err.value)
    assert SECRET not in str(err.value)
    assert "Starting KafkaAdminClient with configuration: <redacted>" in caplog.text
    assert SECRET not in caplog.text


# ---------------------------------------------------------------- find-hanging on a fake admin client
T = "orders"


def _producer(pid: int, start: int, last_ts: int, epoch: int = 0, coordinator_epoch: int = -1) -> ProducerState:
    return ProducerState(producer_id=pid, producer_epoch=epoch, last_sequence=4, last_timestamp=last_ts,
                         coordinator_epoch=coordinator_epoch, current_transaction_start_offset=start)


class _FakeAdmin:
    """Partitions 0-2 of ``orders`` on broker 1; partition 2 also on broker 2."""

    def __init__(self, producers: dict[int, list[ProducerState]], listings: list[TransactionListing],
                 descriptions: dict[str, set[TopicPartition]]):
        self.producers, self.listings, self.descriptions = producers, listings, descriptions
        self.calls: list[tuple] = []

    def describe_topics(self, topics=None):
        self.calls.append(("describe_topics", topics))
        return [{"name": T, "error_code": 0, "partitions": [
            {"partition_index": 0, "replica_nodes": [1]}, {"partition_index": 1, "replica_nodes": [1]},
            {"partition_index": 2, "replica_nodes": [1, 2]}]}]

    def describe_producers(self, partitions, broker_id=None):
        self.calls.append(("describe_producers", sorted(partitions), broker_id))
        return {tp: PartitionProducerState(active_producers=self.producers.get(tp.partition, [])) for tp in partitions}

    def list_transactions(self, producer_id_filters=None):
        self.calls.append(("list_transactions", producer_id_filters))
        return {1: [t for t in self.listings if t.producer_id in producer_id_filters]}

    def describe_transactions(self, ids):
        [txn_id] = ids
        if txn_id not in self.descriptions:
            raise TransactionalIdNotFoundError(txn_id)
        return {txn_id: SimpleNamespace(coordinator_id=1, state=TransactionState.ONGOING, producer_id=0,
                                        producer_epoch=0, transaction_timeout_ms=60000,
                                        transaction_start_time_ms=1, topic_partitions=self.descriptions[txn_id])}

    def close(self):
        pass


def _hook_with(monkeypatch, fake: _FakeAdmin) -> KafkaTransactionsHook:
    from contextlib import contextmanager

    @contextmanager
    def admin_client(self):
        yield fake

    monkeypatch.setattr(KafkaTransactionsHook, "admin_client", admin_client)
    return KafkaTransactionsHook(kafka_config_id="k")


def test_find_hanging_is_partition_side_then_asks_the_coordinators(monkeypatch):
    now = int(kafka_transactions.time.time() * 1000)
    old, recent = now - 20 * 60_000, now - 60_000
    fake = _FakeAdmin(
        producers={
            0: [_producer(10, 100, old), _producer(11, -1, old)],  # 10: coordinator forgot it; 11: no txn
            1: [_producer(12, 200, old), _producer(13, 300, recent)],  # 12: coordinator still has it; 13: young
            2: [_producer(14, 400, old), _producer(15, 500, old)],  # 14: id unknown; 15: txn moved on
        },
        listings=[TransactionListing("t12", 12, TransactionState.ONGOING),
                  TransactionListing("t14", 14, TransactionState.ONGOING),
                  TransactionListing("t15", 15, TransactionState.ONGOING)],
        descriptions={"t12": {TopicPartition(T, 1)}, "t15": {TopicPartition("other", 0)}},
    )
    rows = _hook_with(monkeypatch, fake).find_hanging(topic=T)
    assert [(r["Partition"], r["ProducerId"], r["StartOffset"]) for r in rows] == [
        (0, 10, 100), (2, 14, 400), (2, 15, 500)]
    assert rows[0]["Topic"] == T and rows[0]["Duration(min)"] in (19, 20) and rows[0]["CoordinatorEpoch"] == -1
    # The coordinators are asked only about the candidates (open, older than the maximum timeout).
    assert ("list_transactions", [10, 12, 14, 15]) in fake.calls

    # --broker-id: only the partitions with a replica there, asked at that broker.
    fake.calls.clear()
    assert [r["ProducerId"] for r in _hook_with(monkeypatch, fake).find_hanging(broker_id=2)] == [14, 15]
    assert ("describe_producers", [TopicPartition(T, 2)], 2) in fake.calls

    # A longer maximum timeout: nothing is a candidate, no coordinator is asked.
    fake.calls.clear()
    assert _hook_with(monkeypatch, fake).find_hanging(topic=T, partition=0, max_transaction_timeout_minutes=30) == []
    assert [c[0] for c in fake.calls] == ["describe_producers"]


def test_find_hanging_needs_a_scope():
    hook = KafkaTransactionsHook(kafka_config_id="k")
    with pytest.raises(Exception, match="broker_id or topic"):
        hook.find_hanging()
    with pytest.raises(Exception, match="partition needs topic"):
        hook.find_hanging(broker_id=1, partition=0)


def test_a_partition_without_a_leader_yet_is_asked_again_with_a_new_client(monkeypatch):
    """A topic just created, or a leader election: DescribeProducers answers NotLeaderForPartition
    (retriable) and is asked again through a new client; an error that is not retriable fails at once."""
    from kafka.errors import NotLeaderForPartitionError, TopicAuthorizationFailedError

    from airflow_provider_eos.hooks.kafka_transactions import AirflowException

    fake = _FakeAdmin(producers={0: [_producer(10, 7, 1)]}, listings=[], descriptions={})
    answers: list[Exception | None] = [NotLeaderForPartitionError("no leader yet"), NotLeaderForPartitionError(), None]
    clients: list[int] = []
    real = fake.describe_producers

    def flaky(partitions, broker_id=None):
        error = answers.pop(0)
        if error is not None:
            raise error
        return real(partitions, broker_id)

    from contextlib import contextmanager

    @contextmanager
    def admin_client(self):
        clients.append(1)
        yield fake

    monkeypatch.setattr(fake, "describe_producers", flaky)
    monkeypatch.setattr(KafkaTransactionsHook, "admin_client", admin_client)
    monkeypatch.setattr(kafka_transactions, "LEADER_WAIT_SECONDS", 5.0)
    hook = KafkaTransactionsHook(kafka_config_id="k")
    assert [r["CurrentTransactionStartOffset"] for r in hook.describe_producers(T, 0)] == [7]
    assert len(clients) == 3 and answers == []

    answers[:] = [TopicAuthorizationFailedError("not allowed"), None]
    with pytest.raises(AirflowException, match=r"DescribeProducers of orders\[0\].*TopicAuthorizationFailed"):
        hook.describe_producers(T, 0)
    assert answers == [None]  # not asked again
