"""Whether Kafka still holds everything a replay from stored offsets needs: retention gaps and
compacted topics refuse a replay (and a restore that would need one) before anything is written."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from airflow.sdk.exceptions import AirflowException

from spark_apps.eos_stream.kafka.offsets import to_nested


class RetentionGapError(AirflowException):
    """Kafka no longer holds (part of) what a replay needs: replaying would lose data silently."""


class CompactedTopicError(AirflowException):
    """A topic is compacted: Kafka no longer holds every record, so no replay from offsets is exact."""


@dataclass
class RetentionGap:
    """A partition whose replay start is no longer (or not yet) in Kafka."""

    topic: str
    partition: int
    needed: int
    earliest: int
    log_end: int

    @property
    def missing(self) -> int:
        return self.earliest - self.needed if self.needed < self.earliest else self.needed - self.log_end

    def describe(self) -> str:
        if self.log_end < 0:
            return f"{self.topic}[{self.partition}]: partition no longer exists in Kafka (replay needs {self.needed})"
        if self.needed < self.earliest:
            return (f"{self.topic}[{self.partition}]: replay needs offset {self.needed} but the log starts at "
                    f"{self.earliest} ({self.missing} records deleted by retention)")
        return (f"{self.topic}[{self.partition}]: replay starts at {self.needed}, beyond the log end "
                f"{self.log_end} (topic recreated or truncated?)")


def retention_gaps(
    needed: dict[tuple[str, int], int], kafka: dict[tuple[str, int], Any]
) -> list[RetentionGap]:
    """Partitions a replay from ``needed`` cannot read in full.

    :param needed: ``{(topic, partition): next_offset}`` of the replay point; a
        partition of the topics absent here starts at 0.
    :param kafka: ``{(topic, partition): PartitionOffsets}`` (``earliest`` and
        ``high_watermark`` are used).
    """
    gaps = []
    for key in sorted(kafka):
        offsets = kafka[key]
        want = needed.get(key, 0)
        earliest = int(offsets.earliest or 0)
        end = int(offsets.high_watermark)
        if want < earliest or want > end:
            gaps.append(RetentionGap(key[0], key[1], want, earliest, end))
    for key in sorted(set(needed) - set(kafka)):
        gaps.append(RetentionGap(key[0], key[1], needed[key], 0, -1))
    return gaps


def kafka_offsets(kafka_config_id: str, topics: list[str]) -> dict[tuple[str, int], Any]:
    """Each partition's earliest and last stable offset, through the Kafka connection."""
    from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook

    hook = KafkaOffsetsHook(kafka_config_id=kafka_config_id)
    try:
        return hook.partition_offsets(topics, include_earliest=True)
    finally:
        hook.close()


def check_retention(kafka_config_id: str, needed: dict[tuple[str, int], int], topics: list[str],
                    what: str) -> dict[str, Any]:
    """Raises RetentionGapError naming every partition Kafka cannot replay in full, and
    CompactedTopicError when a topic is compacted (Kafka cannot give back every record).

    Offsets stored for topics no longer in the definition (a topic removed from it) are
    not needed: nothing replays them, their rows stay as they are (``retired_topics``).
    ``topics`` may hold a mirror's subscription regex (``subscribed_topics``): the topics it
    matches now are the pipeline's."""
    from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
    from spark_apps.eos_stream.audit.rules import retired_topics
    from spark_apps.eos_stream.run import preflight
    from spark_apps.eos_stream.run.config import ConfigError

    hook = KafkaOffsetsHook(kafka_config_id=kafka_config_id)
    topics = hook.resolve_topics(topics)  # a mirror's pattern: the topics it matches now
    retired = {tp: needed[tp] for tp in retired_topics(topics, needed)}
    needed = {tp: o for tp, o in needed.items() if tp not in retired}
    kafka = kafka_offsets(kafka_config_id, topics)  # first: a missing topic gets its own clear error
    try:
        preflight.refuse_compacted(hook.get_admin_client(), topics, "replay")
    except ConfigError as exc:
        raise CompactedTopicError(str(exc)) from exc
    finally:
        hook.close()
    gaps = retention_gaps(needed, kafka)
    report = {
        "retired_topics": to_nested(retired),
        "needed": to_nested(needed),
        "earliest": to_nested({k: int(v.earliest or 0) for k, v in kafka.items()}),
        "last_stable": to_nested({k: v.last_stable for k, v in kafka.items()}),
        "records_to_replay": sum(max(0, v.last_stable - needed.get(k, 0)) for k, v in kafka.items()),
        "gaps": [asdict(g) | {"missing": g.missing} for g in gaps],
    }
    if gaps:
        raise RetentionGapError(
            f"cannot replay {what}: Kafka no longer holds what it needs, a replay would lose data silently. "
            + "; ".join(g.describe() for g in gaps)
        )
    return report
