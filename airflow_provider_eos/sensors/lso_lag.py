"""Sensor on the last-stable-offset lag of Kafka topics (stuck / hanging transactions)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.kafka_offsets import KafkaOffsetsHook
from airflow_provider_eos.hooks.kafka_transactions import KafkaTransactionsHook, open_transaction_of
from airflow_provider_eos.operators.base import (
    DEFAULT_DEFER_AFTER,
    CheckOutcomeMixin,
    default_deferrable,
    poll_before_defer,
)
from airflow_provider_eos.state.lso_watch import load_lso_watch, save_lso_watch
from airflow_provider_eos.triggers.lso_lag import GATE, HEALTH, LsoLagTrigger, check_mode, evaluate
from airflow_provider_eos.utils.lso_watch import (
    DEFAULT_MARGIN_SECONDS,
    DEFAULT_TXN_MAX_TIMEOUT_MS,
    LsoReport,
    LsoWatch,
)
from airflow_provider_eos.utils.subscription import topic_entries
from spark_apps.eos_stream.state import meta_tables

# XCom key of the hanging partitions' details (producer, start offset, abort parameters).
HANGING_XCOM_KEY = "eos_hanging"


# Seconds for the triggerer to deliver the gate's own give-up event before Airflow's
# deferral timeout (which carries no report) would fire.
GATE_DEFERRAL_SLACK = 10.0


class LastStableOffsetLagSensor(CheckOutcomeMixin, BaseSensorOperator):
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

    By default the sensor watches in the worker for ``defer_after`` seconds (a gate usually
    opens within seconds, and a trigger that fires that soon after a deferral meets
    apache/airflow#72716; see ``base.poll_before_defer``), then defers the same watch to
    :class:`~airflow_provider_eos.triggers.lso_lag.LsoLagTrigger`
    (``timeout`` is honoured: in ``gate`` mode the trigger gets it as a deadline and
    reports what is stuck, and the deferral's own timeout, a little later, is only a
    backstop). With ``deferrable=False`` it pokes with the same logic;
    the watch state lives on the operator instance, so use ``mode='poke'`` (the
    default) -- in ``reschedule`` mode every poke would start a new watch.

    Given ``pipeline`` and ``meta_schema``, each partition's stuck-since time is kept in
    ``<meta_schema>.lso_watch`` across runs: a run starts from the stored times (kept only
    while the LSO is the same value and still behind the HW), so a scheduled health check
    that watches for a few minutes still sees a transaction stuck for longer than
    ``hanging_after`` as ``hanging``. A ``hanging`` partition fails the check with its
    producer (``describe-producers``), the transaction's start offset and the
    :class:`~airflow_provider_eos.operators.hanging_transactions.HangingTransactionsOperator`
    parameters that would abort it (also as XCom ``eos_hanging``); nothing is aborted here.

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
    :param deferrable: defer to the trigger instead of poking in the worker; default: ``[operators]
        default_deferrable``.
    :param defer_after: seconds to watch in the worker before deferring (0: one observation).
    :param pipeline: the pipeline whose health this is; with ``meta_schema``, keeps the
        stuck-since times across runs. None (the recovery gate): every run starts afresh.
    :param meta_schema: the pipeline's bookkeeping schema (holds ``lso_watch``).
    :param postgres_conn_id: the pipeline's database connection, default "eos_postgres".
    :param hanging_after: seconds stuck (across runs) after which a partition is ``hanging``;
        None: ``txn_max_timeout_ms`` / 1000 + ``margin``.
    :param timeout: (``BaseSensorOperator``) seconds; in ``gate`` mode the gate gives
        up at its last observation before it, with the stuck partitions in the error.
    """

    template_fields: Sequence[str] = ("topics", "kafka_config_id", "watch_mode", "pipeline", "meta_schema")
    ui_color = "#ffefeb"
    check_name = "lso_lag"

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
        deferrable: bool = default_deferrable(),
        pipeline: str | None = None,
        meta_schema: str | None = None,
        postgres_conn_id: str = "eos_postgres",
        hanging_after: float | None = None,
        defer_after: float = DEFAULT_DEFER_AFTER,
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
        self.defer_after = float(defer_after)
        self.pipeline = pipeline
        self.meta_schema = meta_schema
        self.postgres_conn_id = postgres_conn_id
        self.hanging_after = None if hanging_after is None else float(hanging_after)
        if self.hanging_after is not None and self.hanging_after <= 0:
            raise ValueError(f"hanging_after must be positive, got {hanging_after!r}")
        self._watch: LsoWatch | None = None
        self._deadline: float | None = None
        self.last_report: dict[str, Any] | None = None

    @cached_property
    def hook(self) -> KafkaOffsetsHook:
        return KafkaOffsetsHook(kafka_config_id=self.kafka_config_id, timeout=self.request_timeout)

    def topic_list(self) -> list[str]:
        """The rendered ``topics`` as a flat list (``utils.subscription.topic_entries``)."""
        return topic_entries(self.topics)

    @property
    def persistent(self) -> bool:
        """Stuck-since times are kept across runs (``pipeline`` and ``meta_schema`` given)."""
        return bool(self.pipeline and self.meta_schema)

    def store(self) -> EosPostgresHook:
        return EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=str(self.meta_schema))

    def new_watch(self) -> LsoWatch:
        """A watch with this sensor's thresholds, seeded with the stored stuck-since times when persistent."""
        watch = LsoWatch(
            stuck_after=self.stuck_after,
            txn_max_timeout_ms=self.txn_max_timeout_ms,
            margin=self.margin,
            hanging_after=self.hanging_after,
        )
        if self.persistent:
            stored = load_lso_watch(self.store(), str(self.pipeline))
            watch.resume(stored, time.time())
            if stored:
                self.log.info(
                    "Resuming from %s.%s: %s", self.meta_schema, meta_tables.LSO_WATCH,
                    ", ".join(f"{r.topic}[{r.partition}] LSO {r.last_stable} for {r.stuck_for:.1f}s" for r in stored),
                )
        return watch

    def save_watch(self, watch: LsoWatch) -> None:
        """Store the watch's stuck-since times for the next run (no-op unless persistent)."""
        if self.persistent:
            save_lso_watch(self.store(), str(self.pipeline), watch.to_stored(time.time()))

    def hanging_details(self, report: LsoReport) -> list[dict[str, Any]]:
        """
        For each ``hanging`` partition of ``report``: its producer (``describe-producers``), the
        open transaction's start offset and the abort operator's parameters, ready to trigger.
        A failing ``describe-producers`` is reported in the entry (``error``), not raised.
        """
        if not report.hanging:
            return []
        # kafka-python's DescribeProducers (no JVM), bounded like the sensor's other requests.
        hook = KafkaTransactionsHook(kafka_config_id=self.kafka_config_id, request_timeout=self.request_timeout)
        details = []
        for p in report.hanging:
            entry: dict[str, Any] = {
                "topic": p.topic, "partition": p.partition, "last_stable": p.last_stable, "lag": p.lag,
                "stuck_seconds": p.stuck_seconds, "producer": None, "start_offset": None, "abort": None,
            }
            try:
                row = open_transaction_of(hook.describe_producers(p.topic, p.partition), p.last_stable)
            except Exception as err:
                entry["error"] = f"describe-producers failed: {err}"
                details.append(entry)
                continue
            if row is None:
                entry["error"] = "describe-producers shows no open transaction (resolved since the LSO was read?)"
            else:
                start = int(row["CurrentTransactionStartOffset"])
                entry["producer"] = {
                    "producer_id": row.get("ProducerId"), "producer_epoch": row.get("ProducerEpoch"),
                    "last_timestamp": row.get("LastTimestamp"), "coordinator_epoch": row.get("LatestCoordinatorEpoch"),
                }
                entry["start_offset"] = start
                entry["abort"] = {
                    "action": "abort", "kafka_config_id": self.kafka_config_id, "topic": p.topic,
                    "partition": p.partition, "start_offset": start, "confirm_abort": True,
                }
            details.append(entry)
        return details

    def _stuck_error(self, context: Any, report: LsoReport, text: str) -> AirflowException:
        """The failure for a stuck watch; hanging partitions get their producer and abort appended."""
        details = self.hanging_details(report)
        if not details:
            return AirflowException(f"Kafka partitions with a stuck last stable offset:\n{text}")
        ti = context.get("ti") if hasattr(context, "get") else None
        if ti is not None:
            ti.xcom_push(key=HANGING_XCOM_KEY, value=details)
        lines = [
            f"{len(details)} hanging transaction(s), stuck past hanging_after={report.hanging_after:g}s: "
            "a person must abort them (nothing was aborted). HangingTransactionsOperator parameters:"
        ]
        for d in details:
            where = (f"{d['topic']}[{d['partition']}] LSO {d['last_stable']} lag {d['lag']} "
                     f"stuck {d['stuck_seconds']:.1f}s")
            if d["abort"] is None:
                lines.append(f"  {where}: {d.get('error')}")
            else:
                producer = d["producer"]
                lines.append(
                    f"  {where}: producer id {producer['producer_id']} epoch {producer['producer_epoch']}, "
                    f"transaction started at offset {d['start_offset']}; abort: {json.dumps(d['abort'])}"
                )
        return AirflowException("Kafka partitions with a hanging transaction:\n" + "\n".join(lines) + f"\n{text}")

    def _trigger(self, deadline: float | None = None, watch: LsoWatch | None = None) -> LsoLagTrigger:
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
            hanging_after=self.hanging_after,
            # Read here, in the worker, so the triggerer never touches the database.
            watch_state=None if watch is None else watch.to_json(),
        )

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)  # CheckOutcomeMixin records around the poke loop
        # This class's own execute comes before CheckOutcomeMixin's: record here, so a check that
        # passes or fails in the worker, before any deferral, still leaves its outcome and report.
        return self._recorded(context, lambda: self._check_then_defer(context))

    def _check_then_defer(self, context: Any) -> Any:
        seconds = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else float(self.timeout)
        # The same watch as poke's (it starts the deadline), so the trigger continues it: the
        # stuck-since times and the gate's deadline do not start over at the deferral.
        poked, done = poll_before_defer(lambda: self.poke(context), lambda r: r.is_done,
                                        min(self.defer_after, seconds), float(self.poke_interval))
        if done:
            return poked.xcom_value
        deadline = None
        remaining = max(0.0, float(self._deadline or 0.0) - time.time())
        if self.watch_mode == GATE:
            # The trigger gives up at the deadline with a report naming the stuck
            # partitions; Airflow's deferral timeout, one poke and one request later
            # (+ slack for delivering the event), only backs it up.
            deadline = self._deadline
            remaining += float(self.poke_interval) + self.request_timeout + GATE_DEFERRAL_SLACK
        self.defer(trigger=self._trigger(deadline, self._watch), method_name="execute_complete",
                   timeout=timedelta(seconds=remaining))

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        if not event:
            raise AirflowException("LSO lag trigger ended without an event")
        status = event.get("status")
        # What the watch saw, for the check's recorded outcome (and the health summary's metrics).
        self.last_report = event.get("report")
        if event.get("watch_state"):
            self.save_watch(LsoWatch.from_json(event["watch_state"]))
        if status == "ok":
            self.log.info("LSO lag watch (%s) passed\n%s", event.get("mode"), event.get("message"))
            return event.get("report")
        if status == "stuck":
            report = LsoReport.from_dict(event["report"]) if event.get("report") else None
            if report is None:
                raise AirflowException(f"Kafka partitions with a stuck last stable offset:\n{event.get('message')}")
            raise self._stuck_error(context, report, str(event.get("message")))
        if status == "timeout":
            raise AirflowException(f"LSO gate timed out:\n{event.get('message')}")
        raise AirflowException(f"LSO lag watch failed: {event.get('message')}")

    def poke(self, context: Any) -> PokeReturnValue:
        now = time.time()
        if self._watch is None:
            self._watch = self.new_watch()
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
        if status is not None:
            self.save_watch(self._watch)
        if status == "stuck":
            raise self._stuck_error(context, report, text)
        if status == "timeout":
            raise AirflowException(f"LSO gate timed out:\n{text}")
        return PokeReturnValue(is_done=status == "ok", xcom_value=self.last_report)


__all__ = ["GATE", "HANGING_XCOM_KEY", "HEALTH", "LastStableOffsetLagSensor"]
