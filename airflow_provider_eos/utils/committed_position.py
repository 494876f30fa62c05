"""What a pipeline's target holds, as Kafka positions: the committed offsets per partition.

The app writes ``next_offset`` and ``batch_id`` per partition in the same transaction as the
batch's data, so a row read here is a promise: the target holds every committed record below
these offsets, exactly once. The asset watcher (:mod:`airflow_provider_eos.triggers.committed_offsets`)
turns each new position into an Asset event; this module is the pure part of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# {topic: {partition (str, as JSON keys are): next_offset}}
Offsets = dict[str, dict[str, int]]


def committed_position(pipeline: str, rows: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The payload of an Asset event from the offsets table's rows of one pipeline
    (``topic``, ``partition``, ``next_offset``, ``batch_id``); ``None`` before its first batch.

    ``batch_ids`` are the micro-batches that last wrote each partition (a partition idle for a
    while keeps an older one); ``batch_id`` is the newest of them."""
    offsets: Offsets = {}
    batches: dict[str, dict[str, int | None]] = {}
    for row in rows:
        topic, partition = str(row["topic"]), str(int(row["partition"]))
        offsets.setdefault(topic, {})[partition] = int(row["next_offset"])
        batch = row.get("batch_id")
        batches.setdefault(topic, {})[partition] = None if batch is None else int(batch)
    if not offsets:
        return None
    known = [b for parts in batches.values() for b in parts.values() if b is not None]
    return {"pipeline": pipeline, "offsets": _sorted(offsets), "batch_ids": _sorted(batches),
            "batch_id": max(known) if known else None}


def position_change(previous: Offsets | None, current: Offsets) -> str | None:
    """How ``current`` differs from the last position announced: ``None`` (the same),
    ``"first"`` (nothing announced yet), ``"advanced"`` (no partition went back) or
    ``"rewound"`` (some partition went back: a restore put the target to an earlier snapshot)."""
    if previous is None:
        return "first"
    if previous == current:
        return None
    # A partition the earlier position had and this one lacks went back to "nothing yet".
    went_back = any(current.get(topic, {}).get(partition, -1) < offset
                    for topic, parts in previous.items() for partition, offset in parts.items())
    return "rewound" if went_back else "advanced"


def _sorted(nested: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {topic: dict(sorted(parts.items(), key=lambda item: int(item[0])))
            for topic, parts in sorted(nested.items())}
