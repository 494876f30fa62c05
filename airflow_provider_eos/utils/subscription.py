"""The topics a pipeline reads, as the provider's Kafka reads name them."""

from __future__ import annotations

from typing import Any


def subscription_of(pipeline: Any) -> str | None:
    """A mirror's subscription regex when its definition names tables by pattern
    (``PipelineSpec.subscription``), else None. ``pipeline``: a definition or an app config
    (its ``topics`` and ``spec``); a spec that is no mirror is not loaded."""
    from spark_apps.eos_stream.records.spec import load_spec

    if not str(pipeline.spec).startswith("mirror:"):
        return None
    return load_spec(pipeline.spec).subscription(list(pipeline.topics))


def subscribed_topics(pipeline: Any) -> list[str]:
    """What a pipeline reads, for ``KafkaOffsetsHook``: its topics, and its subscription regex,
    which the hook expands at each request to the topics it matches then (created later too)."""
    pattern = subscription_of(pipeline)
    return list(pipeline.topics) if pattern is None else [*pipeline.topics, pattern]
