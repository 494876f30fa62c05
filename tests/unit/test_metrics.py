"""The metric names and values made from the reports the checks, the app and the recovery produce
(airflow_provider_eos/metrics/scheme.py; the scheme is documented in docs/metrics.md)."""

from __future__ import annotations

from airflow_provider_eos.metrics.scheme import Metric, health_metrics, recovery_metrics, segment, stream_event_metrics
from airflow_provider_eos.metrics.sender import emit
from airflow_provider_eos.utils.lso_watch import LsoReport, PartitionStatus


def _by_name(metrics: list[Metric]) -> dict[str, tuple[str, float]]:
    names = [m.name for m in metrics]
    assert len(names) == len(set(names)), names
    return {m.name: (m.kind, m.value) for m in metrics}


def test_segments_keep_the_name_hierarchy() -> None:
    # Topic and pipeline names may contain dots: StatsD would read them as levels.
    assert segment("ledger.events") == "ledger__events"
    assert segment("orders-v2_x") == "orders-v2_x"
    assert segment(3) == "3"
    assert segment("a b/c") == "a_b_c"  # characters StatsD refuses


def test_health_metrics_from_every_check() -> None:
    lso = LsoReport(observed_at=1.0, watched_seconds=5.0, stuck_after=2.0, hanging_after=60.0, partitions=(
        PartitionStatus("ledger.p1", 0, 10, 7, 3, 4.5, "open"),
        PartitionStatus("ledger.p1", 1, 5, 5, 0, 0.0, "ok"),
    )).to_dict()
    reports = {
        "lso_lag": lso,
        "liveness": {"ok": True, "age_seconds": 12.5, "message": "..."},
        "caught_up": {"ok": False, "partitions": [{"topic": "ledger.p1", "partition": 0, "lag": 2},
                                                  {"topic": "ledger.p1", "partition": 1, "lag": 0}]},
        "dead_letters": {"new": 2, "last_seen_id": 9},
        "prepared_transactions": {"count": 1, "oldest_seconds": 30.25, "in_doubt": [{"gid": "x"}]},
    }
    metrics = health_metrics("p1", reports)
    assert _by_name(metrics) == {
        "eos.p1.partition.ledger__p1.0.lso_lag": ("gauge", 3.0),
        "eos.p1.partition.ledger__p1.0.lso_stuck_seconds": ("gauge", 4.5),
        "eos.p1.partition.ledger__p1.1.lso_lag": ("gauge", 0.0),
        "eos.p1.partition.ledger__p1.1.lso_stuck_seconds": ("gauge", 0.0),
        "eos.p1.last_batch_age_seconds": ("gauge", 12.5),
        "eos.p1.partition.ledger__p1.0.records_behind": ("gauge", 2.0),
        "eos.p1.partition.ledger__p1.1.records_behind": ("gauge", 0.0),
        "eos.p1.new_dead_letters": ("gauge", 2.0),
        "eos.p1.in_doubt_transactions": ("gauge", 1.0),
        "eos.p1.in_doubt_oldest_seconds": ("gauge", 30.25),
    }
    # Tags keep the original names for the backends that keep tags.
    assert metrics[0].tags == {"pipeline": "p1", "topic": "ledger.p1", "partition": "0"}
    assert all(m.tags["pipeline"] == "p1" for m in metrics)


def test_a_check_that_measured_nothing_sends_nothing() -> None:
    # Never a batch (age None), a check that failed before measuring (report None): no metric, not 0.
    reports = {"liveness": {"ok": False, "age_seconds": None}, "lso_lag": None, "dead_letters": None}
    assert health_metrics("p1", reports) == []
    assert health_metrics("p1", {}) == []


def test_stream_events() -> None:
    assert _by_name(stream_event_metrics("ledger.x", "progress", {"batch_id": 3, "rows_per_second": 812.4})) == {
        "eos.ledger__x.rows_per_second": ("gauge", 812.4)}
    # A batch without dead letters still sends the counter (0), so the series exists.
    assert _by_name(stream_event_metrics("p", "batch", {"applied": 120, "dead_lettered": 0})) == {
        "eos.p.rows_applied": ("incr", 120.0), "eos.p.dead_letters": ("incr", 0.0)}
    assert stream_event_metrics("p", "resume", {"epoch": 2}) == []
    assert stream_event_metrics("p", "progress", {"batch_id": 0}) == []


def test_recovery_steps() -> None:
    metrics = recovery_metrics("p", {"lock": 0.25, "restore": 3.5, "finalize": None})
    assert _by_name(metrics) == {"eos.p.recovery.lock": ("timing", 0.25), "eos.p.recovery.restore": ("timing", 3.5)}
    assert metrics[1].tags == {"pipeline": "p", "step": "restore"}


def test_emit_without_metrics_configured_sends_nothing_and_never_raises() -> None:
    # Stats not initialized (no [metrics] backend): everything is dropped, quietly.
    assert emit([*recovery_metrics("p", {"lock": 1.0}), Metric("bogus", "eos.p.x", 1.0)]) == 1
