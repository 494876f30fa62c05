"""Lost data: a stored offset that Kafka no longer holds.

A pipeline's replay point is the next offset it stored for each partition. Two things make it
unreachable, and neither mends itself, so a run that meets one exits ``EXIT_DATA_LOST`` and the
supervisor fails the task without restarts:

* the stored offset is below the partition's log start: retention (or ``delete_records``)
  removed records the pipeline had not applied yet;
* the stored offset is above the partition's log end: the topic was deleted and recreated,
  and its offsets began again at 0.

The way out is ``eos offsets reset`` (``airflow_provider_eos.cli``; docs/streaming_app.md,
"Lost data"): it moves the stored offsets on purpose and records each skipped range as an
accepted gap, which the audit then reports instead of "missing".

Imports nothing but the standard library at module level: the provider reads ``EXIT_DATA_LOST``
and ``DATA_LOST_KIND`` from here without the app's database modules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spark_apps.eos_stream.kafka.metadata import KafkaUnavailable
from spark_apps.eos_stream.kafka.partitions import TopicPartition

# The app's exit when a stored offset is no longer in Kafka (the provider imports it).
EXIT_DATA_LOST = 4
# The ``kind`` of its ``EOS-ERROR`` event.
DATA_LOST_KIND = "data_lost"


def way_out(pipeline: str) -> str:
    """What to do, for the message: ``eos offsets reset`` moves the stored offsets, every delivery
    mode's replay point."""
    return ("Kafka no longer holds these records, so no restart can succeed. To skip them on purpose, with "
            f"the skipped ranges recorded for the audit: eos offsets reset {pipeline} --to earliest "
            "--reason \"...\" --yes (docs/streaming_app.md, 'Lost data')")


# What Spark's Kafka source or a Kafka client says when the offsets it must read are gone, mid-stream:
# Spark's KafkaIllegalStateException ("Some data may have been lost ...", error class
# KAFKA_DATA_LOSS), Kafka's OffsetOutOfRangeException, and the executors' own range read
# (``ranges._chunks``: "deleted by retention").
_SPARK_DATA_LOSS = re.compile(
    r"KafkaIllegalStateException|Some data may have been lost|KAFKA_DATA_LOSS|OffsetOutOfRange|"
    r"OFFSET_OUT_OF_RANGE|deleted by retention: the log starts above it")


@dataclass(frozen=True)
class LostPartition:
    """One partition whose stored offset Kafka no longer holds.

    :param log_start: the first offset Kafka still holds.
    :param log_end: the offset its next record gets (the high watermark).
    """

    topic: str
    partition: int
    stored: int
    log_start: int
    log_end: int

    @property
    def cause(self) -> str:
        if self.stored < self.log_start:
            return "records below the log start were deleted (retention or delete-records) before they were applied"
        return "the stored offset is past the log end: the topic was deleted and recreated"

    def describe(self) -> str:
        return (f"{self.topic}[{self.partition}]: stored offset {self.stored}, log start {self.log_start}, "
                f"log end {self.log_end} ({self.cause})")


class DataLost(RuntimeError):
    """Stored offsets Kafka no longer holds: fails the run with ``EXIT_DATA_LOST``."""

    def __init__(self, pipeline: str, lost: list[LostPartition]) -> None:
        self.pipeline, self.lost = pipeline, lost
        super().__init__(f"pipeline {pipeline!r} lost data: " + "; ".join(p.describe() for p in lost) +
                         ". " + way_out(pipeline))


def lost_partitions(stored: Mapping[TopicPartition, int],
                    bounds: Mapping[TopicPartition, tuple[int, int]]) -> list[LostPartition]:
    """The partitions of ``bounds`` whose stored offset lies outside ``[log start, log end]``.

    A partition never applied has no stored offset and reads from the earliest: not lost. A stored
    offset equal to the log end is the usual caught-up state; equal to the log start, nothing
    before it was needed."""
    lost = []
    for (topic, partition), (start, end) in sorted(bounds.items()):
        offset = stored.get((topic, partition))
        if offset is not None and not start <= offset <= end:
            lost.append(LostPartition(topic, partition, offset, start, end))
    return lost


def log_bounds(bootstrap: str, options: Mapping[str, str], partitions: list[TopicPartition],
               timeout: float = 30.0) -> dict[TopicPartition, tuple[int, int]]:
    """(log start, high watermark) of each partition, from the brokers (``AdminClient.list_offsets``).

    :raises KafkaUnavailable: a broker could not give a partition's offsets, naming it and why.
        Retryable: the topic's metadata listed the partition, and a partition created moments
        ago is unknown to its leader for a while (UNKNOWN_TOPIC_OR_PART), as in a leader election.
    """
    from confluent_kafka import IsolationLevel, KafkaException
    from confluent_kafka import TopicPartition as KafkaPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    from spark_apps.eos_stream.kafka.client_logs import with_python_logging

    if not partitions:
        return {}
    admin = AdminClient(with_python_logging({"bootstrap.servers": bootstrap, **options}))
    found: dict[TopicPartition, list[int]] = {tp: [0, 0] for tp in partitions}
    for index, spec in enumerate((OffsetSpec.earliest(), OffsetSpec.latest())):
        futures = admin.list_offsets({KafkaPartition(t, p): spec for t, p in partitions},
                                     isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=timeout)
        for kafka_partition, future in futures.items():
            try:
                offset = future.result(timeout).offset
            except KafkaException as exc:
                raise KafkaUnavailable(
                    f"Kafka at {bootstrap} could not give the {('earliest', 'latest')[index]} offset of "
                    f"{kafka_partition.topic}[{kafka_partition.partition}]: {exc}; retried on the next start "
                    "(a partition created moments ago is unknown to its leader for a while)") from exc
            found[(kafka_partition.topic, kafka_partition.partition)][index] = offset
    return {tp: (start, end) for tp, (start, end) in found.items()}


def check_stored_offsets(pipeline: str, bootstrap: str, options: Mapping[str, str],
                         stored: Mapping[TopicPartition, int],
                         partitions: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
    """Raises DataLost when a stored offset of ``partitions`` is outside Kafka's log; returns
    the logs' bounds (``log_bounds``)."""
    bounds = log_bounds(bootstrap, options, partitions)
    lost = lost_partitions(stored, bounds)
    if lost:
        raise DataLost(pipeline, lost)
    return bounds


def is_spark_data_loss(texts: list[str] | tuple[Any, ...]) -> bool:
    """Whether a failure's texts (its message and its causes') say Kafka lost the records to read."""
    return any(_SPARK_DATA_LOSS.search(str(text)) for text in texts)
