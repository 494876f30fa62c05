"""Sensors on a running pipeline: liveness (a recent progress row) and caught-up (stored
offsets vs the Kafka last stable offset)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.operators.base import (
    DEFAULT_DEFER_AFTER,
    CheckOutcomeMixin,
    default_deferrable,
    poll_before_defer,
)
from airflow_provider_eos.recovery.contracts import Replayed
from airflow_provider_eos.state.progress import latest_progress
from airflow_provider_eos.triggers.stream_progress import (
    StreamCaughtUpTrigger,
    StreamLivenessTrigger,
    caught_up_check,
    liveness_report,
)
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.subscription import topic_entries
from spark_apps.eos_stream.kafka.offsets import to_nested


class _ProgressSensor(CheckOutcomeMixin, BaseSensorOperator):
    """Deferrable if ``deferrable`` (default: ``[operators] default_deferrable``): checks in the
    worker every ``poke_interval`` for ``defer_after``
    seconds (``base.poll_before_defer``: a trigger firing at once would meet apache/airflow#72716),
    then defers to the trigger (which fires ``timeout`` with its last report when ``timeout``
    runs out). ``deferrable=False`` pokes.

    :param defer_after: seconds to check in the worker before deferring (0: check once).
    """

    def __init__(self, *, deferrable: bool = default_deferrable(), defer_after: float = DEFAULT_DEFER_AFTER,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deferrable = deferrable
        self.defer_after = float(defer_after)
        self.last_report: dict[str, Any] | None = None

    def check(self) -> dict[str, Any]:
        raise NotImplementedError

    def make_trigger(self, timeout_seconds: float) -> Any:
        raise NotImplementedError

    def poke(self, context: Any) -> PokeReturnValue:
        report = self.check()
        self.last_report = report
        self.log.info("%s: %s", self.check_name, report["message"])
        return PokeReturnValue(is_done=bool(report["ok"]), xcom_value=report)

    def execute(self, context: Any) -> Any:
        return self._recorded(context, lambda: self._execute(context))

    def _execute(self, context: Any) -> Any:
        if not self.deferrable:
            try:
                return BaseSensorOperator.execute(self, context)
            except AirflowSensorTimeout as err:
                message = self.last_report["message"] if self.last_report else str(err)
                raise AirflowSensorTimeout(f"{self.check_name} not satisfied within {self.timeout}s: {message}"
                                           ) from err
        timeout = float(self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else self.timeout)
        started = time.monotonic()
        report, done = poll_before_defer(self._logged_check, lambda r: bool(r["ok"]),
                                         min(self.defer_after, timeout), float(self.poke_interval))
        if done:
            return report
        remaining = timeout - (time.monotonic() - started)
        if remaining <= 0:
            raise AirflowSensorTimeout(f"{self.check_name} not satisfied within {self.timeout}s: {report['message']}")
        # The trigger fires "timeout" with its last report; the deferral timeout is only a backstop.
        self.defer(trigger=self.make_trigger(remaining), method_name="execute_complete",
                   timeout=timedelta(seconds=remaining + max(60.0, float(self.poke_interval) * 2)))

    def _logged_check(self) -> dict[str, Any]:
        report = self.last_report = self.check()
        self.log.info("%s: %s", self.check_name, report["message"])
        return report

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        if not event:
            raise AirflowException(f"{self.check_name} trigger ended without an event")
        # The trigger's last report, for the check's recorded outcome (and the health summary's metrics).
        self.last_report = event.get("report")
        status = event.get("status")
        if status == "ok":
            self.log.info("%s: %s", self.check_name, event.get("message"))
            return event.get("report")
        if status == "timeout":
            raise AirflowSensorTimeout(
                f"{self.check_name} not satisfied within {self.timeout}s: {event.get('message')}")
        raise AirflowException(f"{self.check_name} check failed: {event.get('message')}")


class StreamLivenessSensor(_ProgressSensor):
    """
    Waits until the pipeline's newest progress row (``<meta_schema>.stream_progress``) is at most
    ``max_age_seconds`` old; fails when ``timeout`` passes first (the message gives the last
    batch and its age). A stream with no new input writes no progress rows: pair it with
    :class:`StreamCaughtUpSensor` to tell idle from stalled.

    :param pipeline: pipeline name.
    :param max_age_seconds: the newest progress row must be younger than this.
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables.
    :param deferrable: defer to :class:`~airflow_provider_eos.triggers.stream_progress.StreamLivenessTrigger`
        instead of poking in the worker; default: ``[operators] default_deferrable``.
    """

    template_fields: Sequence[str] = ("pipeline", "max_age_seconds", "postgres_conn_id", "meta_schema")
    check_name = "liveness"
    ui_color = "#eaffea"

    def __init__(self, *, pipeline: str, max_age_seconds: float | str = 300, postgres_conn_id: str = "eos_postgres",
                 meta_schema: str = "eos", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.max_age_seconds = max_age_seconds
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema

    def check(self) -> dict[str, Any]:
        hook = EosPostgresHook(postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema)
        return liveness_report(latest_progress(hook, self.pipeline), float(self.max_age_seconds))

    def make_trigger(self, timeout_seconds: float) -> StreamLivenessTrigger:
        return StreamLivenessTrigger(
            pipeline=self.pipeline, max_age_seconds=float(self.max_age_seconds),
            postgres_conn_id=self.postgres_conn_id, meta_schema=self.meta_schema,
            poke_interval=float(self.poke_interval), timeout_seconds=timeout_seconds,
        )


class StreamCaughtUpSensor(_ProgressSensor):
    """
    Waits until, on every partition of ``topics``, the pipeline's stored next offset
    (``<meta_schema>.kafka_offsets``) is within ``max_lag`` of the partition's last stable
    offset. The LSO counts transaction markers and aborted records, and exactly-once stores
    the offsets Spark planned (markers included), so a caught-up pipeline has lag 0. Needs
    ``delivery='exactly_once'`` (the other modes store no offsets in the database).
    Each poke logs the per-partition lag; the timeout message lists the partitions behind.

    :param pipeline: pipeline name.
    :param topics: the pipeline's topics.
    :param max_lag: largest acceptable lag per partition.
    :param kafka_config_id: Kafka connection, default "kafka_default".
    :param postgres_conn_id: target database connection, default "eos_postgres".
    :param meta_schema: schema of the bookkeeping tables.
    :param request_timeout: seconds allowed for each Kafka Admin request.
    :param target_offsets: ``{topic: {partition: offset}}`` to reach instead of the current LSO
        (templated).
    :param replayed: instead of ``target_offsets``: the replay's output (``contracts.Replayed``, its XCom
        or the replay task's ``.output``); its ``lso_at_start`` is the target.
    :param plan_only: check once and return the report without waiting (templated).
    :param deferrable: defer to :class:`~airflow_provider_eos.triggers.stream_progress.StreamCaughtUpTrigger`
        instead of poking in the worker; default: ``[operators] default_deferrable``.
    """

    template_fields: Sequence[str] = ("pipeline", "topics", "max_lag", "kafka_config_id", "postgres_conn_id",
                                      "meta_schema", "target_offsets", "replayed", "plan_only")
    check_name = "caught_up"
    ui_color = "#eaffea"

    def __init__(self, *, pipeline: str, topics: Sequence[str] | str, max_lag: int | str = 0,
                 kafka_config_id: str = "kafka_default", postgres_conn_id: str = "eos_postgres",
                 meta_schema: str = "eos", request_timeout: float = 10.0, target_offsets: Any = None,
                 replayed: Any = None, plan_only: Any = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_offsets = target_offsets
        self.replayed = replayed
        self.plan_only = plan_only
        self.pipeline = pipeline
        self.topics = topics
        self.max_lag = max_lag
        self.kafka_config_id = kafka_config_id
        self.postgres_conn_id = postgres_conn_id
        self.meta_schema = meta_schema
        self.request_timeout = request_timeout
        self._kafka: Any = None

    def _topics(self) -> list[str]:
        return topic_entries(self.topics)

    def _target(self) -> dict[str, dict[str, int]] | None:
        if self.replayed:
            return to_nested(Replayed.from_xcom(self.replayed).lso_at_start) or None
        return dict(self.target_offsets) if self.target_offsets else None

    def check(self) -> dict[str, Any]:
        return caught_up_check(self, self.pipeline, self._topics(), int(self.max_lag), self._target())

    def execute(self, context: Any) -> Any:
        if as_bool(self.plan_only):
            return self.check()
        return super().execute(context)

    def make_trigger(self, timeout_seconds: float) -> StreamCaughtUpTrigger:
        return StreamCaughtUpTrigger(
            pipeline=self.pipeline, topics=self._topics(), max_lag=int(self.max_lag),
            kafka_config_id=self.kafka_config_id, postgres_conn_id=self.postgres_conn_id,
            meta_schema=self.meta_schema, poke_interval=float(self.poke_interval),
            timeout_seconds=timeout_seconds, request_timeout=self.request_timeout, target_offsets=self._target(),
        )
