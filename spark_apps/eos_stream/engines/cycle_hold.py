"""A whole mirror's incomplete source transactions, held in memory between the continuous
engine's cycles.

A cycle rarely ends on a source transaction's boundary: its last transactions miss their END,
or events of a partition read less far. Held in the database (``cdc/transactions_sql``), every
such record is written into ``held_changes`` by one cycle and moved back by the next, a few
hundred to a few thousand rows a cycle with all their columns. The continuous engine has each
cycle's records in memory and commits cycles one after the other, so it walks each cycle while
it stages it (``transaction_walk.walk``, the same decision over the same groups: every line is
COPYed as it is made, the walk runs once the last chunk is sent, and what waits is removed from
the stage before the COPY commits):

- the records at or above each partition's bound (the first event of a transaction not ready,
  the first END waiting) are carried, with their stage lines and their groups, into the next
  cycle's walk, which stages them when their transactions are complete;
- the cycle stores, for each such partition, the offset of the first record it did not apply
  (its bound), and starts the next cycle's range there: the stored offsets are a replay point
  at a transaction boundary, and nothing is held in the database;
- the stage then holds exactly the records to apply, and the batch's transaction only applies it
  (``StageCount.walked``).

The held records keep their stage lines; the applied ones do not (a retry makes them again), so
what this adds to the engine's memory is the held records, at most ``max_bytes``.

Failure transitions (the continuous engine's C-transitions and the sink's hold as they are):

H1. a crash, or a stop, with records held in memory: they were never applied and lie at or
    above the stored offsets, so the rerun reads them again from Kafka.
H2. a cycle that fails after it was planned (its staging, its commit, after retries): the
    cycles after it never commit (A2), and the run fails; what it carried is lost with the
    process, as in H1. A retry or an isolation of the cycle stages the same records again,
    from its plan, without walking again.
H3. the held records pass ``max_bytes`` of keys, values and lines, or the oldest has waited
    ``HOLD_SECONDS`` (a transaction larger than memory allows, an END late or lost): that cycle
    stages every record, the held ones included, and the database holds what waits
    (``held_changes``, where the health check sees it). The cycles after it wait for the
    previous cycle's commit, then look at ``held_changes``: while it holds records of the
    pipeline they stage every record too, without applying ahead of that commit; once empty, the
    engine holds in memory again.
H4. ``held_changes`` holds records of the pipeline when the run starts (an earlier run's H3, or
    the Spark engine's batches): as H3's later cycles. The first cycle looks; a look that fails
    (the database unreachable) leaves that cycle to the database's walk, which is right whatever
    ``held_changes`` holds, and the cycle's staging or commit meets the outage as any cycle does.
H5. the walk refuses the cycle (``TransactionError``): the plan raises it, every time it is
    asked, and so do the plans after it; the cycle never commits and the run fails as it would
    in the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, compress
from typing import Any

from spark_apps.eos_stream.cdc import transaction_walk, transactions_sql
from spark_apps.eos_stream.cdc.mirror import KafkaRecord
from spark_apps.eos_stream.cdc.pipeline import STAGE_CHUNK_CHARS, bounded_chunks
from spark_apps.eos_stream.cdc.transaction_walk import NO_BOUND, Groups
from spark_apps.eos_stream.kafka.partitions import TopicPartition
from spark_apps.eos_stream.kafka.ranges import MessageChunk
from spark_apps.eos_stream.records.spec import MirrorApply, StageCount

# How long a record may wait in memory for its transaction (H3). An END follows its events within
# milliseconds; past this the wait is worth a row in ``held_changes``, which the health check reads.
HOLD_SECONDS = 5.0
_WAIT_SLICE_SECONDS = 0.05

Item = tuple[KafkaRecord, str]  # a record and its stage line


@dataclass
class Held:
    """What earlier cycles carried: records with their lines, in order per partition, and the
    groups of the incomplete transactions and the waiting ENDs (``transaction_walk.Groups``).

    :param starts: each partition's bound, the offset the last cycle stored for it.
    :param reader_ends: each partition's end in the last cycle that read it: where it stores
        once its held records apply, if no later cycle read it.
    :param since: when the oldest was first held."""

    items: list[Item] = field(default_factory=list)
    groups: Groups = field(default_factory=Groups)
    starts: dict[TopicPartition, int] = field(default_factory=dict)
    reader_ends: dict[TopicPartition, int] = field(default_factory=dict)
    since: float | None = None


@dataclass(frozen=True)
class Planned:
    """A cycle's stage and range: ``records`` the records it applies (their lines are not kept:
    a retry makes them again), ``rows`` the stage lines they make (the transaction topic's
    records are counted, not staged); ``groups`` their groups for the database's walk, None
    when walked here (``walked``)."""

    records: list[KafkaRecord]
    rows: int
    groups: Groups | None
    starts: dict[TopicPartition, int]
    ends: dict[TopicPartition, int]
    bound: dict[tuple[str, int], int] = field(default_factory=dict)  # each partition's first held offset

    @property
    def count(self) -> StageCount:
        return StageCount(self.rows, self.groups, walked=self.groups is None)

    def chunks(self, mirror: MirrorApply, keep_raw: bool) -> Iterator[bytes]:
        """The stage's COPY text, made again (a retry, or an isolation with each record's raw bytes)."""
        lines = mirror.lines_of(mirror.group_counter())  # counts nothing used: the plan is made
        return bounded_chunks(lines(self.records, keep_raw), STAGE_CHUNK_CHARS)


class TransactionHolds:
    """One run's held records, and the plans of its cycles, made one after the other.

    :param mirror: the pipeline's mirror (``transactions: whole``).
    :param max_bytes: the held records' bound (H3).
    :param held_in_database: whether ``held_changes`` holds records of the pipeline now (H3, H4).
    :param notify: ``notify(event, **fields)`` for each cycle that holds or releases records."""

    def __init__(self, mirror: MirrorApply, max_bytes: int, held_in_database: Callable[[], bool],
                 notify: Callable[..., None], clock: Callable[[], float] = time.monotonic) -> None:
        self.mirror, self.max_bytes, self.notify, self.clock = mirror, max_bytes, notify, clock
        self.held_in_database = held_in_database
        self.held = Held()
        self.in_database = True  # not known until the first plan looks (H4)
        self.failed = threading.Event()  # set by the run once a cycle's commit failed
        self._last: CyclePlan | None = None

    def plan(self, messages: list[Any], starts: dict[TopicPartition, int],
             ends: dict[TopicPartition, int]) -> CyclePlan:
        """The plan of the cycle read next (made when first asked, after the previous one's)."""
        self._last = CyclePlan(self, messages, starts, ends, self._last)
        return self._last

    def look_at_database(self) -> None:
        """Whether ``held_changes`` still holds records of the pipeline (H3, H4). A failed look
        (the database unreachable) leaves the walk to the database, which is right either way:
        the cycle's staging or apply then meets the outage and retries it."""
        try:
            self.in_database = self.held_in_database()
        except Exception as exc:
            self.notify("held_changes_not_read", error=" ".join(str(exc).split())[:300])

    def overdue(self) -> bool:
        """Whether the oldest held record has waited past ``HOLD_SECONDS`` (the loop then commits
        an empty cycle, so that an idle stream moves it to ``held_changes`` too: H3)."""
        since = self.held.since
        return since is not None and self.clock() - since > HOLD_SECONDS

    def decide(self, held: Held, records: list[KafkaRecord], lines: list[str], groups: Groups,
               starts: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> Planned:
        """Walks the records ``held`` before and the cycle's ``records`` (``groups`` counts both;
        see the module), and keeps what waits in place of ``held``. ``lines``: each record's stage
        line, empty for one counted instead of staged (the transaction topic's BEGINs and ENDs)."""
        rows = len(held.items) + len(records) - lines.count("")
        self.held = Held()
        starts = {**starts, **held.starts}
        reader_ends = {**held.reader_ends, **ends}
        if self.in_database:
            return Planned(_records(held.items) + records, rows, groups, starts, reader_ends)
        walked = transaction_walk.walk(groups)
        bound = {(t, p): first for t, p, first, _ in walked.bounds}
        held_below = _below_each(_records(held.items), bound)
        released = list(compress(held.items, held_below))
        kept = [item for item, now in zip(held.items, held_below, strict=True) if not now]
        applied = records
        if bound:  # a record applies, or waits with its line (a counted one has none)
            below = _below_each(records, bound)
            applied = list(compress(records, below))
            # A refused record of the transaction topic has a line; the others counted have none.
            kept += [(record, line) for record, line, now in zip(records, lines, below, strict=True)
                     if not now and line]
        kept_groups = groups.at_or_above(bound, NO_BOUND)
        size = sum(_size(item) for item in kept)
        now = self.clock()
        since = held.since if held.since is not None and _any_kept(held, bound) else now
        if size > self.max_bytes or (kept_groups and now - since > HOLD_SECONDS):
            self.in_database = True  # H3
            self.notify("transactions_held_in_database", records=len(kept), bytes=size, max_bytes=self.max_bytes,
                        seconds=round(now - since, 1), waiting=walked.waiting)
            return Planned(_records(held.items) + records, rows, groups, starts, reader_ends)
        if kept_groups or held.groups:
            self.notify("mirror_transactions", held=len(kept), held_bytes=size, held_in="memory",
                        released=len(released), transactions_applied=walked.ready, waiting=walked.waiting)
        if kept_groups:
            self.held = Held(kept, kept_groups, dict(bound), {tp: reader_ends[tp] for tp in bound}, since)
        return Planned(_records(released) + applied, rows - len(kept), None, starts, {**reader_ends, **bound}, bound)


# Staging: COPYs the chunks, then runs the callable, if any, on its cursor and the stage, in its transaction.
Copy = Callable[[Iterator[bytes], Callable[[Any, Any], None] | None], None]


class CyclePlan:
    """One cycle's plan, made once, after the previous cycle's: by its first staging, which
    COPYs every record's line as it is made and then removes from the stage, in the same
    transaction, what the walk holds; else (that staging failed) by its apply. ``committed`` is
    set once the cycle's commit has ended."""

    def __init__(self, holds: TransactionHolds, messages: list[Any], starts: dict[TopicPartition, int],
                 ends: dict[TopicPartition, int], previous: CyclePlan | None) -> None:
        self.holds, self.previous = holds, previous
        self._cycle: tuple[list[Any], dict, dict] | None = (messages, starts, ends)
        self._lock = threading.Lock()
        self._planned: Planned | None = None
        self._failure: BaseException | None = None
        self.committed = threading.Event()

    def stage(self, copy: Copy, keep_raw: bool) -> StageCount:
        """Stages the cycle with ``copy`` (see the class); returns what it staged."""
        with self._lock:
            if self._planned is None and self._failure is None and not keep_raw:
                self._stage_while_planning(copy)
                assert self._planned is not None
                return self._planned.count
        planned = self.result()
        copy(planned.chunks(self.holds.mirror, keep_raw), None)
        return planned.count

    def result(self) -> Planned:
        """The plan; raises the walk's refusal (H5) or the previous plan's, each time."""
        with self._lock:
            if self._planned is None and self._failure is None:
                held, records, counter = self._begin()
                lines = list(self.holds.mirror.lines_of(counter, aligned=True)(records, False))
                self._decide(held, records, lines, counter)
            return self._made()

    def _stage_while_planning(self, copy: Copy) -> None:
        """COPYs the held records' lines and the cycle's as they are made, walks once the last
        chunk is sent, then (``after``: the COPY ended, its transaction open) removes what is held
        from the stage. A staging that fails before the walk leaves the plan unmade, and the
        held records as they were."""
        held, records, counter = self._begin()

        def chunks() -> Iterator[bytes]:
            made: list[str] = []  # every line sent, an empty one for each record counted instead
            lines = self.holds.mirror.lines_of(counter, aligned=True)(records, False)
            yield from bounded_chunks(chain((line for _, line in held.items), lines), STAGE_CHUNK_CHARS, made)
            self._decide(held, records, made[len(held.items):], counter)  # while the database takes the last chunk

        def after(cur: Any, stage: Any) -> None:
            planned = self._made()
            if planned.bound:
                cur.execute(*transactions_sql.remove_held(stage, planned.bound))

        copy(chunks(), after)

    def _begin(self) -> tuple[Held, list[KafkaRecord], Any]:
        self._wait_for_previous()
        if self.holds.in_database:
            self.holds.look_at_database()
        assert self._cycle is not None
        return self.holds.held, list(MessageChunk(self._cycle[0]).records()), self.holds.mirror.group_counter()

    def _decide(self, held: Held, records: list[KafkaRecord], lines: list[str], counter: Any) -> None:
        assert self._cycle is not None
        _, starts, ends = self._cycle
        try:
            groups = Groups.joined([held.groups, counter.groups()])
            self._planned = self.holds.decide(held, records, lines, groups, starts, ends)
        except Exception as exc:
            self._failure = exc
        self._cycle = None  # the messages are the plan's records now

    def _made(self) -> Planned:
        if self._failure is not None:
            raise self._failure
        assert self._planned is not None
        return self._planned

    def _wait_for_previous(self) -> None:
        """The previous plan made (its held records are this one's), and in H3 and H4 its commit
        ended, which may have emptied ``held_changes``."""
        previous = self.previous
        if previous is None:
            return
        previous.result()
        while self.holds.in_database and not previous.committed.wait(_WAIT_SLICE_SECONDS):
            if self.holds.failed.is_set():  # A2: a cycle before it failed, and no later one commits
                raise RuntimeError("an earlier cycle failed; this one will not commit")
        self.previous = None


def _below_each(records: list[KafkaRecord], bound: dict[tuple[str, int], int]) -> list[bool]:
    """Whether each record lies below its partition's bound: applied now, not held. One
    comprehension: a cycle has tens of thousands."""
    get = bound.get
    return [offset < get((topic, partition), NO_BOUND) for topic, partition, offset, _, _ in records]


def _any_kept(held: Held, bound: dict[tuple[str, int], int]) -> bool:
    """Whether a group held before stays held (its transaction still incomplete)."""
    return any(held.groups.reaching(bound, NO_BOUND))


def _records(items: list[Item]) -> list[KafkaRecord]:
    return [record for record, _ in items]


def _size(item: Item) -> int:
    (_, _, _, key, value), line = item
    return len(key or b"") + len(value or b"") + len(line)
