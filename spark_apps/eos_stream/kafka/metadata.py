"""Reading Kafka's topic metadata: a topic that is missing is not one that is unavailable."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from confluent_kafka import KafkaError


class KafkaUnavailable(RuntimeError):
    """The brokers cannot be reached, or cannot serve a topic yet (retryable, unlike a ConfigError)."""


# What Kafka allows in a topic's name: anything else in a list of topics is a subscription regex.
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]+")


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


def matching_topics(names: Iterable[str], pattern: str | None, exclude: Collection[str] = ()) -> list[str]:
    """The names (a broker's topic list) a subscription regex (``PipelineSpec.subscription``)
    matches in full, sorted, but those in ``exclude``."""
    if pattern is None:
        return []
    regex = re.compile(pattern)
    return sorted(n for n in names if regex.fullmatch(n) and n not in exclude)


def expand_patterns(topics: Iterable[str], existing: Iterable[str]) -> list[str]:
    """``topics`` with each entry that is no topic name (a subscription regex) replaced by the
    ``existing`` topics it matches in full; each topic once, in order."""
    names = list(existing)
    expanded: list[str] = []
    for entry in topics:
        expanded += [entry] if TOPIC_NAME.fullmatch(entry) else matching_topics(names, entry)
    return list(dict.fromkeys(expanded))
