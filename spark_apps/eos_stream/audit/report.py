"""The audit's report: its sections compared and summed up (rules in ``oracle``)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_apps.eos_stream.audit.kafka import KafkaSide
from spark_apps.eos_stream.audit.rules import (
    PartitionRange,
    Position,
    accepted_gap_offsets,
    as_number,
    carrier_for,
    compare_rows,
    dead_letter_verdict,
    goal_shortfall,
    keep_latest,
    tail_counts_as_missing,
    without_accepted_gaps,
    wrong_keys,
)
from spark_apps.eos_stream.audit.snapshot import Snapshot
from spark_apps.eos_stream.audit.trials import DeadLetterKey
from spark_apps.eos_stream.errors import dead_letter_class
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec
from spark_apps.eos_stream.run.config import PipelineConfig
from spark_apps.eos_stream.sink.modes import MODES

SAMPLE = 20  # entries of a list the report spells out


@dataclass
class _Counted:
    """What Kafka holds that the report compares with: the applied range, and the tail too when it
    counts as missing (``tail_missing``); the tail is otherwise only ``not_yet_applied``."""

    tail_missing: bool
    regions: tuple[int, ...]
    valid: dict[TopicPartition, set[int]]
    malformed: dict[TopicPartition, set[int]]
    committed: Counter
    not_yet_applied: Counter


def _counted(side: KafkaSide, tail_missing: bool) -> _Counted:
    """:param side: Kafka's records, split at the stored offsets.
    :param tail_missing: whether the tail counts as missing (``tail_counts_as_missing``)."""
    regions = (0, 1) if tail_missing else (0,)
    return _Counted(tail_missing=tail_missing, regions=regions, valid=_merged(side.valid, regions),
                    malformed=_merged(side.malformed, regions),
                    committed=sum((side.committed[r] for r in regions), Counter()),
                    not_yet_applied=Counter() if tail_missing else side.committed[1])


def _merged(parts: tuple[dict, dict], regions: tuple[int, ...]) -> dict[TopicPartition, set[int]]:
    """The offsets per partition of ``parts``' ``regions`` (0: applied, 1: tail), merged."""
    out: dict[TopicPartition, set[int]] = defaultdict(set)
    for region in regions:
        for tp, offsets in parts[region].items():
            out[tp] |= offsets
    return out


@dataclass
class _Section:
    """One part of the report and the mismatches it found, in the order it found them."""

    part: dict[str, Any]
    mismatches: list[str] = field(default_factory=list)


def _kafka_section(ranges: dict[TopicPartition, PartitionRange], counted: _Counted) -> _Section:
    """Per partition, the range of Kafka compared; a retention gap or stored offsets ahead of the LSO
    is a mismatch.

    :param ranges: per partition, Kafka's range and the stored offset.
    :param counted: what the report compares with."""
    section = _Section({})
    for (t, p), rng in sorted(ranges.items()):
        section.part[f"{t}:{p}"] = {
            "earliest": rng.earliest, "lso": rng.lso, "stored_offset": rng.stored,
            "checked_to": rng.check_end(counted.tail_missing), "not_yet_applied": counted.not_yet_applied[(t, p)],
            "retention_gap": rng.retention_gap, "offsets_ahead": rng.offsets_ahead,
        }
        if rng.retention_gap:
            section.mismatches.append(f"retention_gap:{t}:{p}")
        if rng.offsets_ahead:
            section.mismatches.append(f"offsets_ahead:{t}:{p}")
    return section


def _rows_section(snap: Snapshot, ranges: dict[TopicPartition, PartitionRange], counted: _Counted,
                  stores: bool) -> _Section:
    """Per row target and partition, its rows against Kafka's valid records (``compare_rows``).

    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param counted: what the report compares with.
    :param stores: whether the delivery mode stores offsets."""
    section = _Section({})
    dead_per_partition = Counter((t, p) for t, p, _o in snap.dead)
    for table, present in snap.rows.items():
        for tp in sorted((set(ranges) | set(present)) - snap.retired):
            # A partition the target names but Kafka does not have: nothing in it is expected.
            rng = ranges.get(tp) or PartitionRange(0, 0, snap.stored.get(tp), stores)
            end = rng.check_end(counted.tail_missing)
            expected = {o for o in counted.valid.get(tp, ()) if rng.earliest <= o < end}
            result = compare_rows(expected, present.get(tp, Counter()), rng, counted.tail_missing)
            name = f"{table}:{tp[0]}:{tp[1]}"
            section.part[name] = {
                "expected": result.expected, "rows": result.rows, "duplicated": result.duplicated,
                "missing": result.missing, "unexpected": result.unexpected, "lso": rng.lso if tp in ranges else None,
                "dead_lettered": dead_per_partition[tp], "earliest": rng.earliest, "stored_offset": rng.stored,
                "checked_to": end, "rows_below_earliest": result.rows_below_earliest,
                "beyond_offsets": result.beyond_offsets, "not_yet_applied": counted.not_yet_applied[tp],
            }
            if result.duplicated or result.missing or result.unexpected or result.beyond_offsets:
                section.mismatches.append(name)
    return section


@dataclass
class _DeadLetters:
    """The dead letters of the current topics, judged."""

    by_class: Counter = field(default_factory=Counter)
    wrongly: list[dict[str, Any]] = field(default_factory=list)
    not_in_kafka: list[dict[str, Any]] = field(default_factory=list)
    beyond_offsets: int = 0
    # Malformed records Kafka committed that no dead letter holds.
    not_quarantined: int = 0

    @property
    def mismatches(self) -> list[str]:
        return [name for failed, name in (
            (self.not_quarantined, "dead_letters"), (self.wrongly, "dead_letters:wrongly_quarantined"),
            (self.not_in_kafka, "dead_letters:not_in_kafka"), (self.beyond_offsets, "dead_letters:beyond_offsets"),
        ) if failed]


def _dead_letter_section(snap: Snapshot, ranges: dict[TopicPartition, PartitionRange], side: KafkaSide,
                         trials: Mapping[DeadLetterKey, str], counted: _Counted, stores: bool) -> _DeadLetters:
    """Each dead letter by its class and its trial (``dead_letter_verdict``), whether Kafka holds
    its record, and whether it lies at or above the stored offset.

    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param side: Kafka's records (``dead_seen``: the dead-lettered offsets it still holds).
    :param trials: each dead letter's trial outcome (``try_dead_letters``).
    :param counted: what the report compares with.
    :param stores: whether the delivery mode stores offsets."""
    dead = _DeadLetters(not_quarantined=sum(len(v) for v in counted.malformed.values()))
    for (t, p, o), (error, code, _key, _value) in sorted(snap.dead.items()):
        if (t, p) in snap.retired:
            continue
        error_class = dead_letter_class(code, error)
        dead.by_class[error_class] += 1
        trial = trials.get((t, p, o))
        reason = dead_letter_verdict(error_class, trial)
        entry = {"topic": t, "partition": p, "offset": o, "class": error_class, "sqlstate": code,
                 "error": error[:200], "trial": trial}
        if reason:
            dead.wrongly.append({**entry, "reason": reason})
        held = ranges.get((t, p))
        if (t, p, o) not in side.dead_seen and (held is None or o >= held.earliest):
            dead.not_in_kafka.append(entry)
        if stores and o >= (snap.stored.get((t, p)) or 0):
            dead.beyond_offsets += 1
    return dead


def _keep_all_latest(into: dict[tuple, dict[str, tuple[Position, Any]]],
                     source: Mapping[tuple, Mapping[str, tuple[Position, Any]]]) -> None:
    """Folds ``source``'s latest values per key and column into ``into`` (``keep_latest``)."""
    for group, values in source.items():
        for column, (position, value) in values.items():
            keep_latest(into[group], column, position, value)


@dataclass
class _Aggregates:
    """Per aggregate target, its totals against the expected ones; those that cannot be recomputed."""

    totals: dict[str, Any] = field(default_factory=dict)
    unverified: list[dict[str, str]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def _aggregate_section(spec: PipelineSpec, aggregates: list[AggregateTarget], snap: Snapshot,
                       ranges: dict[TopicPartition, PartitionRange], side: KafkaSide,
                       counted: _Counted) -> _Aggregates:
    """Each aggregate target against Kafka's records in the compared range, plus its carrier's rows
    below the earliest offsets where Kafka deleted records; unverified without a carrier.

    :param spec: the pipeline's spec.
    :param aggregates: its aggregate targets, in the order of ``snap.actual``.
    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param side: Kafka's records (``sums`` and ``latest`` per region and aggregate).
    :param counted: what the report compares with."""
    section = _Aggregates()
    gone = sorted(f"{t}[{p}]" for (t, p), rng in ranges.items() if rng.earliest > 0)
    gone += [f"{t}[{p}] (retired)" for t, p in sorted(snap.retired)]
    for index, target in enumerate(aggregates):
        expected_totals: dict[tuple, Counter] = defaultdict(Counter)
        # (key, (topic, partition)) -> column -> (position, value) of the key's last record there
        last_per_partition: dict[tuple, dict[str, tuple[Position, Any]]] = defaultdict(dict)
        for region in counted.regions:
            for group, counter in side.sums[region][index].items():
                expected_totals[group].update(counter)
            _keep_all_latest(last_per_partition, side.latest[region][index])
        carrier, below = carrier_for(spec, target), snap.below_earliest[index]
        checked_against = "kafka"
        if gone and below is None:
            reason = (f"records below the earliest offset of {', '.join(gone)} are gone from Kafka and no row "
                      f"target carries the inputs of {target.table} ({', '.join(target.group_by)}, "
                      f"{', '.join(sorted(target.inputs - set(target.group_by))) or 'counts'})")
            section.unverified.append({"target": target.table, "reason": reason})
        elif gone and carrier is not None and below is not None:
            checked_against = f"kafka, and {carrier.table} below the earliest offsets"
            for group, counter in below.items():
                expected_totals[group].update(counter)
            _keep_all_latest(last_per_partition, snap.below_latest[index])
        actual = snap.actual[index]
        latest_values, spread = _expected_latest(last_per_partition, actual, target.latest)
        verified = not (gone and below is None)
        wrong = (wrong_keys(actual, expected_totals, target.increments, latest_values, target.latest)
                 if verified else [])
        section.totals[target.table] = {
            "keys": len(actual),
            "keys_wrong": len(wrong) if verified else None,
            "verified": verified,
            "checked_against": checked_against if verified else None,
            "wrong_keys": [list(k) for k in wrong[:SAMPLE]],
            "keys_spread_over_partitions": spread,
            **{f"expected_{c}": sum(g[c] for g in expected_totals.values()) for c in target.increments},
            **{f"actual_{c}": sum(as_number(v.get(c)) for v in actual.values()) for c in target.increments},
        }
        if wrong:
            section.mismatches.append(target.table)
    return section


def _expected_latest(per_partition: Mapping[tuple, Mapping[str, tuple[Position, Any]]],
                     actual: Mapping[tuple, Mapping[str, Any]], columns: Mapping[str, str]
                     ) -> tuple[dict[tuple, dict[str, Any]], int]:
    """Each key's expected latest values, from its last record in each partition it has records in.

    In one partition: that record's values, the in-order fold. Spread over partitions (an unkeyed
    producer, partitions added): the apply overwrites with each batch's highest (partition, offset),
    so the stored values are those of the key's last record in the highest partition of the last
    batch that touched the key, and no later batch holds the key's records: whatever the batches,
    they are the key's last record of one of its partitions. A stored row equal to one of those is
    expected as it is; any other is compared with the fold over all of them (and is wrong).

    :param per_partition: (key, (topic, partition)) -> column -> (position, value).
    :param actual: the stored rows, key -> column -> value.
    :param columns: the target's latest columns.
    :returns: key -> column -> expected value, and how many keys are spread over partitions."""
    by_key: dict[tuple, list[Mapping[str, tuple[Position, Any]]]] = defaultdict(list)
    for (group, _tp), values in per_partition.items():
        by_key[group].append(values)
    expected: dict[tuple, dict[str, Any]] = {}
    spread = 0
    for group, parts in by_key.items():
        folded: dict[str, tuple[Position, Any]] = {}
        for values in parts:
            for column, (position, value) in values.items():
                keep_latest(folded, column, position, value)
        expected[group] = {column: value for column, (_, value) in folded.items()}
        if len(parts) > 1:
            spread += 1
            stored = actual.get(group)
            for values in parts:
                candidate = {column: value for column, (_, value) in values.items()}
                if stored is not None and all(stored.get(c) == candidate.get(c) for c in columns):
                    expected[group] = candidate
                    break
    return expected, spread


def _retired_section(snap: Snapshot) -> dict[str, dict[str, Any]]:
    """Per retired topic: its stored offsets, rows and dead letters, kept as they are.

    :param snap: the database side."""
    retired: dict[str, dict[str, Any]] = {}
    for t, p in sorted(snap.retired):
        gone_topic = retired.setdefault(t, {"stored_offsets": {}, "rows": Counter(), "dead_letters": 0})
        if (t, p) in snap.stored:
            gone_topic["stored_offsets"][str(p)] = snap.stored[(t, p)]
        for table, present in snap.rows.items():
            gone_topic["rows"][table] += sum(present.get((t, p), Counter()).values())
        gone_topic["dead_letters"] += sum(1 for dt, dp, _o in snap.dead if (dt, dp) == (t, p))
    return retired


def _summary(snap: Snapshot, ranges: dict[TopicPartition, PartitionRange], trials: Mapping[DeadLetterKey, str],
             counted: _Counted, partitions: _Section, dead: _DeadLetters, aggregate: _Aggregates,
             shortfall: Mapping[TopicPartition, int], retired: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report's summary: the sections' counts, summed."""
    rows = partitions.part.values()
    return {
        "committed_records": sum(counted.committed.values()),
        "duplicated": sum(p["duplicated"] for p in rows),
        "missing": sum(p["missing"] for p in rows),
        "unexpected": sum(p["unexpected"] for p in rows),
        "dead_lettered": sum(1 for t, p, _o in snap.dead if (t, p) not in snap.retired),
        "malformed_not_quarantined": dead.not_quarantined,
        "wrongly_quarantined": len(dead.wrongly),
        "dead_letters_not_in_kafka": len(dead.not_in_kafka),
        "dead_letters_by_class": dict(sorted(dead.by_class.items())),
        # What each dead letter's own insert did when tried (and rolled back): applies, refused:<SQLSTATE>...
        "dead_letter_trials": dict(sorted(Counter(trials.values()).items())),
        "rows_below_earliest": sum(p["rows_below_earliest"] for p in rows),
        "beyond_offsets": sum(p["beyond_offsets"] for p in rows) + dead.beyond_offsets,
        "not_yet_applied": sum(counted.not_yet_applied.values()),
        "retention_gap_offsets": sum(r.retention_gap for r in ranges.values()),
        "offsets_ahead": sum(r.offsets_ahead for r in ranges.values()),
        "unverified_aggregates": len(aggregate.unverified),
        "goal_shortfall": sum(shortfall.values()),
        "retired_topics": len(retired),
        "accepted_gap_offsets": accepted_gap_offsets(snap.accepted_gaps),
    }


def build_report(config: PipelineConfig, spec: PipelineSpec, aggregates: list[AggregateTarget], snap: Snapshot,
            ranges: dict[TopicPartition, PartitionRange], side: KafkaSide, trials: Mapping[DeadLetterKey, str], *,
            running: bool, pending: str, goal: Mapping[TopicPartition, int] | None = None) -> dict[str, Any]:
    """The report from what the audit read: its sections (Kafka's ranges, the row targets, the dead
    letters, the aggregates, the goal, the retired topics) and a summary of them. Its mismatches are
    the sections' own, in that order.

    :param config: the pipeline's config.
    :param spec: the pipeline's spec.
    :param aggregates: its aggregate targets, in the order of ``snap.actual``.
    :param snap: the database side.
    :param ranges: per partition, Kafka's range and the stored offset.
    :param side: Kafka's records, split at the stored offsets.
    :param trials: each dead letter's trial outcome (``try_dead_letters``).
    :param running: whether a driver ran at the snapshot or when the read ended.
    :param pending: how the tail counts (``PENDING_POLICIES``).
    :param goal: the offsets the stored ones must have reached, if any."""
    stores = MODES[config.delivery].stores_offsets
    counted = _counted(side, tail_counts_as_missing(pending, running, has_goal=goal is not None))
    counted.valid = without_accepted_gaps(counted.valid, snap.accepted_gaps)
    counted.malformed = without_accepted_gaps(counted.malformed, snap.accepted_gaps)
    kafka = _kafka_section(ranges, counted)
    partitions = _rows_section(snap, ranges, counted, stores)
    dead = _dead_letter_section(snap, ranges, side, trials, counted, stores)
    aggregate = _aggregate_section(spec, aggregates, snap, ranges, side, counted)
    shortfall = goal_shortfall(snap.stored, goal or {})
    mismatches = [*kafka.mismatches, *partitions.mismatches, *dead.mismatches, *aggregate.mismatches,
                  *(f"goal_not_reached:{t}:{p}" for t, p in shortfall)]
    retired = _retired_section(snap)
    summary = _summary(snap, ranges, trials, counted, partitions, dead, aggregate, shortfall, retired)
    return {
        "pipeline": config.pipeline, "ok": not mismatches, "mismatches": mismatches, "summary": summary,
        "aggregates": aggregate.totals, "partitions": partitions.part, "kafka": kafka.part,
        "unverified": aggregate.unverified,
        # Ranges skipped on purpose (eos offsets reset): not expected in the targets, not a mismatch.
        "accepted_gaps": snap.accepted_gaps,
        "goal": None if goal is None else {
            f"{t}:{p}": {"goal": want, "stored_offset": snap.stored.get((t, p)), "short": shortfall.get((t, p), 0)}
            for (t, p), want in sorted(goal.items())},
        "retired_topics": {t: {**e, "rows": dict(e["rows"])} for t, e in retired.items()},
        "dead_letters": {"by_class": summary["dead_letters_by_class"], "wrongly_quarantined": dead.wrongly[:SAMPLE],
                         "not_in_kafka": dead.not_in_kafka[:SAMPLE]},
        "snapshot": {
            "isolation": "repeatable read, read only", "delivery": config.delivery, "stores_offsets": stores,
            "driver_running": running, "pending": pending,
            "records_above_stored_offsets": "missing" if counted.tail_missing else "not_yet_applied",
        },
    }
