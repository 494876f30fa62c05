"""Sensor on the last-stable-offset lag of Kafka topics (stuck / hanging transactions)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.lso_lag import DEFAULT_MARGIN_SECONDS, DEFAULT_TXN_MAX_TIMEOUT_MS, LsoWatch
from airflow_provider_eos.triggers.lso_lag import GATE, HEALTH, LsoLagTrigger, check_mode, evaluate


class LastStableOffsetLagSensor(BaseSensorOperator):
    """
    Waits on the LSO lag (``HW - LSO``) of every partition of ``topics``.

    ``watch_mode='health'`` fails (``AirflowException`` with a per-partition report)
    as soon as a partition's LSO has not advanced for ``stuck_after`` seconds while
    it has lag -- an open transaction that blocks every ``read_committed`` reader --
    and succeeds after one full ``stuck_after`` window with nothing stuck.
    ``watch_mode='gate'`` succeeds when the LSO lag is 0 on all partitions, e.g.
    before a job that must see everything that was written.

    By default the sensor defers at once to :class:`~airflow_provider_eos.triggers.lso_lag.LsoLagTrigger`
    (``timeout`` is honoured). With ``deferrable=False`` it pokes with the same logic;
    the watch state lives on the operator instance, so use ``mode='poke'`` (the
    default) -- in ``reschedule`` mode every poke would start a new watch.

    :param topics: topic names to watch.
    :param kafka_config_id: The connection object to use, defaults to "kafka_default"
    :param watch_mode: ``health`` or ``gate`` (named ``watch_mode`` because ``mode`` is
        the sensor's poke/reschedule mode).
    :param stuck_after: seconds without LSO progress (with lag) before a partition is stuck.
    :param poke_interval: seconds between observations.
    :param txn_max_timeout_ms: the broker's ``transaction.max.timeout.ms``; stuck longer
        than this plus ``margin`` is classified ``hanging``.
    :param margin: seconds added to ``txn_max_timeout_ms``.
    :param request_timeout: seconds allowed for each Admin API request.
    :param deferrable: defer to the trigger (default) instead of poking in the worker.
    """

    template_fields: Sequence[str] = ("topics", "kafka_config_id", "watch_mode")
    ui_color = "#ffefeb"

    def __init__(
        self,
        *,
        topics: Sequence[str],
        kafka_config_id: str = "kafka_default",
        watch_mode: str = HEALTH,
        stuck_after: float = 60.0,
        poke_interval: float = 10.0,
        txn_max_timeout_ms: int = DEFAULT_TXN_MAX_TIMEOUT_MS,
        margin: float = DEFAULT_MARGIN_SECONDS,
        request_timeout: float = 10.0,
        deferrable: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        # Kept as given: a template may render to a string or (native rendering) a list.
        self.topics: Any = topics
        self.kafka_config_id = kafka_config_id
        self.watch_mode = check_mode(watch_mode)
        self.stuck_after = float(stuck_after)
        self.txn_max_timeout_ms = int(txn_max_timeout_ms)
        self.margin = float(margin)
        self.request_timeout = float(request_timeout)
        self.deferrable = deferrable
        self._watch: LsoWatch | None = None
        self.last_report: dict[str, Any] | None = None

    @cached_property
    def hook(self) -> KafkaOffsetsHook:
        return KafkaOffsetsHook(kafka_config_id=self.kafka_config_id, timeout=self.request_timeout)

    def topic_list(self) -> list[str]:
        """The rendered ``topics`` as a flat list: a name, a comma-separated string, or lists of them."""
        pending, names = [self.topics], []
        while pending:
            item = pending.pop(0)
            if isinstance(item, str):
                names += [t.strip() for t in item.split(",") if t.strip()]
            else:
                pending[:0] = list(item)
        return names

    def _trigger(self) -> LsoLagTrigger:
        return LsoLagTrigger(
            topics=self.topic_list(),
            kafka_config_id=self.kafka_config_id,
            mode=self.watch_mode,
            stuck_after=self.stuck_after,
            poke_interval=float(self.poke_interval),
            txn_max_timeout_ms=self.txn_max_timeout_ms,
            margin=self.margin,
            request_timeout=self.request_timeout,
        )

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        timeout = timedelta(seconds=self.timeout) if isinstance(self.timeout, (int, float)) else self.timeout
        self.defer(trigger=self._trigger(), method_name="execute_complete", timeout=timeout)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        if not event:
            raise AirflowException("LSO lag trigger ended without an event")
        status = event.get("status")
        if status == "ok":
            self.log.info("LSO lag watch (%s) passed\n%s", event.get("mode"), event.get("message"))
            return event.get("report")
        if status == "stuck":
            raise AirflowException(f"Kafka partitions with a stuck last stable offset:\n{event.get('message')}")
        raise AirflowException(f"LSO lag watch failed: {event.get('message')}")

    def poke(self, context: Any) -> PokeReturnValue:
        if self._watch is None:
            self._watch = LsoWatch(
                stuck_after=self.stuck_after, txn_max_timeout_ms=self.txn_max_timeout_ms, margin=self.margin
            )
        offsets = self.hook.partition_offsets(self.topic_list(), include_earliest=False)
        report = self._watch.observe(time.time(), offsets)
        self.last_report = report.to_dict()
        status = evaluate(self.watch_mode, self._watch, report)
        self.log.info("LSO lag (%s): %s\n%s", self.watch_mode, status or "watching", report.format())
        if status == "stuck":
            raise AirflowException(f"Kafka partitions with a stuck last stable offset:\n{report.format()}")
        return PokeReturnValue(is_done=status == "ok", xcom_value=self.last_report)


__all__ = ["GATE", "HEALTH", "LastStableOffsetLagSensor"]
