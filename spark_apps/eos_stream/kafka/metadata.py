"""Reading Kafka's topic metadata: a topic that is missing is not one that is unavailable."""

from __future__ import annotations

from confluent_kafka import KafkaError


def topic_metadata_problem(found: object | None) -> str | None:
    """What is wrong with one topic's entry in ``list_topics`` metadata: None (usable),
    ``"missing"`` (absent, or the broker answered UNKNOWN_TOPIC_OR_PART), or the
    name of any other topic-level error, e.g. ``LEADER_NOT_AVAILABLE`` while a
    leader is elected. Only ``missing`` means the topic does not exist; the others
    are transient and must not be reported as a missing topic."""
    if found is None:
        return "missing"
    error = getattr(found, "error", None)
    if error is None:
        return None
    if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        return "missing"
    return str(error.name() or error.code())
