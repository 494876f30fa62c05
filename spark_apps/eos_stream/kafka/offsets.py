"""Kafka offsets: one in-memory shape, one serialized shape, one converter.

In memory a set of offsets is ``{(topic, partition): offset}``. Wherever offsets leave a process
(JSON events, XCom, manifests, Spark's ``startingOffsets``, the audit's ``--goal``) they are
``{topic: {"partition": offset}}``: JSON object keys are strings, and Spark's Kafka source reads
exactly that shape. ``to_nested`` and ``from_nested`` are the only ways between the two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from spark_apps.eos_stream.kafka.partitions import TopicPartition

Offsets = dict[TopicPartition, int]
NestedOffsets = dict[str, dict[str, int]]


def to_nested(offsets: Mapping[TopicPartition, Any]) -> NestedOffsets:
    """``{(topic, partition): offset}`` as ``{topic: {"partition": offset}}``, partitions in order."""
    nested: NestedOffsets = {}
    for (topic, partition), offset in sorted(offsets.items()):
        nested.setdefault(str(topic), {})[str(int(partition))] = int(offset)
    return nested


def from_nested(nested: Mapping[str, Mapping[Any, Any]] | None) -> Offsets:
    """``{topic: {partition: offset}}`` (partition keys as JSON gives them, or ints) as
    ``{(topic, partition): offset}``; None is no offsets.

    :raises ValueError: a partition or an offset that is not a whole number."""
    return {(str(topic), int(partition)): int(offset)
            for topic, parts in (nested or {}).items() for partition, offset in parts.items()}


def to_json(offsets: Mapping[TopicPartition, Any]) -> str:
    """The nested shape as JSON with sorted keys (Spark's ``startingOffsets``, the app's events)."""
    return json.dumps(to_nested(offsets), sort_keys=True)
