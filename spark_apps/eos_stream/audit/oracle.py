"""The exactly-once oracle: what Kafka committed against what the database holds (a mirror
pipeline's offsets only: ``audit/mirror.py``).

Green only when the target is right, red only when it is wrong. The rules
(also in ``docs/audit.md``; the pure ones live in ``audit_rules.py``):

* **One snapshot.** The database is read in one REPEATABLE READ, READ ONLY
  transaction: rows, aggregates, dead letters and the stored offsets all come
  from the same instant, and since every batch commits its data with its
  offsets, the snapshot is a consistent cut of the pipeline. Kafka is read
  *after* the snapshot, so every stored offset is at or below the LSO the
  audit sees.
* **Compared up to the stored offsets.** For delivery modes that store
  offsets (``exactly_once``, ``two_phase``) every committed record below the
  stored ``next_offset`` must be in the target; committed records above it
  are the *tail*. While a driver holds the pipeline's running lock (at the
  snapshot or when the read ends) the tail is "not yet applied", reported
  but not a mismatch, so an audit of a running stream does not false-alarm.
  With no driver running the tail counts as missing, as a stopped pipeline
  must have applied everything (``pending`` overrides this: ``missing`` or
  ``allowed``). Rows or dead letters at or above the stored offset are a
  mismatch (``beyond_offsets``): a restart would apply them again. Modes that
  store no offsets are compared up to the LSO and have no consistent cut.
* **What Kafka no longer holds.** Rows below a partition's earliest offset
  (retention, ``delete_records``) are not "unexpected": they are counted as
  ``rows_below_earliest`` and checked for duplicates only. A stored offset
  below the earliest offset is a ``retention_gap``: records the pipeline never
  applied are gone. A stored offset above the LSO is ``offsets_ahead``.
* **Aggregates.** Per key, the expected totals are Kafka's valid, not
  dead-lettered committed records in the compared range, plus the rows of a
  *carrier* row target (one whose columns hold the aggregate's key and
  increment fields) below the earliest offset, where Kafka's copy is gone.
  Without a carrier, an aggregate whose inputs are partly gone from Kafka
  (some partition's earliest offset above 0) cannot be recomputed: it is
  reported under ``unverified`` with the reason, neither ok nor a mismatch.
  A latest column holds the key's last record in Kafka order; for a key whose
  records sit in several partitions the apply's value depends on where batches
  end, and any one partition's last record is accepted (``_expected_latest``).
* **Dead letters** are grouped by ``errors.dead_letter_class``. One whose
  SQLSTATE is not a data error (class 22 or 23) is a mismatch. Every other
  one is judged by PostgreSQL: ``try_dead_letters`` tries the record's own
  insert into the targets (the sink's staging and apply SQL) and rolls it
  back; one that applies is a valid record wrongly quarantined. The value
  tried is Kafka's while Kafka holds the record, the stored raw value after
  that. A dead letter at an offset where Kafka holds no committed record is a
  mismatch too; a malformed record not quarantined is one.
* **After a replay** (``goal``: its ``lso_at_start``) the tail is the resumed
  stream's work even with no driver running, and the stored offsets must
  have reached the goal (``goal_not_reached`` otherwise).
* **Compacted topics** are refused; topics no longer in the definition are
  ``retired_topics``: reported, not compared (their carrier rows still count
  in the aggregates).
* **Bounded reads.** A partition is finished by offset (record, position or
  end-of-partition), never by waiting for a record, so trailing markers or a
  fully deleted partition cannot hang the read; an overall ``timeout`` ends
  it anyway, naming the partitions that did not finish. If retention deletes
  records inside the range while it is read, the audit starts over.
* **Parallel reads.** A big read of Kafka is dealt out to worker processes,
  one per core (``audit_readers``), while this process reads the rest of the
  snapshot; their merged sides are the side one process builds, so the
  report is the same.

    python -m spark_apps.eos_stream.audit --config pipeline.json [--timeout S] [--pending auto|missing|allowed]
        [--goal '{"topic": {"0": 1234}}'] [--workers N]

Prints one JSON report; exits 1 on any mismatch, 0 when exact, 2 when the
read of Kafka timed out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from spark_apps.eos_stream.audit.kafka import KafkaOffsets, ReadTask
from spark_apps.eos_stream.audit.readers import KafkaRead
from spark_apps.eos_stream.audit.report import build_report
from spark_apps.eos_stream.audit.rules import (
    PENDING_POLICIES,
    PartitionRange,
)
from spark_apps.eos_stream.audit.snapshot import read_accepted_gaps, read_cut, read_snapshot
from spark_apps.eos_stream.audit.trials import as_the_database_reads, try_dead_letters
from spark_apps.eos_stream.errors import dead_letter_class
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec
from spark_apps.eos_stream.run import preflight
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink.modes import MODES
from spark_apps.eos_stream.sink.postgres import connect
from spark_apps.eos_stream.state.control import driver_running

DEFAULT_TIMEOUT = 900.0
# Starts over when retention deletes records in the range while it is read.
ATTEMPTS = 3


def audit(config: PipelineConfig, spec: PipelineSpec, *, timeout: float = DEFAULT_TIMEOUT,
          pending: str = "auto", goal: Mapping[TopicPartition, int] | None = None,
          workers: int | None = None) -> dict[str, Any]:
    """Compares the pipeline's target with what Kafka committed (rules in the module docstring).

    :param config: the pipeline's config.
    :param spec: the pipeline's spec.
    :param timeout: seconds from the audit's start after which the read of
        Kafka gives up; AuditTimeout then names the partitions that did not finish.
    :param pending: how committed records above the stored offsets count:
        ``auto`` (not yet applied while a driver runs or a ``goal`` is given, missing
        otherwise), ``missing`` or ``allowed``.
    :param goal: ``{(topic, partition): offset}`` the stored offsets must have reached (a
        replay's ``lso_at_start``); a partition short of it is a ``goal_not_reached`` mismatch.
    :param workers: processes reading Kafka (``audit_readers``): None for one per core when
        the read is big, 1 for this process alone. The report is the same either way.
    :raises AuditTimeout: the read of Kafka did not finish in ``timeout``.
    :raises ConfigError: a topic is compacted (``preflight.refuse_compacted``).
    """
    if pending not in PENDING_POLICIES:
        raise ValueError(f"pending must be one of {PENDING_POLICIES}, got {pending!r}")
    if spec.mirror is not None:  # its rows hold each key's last change: compared with its source, not Kafka
        from spark_apps.eos_stream.audit.mirror import audit_mirror

        return audit_mirror(config, pending=pending, goal=goal)
    deadline = time.monotonic() + timeout
    moved = ""
    for _attempt in range(ATTEMPTS):
        report, moved = _audit_once(config, spec, timeout=timeout, deadline=deadline, pending=pending,
                                    goal=goal, workers=workers)
        if report is not None:
            return report
    raise RuntimeError(f"audit: retention deleted records inside the audited range during each of {ATTEMPTS} "
                       f"attempts ({moved}); rerun it")


def _audit_once(config: PipelineConfig, spec: PipelineSpec, *, timeout: float, deadline: float,
                pending: str, goal: Mapping[TopicPartition, int] | None,
                workers: int | None) -> tuple[dict[str, Any] | None, str]:
    kafka = KafkaOffsets(config.kafka_bootstrap, config.librdkafka_options())
    partitions = kafka.partitions(config.topics)
    preflight.refuse_compacted(kafka.admin, list(config.topics), "audit")
    earliest = kafka.offsets(partitions, "earliest")
    aggregates = [t for t in spec.targets if isinstance(t, AggregateTarget)]
    stores = MODES[config.delivery].stores_offsets
    conn = connect(config.postgres.dsn_kwargs(), describe=config.postgres.describe(), application_name="eos-audit")
    try:
        cut = read_cut(conn, config)
        # Read after the snapshot was fixed: every stored offset in it is at or below this LSO.
        lso = kafka.offsets(partitions, "lso")
        ranges = {tp: PartitionRange(earliest[tp], lso[tp], cut.stored.get(tp), stores) for tp in partitions}
        task = ReadTask(config.kafka_bootstrap, config.librdkafka_options(), spec, aggregates, ranges,
                        frozenset(cut.dead), timeout, deadline)
        # Workers read Kafka while this process reads the rest of the snapshot (one read: Kafka after it).
        with KafkaRead(task, workers) as reading:
            snap = read_snapshot(conn, config, spec, aggregates, earliest, cut)
            snap.accepted_gaps = read_accepted_gaps(conn, config)
            conn.commit()
            side = reading.side()
        as_the_database_reads(conn, spec, aggregates, side)
        running_after = driver_running(conn, config.pipeline)
        conn.commit()
    finally:
        conn.close()
    after = kafka.offsets(partitions, "earliest")
    moved = [f"{t}[{p}] {earliest[(t, p)]}->{after[(t, p)]}" for t, p in partitions
             if earliest[(t, p)] < after[(t, p)] and earliest[(t, p)] < lso[(t, p)]]
    if moved:
        return None, ", ".join(moved)
    running = snap.running or running_after
    # Kafka's copy while Kafka holds it, the stored one after that; a not_data class is wrong whatever it holds.
    trials = try_dead_letters(config, spec, {
        k: (key, side.dead_seen[k] if k in side.dead_seen else value)
        for k, (error, code, key, value) in snap.dead.items()
        if (k[0], k[1]) not in snap.retired and not dead_letter_class(code, error).startswith("not_data:")})
    return build_report(config, spec, aggregates, snap, ranges, side, trials, running=running, pending=pending,
                   goal=goal), ""
