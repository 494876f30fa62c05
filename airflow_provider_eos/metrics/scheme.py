"""The provider's metrics: their names and values, made from reports its tasks already produce.

Pure (no I/O): :mod:`airflow_provider_eos.metrics.sender` sends what these functions return
through Airflow's Stats. The scheme (docs/metrics.md) puts the pipeline, and the topic and
partition where they matter, into the name, because plain StatsD drops tags; every metric
also carries them as tags for the backends that keep them (DogStatsD, OpenTelemetry, StatsD
with ``statsd_influxdb_enabled``)::

    eos.<pipeline>.partition.<topic>.<partition>.lso_lag            gauge    health check
    eos.<pipeline>.partition.<topic>.<partition>.lso_stuck_seconds  gauge    health check
    eos.<pipeline>.partition.<topic>.<partition>.records_behind     gauge    health check
    eos.<pipeline>.last_batch_age_seconds                           gauge    health check
    eos.<pipeline>.new_dead_letters                                 gauge    health check
    eos.<pipeline>.in_doubt_transactions                            gauge    health check
    eos.<pipeline>.in_doubt_oldest_seconds                          gauge    health check
    eos.<pipeline>.rows_per_second                                  gauge    stream, each batch
    eos.<pipeline>.rows_applied                                     counter  stream, each batch
    eos.<pipeline>.dead_letters                                     counter  stream, each batch
    eos.<pipeline>.recovery.<step>                                  timer    recovery summary

Airflow's ``[metrics] statsd_prefix`` (default ``airflow``) comes in front of each name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow.sdk.observability.stats import normalize_name_for_stats

PREFIX = "eos"
GAUGE, COUNTER, TIMER = "gauge", "incr", "timing"


@dataclass(frozen=True)
class Metric:
    """One observation to send: ``kind`` is ``gauge``, ``incr`` (a counter) or ``timing``
    (``value`` in seconds; sent as a duration)."""

    kind: str
    name: str
    value: float
    tags: Mapping[str, str] = field(default_factory=dict)


def segment(value: Any) -> str:
    """One segment of a metric name. StatsD splits names at dots, and topic (and pipeline)
    names may contain them: '.' becomes '__', as Airflow does for task ids in its own names.
    Any other character StatsD refuses becomes '_' (Airflow's normalize_name_for_stats)."""
    return normalize_name_for_stats(str(value).replace(".", "__"))


def _name(pipeline: str, *parts: Any) -> str:
    return ".".join([PREFIX, segment(pipeline), *(segment(p) for p in parts)])


def _partition_metrics(pipeline: str, rows: Sequence[Mapping[str, Any]], fields: Mapping[str, str]
                       ) -> list[Metric]:
    """For each partition row: a gauge per ``{row_field: metric}``, named under the partition."""
    out = []
    for row in rows:
        tags = {"pipeline": pipeline, "topic": str(row["topic"]), "partition": str(row["partition"])}
        for row_field, metric in fields.items():
            if row.get(row_field) is not None:
                out.append(Metric(GAUGE, _name(pipeline, "partition", row["topic"], row["partition"], metric),
                                  float(row[row_field]), tags))
    return out


def health_metrics(pipeline: str, reports: Mapping[str, Mapping[str, Any] | None]) -> list[Metric]:
    """
    What a health-check run measured, from its checks' reports (passed or failed).

    :param pipeline: the pipeline checked.
    :param reports: check name (``lso_lag``, ``liveness``, ``caught_up``, ``dead_letters``,
        ``prepared_transactions``) -> its report; a check without one (it ended before measuring
        anything) gives no metric, so a gap in a series means "not measured", never 0.
    :return: the metrics, in check order.
    """
    tags = {"pipeline": pipeline}
    out: list[Metric] = []
    lso = reports.get("lso_lag") or {}
    out += _partition_metrics(pipeline, lso.get("partitions") or [],
                              {"lag": "lso_lag", "stuck_seconds": "lso_stuck_seconds"})
    live = reports.get("liveness") or {}
    if live.get("age_seconds") is not None:
        out.append(Metric(GAUGE, _name(pipeline, "last_batch_age_seconds"), float(live["age_seconds"]), tags))
    caught = reports.get("caught_up") or {}
    out += _partition_metrics(pipeline, caught.get("partitions") or [], {"lag": "records_behind"})
    letters = reports.get("dead_letters") or {}
    if letters.get("new") is not None:
        out.append(Metric(GAUGE, _name(pipeline, "new_dead_letters"), float(letters["new"]), tags))
    prepared = reports.get("prepared_transactions") or {}
    if prepared.get("count") is not None:
        out.append(Metric(GAUGE, _name(pipeline, "in_doubt_transactions"), float(prepared["count"]), tags))
        out.append(Metric(GAUGE, _name(pipeline, "in_doubt_oldest_seconds"),
                          float(prepared.get("oldest_seconds") or 0.0), tags))
    return out


def stream_event_metrics(pipeline: str, kind: str, data: Mapping[str, Any]) -> list[Metric]:
    """
    Metrics of one ``EOS-`` event of a running app: a ``progress`` event (Spark's report of a
    finished micro-batch) gives the rows per second, a ``batch`` event (the sink's commit) the
    rows applied and the new dead letters. Other events give none.

    :param pipeline: the app's pipeline.
    :param kind: the event's kind (``progress`` for ``EOS-PROGRESS``...).
    :param data: the event's fields.
    """
    tags = {"pipeline": pipeline}
    if kind == "progress" and data.get("rows_per_second") is not None:
        return [Metric(GAUGE, _name(pipeline, "rows_per_second"), float(data["rows_per_second"]), tags)]
    if kind == "batch":
        # Sent even when 0: a counter series that exists reads 0, not "no data".
        return [Metric(COUNTER, _name(pipeline, "rows_applied"), float(data.get("applied") or 0), tags),
                Metric(COUNTER, _name(pipeline, "dead_letters"), float(data.get("dead_lettered") or 0), tags)]
    return []


def recovery_metrics(pipeline: str, seconds_per_step: Mapping[str, float | None]) -> list[Metric]:
    """
    One timer per recovery step that reported its duration.

    :param pipeline: the pipeline recovered.
    :param seconds_per_step: step (task id) -> seconds, None for a step that did not run.
    """
    return [Metric(TIMER, _name(pipeline, "recovery", step), float(seconds), {"pipeline": pipeline, "step": step})
            for step, seconds in seconds_per_step.items() if seconds is not None]
