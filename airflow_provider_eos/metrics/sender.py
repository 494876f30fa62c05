"""The one place the provider sends metrics: through Airflow's Stats (``airflow.sdk.observability.stats``).

Airflow's task runner initializes Stats from ``[metrics]`` (StatsD, DogStatsD or OpenTelemetry)
in the worker's task process, so callers are worker-side code: operators and the sensors'
``execute``/``execute_complete``, never triggers (the triggerer initializes another copy of
the module). Without metrics configured Stats drops everything at no cost.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from airflow_provider_eos.metrics.scheme import COUNTER, GAUGE, TIMER, Metric

log = logging.getLogger(__name__)


def emit(metrics: Iterable[Metric]) -> int:
    """
    Sends each metric through Airflow's Stats. A failure is logged, never raised: metrics must
    not fail the task that measured them.

    :param metrics: what to send (from :mod:`airflow_provider_eos.metrics.scheme`).
    :return: how many were handed to Stats.
    """
    from airflow.sdk.observability import stats

    sent = 0
    for metric in metrics:
        tags = dict(metric.tags)
        try:
            if metric.kind == GAUGE:
                stats.gauge(metric.name, metric.value, tags=tags)
            elif metric.kind == COUNTER:
                stats.incr(metric.name, int(metric.value), tags=tags)
            elif metric.kind == TIMER:
                # A timedelta: StatsD and OpenTelemetry both turn it into milliseconds themselves.
                stats.timing(metric.name, timedelta(seconds=metric.value), tags=tags)
            else:
                raise ValueError(f"unknown metric kind {metric.kind!r}")
            sent += 1
        except Exception:
            log.warning("could not send metric %s", metric.name, exc_info=True)
    return sent
