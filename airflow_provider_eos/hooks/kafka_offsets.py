"""A hook that reads high watermarks, last stable offsets and retention starts."""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import cached_property
from typing import Any

from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook
from airflow.sdk.exceptions import AirflowException
from confluent_kafka import IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from airflow_provider_eos.utils.lso_watch import PartitionOffsets, TopicPartitionKey
from spark_apps.eos_stream.kafka.client_logs import with_python_logging
from spark_apps.eos_stream.kafka.metadata import TOPIC_NAME, expand_patterns, topic_metadata_problem

_UNREACHABLE_CODES = frozenset(
    {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE}
)
_RETRIABLE_CODES = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.OFFSET_NOT_AVAILABLE,
    }
)


class KafkaUnreachableError(AirflowException):
    """The Kafka cluster did not answer within the timeout."""


class KafkaTopicNotFoundError(AirflowException):
    """One of the requested topics does not exist."""


class KafkaOffsetsHook(KafkaBaseHook):
    """
    Reads per-partition offsets with the Kafka Admin API (``ListOffsets``).

    For all partitions of all requested topics it sends one ``ListOffsets`` request
    per isolation level: ``latest`` with ``READ_UNCOMMITTED`` is the high watermark,
    ``latest`` with ``READ_COMMITTED`` is the last stable offset, and (optionally)
    ``earliest`` is the retention start. It does not use
    ``Consumer.get_watermark_offsets``: librdkafka consumers default to
    ``isolation.level=read_committed``, in which case that call returns the LSO as
    the "high" offset.

    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
        (librdkafka settings in the extra JSON, ``bootstrap.servers`` required).
    :param timeout: seconds to wait for the metadata and each ``ListOffsets`` request.
    """

    def __init__(self, kafka_config_id: str = KafkaBaseHook.default_conn_name, timeout: float = 10.0) -> None:
        super().__init__(kafka_config_id=kafka_config_id)
        self.timeout = timeout

    @cached_property
    def config(self) -> dict[str, Any]:
        return self._build_config()

    @property
    def bootstrap_servers(self) -> str:
        return str(self.config.get("bootstrap.servers", ""))

    @cached_property
    def admin_client(self) -> AdminClient:
        return self._get_client(with_python_logging(self.config))

    def get_admin_client(self) -> AdminClient:
        """The AdminClient, built once from the connection config."""
        return self.admin_client

    # ------------------------------------------------------------------ metadata
    def list_partitions(self, topics: Iterable[str]) -> list[TopicPartitionKey]:
        """
        The current partitions of ``topics`` from cluster metadata (so partitions added
        since the last call appear). An entry that cannot be a topic name (Kafka allows only
        letters, digits, ``.``, ``_`` and ``-``) is a subscription regex, a mirror's pattern
        (``PipelineSpec.subscription``): it stands for every topic it matches in full now,
        none included.

        :raises KafkaUnreachableError: when the cluster does not answer in time.
        :raises KafkaTopicNotFoundError: when a topic does not exist.
        :raises KafkaUnreachableError: also when a topic exists but has no leader right now.
        """
        topics = list(dict.fromkeys(topics))
        if not topics:
            raise ValueError("at least one topic is required")
        admin = self.get_admin_client()
        try:
            metadata = admin.list_topics(timeout=self.timeout)
        except KafkaException as err:
            raise self._unreachable(err) from err
        missing: list[str] = []
        result: list[TopicPartitionKey] = []
        for topic in expand_patterns(topics, metadata.topics):
            meta = metadata.topics.get(topic)
            problem = topic_metadata_problem(meta)
            if problem == "missing":
                missing.append(topic)
                continue
            if problem is not None or meta is None:
                # E.g. LEADER_NOT_AVAILABLE during a leader election: the topic exists.
                raise KafkaUnreachableError(
                    f"Kafka topic {topic!r} on {self.bootstrap_servers} is temporarily unavailable ({problem}); "
                    "it exists, but no broker serves it right now: retry")
            result.extend((topic, p) for p in sorted(meta.partitions))
        if missing:
            raise KafkaTopicNotFoundError(
                f"Kafka topic(s) {', '.join(repr(t) for t in missing)} do not exist on "
                f"{self.bootstrap_servers} (connection {self.kafka_config_id!r})"
            )
        return result

    def resolve_topics(self, topics: Iterable[str]) -> list[str]:
        """``topics`` with each subscription regex replaced by the topics it matches now."""
        topics = list(dict.fromkeys(topics))
        if all(TOPIC_NAME.fullmatch(t) for t in topics):
            return topics
        try:
            metadata = self.get_admin_client().list_topics(timeout=self.timeout)
        except KafkaException as err:
            raise self._unreachable(err) from err
        return expand_patterns(topics, metadata.topics)

    # ------------------------------------------------------------------ offsets
    def partition_offsets(
        self, topics: Iterable[str], include_earliest: bool = True
    ) -> dict[TopicPartitionKey, PartitionOffsets]:
        """
        High watermark, last stable offset and (optionally) earliest offset of every
        partition of ``topics``.

        :param topics: topic names, or subscription regexes (``list_partitions``).
        :param include_earliest: also read the retention start (a third request);
            the LSO lag does not need it.
        :return: ``{(topic, partition): PartitionOffsets}``
        """
        keys = self.list_partitions(topics)
        hw = self._list_offsets(keys, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED)
        lso = self._list_offsets(keys, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED)
        earliest = (
            self._list_offsets(keys, OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED) if include_earliest else {}
        )
        return {
            key: PartitionOffsets(high_watermark=hw[key], last_stable=lso[key], earliest=earliest.get(key))
            for key in keys
        }

    def _list_offsets(
        self, keys: list[TopicPartitionKey], spec: OffsetSpec, isolation: IsolationLevel
    ) -> dict[TopicPartitionKey, int]:
        """One ``ListOffsets`` request for all ``keys``; partitions that fail with a
        retriable error (e.g. no leader yet for a topic just created) are asked again
        until ``timeout``."""
        out: dict[TopicPartitionKey, int] = {}
        pending = list(keys)
        deadline = time.monotonic() + self.timeout
        admin = self.get_admin_client()
        while pending:
            request = {TopicPartition(topic, partition): spec for topic, partition in pending}
            futures = admin.list_offsets(request, isolation_level=isolation, request_timeout=self.timeout)
            retry: list[TopicPartitionKey] = []
            for tp, future in futures.items():
                key = (tp.topic, tp.partition)
                try:
                    out[key] = int(future.result(timeout=self.timeout + 5).offset)
                except TimeoutError as err:
                    raise self._unreachable(err, "ListOffsets request") from err
                except KafkaException as err:
                    kerr = err.args[0] if err.args else None
                    if not isinstance(kerr, KafkaError):
                        raise
                    what = f"ListOffsets({isolation.name}) for {tp.topic}[{tp.partition}]"
                    if kerr.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise KafkaTopicNotFoundError(
                            f"Kafka partition {tp.topic}[{tp.partition}] does not exist on {self.bootstrap_servers!r}"
                        ) from err
                    if kerr.code() in _UNREACHABLE_CODES:
                        raise self._unreachable(err, what) from err
                    if kerr.retriable() or kerr.code() in _RETRIABLE_CODES:
                        if time.monotonic() < deadline:
                            retry.append(key)
                            continue
                        raise self._unreachable(err, what) from err
                    raise AirflowException(f"Kafka {what} failed on {self.bootstrap_servers!r}: {kerr}") from err
            pending = retry
            if pending:
                time.sleep(0.1)
        return out

    def _unreachable(self, err: BaseException, what: str = "metadata request") -> AirflowException:
        # Drop the client so librdkafka stops reconnecting in the background once it is collected.
        self.close()
        return KafkaUnreachableError(
            f"Kafka {what} failed for bootstrap servers {self.bootstrap_servers!r} "
            f"(connection {self.kafka_config_id!r}, timeout {self.timeout:g}s): {err}"
        )

    def close(self) -> None:
        """Drop the AdminClient (librdkafka handles are freed on garbage collection)."""
        self.__dict__.pop("admin_client", None)
