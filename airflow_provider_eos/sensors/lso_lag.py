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

# Seconds for the triggerer to deliver the gate's own give-up event before Airflow's
# deferral timeout (which carries no report) would fire.
GATE_DEFERRAL_SLACK = 10.0


class LastStableOffsetLagSensor(BaseSensorOperator):
    """
    Waits on the LSO lag (``HW - LSO``) of every partition of ``topics``.

    ``watch_mode='health'`` fails (``AirflowException`` with a per-partition report)
    as soon as a partition's LSO has not advanced for ``stuck_after`` seconds while
    it has lag -- an open transaction that blocks every ``read_committed`` reader --
    and succeeds after one full ``stuck_after`` window with nothing stuck.
    ``watch_mode='gate'`` succeeds as soon as no partition is stuck: each has no lag,
    or an LSO that advanced within ``stuck_after`` (transactions that stay open but
    keep committing, as Flink or Kafka Streams producers do, never give a moment with
    lag 0 everywhere; a replay stops at the LSO it saw, so they are harmless). A stuck
    partition keeps the gate waiting (its coordinator may still abort the
    transaction); at ``timeout`` the gate fails naming the stuck partitions and for
    how long, and a ``hanging`` one fails it at once.

    By default the sensor defers at once to :class:`~airflow_provider_eos.triggers.lso_lag.LsoLagTrigger`
    (``timeout`` is honoured: in ``gate`` mode the trigger gets it as a deadline and
    reports what is stuck, and the deferral's own timeout, a little later, is only a
    backstop). With ``deferrable=False`` it pokes with the same logic;
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
    :param timeout: (``BaseSensorOperator``) seconds; in ``gate`` mode the gate gives
        up at its last observation before it, with the stuck partitions in the error.
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
        self._deadline: float | None = None
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

    def _trigger(self, deadline: float | None = None) -> LsoLagTrigger:
        return LsoLagTrigger(
            topics=self.topic_list(),
            kafka_config_id=self.kafka_config_id,
            mode=self.watch_mode,
            stuck_after=self.stuck_after,
            poke_interval=float(self.poke_interval),
            txn_max_timeout_ms=self.txn_max_timeout_ms,
            margin=self.margin,
            request_timeout=self.request_timeout,
            deadline=deadline,
        )

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        seconds = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else float(self.timeout)
        deadline = None
        if self.watch_mode == GATE:
            # The trigger gives up at the deadline with a report naming the stuck
            # partitions; Airflow's deferral timeout, one poke and one request later
            # (+ slack for delivering the event), only backs it up.
            deadline = time.time() + seconds
            seconds += float(self.poke_interval) + self.request_timeout + GATE_DEFERRAL_SLACK
        self.defer(trigger=self._trigger(deadline), method_name="execute_complete", timeout=timedelta(seconds=seconds))

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        if not event:
            raise AirflowException("LSO lag trigger ended without an event")
        status = event.get("status")
        if status == "ok":
            self.log.info("LSO lag watch (%s) passed\n%s", event.get("mode"), event.get("message"))
            return event.get("report")
        if status == "stuck":
            raise AirflowException(f"Kafka partitions with a stuck last stable offset:\n{event.get('message')}")
        if status == "timeout":
            raise AirflowException(f"LSO gate timed out:\n{event.get('message')}")
        raise AirflowException(f"LSO lag watch failed: {event.get('message')}")

    def poke(self, context: Any) -> PokeReturnValue:
        now = time.time()
        if self._watch is None:
            self._watch = LsoWatch(
                stuck_after=self.stuck_after, txn_max_timeout_ms=self.txn_max_timeout_ms, margin=self.margin
            )
            # BaseSensorOperator starts its timeout clock just before the first poke.
            timeout = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else float(self.timeout)
            self._deadline = now + timeout
        offsets = self.hook.partition_offsets(self.topic_list(), include_earliest=False)
        report = self._watch.observe(time.time(), offsets)
        self.last_report = report.to_dict()
        deadline = self._deadline if self.watch_mode == GATE else None
        status = evaluate(self.watch_mode, self._watch, report, deadline, float(self.poke_interval))
        text = report.format() if self.watch_mode == HEALTH else f"{report.gate_summary()}\n{report.format()}"
        self.log.info("LSO lag (%s): %s\n%s", self.watch_mode, status or "watching", text)
        if status == "stuck":
            raise AirflowException(f"Kafka partitions with a stuck last stable offset:\n{text}")
        if status == "timeout":
            raise AirflowException(f"LSO gate timed out:\n{text}")
        return PokeReturnValue(is_done=status == "ok", xcom_value=self.last_report)


__all__ = ["GATE", "HEALTH", "LastStableOffsetLagSensor"]
