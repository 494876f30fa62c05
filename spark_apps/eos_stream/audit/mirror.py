"""The audit of a mirror pipeline (``cdc/``): its offsets, not its rows.

A mirror table holds each key's last change, not one row per record, so the record-by-record
comparison of ``oracle`` does not apply: whether a mirror holds the right rows is decided by
comparing it with its source (``EXCEPT`` both ways, and each aggregate with its ``GROUP BY``;
docs/cdc.md), which the pipeline's Kafka and target databases cannot see. What Kafka and the
target do tell is checked here, in one REPEATABLE READ, READ ONLY snapshot as the oracle reads:

* every stored offset reached the ``goal`` (a replay's ``lso_at_start``): ``goal_not_reached``;
* none is below Kafka's earliest offset (``retention_gap``: changes never applied are gone)
  or above its last stable offset (``offsets_ahead``: a recreated or truncated topic);
* with no goal and no driver running, committed offsets above the stored ones are
  ``missing``; with a goal or a running driver, they are the stream's next work.

Dead letters are counted, not tried: a mirror's apply is by key, and one quarantined change is
judged by the change that follows it, which the source comparison sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spark_apps.eos_stream.audit.kafka import KafkaOffsets
from spark_apps.eos_stream.audit.rules import PartitionRange, goal_shortfall, tail_counts_as_missing
from spark_apps.eos_stream.audit.snapshot import read_cut
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink.postgres import connect

ROWS_NOT_COMPARED = ("a mirror holds each key's last change, not one row per record: its rows are compared with "
                     "its source (EXCEPT both ways, aggregates with their GROUP BY), not with Kafka")


def audit_mirror(config: PipelineConfig, *, pending: str = "auto",
                 goal: Mapping[TopicPartition, int] | None = None) -> dict[str, Any]:
    """The report of a mirror pipeline's offsets (module docstring), shaped as ``oracle.audit``'s:
    ``ok``, ``mismatches``, ``summary``, ``partitions``, ``goal``."""
    kafka = KafkaOffsets(config.kafka_bootstrap, config.librdkafka_options())
    partitions = kafka.partitions(config.topics)
    preflight.refuse_compacted(kafka.admin, list(config.topics), "audit")
    earliest = kafka.offsets(partitions, "earliest")
    conn = connect(config.postgres.dsn_kwargs(), describe=config.postgres.describe(), application_name="eos-audit")
    try:
        cut = read_cut(conn, config)
        lso = kafka.offsets(partitions, "lso")  # after the snapshot: every stored offset is at or below it
        conn.commit()
    finally:
        conn.close()
    ranges = {tp: PartitionRange(earliest[tp], lso[tp], cut.stored.get(tp), True) for tp in partitions}
    tail_missing = tail_counts_as_missing(pending, cut.running, has_goal=goal is not None)
    mismatches, summary = offsets_findings(ranges, cut.stored, goal, tail_missing)
    summary.update(dead_letters=len(cut.dead), driver_running=cut.running)
    shortfall = goal_shortfall(cut.stored, goal or {})
    return {
        "pipeline": config.pipeline, "ok": not mismatches, "mismatches": mismatches, "summary": summary,
        "aggregates": {}, "unverified": {"mirror": ROWS_NOT_COMPARED},
        "partitions": {f"{t}:{p}": {"earliest": r.earliest, "lso": r.lso, "stored_offset": r.stored}
                       for (t, p), r in sorted(ranges.items())},
        "goal": None if goal is None else {
            f"{t}:{p}": {"goal": want, "stored_offset": cut.stored.get((t, p)), "short": shortfall.get((t, p), 0)}
            for (t, p), want in sorted(goal.items())},
    }


def offsets_findings(ranges: Mapping[TopicPartition, PartitionRange], stored: Mapping[TopicPartition, int],
                     goal: Mapping[TopicPartition, int] | None, tail_missing: bool) -> tuple[list[str], dict[str, Any]]:
    """The mismatches of a mirror's offsets (module docstring) and their summary.

    :param ranges: per partition, Kafka's range and the stored offset.
    :param stored: the stored next offsets.
    :param goal: the offsets they must have reached (a replay's), if any.
    :param tail_missing: whether committed offsets above the stored ones count as missing."""
    tail = {tp: max(0, rng.lso - max(rng.applied_end, rng.earliest)) for tp, rng in ranges.items()}
    shortfall = goal_shortfall(stored, goal or {})
    mismatches = [*(f"retention_gap:{t}:{p}" for (t, p), r in sorted(ranges.items()) if r.retention_gap),
                  *(f"offsets_ahead:{t}:{p}" for (t, p), r in sorted(ranges.items()) if r.offsets_ahead),
                  *(f"missing:{t}:{p}" for (t, p), n in sorted(tail.items()) if tail_missing and n),
                  *(f"goal_not_reached:{t}:{p}" for t, p in shortfall)]
    summary = {
        "rows": "not compared", "why": ROWS_NOT_COMPARED,
        "offsets_applied": sum(max(0, r.applied_end - r.earliest) for r in ranges.values()),
        "offsets_above_stored": sum(tail.values()),
        "records_above_stored_offsets": "missing" if tail_missing else "not_yet_applied",
        "retention_gap_offsets": sum(r.retention_gap for r in ranges.values()),
        "offsets_ahead": sum(r.offsets_ahead for r in ranges.values()),
        "goal_short_by": sum(shortfall.values()),
    }
    return mismatches, summary
