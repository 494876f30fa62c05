"""The topics a pipeline reads, as the provider's Kafka reads name them."""

from __future__ import annotations

from typing import Any


def subscribed_topics(pipeline: Any) -> list[str]:
    """What a pipeline (a definition or an app config: its ``topics`` and ``spec``) reads, for
    the hook: its topics, and a mirror's subscription regex when its definition names tables by
    pattern (``PipelineSpec.subscription``), which the hook expands at each request to the
    topics it matches then, ones created later included."""
    from spark_apps.eos_stream.records.spec import load_spec

    topics = list(pipeline.topics)
    pattern = load_spec(pipeline.spec).subscription(topics) if str(pipeline.spec).startswith("mirror:") else None
    return topics if pattern is None else [*topics, pattern]
