"""Pure decisions behind issue 22 §4: a topic without a leader is not a missing topic, and
a server out of prepared-transaction slots fails with a message naming the setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError


def _topic(code: int | None) -> SimpleNamespace:
    """A ``TopicMetadata`` as ``AdminClient.list_topics`` returns it: an error (a real KafkaError) or None."""
    return SimpleNamespace(error=None if code is None else KafkaError(code), partitions={0: None, 1: None})


@pytest.mark.parametrize(("found", "expected"), [
    (None, "missing"),
    (_topic(KafkaError.UNKNOWN_TOPIC_OR_PART), "missing"),
    (_topic(None), None),
    (_topic(KafkaError.LEADER_NOT_AVAILABLE), "LEADER_NOT_AVAILABLE"),
    (_topic(KafkaError.NOT_LEADER_FOR_PARTITION), "NOT_LEADER_FOR_PARTITION"),
    (_topic(KafkaError.TOPIC_AUTHORIZATION_FAILED), "TOPIC_AUTHORIZATION_FAILED"),
])
def test_only_an_unknown_topic_is_missing(found, expected) -> None:
    from spark_apps.eos_stream.kafka.metadata import topic_metadata_problem

    assert topic_metadata_problem(found) == expected


def test_the_preflight_retries_a_topic_without_a_leader(monkeypatch) -> None:
    from spark_apps.eos_stream.run import preflight
    from spark_apps.eos_stream.run.config import ConfigError

    topics = {"led": _topic(KafkaError.LEADER_NOT_AVAILABLE), "gone": _topic(KafkaError.UNKNOWN_TOPIC_OR_PART),
              "ok": _topic(None)}

    class Admin:
        def __init__(self, conf: dict) -> None:
            pass

        def list_topics(self, timeout: float) -> SimpleNamespace:
            return SimpleNamespace(topics=topics)

    monkeypatch.setattr("confluent_kafka.admin.AdminClient", Admin)
    assert preflight.kafka_partitions("b:9092", ["ok"], {}) == {"ok": [0, 1]}
    with pytest.raises(preflight.KafkaUnavailable, match=r"'led' on b:9092 is temporarily unavailable "
                                                         r"\(LEADER_NOT_AVAILABLE\)"):
        preflight.kafka_partitions("b:9092", ["ok", "led"], {})
    with pytest.raises(ConfigError, match="'gone' does not exist"):
        preflight.kafka_partitions("b:9092", ["gone"], {})


class _PgError(Exception):
    def __init__(self, pgcode: str, pgerror: str) -> None:
        super().__init__(pgerror)
        self.pgcode, self.pgerror = pgcode, pgerror


@pytest.mark.parametrize(("code", "message"), [
    # PostgreSQL 15 twophase.c: ERRCODE_OUT_OF_MEMORY when every slot is taken ...
    ("53200", "ERROR:  maximum number of prepared transactions reached\nHINT:  Increase max_prepared_transactions "
              "(currently 2)."),
    # ... 53400 as issue 22 names it ...
    ("53400", "ERROR:  configuration limit exceeded"),
    # ... and ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE with max_prepared_transactions = 0.
    ("55000", "ERROR:  prepared transactions are disabled\nHINT:  Set max_prepared_transactions to a nonzero value."),
])
def test_no_prepared_transaction_slot_names_max_prepared_transactions(code, message) -> None:
    from spark_apps.eos_stream.sink.in_doubt import PreparedTransactionsExhausted, prepare_failure

    error = prepare_failure(_PgError(code, message), gid="eos:p:abc")
    assert isinstance(error, PreparedTransactionsExhausted)
    text = str(error)
    assert "max_prepared_transactions" in text and "pg_prepared_xacts" in text and f"SQLSTATE {code}" in text
    assert "eos:p:abc" in text and "HINT" not in text  # the first line of the server's message only


@pytest.mark.parametrize(("code", "message"), [
    ("53200", "ERROR:  out of memory"),  # 53200 for something else than the slots
    ("55000", "ERROR:  cannot PREPARE a transaction that has operated on temporary objects"),
    ("40001", "ERROR:  could not serialize access"),
    (None, "server closed the connection unexpectedly"),
])
def test_other_prepare_errors_are_left_alone(code, message) -> None:
    from spark_apps.eos_stream.sink.in_doubt import prepare_failure

    assert prepare_failure(_PgError(code, message)) is None
