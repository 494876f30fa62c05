"""Which engine replays a recovery: ``spark``, ``direct``, or ``auto`` (by the replay's size).

A recovery's replay is usually small (what came after the snapshot) and urgent. ``direct``
(``spark_apps/eos_stream/engines/direct_replay.py``) replays in the Airflow worker's process and pays
no spark-submit and no cold first batch; ``spark`` pays ~12 s for those whatever the size but
then reads with every executor of the cluster. So ``auto`` takes ``direct`` when the records
between the restored offsets and Kafka's last stable offsets are at most
``direct_max_records``, and ``spark`` otherwise.

Why 500,000 by default (measured on the 2-core bench machine, docs/benchmarks.md "Recovery"):
``direct`` replayed 20k records in ~1.2 s and 200k in ~3.4 s (``direct_replay.replay`` alone,
load average ~3.7: ~12 µs a record after ~1 s), while ``spark`` spent 13.6 s on 20k and 16.7 s on
200k (``bench/results/recovery_times.json`` as of 27c510e, unloaded: ~13 s before its first record is
written, whatever the size). Even a cluster that read infinitely fast would still pay those
~13 s, in which ``direct`` replays ~1M records; 500k keeps a factor of two for a slower worker or
larger records. Below it ``direct`` is the faster engine on any cluster; above it a cluster's
executors may win, and a replay that large should not hold one worker's process anyway.

Nothing here imports Airflow: the choice is pure, the operator logs and returns it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from spark_apps.eos_stream.run.config import REPLAY_ENGINES

AUTO = "auto"
# What a definition's ``stream.replay_engine`` and ReplayOperator(engine=...) accept.
REPLAY_ENGINE_CHOICES = (AUTO, *REPLAY_ENGINES)
DEFAULT_REPLAY_ENGINE = AUTO
DEFAULT_DIRECT_MAX_RECORDS = 500_000


@dataclass(frozen=True)
class ReplayChoice:
    """The engine a replay runs on, and why.

    :param engine: ``spark`` or ``direct``: what runs.
    :param asked: what the definition or the operator asked for (``auto``, ``spark``, ``direct``).
    :param records_to_replay: offsets between the restored offsets and the last stable offsets
        (an upper bound on the records: transaction markers take offsets too); None: unknown.
    :param direct_max_records: ``auto``'s threshold.
    :param reason: one sentence for the log.
    """

    engine: str
    asked: str
    records_to_replay: int | None
    direct_max_records: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_replay_engine(asked: str, records_to_replay: int | None, direct_max_records: int) -> ReplayChoice:
    """The engine for a replay of ``records_to_replay`` records.

    ``spark`` and ``direct`` are taken as asked. ``auto`` takes ``direct`` up to
    ``direct_max_records`` records, ``spark`` above; an unknown count takes ``spark``, the engine
    that is never badly wrong: it costs seconds on a small replay, while ``direct`` on a huge one
    reads everything through one process.

    :raises ValueError: ``asked`` is not a choice, or the threshold is negative.
    """
    if asked not in REPLAY_ENGINE_CHOICES:
        raise ValueError(f"unknown replay engine {asked!r}; choose one of {', '.join(REPLAY_ENGINE_CHOICES)}")
    if direct_max_records < 0:
        raise ValueError(f"direct_max_records must be >= 0, not {direct_max_records}")
    if asked != AUTO:
        engine, reason = asked, f"{asked} as asked"
    elif records_to_replay is None:
        engine, reason = "spark", "the number of records to replay is unknown"
    elif records_to_replay <= direct_max_records:
        engine, reason = "direct", f"{records_to_replay} records to replay <= {direct_max_records}"
    else:
        engine, reason = "spark", f"{records_to_replay} records to replay > {direct_max_records}"
    return ReplayChoice(engine, asked, records_to_replay, direct_max_records, reason)
