"""A Kafka partition as every part of the app and the provider names it."""

from __future__ import annotations

# (topic, partition): the key of every per-partition offset map.
TopicPartition = tuple[str, int]
