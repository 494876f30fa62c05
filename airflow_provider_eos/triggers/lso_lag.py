"""Trigger that watches the last-stable-offset lag of Kafka topics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_eos.utils.lso_watch import (
    DEFAULT_MARGIN_SECONDS,
    DEFAULT_TXN_MAX_TIMEOUT_MS,
    LsoReport,
    LsoWatch,
)

HEALTH = "health"
GATE = "gate"
WATCH_MODES = (HEALTH, GATE)


def check_mode(mode: str) -> str:
    if mode not in WATCH_MODES:
        raise ValueError(f"mode must be one of {WATCH_MODES}, got {mode!r}")
    return mode


def evaluate(
    mode: str, watch: LsoWatch, report: LsoReport, deadline: float | None = None, poke_interval: float = 0.0
) -> str | None:
    """
    Decide whether a watch is finished after ``report``.

    ``health``: ``'stuck'`` as soon as any partition is ``open`` or ``hanging``;
    ``'ok'`` once a full window of ``stuck_after`` seconds was watched with nothing
    stuck.

    ``gate``: ``'ok'`` as soon as no partition is stuck (:attr:`LsoReport.gate_ready`:
    every partition has no lag, or its LSO advanced within ``stuck_after``). A stuck
    (``open``) partition keeps the gate waiting, because its coordinator still aborts
    the transaction when the producer's ``transaction.timeout.ms`` expires; a
    ``hanging`` one fails it at once (nothing will resolve it). When the next
    observation would come after ``deadline``, the gate gives up: ``'stuck'`` if a
    partition is stuck, else ``'timeout'``.

    :param deadline: wall-clock time (``report.observed_at``'s clock) after which the
        gate gives up; None waits forever (the task's own timeout ends it).
    :param poke_interval: seconds until the next observation.
    :return: the event status, or None to keep watching.
    """
    if mode == HEALTH:
        if report.stuck:
            return "stuck"
        if report.watched_seconds >= watch.stuck_after:
            return "ok"
        return None
    if report.gate_ready:
        return "ok"
    if report.hanging:
        return "stuck"
    if deadline is not None and report.observed_at + poke_interval > deadline:
        return "stuck" if report.stuck else "timeout"
    return None


def event_payload(mode: str, status: str, report: LsoReport, watch: LsoWatch | None = None) -> dict[str, Any]:
    """The trigger's event: status, mode, the readable report and its dict, and the watch's
    JSON state at the end (the sensor stores the stuck-since times from it)."""
    message = report.format()
    if mode == GATE:
        # The line that names the stuck partitions and for how long comes first.
        message = f"{report.gate_summary()}\n{message}"
    return {
        "status": status,
        "mode": mode,
        "message": message,
        "report": report.to_dict(),
        "watch_state": None if watch is None else watch.to_json(),
    }


class LsoLagTrigger(BaseTrigger):
    """
    Polls HW and LSO of every partition of ``topics`` and fires when the watch ends.

    The blocking Admin API calls run in a worker thread, so the triggerer's event
    loop is never blocked.

    :param topics: topic names to watch (all their partitions, including partitions
        added while watching).
    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
    :param mode: ``health`` (event ``stuck`` with the report as soon as a partition's
        LSO has not advanced for ``stuck_after`` seconds while it has lag, or ``ok``
        after a full ``stuck_after`` window with nothing stuck) or ``gate`` (event
        ``ok`` as soon as no partition is stuck: each has no lag or an LSO that
        advanced within ``stuck_after``; event ``stuck`` on a ``hanging`` partition,
        or at ``deadline`` while a partition is stuck, naming it; ``timeout`` at
        ``deadline`` otherwise).
    :param stuck_after: seconds without LSO progress (with lag) before a partition counts as stuck.
    :param poke_interval: seconds between two observations.
    :param txn_max_timeout_ms: the broker's ``transaction.max.timeout.ms`` (``hanging`` threshold).
    :param margin: seconds added to ``txn_max_timeout_ms`` before a partition is ``hanging``.
    :param hanging_after: seconds stuck before a partition is ``hanging``, instead of
        ``txn_max_timeout_ms`` + ``margin`` (None: those).
    :param request_timeout: seconds allowed for each Admin API request.
    :param watch_state: JSON state of an :class:`~airflow_provider_eos.utils.lso_watch.LsoWatch`
        to resume from (set by :meth:`serialize`, or by the sensor with the stuck-since
        times of earlier runs); its thresholds win over the ones above.
    :param deadline: ``gate`` only: Unix time at which the gate gives up and reports
        what is stuck (absolute, so a triggerer restart does not extend it); None
        waits until the task's own timeout.
    """

    def __init__(
        self,
        topics: Sequence[str],
        kafka_config_id: str = "kafka_default",
        mode: str = HEALTH,
        stuck_after: float = 60.0,
        poke_interval: float = 10.0,
        txn_max_timeout_ms: int = DEFAULT_TXN_MAX_TIMEOUT_MS,
        margin: float = DEFAULT_MARGIN_SECONDS,
        request_timeout: float = 10.0,
        watch_state: dict[str, Any] | None = None,
        deadline: float | None = None,
        hanging_after: float | None = None,
    ) -> None:
        super().__init__()
        self.deadline = None if deadline is None else float(deadline)
        self.topics = list(topics)
        self.kafka_config_id = kafka_config_id
        self.mode = check_mode(mode)
        self.stuck_after = float(stuck_after)
        self.poke_interval = float(poke_interval)
        self.txn_max_timeout_ms = int(txn_max_timeout_ms)
        self.margin = float(margin)
        self.request_timeout = float(request_timeout)
        self.hanging_after = None if hanging_after is None else float(hanging_after)
        self.watch = (
            LsoWatch.from_json(watch_state)
            if watch_state
            else LsoWatch(
                stuck_after=self.stuck_after,
                txn_max_timeout_ms=self.txn_max_timeout_ms,
                margin=self.margin,
                hanging_after=self.hanging_after,
            )
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "topics": list(self.topics),
                "kafka_config_id": self.kafka_config_id,
                "mode": self.mode,
                "stuck_after": self.stuck_after,
                "poke_interval": self.poke_interval,
                "txn_max_timeout_ms": self.txn_max_timeout_ms,
                "margin": self.margin,
                "request_timeout": self.request_timeout,
                "watch_state": self.watch.to_json(),
                "deadline": self.deadline,
                "hanging_after": self.hanging_after,
            },
        )

    def _make_hook(self):
        from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook

        return KafkaOffsetsHook(kafka_config_id=self.kafka_config_id, timeout=self.request_timeout)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            hook = await asyncio.to_thread(self._make_hook)
            await asyncio.to_thread(hook.get_admin_client)
        except Exception as err:
            yield TriggerEvent({"status": "error", "mode": self.mode, "message": str(err), "report": None})
            return
        while True:
            started = time.monotonic()
            try:
                offsets = await asyncio.to_thread(hook.partition_offsets, self.topics, False)
            except Exception as err:
                yield TriggerEvent({"status": "error", "mode": self.mode, "message": str(err), "report": None})
                return
            report = self.watch.observe(time.time(), offsets)
            self.log.debug("%s", report)
            status = evaluate(self.mode, self.watch, report, self.deadline, self.poke_interval)
            if status is not None:
                self.log.info("LSO lag watch (%s) finished: %s\n%s", self.mode, status, report)
                yield TriggerEvent(event_payload(self.mode, status, report, self.watch))
                return
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.poke_interval - elapsed))
