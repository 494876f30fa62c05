"""Hanging Kafka transactions (KIP-664) from Python: find them, describe a partition's
producers, abort one. No JVM: the hook speaks the Kafka protocol through kafka-python's
``KafkaAdminClient`` (``DescribeProducers``, ``ListTransactions``, ``DescribeTransactions``
and ``WriteTxnMarkers``); librdkafka (confluent-kafka) has none of these calls.

``find_hanging`` takes the **partition-side view**, as Kafka's own ``kafka-transactions.sh
find-hanging`` does: it asks each partition's leader (``DescribeProducers``) which producers
have a transaction open there for longer than the maximum transaction timeout, then asks the
coordinators whether they still know that transaction. One whose coordinator has forgotten it
(no transactional id for the producer id, an unknown transactional id, or a transaction that
no longer includes the partition) is hanging. kafka-python's own
``find_hanging_transactions`` only lists what the coordinators know and misses exactly that
case, so it is not used.

Credentials come only from the ``kafka`` connection's extra (librdkafka names), translated by
:func:`~airflow_provider_eos.hooks.kafka_admin_config.kafka_python_config`; no secret is logged or
put in an exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.kafka_admin_config import kafka_python_config

# Producers read per DescribeProducers request (Kafka's tool uses the same batch size).
DESCRIBE_BATCH = 500
# How long a DescribeProducers is asked again while Kafka answers with a retriable error: a
# partition without a leader yet (a topic just created) or in a leader election.
LEADER_WAIT_SECONDS = 15.0

class _RedactAdminConfig(logging.Filter):
    """kafka-python logs its whole configuration, password included, at DEBUG when an admin
    client starts: replace that record's arguments so no secret reaches a task log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Starting KafkaAdminClient with configuration"):
            record.args = ("<redacted>",)
        return True


_REDACT = _RedactAdminConfig()
logging.getLogger("kafka.admin.client").addFilter(_REDACT)
# kafka-python logs every connection and transport at INFO: a dozen lines per call in a task log.
# Unless a deployment configured its logger, only its warnings and errors are shown.
if logging.getLogger("kafka").level == logging.NOTSET:
    logging.getLogger("kafka").setLevel(logging.WARNING)


def _stop_partial(client: Any) -> None:
    """Stop what a ``KafkaAdminClient`` whose ``__init__`` failed had started (as its ``close``)."""
    for part, method in (("_client", "close"), ("_net", "stop")):
        try:
            getattr(getattr(client, part), method)()
        except Exception:  # best effort: the start's own error is what matters
            pass


def _producer_row(p: Any) -> dict[str, Any]:
    """A ``DescribeProducers`` entry, with the column names of Kafka's ``describe-producers``."""
    start = int(p.current_transaction_start_offset)
    return {
        "ProducerId": int(p.producer_id),
        "ProducerEpoch": int(p.producer_epoch),
        "LatestCoordinatorEpoch": int(p.coordinator_epoch),
        "LastSequence": int(p.last_sequence),
        "LastTimestamp": int(p.last_timestamp),
        "CurrentTransactionStartOffset": start if start >= 0 else None,
    }


def open_transaction_of(rows: list[dict[str, Any]], last_stable: int | None = None) -> dict[str, Any] | None:
    """
    The ``describe_producers`` row whose open transaction holds the partition's LSO back.

    The LSO is the first offset of the partition's oldest open transaction, so that is the
    producer whose ``CurrentTransactionStartOffset`` equals it; without ``last_stable`` (or if
    none equals it: the LSO moved since it was read) the open transaction that started first.

    :param rows: ``describe_producers`` rows.
    :param last_stable: the partition's LSO, if known.
    :return: the row, or None when no producer has an open transaction.
    """
    open_rows = [r for r in rows if isinstance(r.get("CurrentTransactionStartOffset"), int)]
    if not open_rows:
        return None
    exact = [r for r in open_rows if r["CurrentTransactionStartOffset"] == last_stable]
    return (exact or sorted(open_rows, key=lambda r: r["CurrentTransactionStartOffset"]))[0]


class KafkaTransactionsHook(KafkaBaseHook):
    """
    Finds, describes and aborts open Kafka transactions with kafka-python's admin client.

    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
        (``bootstrap.servers`` and security settings come from its extra, librdkafka names;
        see :func:`kafka_python_config`).
    :param request_timeout: seconds allowed to reach the cluster and for each request.
    """

    hook_name = "EOS Kafka transactions"

    def __init__(
        self,
        kafka_config_id: str = KafkaBaseHook.default_conn_name,
        *,
        request_timeout: float = 30.0,
    ) -> None:
        super().__init__(kafka_config_id=kafka_config_id)
        self.request_timeout = float(request_timeout)

    def client_config(self) -> dict[str, Any]:
        """The ``KafkaAdminClient`` options for this connection."""
        timeout_ms = max(1, int(self.request_timeout * 1000))
        return {
            **kafka_python_config(self._build_config()),
            "request_timeout_ms": timeout_ms,
            "bootstrap_timeout_ms": timeout_ms,
        }

    def _failure(self, what: str, err: Exception, servers: Any = None) -> AirflowException:
        where = f" ({','.join(servers)})" if servers else ""
        return AirflowException(
            f"Kafka {what} through connection {self.kafka_config_id!r}{where} failed: {type(err).__name__}: {err}"
        )

    def _producer_states(self, partitions: list[Any], broker_id: int | None, what: str) -> dict[Any, Any]:
        """``DescribeProducers`` of ``partitions``, asked again with a new client (whose metadata
        names the new leader) while Kafka's answer is a retriable error, for up to
        :data:`LEADER_WAIT_SECONDS`; any other error, or one that outlasts the wait, fails
        naming ``what``."""
        from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

        retrying = Retrying(
            retry=retry_if_exception(lambda err: bool(getattr(err, "retriable", False))),
            stop=stop_after_delay(LEADER_WAIT_SECONDS),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt, self.admin_client() as client:
                    return dict(client.describe_producers(partitions, broker_id=broker_id))
        except AirflowException:
            raise
        except Exception as err:
            raise self._failure(what, err) from err
        raise AssertionError("unreachable: tenacity reraises the last error")

    @contextmanager
    def admin_client(self) -> Iterator[Any]:
        """A connected ``kafka.KafkaAdminClient``, closed on exit."""
        from kafka import KafkaAdminClient

        config = self.client_config()
        # Created in two steps so that a client whose start fails (cluster unreachable, wrong
        # password) can still be stopped: kafka-python starts its IO thread before it bootstraps.
        client = KafkaAdminClient.__new__(KafkaAdminClient)
        try:
            client.__init__(**config)
        except Exception as err:
            _stop_partial(client)
            raise self._failure("admin client start", err, config["bootstrap_servers"]) from err
        try:
            yield client
        finally:
            client.close()

    # ---------------------------------------------------------------- describe
    def describe_producers(self, topic: str, partition: int, broker_id: int | None = None) -> list[dict[str, Any]]:
        """
        ``DescribeProducers`` on one partition (its leader, or replica ``broker_id``): its active
        producers as rows with Kafka's ``describe-producers`` columns (``ProducerId``,
        ``ProducerEpoch``, ``LatestCoordinatorEpoch``, ``LastSequence``, ``LastTimestamp``,
        ``CurrentTransactionStartOffset``: None when the producer has no open transaction).
        """
        from kafka import TopicPartition

        tp = TopicPartition(topic, int(partition))
        states = self._producer_states([tp], broker_id, f"DescribeProducers of {topic}[{partition}]")
        rows = [_producer_row(p) for p in states[tp].active_producers]
        self.log.info("Producers of %s[%s]: %s", topic, partition, rows)
        return rows

    def describe_transaction(self, transactional_id: str) -> dict[str, Any] | None:
        """
        ``DescribeTransactions`` at the id's coordinator, with Kafka's ``describe`` columns
        (``CoordinatorId``, ``TransactionalId``, ``ProducerId``, ``ProducerEpoch``,
        ``TransactionState``, ``TransactionTimeoutMs``, ``CurrentTransactionStartTimeMs``,
        ``TopicPartitions``: ``[(topic, partition), ...]``); None if the coordinator does not
        know the id.
        """
        with self.admin_client() as client:
            return self._describe_transaction(client, transactional_id)

    def _describe_transaction(self, client: Any, transactional_id: str) -> dict[str, Any] | None:
        from kafka.errors import TransactionalIdNotFoundError

        try:
            d = client.describe_transactions([transactional_id])[transactional_id]
        except TransactionalIdNotFoundError:
            return None
        except Exception as err:
            raise self._failure(f"DescribeTransactions of {transactional_id!r}", err) from err
        start = int(d.transaction_start_time_ms)
        return {
            "CoordinatorId": int(d.coordinator_id),
            "TransactionalId": transactional_id,
            "ProducerId": int(d.producer_id),
            "ProducerEpoch": int(d.producer_epoch),
            "TransactionState": d.state.value,
            "TransactionTimeoutMs": int(d.transaction_timeout_ms),
            "CurrentTransactionStartTimeMs": start if start >= 0 else None,
            "TopicPartitions": sorted((tp.topic, tp.partition) for tp in d.topic_partitions),
        }

    # ---------------------------------------------------------------- find-hanging
    def find_hanging(
        self,
        *,
        broker_id: int | None = None,
        topic: str | None = None,
        partition: int | None = None,
        max_transaction_timeout_minutes: int | None = None,
    ) -> list[dict[str, Any]]:
        """
        Transactions open on a partition for longer than ``max_transaction_timeout_minutes``
        (default 15: Kafka's ``transaction.max.timeout.ms``) that their coordinator no longer
        resolves, on the partitions of ``topic`` [``partition``] and/or with a replica on
        ``broker_id`` (asked there). Rows have the columns of Kafka's ``find-hanging``:
        ``Topic``, ``Partition``, ``ProducerId``, ``ProducerEpoch``, ``CoordinatorEpoch``,
        ``StartOffset``, ``LastTimestamp``, ``Duration(min)``.

        Partition side first: ``DescribeProducers`` on every partition in scope gives each
        open transaction and the time of its producer's last write there; one older than the
        maximum timeout is a candidate. Then the coordinators: ``ListTransactions`` filtered on
        the candidates' producer ids, and ``DescribeTransactions`` of their transactional ids.
        A candidate is hanging when no coordinator lists its producer id, its id is unknown,
        or the coordinator's transaction does not include the partition (it has completed, or
        a later one is running).
        """
        if broker_id is None and not topic:
            raise AirflowException("find-hanging needs broker_id or topic")
        if partition is not None and not topic:
            raise AirflowException("find-hanging's partition needs topic")
        max_ms = 60_000 * (15 if max_transaction_timeout_minutes is None else int(max_transaction_timeout_minutes))
        with self.admin_client() as client:
            partitions = self._partitions_in_scope(client, broker_id, topic, partition)
            candidates = self._candidates(partitions, broker_id, max_ms)
            hanging = self._unresolved(client, candidates) if candidates else []
        now_ms = int(time.time() * 1000)
        rows = [
            {
                "Topic": tp.topic,
                "Partition": tp.partition,
                "ProducerId": int(p.producer_id),
                "ProducerEpoch": int(p.producer_epoch),
                "CoordinatorEpoch": int(p.coordinator_epoch),
                "StartOffset": int(p.current_transaction_start_offset),
                "LastTimestamp": int(p.last_timestamp),
                "Duration(min)": (now_ms - int(p.last_timestamp)) // 60_000,
            }
            for tp, p in hanging
        ]
        self.log.info(
            "find-hanging on %d partition(s): %d open longer than %d min, %d hanging: %s",
            len(partitions), len(candidates), max_ms // 60_000, len(rows), rows,
        )
        return rows

    def _partitions_in_scope(
        self, client: Any, broker_id: int | None, topic: str | None, partition: int | None
    ) -> list[Any]:
        from kafka import TopicPartition

        if topic and partition is not None:
            return [TopicPartition(topic, int(partition))]
        try:
            described = client.describe_topics([topic] if topic else None)
        except Exception as err:
            raise self._failure("topic metadata", err) from err
        found = []
        for t in described:
            if t.get("error_code"):
                from kafka.errors import for_code

                raise self._failure(f"metadata of topic {t.get('name')!r}", for_code(t["error_code"])())
            for p in t.get("partitions", ()):
                if broker_id is None or int(broker_id) in p.get("replica_nodes", ()):
                    found.append(TopicPartition(t["name"], int(p["partition_index"])))
        return sorted(found)

    def _candidates(self, partitions: list[Any], broker_id: int | None, max_ms: int) -> list[Any]:
        """``(TopicPartition, ProducerState)`` of every transaction open on ``partitions`` whose
        producer last wrote there more than ``max_ms`` ago."""
        found = []
        for i in range(0, len(partitions), DESCRIBE_BATCH):
            batch = partitions[i : i + DESCRIBE_BATCH]
            states = self._producer_states(batch, broker_id, f"DescribeProducers of {len(batch)} partition(s)")
            now_ms = int(time.time() * 1000)
            for tp, state in states.items():
                for p in state.active_producers:
                    if p.current_transaction_start_offset >= 0 and now_ms - p.last_timestamp > max_ms:
                        found.append((tp, p))
        return found

    def _unresolved(self, client: Any, candidates: list[Any]) -> list[Any]:
        """The candidates whose coordinator does not know their transaction on that partition."""
        producer_ids = sorted({int(p.producer_id) for _, p in candidates})
        try:
            listings = client.list_transactions(producer_id_filters=producer_ids)
        except Exception as err:
            raise self._failure("ListTransactions", err) from err
        transactional_ids = {
            int(t.producer_id): t.transactional_id
            for per_broker in listings.values()
            for t in per_broker
            if int(t.producer_id) in producer_ids
        }
        descriptions = {
            txn_id: self._describe_transaction(client, txn_id) for txn_id in sorted(set(transactional_ids.values()))
        }
        hanging = []
        for tp, p in candidates:
            txn_id = transactional_ids.get(int(p.producer_id))
            description = descriptions.get(txn_id) if txn_id is not None else None
            if description is None or (tp.topic, tp.partition) not in description["TopicPartitions"]:
                hanging.append((tp, p))
        return hanging

    # ---------------------------------------------------------------- abort
    def abort(self, topic: str, partition: int, start_offset: int) -> dict[str, Any]:
        """
        Abort the transaction open on ``topic``/``partition`` that starts at ``start_offset``:
        ``DescribeProducers`` finds its producer id and epoch, then ``WriteTxnMarkers`` writes an
        abort marker at the partition's leader (the coordinator epoch is the producer's latest,
        or 0 when it has none yet, as Kafka's tool does).

        :return: the aborted producer's ``describe_producers`` row.
        :raises AirflowException: when no producer has an open transaction starting there.
        """
        from kafka import TopicPartition
        from kafka.admin import AbortTransactionSpec

        tp = TopicPartition(topic, int(partition))
        producers = self._producer_states([tp], None, f"DescribeProducers of {topic}[{partition}]")[tp].active_producers
        match = [p for p in producers if p.current_transaction_start_offset == int(start_offset)]
        if not match:
            starts = sorted(p.current_transaction_start_offset for p in producers)
            raise AirflowException(
                f"Could not find any open transactions starting at offset {start_offset} on partition "
                f"{topic}-{partition} (open ones start at {[s for s in starts if s >= 0]})"
            )
        p = match[0]
        spec = AbortTransactionSpec(
            topic_partition=tp,
            producer_id=int(p.producer_id),
            producer_epoch=int(p.producer_epoch),
            coordinator_epoch=max(0, int(p.coordinator_epoch)),
        )
        self.log.warning(
            "Aborting the transaction at %s[%s] starting at offset %s (producer id %s epoch %s)",
            topic, partition, start_offset, spec.producer_id, spec.producer_epoch,
        )
        with self.admin_client() as client:
            try:
                client.abort_transaction(spec)
            except Exception as err:
                raise self._failure(f"abort (WriteTxnMarkers) of {topic}[{partition}] at {start_offset}", err) from err
        return _producer_row(p)
