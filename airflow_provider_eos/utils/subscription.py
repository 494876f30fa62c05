"""The topics a pipeline reads, as the provider's Kafka reads name them."""

from __future__ import annotations

from typing import Any

from spark_apps.eos_stream.kafka.metadata import TOPIC_NAME


def subscription_of(pipeline: Any) -> str | None:
    """A mirror's subscription regex when its definition names tables by pattern
    (``PipelineSpec.subscription``), else None. ``pipeline``: a definition or an app config
    (its ``topics`` and ``mirror``); a Python spec is not loaded."""
    from spark_apps.eos_stream.records.spec import spec_of

    if getattr(pipeline, "mirror", None) is None:
        return None
    return spec_of(pipeline).subscription(list(pipeline.topics))


def subscribed_topics(pipeline: Any) -> list[str]:
    """What a pipeline reads, for ``KafkaOffsetsHook``: its topics, and its subscription regex,
    which the hook expands at each request to the topics it matches then (created later too)."""
    pattern = subscription_of(pipeline)
    return list(pipeline.topics) if pattern is None else [*pipeline.topics, pattern]


def topic_entries(topics: Any) -> list[str]:
    """A sensor's rendered ``topics`` as a flat list of entries (topic names and subscription
    regexes): a name, a comma-separated string of names, a regex, or lists of them."""
    pending, entries = [topics], []
    while pending:
        item = pending.pop(0)
        if isinstance(item, str):
            # Kafka's names have no comma: a string whose pieces are all names is a list of them,
            # any other (a subscription regex such as ``shop\.t{1,3}``) is one entry, commas included.
            pieces = [t.strip() for t in item.split(",") if t.strip()]
            entries += pieces if all(TOPIC_NAME.fullmatch(t) for t in pieces) else [item.strip()]
        else:
            pending[:0] = list(item)
    return entries
