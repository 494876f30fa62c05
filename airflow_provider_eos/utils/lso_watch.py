"""Last-stable-offset (LSO) lag: pure logic, no Kafka client and no Airflow.

In a Kafka partition the *high watermark* (HW) is the end of the log as seen by a
``read_uncommitted`` consumer and the *last stable offset* (LSO) is the end as seen
by a ``read_committed`` consumer: the first offset of the oldest transaction that is
still open. ``HW - LSO`` is the LSO lag. It is normal for it to be positive for a
moment while transactions commit; it becomes a problem when the LSO stops moving,
because every ``read_committed`` reader of the partition (Spark with
``kafka.isolation.level=read_committed``, our exactly-once pipelines) stalls behind it.

:class:`LsoWatch` turns successive offset observations into a per-partition
classification:

``ok``
    lag is 0.
``lagging``
    lag > 0, but the LSO moved within ``stuck_after`` seconds (ordinary traffic).
``open``
    the LSO has not moved for at least ``stuck_after`` seconds while lag > 0, but for
    less than the broker's ``transaction.max.timeout.ms`` + ``margin``: an open
    transaction that the transaction coordinator will still abort once the
    producer's ``transaction.timeout.ms`` expires (e.g. a crashed producer).
``hanging``
    stuck for longer than ``transaction.max.timeout.ms`` + ``margin``: no producer
    may use a longer timeout, so the coordinator no longer resolves it (a *hanging
    transaction*, KIP-664); an operator must abort it
    (see :class:`~airflow_provider_eos.operators.hanging_transactions.HangingTransactionsOperator`).

"Stuck" time is measured from the first observation at which the partition had
lag with its current LSO, so it never over-estimates: a transaction that was
already open when watching started is reported as stuck only after ``stuck_after``
seconds of watching.

A partition with lag is *advancing* once the watch has seen its LSO move (or its
lag appear after none): its stuck time is then the age of its LSO (to within one
observation interval), not only a lower bound. The recovery gate
(:attr:`LsoReport.gate_ready`) passes when every partition has no lag or is
advancing and not stuck: under continuous transactional traffic
some transaction is almost always open, so "lag 0 everywhere at once" may never
happen, but an LSO that keeps moving is harmless to a replay that stops at the LSO
it saw.

The watch state serializes to plain JSON (:meth:`LsoWatch.to_json` /
:meth:`LsoWatch.from_json`) so a deferred trigger can re-create itself from kwargs.

Across runs (a scheduled health check watches for a few minutes at most, a hanging
transaction is one stuck for 15 minutes or more) the stuck-since times travel as
:class:`StoredPartition` rows, whose ``stuck_for`` is an *age* rather than a time:
:meth:`LsoWatch.resume` seeds a watch with them and :meth:`LsoWatch.to_stored`
gives them back, so the store can keep them on its own clock (the database's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from spark_apps.eos_stream.kafka.partitions import TopicPartition as TopicPartitionKey

OK = "ok"
LAGGING = "lagging"
OPEN = "open"
HANGING = "hanging"
CLASSIFICATIONS = (OK, LAGGING, OPEN, HANGING)
STUCK_CLASSIFICATIONS = (OPEN, HANGING)

DEFAULT_TXN_MAX_TIMEOUT_MS = 900_000  # Kafka's default transaction.max.timeout.ms (15 min)
DEFAULT_MARGIN_SECONDS = 60.0



@dataclass(frozen=True)
class StoredPartition:
    """
    A partition's stuck state as kept between watches (e.g. health-check runs).

    :param topic: topic name.
    :param partition: partition number.
    :param high_watermark: HW when last seen (a lower HW later means the topic was recreated).
    :param last_stable: the LSO that has been behind the HW since ``stuck_for`` seconds ago.
    :param stuck_for: seconds since the partition was first seen with lag at this very LSO,
        as of when the state was read.
    """

    topic: str
    partition: int
    high_watermark: int
    last_stable: int
    stuck_for: float


@dataclass(frozen=True)
class PartitionOffsets:
    """
    Offsets of one partition, as read with ``ListOffsets``.

    :param high_watermark: end of the log for ``read_uncommitted`` (latest offset).
    :param last_stable: end of the log for ``read_committed`` (the LSO).
    :param earliest: first offset still in the log (retention start), if it was read.
    """

    high_watermark: int
    last_stable: int
    earliest: int | None = None

    @property
    def lag(self) -> int:
        """``HW - LSO``; 0 for empty partitions and after an abort (control markers
        occupy offsets, so HW == LSO even when only aborted records exist)."""
        return max(0, self.high_watermark - self.last_stable)


def lso_lag(offsets: PartitionOffsets) -> int:
    """LSO lag of a partition: ``HW - LSO``, never negative."""
    return offsets.lag


@dataclass(frozen=True)
class PartitionStatus:
    """One row of an :class:`LsoReport`."""

    topic: str
    partition: int
    high_watermark: int
    last_stable: int
    lag: int
    stuck_seconds: float
    classification: str
    earliest: int | None = None
    # Lag 0, or the LSO was seen to move (or the lag to appear) while watching.
    advancing: bool = False

    @property
    def name(self) -> str:
        return f"{self.topic}[{self.partition}]"


@dataclass(frozen=True)
class LsoReport:
    """The classification of all watched partitions at one observation."""

    observed_at: float
    watched_seconds: float
    stuck_after: float
    hanging_after: float
    partitions: tuple[PartitionStatus, ...]

    @property
    def stuck(self) -> list[PartitionStatus]:
        return [p for p in self.partitions if p.classification in STUCK_CLASSIFICATIONS]

    @property
    def hanging(self) -> list[PartitionStatus]:
        return [p for p in self.partitions if p.classification == HANGING]

    @property
    def total_lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    @property
    def all_caught_up(self) -> bool:
        """True when the LSO equals the HW on every partition (nothing uncommitted)."""
        return all(p.lag == 0 for p in self.partitions)

    @property
    def unconfirmed(self) -> list[PartitionStatus]:
        """Partitions with lag whose LSO has not moved since watching began, but not
        yet for ``stuck_after``: open or stuck, the watch cannot tell yet."""
        return [p for p in self.partitions if p.classification == LAGGING and not p.advancing]

    @property
    def gate_ready(self) -> bool:
        """True when no partition is stuck and none is unconfirmed: every partition
        has no lag, or its LSO advanced within ``stuck_after`` (open transactions
        that keep committing)."""
        return all(p.classification == OK or (p.classification == LAGGING and p.advancing) for p in self.partitions)

    def gate_summary(self) -> str:
        """One line naming what keeps the gate closed (stuck partitions and for how long first)."""
        if self.gate_ready:
            return f"gate open: no partition stuck ({sum(p.lag > 0 for p in self.partitions)} with open transactions)"
        parts = []
        if self.stuck:
            parts.append(
                "stuck (LSO not moved for stuck_after or longer): "
                + ", ".join(
                    f"{p.name} LSO {p.last_stable} lag {p.lag} for {p.stuck_seconds:.1f}s ({p.classification})"
                    for p in sorted(self.stuck, key=lambda p: -p.stuck_seconds)
                )
            )
        if self.unconfirmed:
            parts.append(
                "not yet seen advancing: "
                + ", ".join(
                    f"{p.name} LSO {p.last_stable} lag {p.lag} for {p.stuck_seconds:.1f}s" for p in self.unconfirmed
                )
            )
        return "gate closed: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "observed_at": self.observed_at,
            "watched_seconds": self.watched_seconds,
            "stuck_after": self.stuck_after,
            "hanging_after": self.hanging_after,
            "partitions": [asdict(p) for p in self.partitions],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LsoReport:
        return cls(
            observed_at=float(data["observed_at"]),
            watched_seconds=float(data["watched_seconds"]),
            stuck_after=float(data["stuck_after"]),
            hanging_after=float(data["hanging_after"]),
            partitions=tuple(PartitionStatus(**p) for p in data["partitions"]),
        )

    def format(self, only_with_lag: bool = False) -> str:
        """A fixed-width table, one line per partition (stuck ones first)."""
        rows = [p for p in self.partitions if p.lag > 0 or not only_with_lag]
        order = {HANGING: 0, OPEN: 1, LAGGING: 2, OK: 3}
        rows.sort(key=lambda p: (order.get(p.classification, 9), p.topic, p.partition))
        header = ("topic", "partition", "HW", "LSO", "lag", "stuck_s", "classification")
        lines = [
            (
                p.topic,
                str(p.partition),
                str(p.high_watermark),
                str(p.last_stable),
                str(p.lag),
                f"{p.stuck_seconds:.1f}",
                p.classification,
            )
            for p in rows
        ]
        widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [
            f"LSO lag report: {len(self.partitions)} partition(s), {len(self.stuck)} stuck "
            f"(stuck_after={self.stuck_after:g}s, hanging_after={self.hanging_after:g}s, "
            f"watched {self.watched_seconds:.1f}s)",
            fmt.format(*header),
        ]
        out += [fmt.format(*r) for r in lines]
        if not lines:
            out.append("(no partitions with lag)" if only_with_lag else "(no partitions)")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()


@dataclass
class _PartitionState:
    high_watermark: int
    last_stable: int
    # Since when the partition has had lag with this very LSO (None when lag == 0).
    stuck_since: float | None
    # stuck_since is an observed LSO move (or the lag appearing), not the first sight of the partition.
    advancing: bool = False


def _key_str(key: TopicPartitionKey) -> str:
    return f"{key[0]}:{key[1]}"


def _next_state(before: _PartitionState | None, off: PartitionOffsets, now: float) -> _PartitionState:
    """A partition's state after an observation: since when it is stuck (None: no lag) and
    whether its LSO has been seen to move."""
    if off.lag == 0:
        return _PartitionState(off.high_watermark, off.last_stable, None, True)
    if (
        before is not None
        and before.stuck_since is not None
        and before.last_stable == off.last_stable
        # A lower HW: the topic was recreated, this is another log.
        and off.high_watermark >= before.high_watermark
    ):
        return _PartitionState(off.high_watermark, off.last_stable, before.stuck_since, before.advancing)
    # Lag just appeared, the LSO moved, or the partition is new: start counting now.
    # New, or an LSO that went back (topic recreated): its age is unknown.
    advancing = before is not None and (before.stuck_since is None or off.last_stable > before.last_stable)
    return _PartitionState(off.high_watermark, off.last_stable, now, advancing)


class LsoWatch:
    """
    Tracks, per partition, since when the LSO has not advanced while lag > 0.

    :param stuck_after: seconds without LSO progress (with lag > 0) after which a
        partition is considered stuck (``open`` or ``hanging``).
    :param txn_max_timeout_ms: the broker's ``transaction.max.timeout.ms``; a
        transaction open longer than this (+ ``margin``) is no longer resolved by
        its coordinator and is classified ``hanging``.
    :param margin: seconds added to ``txn_max_timeout_ms`` to cover the
        coordinator's abort interval and clock noise.
    :param hanging_after: seconds stuck after which a partition is ``hanging``; when
        given it replaces ``txn_max_timeout_ms / 1000 + margin``.
    """

    def __init__(
        self,
        stuck_after: float,
        txn_max_timeout_ms: int = DEFAULT_TXN_MAX_TIMEOUT_MS,
        margin: float = DEFAULT_MARGIN_SECONDS,
        hanging_after: float | None = None,
    ) -> None:
        if stuck_after <= 0:
            raise ValueError(f"stuck_after must be positive, got {stuck_after!r}")
        if txn_max_timeout_ms <= 0:
            raise ValueError(f"txn_max_timeout_ms must be positive, got {txn_max_timeout_ms!r}")
        if margin < 0:
            raise ValueError(f"margin must not be negative, got {margin!r}")
        if hanging_after is not None and hanging_after <= 0:
            raise ValueError(f"hanging_after must be positive, got {hanging_after!r}")
        self.stuck_after = float(stuck_after)
        self.txn_max_timeout_ms = int(txn_max_timeout_ms)
        self.margin = float(margin)
        self.hanging_after_override = None if hanging_after is None else float(hanging_after)
        self.started_at: float | None = None
        self.last_observed_at: float | None = None
        self._partitions: dict[TopicPartitionKey, _PartitionState] = {}

    @property
    def hanging_after(self) -> float:
        """Seconds of no LSO progress after which a partition is ``hanging``."""
        if self.hanging_after_override is not None:
            return self.hanging_after_override
        return self.txn_max_timeout_ms / 1000.0 + self.margin

    def classify(self, lag: int, stuck_seconds: float) -> str:
        """Classification for a partition with ``lag`` whose LSO has not moved for
        ``stuck_seconds`` (boundaries: ``>= stuck_after`` is open, ``>= hanging_after``
        is hanging)."""
        if lag <= 0:
            return OK
        if stuck_seconds < self.stuck_after:
            return LAGGING
        if stuck_seconds < self.hanging_after:
            return OPEN
        return HANGING

    def observe(self, now: float, offsets: Mapping[TopicPartitionKey, PartitionOffsets]) -> LsoReport:
        """
        Record one observation and classify every partition in it.

        Partitions that appear for the first time (new topics, partitions added while
        watching) start with no stuck time; partitions that disappear (topic deleted)
        are forgotten.

        :param now: observation time in seconds (any monotonic-ish clock; the same
            clock for every call).
        :param offsets: offsets per ``(topic, partition)``.
        """
        if self.started_at is None:
            self.started_at = now
        previous = self._partitions
        current: dict[TopicPartitionKey, _PartitionState] = {}
        rows: list[PartitionStatus] = []
        for key in sorted(offsets):
            off = offsets[key]
            lag = off.lag
            state = current[key] = _next_state(previous.get(key), off, now)
            since, advancing = state.stuck_since, state.advancing
            stuck = 0.0 if since is None else max(0.0, now - since)
            rows.append(
                PartitionStatus(
                    topic=key[0],
                    partition=key[1],
                    high_watermark=off.high_watermark,
                    last_stable=off.last_stable,
                    lag=lag,
                    stuck_seconds=round(stuck, 3),
                    classification=self.classify(lag, stuck),
                    earliest=off.earliest,
                    advancing=advancing,
                )
            )
        self._partitions = current
        self.last_observed_at = now
        return LsoReport(
            observed_at=now,
            watched_seconds=round(now - self.started_at, 3),
            stuck_after=self.stuck_after,
            hanging_after=self.hanging_after,
            partitions=tuple(rows),
        )

    def watched_seconds(self, now: float) -> float:
        return 0.0 if self.started_at is None else now - self.started_at

    # ------------------------------------------------------------ across runs
    def resume(self, stored: Iterable[StoredPartition], now: float) -> None:
        """
        Seed the watch, before its first observation, with partitions kept by an
        earlier watch: each counts as stuck since ``now - stuck_for``. The first
        observation keeps that time only if the partition still has lag at the same
        LSO (and its HW did not go back); otherwise it starts counting afresh, as for
        any LSO move. Seeded partitions are not ``advancing``: the gate still waits to
        see their LSO move.

        :param stored: rows from :meth:`to_stored` of an earlier watch.
        :param now: the clock of this watch's :meth:`observe` calls.
        """
        if self.started_at is not None:
            raise ValueError("resume() must come before the first observe()")
        for row in stored:
            self._partitions[(row.topic, int(row.partition))] = _PartitionState(
                int(row.high_watermark), int(row.last_stable), now - max(0.0, float(row.stuck_for)), False
            )

    def to_stored(self, now: float) -> list[StoredPartition]:
        """
        The partitions that had lag at the last observation, with for how long
        (as of ``now``) their LSO has not moved: the state to keep for the next watch.
        Partitions without lag are left out, so storing this list clears them.
        """
        return [
            StoredPartition(key[0], key[1], st.high_watermark, st.last_stable, round(max(0.0, now - st.stuck_since), 3))
            for key, st in sorted(self._partitions.items())
            if st.stuck_since is not None
        ]

    # ------------------------------------------------------------ JSON state
    def to_json(self) -> dict[str, Any]:
        """Plain-JSON state (str keys, numbers, lists) for trigger kwargs."""
        return {
            "stuck_after": self.stuck_after,
            "txn_max_timeout_ms": self.txn_max_timeout_ms,
            "margin": self.margin,
            "hanging_after": self.hanging_after_override,
            "started_at": self.started_at,
            "last_observed_at": self.last_observed_at,
            "partitions": [
                {
                    "topic": key[0],
                    "partition": key[1],
                    "high_watermark": st.high_watermark,
                    "last_stable": st.last_stable,
                    "stuck_since": st.stuck_since,
                    "advancing": st.advancing,
                }
                for key, st in sorted(self._partitions.items())
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LsoWatch:
        watch = cls(
            stuck_after=data["stuck_after"],
            txn_max_timeout_ms=data["txn_max_timeout_ms"],
            margin=data["margin"],
            hanging_after=data.get("hanging_after"),
        )
        watch.started_at = data.get("started_at")
        watch.last_observed_at = data.get("last_observed_at")
        for p in data.get("partitions", []):
            watch._partitions[(p["topic"], int(p["partition"]))] = _PartitionState(
                int(p["high_watermark"]), int(p["last_stable"]), p["stuck_since"], bool(p.get("advancing", False))
            )
        return watch

    def __repr__(self) -> str:
        return (
            f"LsoWatch(stuck_after={self.stuck_after}, txn_max_timeout_ms={self.txn_max_timeout_ms}, "
            f"margin={self.margin}, hanging_after={self.hanging_after}, "
            f"partitions={[_key_str(k) for k in sorted(self._partitions)]})"
        )
