"""The audit's rules, as pure functions: which dead letters are legitimate, which
rows Kafka can still vouch for, which range of Kafka a target is compared with,
and when a read of Kafka is finished. ``audit.py`` does the I/O around them.

See ``audit.py``'s docstring and ``docs/audit.md`` for the rules in prose.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.records.spec import AggregateTarget, PipelineSpec, RowTarget

# What ``pending`` accepts: how records above the stored offsets are counted.
PENDING_POLICIES = ("auto", "missing", "allowed")


class AuditTimeout(TimeoutError):
    """The audit did not finish reading Kafka in time; names what was left."""

    def __init__(self, message: str, unfinished: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.unfinished = unfinished


# --- dead letters -------------------------------------------------------------


# What trying a dead letter's own insert (in a transaction rolled back) gave: it applies
# now, its value does not parse, or the database refused it ("refused:<SQLSTATE>").
APPLIES = "applies"
UNPARSABLE = "does_not_parse"
REFUSED = "refused:"


def dead_letter_verdict(error_class: str, trial: str | None) -> str | None:
    """Why a dead letter is illegitimate, or None when quarantining it was right.

    PostgreSQL is the judge, not a copy of its rules: the audit tries the record's own
    insert into the targets and rolls it back (``audit.try_dead_letters``).

    :param error_class: from ``errors.dead_letter_class`` (the SQLSTATE stored with it).
    :param trial: the trial's outcome (``APPLIES``, ``UNPARSABLE`` or ``REFUSED`` + SQLSTATE);
        None when it was not tried (a ``not_data`` class is wrong whatever the record holds).
    """
    if error_class.startswith("not_data:"):
        return f"SQLSTATE {error_class.split(':', 1)[1]} is not a data error: a valid record must be retried, " \
               "never quarantined"
    if trial == APPLIES:
        return "its own insert into the targets succeeds (tried in a transaction, rolled back): " \
               "a valid record quarantined"
    return None


def retired_topics(topics: Iterable[str], seen: Iterable[TopicPartition]) -> set[TopicPartition]:
    """The partitions in ``seen`` (stored offsets, rows, dead letters) of topics no longer in the
    definition's ``topics``: their rows and offsets stay as the pipeline left them, and are
    reported, not compared (Kafka is not read for them, the stream never writes them again)."""
    current = set(topics)
    return {tp for tp in seen if tp[0] not in current}


# --- the replay's goal ---------------------------------------------------------


def goal_shortfall(stored: Mapping[TopicPartition, int], goal: Mapping[TopicPartition, int]
                   ) -> dict[TopicPartition, int]:
    """Per partition whose stored next offset is below the goal, how far below (a partition
    with nothing stored is at 0)."""
    return {tp: want - stored.get(tp, 0) for tp, want in sorted(goal.items()) if stored.get(tp, 0) < want}


# --- ranges -------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionRange:
    """What the audit knows about one partition, and the ranges it derives.

    :param earliest: Kafka's earliest offset (below it, records are gone).
    :param lso: Kafka's last stable offset (read_committed end).
    :param stored: the pipeline's stored next offset in the snapshot (None: none stored).
    :param stores_offsets: whether the delivery mode stores offsets with the data.
    """

    earliest: int
    lso: int
    stored: int | None
    stores_offsets: bool

    @property
    def applied_end(self) -> int:
        """End of what the target claims to hold: the stored offset, or the LSO
        for modes that keep no offsets. Never beyond the LSO (a stored offset
        beyond it is reported as ``offsets_ahead``)."""
        if not self.stores_offsets:
            return self.lso
        return min(self.stored or 0, self.lso)

    def check_end(self, tail_missing: bool) -> int:
        """End of the range compared record by record with Kafka."""
        return self.lso if tail_missing else max(self.applied_end, self.earliest)

    @property
    def retention_gap(self) -> int:
        """Offsets the pipeline never applied that Kafka no longer holds."""
        if self.stores_offsets and self.stored is not None and self.stored < self.earliest:
            return self.earliest - self.stored
        return 0

    @property
    def offsets_ahead(self) -> int:
        """Stored offsets beyond anything Kafka has (a recreated or truncated topic)."""
        if self.stores_offsets and self.stored is not None and self.stored > self.lso:
            return self.stored - self.lso
        return 0


def tail_counts_as_missing(pending: str, running: bool, has_goal: bool = False) -> bool:
    """Whether committed records above the stored offsets are "missing" (a
    stopped pipeline should have them) or "not yet applied" (a running one will).

    :param has_goal: the audit checks the stored offsets against a goal of their own
        (a replay's ``lso_at_start``): what Kafka committed past the goal is the resumed
        stream's next work, so under ``auto`` it is never missing.
    """
    if pending not in PENDING_POLICIES:
        raise ValueError(f"pending must be one of {PENDING_POLICIES}, got {pending!r}")
    if pending == "auto":
        return not running and not has_goal
    return pending == "missing"


@dataclass
class RowComparison:
    expected: int
    rows: int
    duplicated: int
    missing: int
    unexpected: int
    rows_below_earliest: int
    beyond_offsets: int


def compare_rows(expected: set[int], present: Mapping[int, int], rng: PartitionRange,
                 tail_missing: bool) -> RowComparison:
    """One row target's rows of one partition against Kafka.

    :param expected: offsets of valid, not dead-lettered committed records in
        ``[earliest, check_end)``.
    :param present: row count per offset in the target.
    """
    duplicated = sum(c - 1 for c in present.values() if c > 1)
    below = sum(c for o, c in present.items() if o < rng.earliest)
    # Rows below Kafka's earliest offset cannot be checked against it: Kafka
    # deleted their records (retention, delete_records), not the pipeline.
    checked = {o for o in present if o >= rng.earliest}
    beyond = 0
    if rng.stores_offsets:
        # Rows commit with their offsets, so a row at or above the stored
        # offset would be applied again by the next batch.
        beyond = sum(c for o, c in present.items() if o >= (rng.stored or 0))
    return RowComparison(
        expected=len(expected), rows=sum(present.values()), duplicated=duplicated,
        missing=len(expected - set(present)), unexpected=len(checked - expected),
        rows_below_earliest=below, beyond_offsets=beyond,
    )


def carrier_for(spec: PipelineSpec, aggregate: AggregateTarget) -> RowTarget | None:
    """The first row target holding every input of ``aggregate`` (its key and
    increment fields): where Kafka has deleted the records, the aggregate is
    checked against that target's rows instead."""
    needed = aggregate.inputs
    for target in spec.targets:
        if isinstance(target, RowTarget) and needed <= set(target.columns):
            return target
    return None


def as_number(value: Any) -> Any:
    """A stored total as a plain number: NULL as 0 (for the report's sums; ``wrong_keys``
    never lets a NULL pass), an integral Decimal as int, any other Decimal exact: a numeric
    sum compares with the audit's own Decimal sum digit for digit, never through a float."""
    if value is None:
        return 0
    if isinstance(value, Decimal) and value.is_finite() and value == value.to_integral_value():
        return int(value)
    return value


# Where a record stands in Kafka's order: (partition, offset). Only meaningful
# within one partition; across partitions it is merely deterministic.
Position = tuple[int, int]


def keep_latest(latest: dict[str, tuple[Position, Any]], column: str, position: Position, value: Any) -> None:
    """Keeps ``value`` for ``column`` when ``position`` comes after the one held: the
    in-order fold of a key's records, whatever order the audit reads them in."""
    held = latest.get(column)
    if held is None or position > held[0]:
        latest[column] = (position, value)


def wrong_keys(actual: Mapping[tuple, Mapping[str, Any]], expected: Mapping[tuple, Counter],
               increments: Iterable[str], expected_latest: Mapping[tuple, Mapping[str, Any]] | None = None,
               latest: Iterable[str] = ()) -> list[tuple]:
    """Keys whose stored row differs from the expected one.

    Increments mean in the audit what they mean in SQL: a key absent on one side counts as
    all zeros there, but a NULL stored in a present key's increment is wrong, whatever was
    expected (the apply never writes one, and NULL + x stays NULL for every later writer).
    Latest values compare as they are, NULL included (timestamps as timestamps: the audit
    casts Kafka's strings in the database first)."""
    sums, last, want_latest = list(increments), list(latest), expected_latest or {}
    empty: Counter = Counter()

    def differs(key: tuple) -> bool:
        row, want = actual.get(key), expected.get(key, empty)
        for column in sums:
            have = 0 if row is None else row.get(column)
            if have is None or as_number(have) != want[column]:
                return True
        return any((None if row is None else row.get(column)) != want_latest.get(key, {}).get(column)
                   for column in last)

    return sorted((key for key in set(actual) | set(expected) | set(want_latest) if differs(key)), key=repr)


# --- reading Kafka --------------------------------------------------------------


@dataclass
class ReadProgress:
    """Which partitions still have offsets to read, by offset alone.

    A partition is finished when a record at or past its end offset arrives,
    when the consumer's position reaches the end (markers and aborted records
    advance it without delivering anything), or at end-of-partition. It never
    relies on receiving a record, so a partition whose remaining offsets are
    all markers or deleted cannot hold the read open; if the broker still
    never lets it finish, the deadline ends the read and names it.

    :param ends: end offset (exclusive) per partition.
    :param starts: first offset to read per partition.
    :param deadline: ``clock()`` value after which the read gives up.
    """

    ends: dict[TopicPartition, int]
    starts: dict[TopicPartition, int]
    deadline: float
    clock: Callable[[], float] = time.monotonic
    positions: dict[TopicPartition, int] = field(default_factory=dict)
    pending: set[TopicPartition] = field(init=False)

    def __post_init__(self) -> None:
        self.pending = {tp for tp, end in self.ends.items() if self.starts.get(tp, 0) < end}
        self.positions = {tp: self.starts.get(tp, 0) for tp in self.pending}

    def record(self, tp: TopicPartition, offset: int) -> bool:
        """Notes a delivered record; True when it lies in the range to read."""
        if tp not in self.pending:
            return False
        self.positions[tp] = offset + 1
        if offset + 1 >= self.ends[tp]:
            self.pending.discard(tp)
        return offset < self.ends[tp]

    def position(self, tp: TopicPartition, position: int) -> None:
        """Notes the consumer's position (negative: not known yet)."""
        if tp in self.pending and position >= 0:
            self.positions[tp] = max(self.positions[tp], position)
            if position >= self.ends[tp]:
                self.pending.discard(tp)

    def end_of_partition(self, tp: TopicPartition, offset: int) -> None:
        """End-of-partition at ``offset``: the LSO now, which is at least the end."""
        self.position(tp, offset)

    @property
    def done(self) -> bool:
        return not self.pending

    def check_deadline(self, timeout: float) -> None:
        """Raises AuditTimeout naming every unfinished partition once the deadline passed."""
        if self.pending and self.clock() >= self.deadline:
            raise read_timeout(timeout, [unfinished_entry(tp, self.positions[tp], self.ends[tp])
                                         for tp in self.pending])


def unfinished_entry(tp: TopicPartition, position: int, end: int) -> dict[str, Any]:
    """One partition an AuditTimeout names: where its read stood and how much was left."""
    return {"topic": tp[0], "partition": tp[1], "position": position, "end": end, "left": end - position}


def read_timeout(timeout: float, unfinished: list[dict[str, Any]]) -> AuditTimeout:
    """The AuditTimeout naming ``unfinished`` (``unfinished_entry``), in partition order: one
    message whether one reader or several (``audit_readers``) timed out."""
    unfinished = sorted(unfinished, key=lambda u: (u["topic"], u["partition"]))
    names = ", ".join(f"{u['topic']}[{u['partition']}] at offset {u['position']} of {u['end']}" for u in unfinished)
    return AuditTimeout(
        f"audit timed out after {timeout:g}s reading Kafka; {len(unfinished)} partition(s) did not "
        f"finish: {names}. The remaining offsets could not be read (a broker not serving them, or "
        "only markers and deleted records the client never moved past); rerun with a longer "
        "--timeout or check the partitions",
        unfinished,
    )


def without_accepted_gaps(offsets: Mapping[TopicPartition, set[int]], gaps: Iterable[Mapping[str, Any]]
                          ) -> dict[TopicPartition, set[int]]:
    """``offsets`` less those inside an accepted gap (``[from_offset, to_offset)`` of its partition,
    skipped on purpose by ``eos offsets reset``): a record skipped there is not expected in the
    target, so it is never "missing". A gap that moved back (a recreated topic) skips nothing."""
    skipped: dict[TopicPartition, list[tuple[int, int]]] = defaultdict(list)
    for gap in gaps:
        if gap["from_offset"] < gap["to_offset"]:
            skipped[(gap["topic"], gap["partition"])].append((gap["from_offset"], gap["to_offset"]))
    return {tp: {o for o in found if not any(low <= o < high for low, high in skipped.get(tp, ()))}
            for tp, found in offsets.items()}


def accepted_gap_offsets(gaps: Iterable[Mapping[str, Any]]) -> int:
    """Offsets skipped on purpose, over every accepted gap."""
    return sum(max(0, gap["to_offset"] - gap["from_offset"]) for gap in gaps)
