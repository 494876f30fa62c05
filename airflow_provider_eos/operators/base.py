"""What the pipeline steps share: the pipeline config, the PostgreSQL hook, the recovery lock
and the step timing that the recovery summary reports."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from typing import Any, TypeVar

from airflow.configuration import conf
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from airflow_provider_eos.hooks.pg_tools import PgToolsHook
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL, holding_lock, target_lock_key
from airflow_provider_eos.recovery.store import SnapshotStore
from airflow_provider_eos.utils.pipeline_config import PipelineConfigError, load_pipeline_config

T = TypeVar("T")

# Seconds a deferrable step checks in the worker before it defers (see poll_before_defer).
DEFAULT_DEFER_AFTER = 10.0


def default_deferrable() -> bool:
    """Airflow's convention for a step that can defer: ``[operators] default_deferrable`` decides
    (False unless the deployment says so). Called in the signature, as Airflow's own operators do,
    so it is read when the module is imported. The DAG factory's DAGs set ``deferrable=True``
    themselves (docs/operators.md says why)."""
    return conf.getboolean("operators", "default_deferrable", fallback=False)


def poll_before_defer(check: Callable[[], T], done: Callable[[T], bool], seconds: float, interval: float,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> tuple[T, bool]:
    """Checks in the worker, every ``interval`` seconds for ``seconds``, before a step defers.

    Every deferrable step of this provider calls it first (the stop, the LSO gate and health
    watch, the progress sensors): a trigger that fires before the deferring task process has
    ended meets an Airflow race (apache/airflow#72716: the deferring process's late "success"
    makes the resumed task fail), and most waits of a recovery end within seconds, which is
    exactly when that race is lost. A condition that holds at once, or within ``seconds``, is
    answered here and never deferred; only a longer wait goes to the triggerer, whose first
    check then comes at least ``seconds`` later than the deferral's start. It costs a worker
    slot for those seconds, less than a defer and resume.

    :param check: one check (its result is returned).
    :param done: whether a result ends the wait (success, or a failure the caller raises).
    :param seconds: how long to check in the worker; 0 checks once.
    :return: the last result, and whether ``done`` held for it (False: defer).
    """
    started = clock()
    while True:
        result = check()
        if done(result):
            return result, True
        left = seconds - (clock() - started)
        if left <= 0:
            return result, False
        sleep(min(interval, left))


def holder_of(context: Any) -> str:
    """The recovery lock holder for a task: its DAG run id (shared by the run's steps and reruns)."""
    run_id = context.get("run_id") if context else None
    return str(run_id or f"manual-{time.time_ns()}")


def timed_step(execute: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Adds ``step_seconds`` to a dict XCom: the recovery summary reports time per step from it."""

    @functools.wraps(execute)
    def wrapper(self: Any, context: Any) -> Any:
        started = time.monotonic()
        result = execute(self, context)
        if isinstance(result, dict):
            result = {**result, "step_seconds": round(time.monotonic() - started, 3)}
        return result

    return wrapper


class PipelineOperatorMixin:
    """Shared by the recovery operators: the pipeline config and the snapshot hook."""

    pipeline_config: Any
    postgres_conn_id: str
    pg_bin_dir: str | None
    # Steps of a recovery run hold the target's recovery lock (see recovery/lock.py).
    hold_lock: bool = False
    lock_ttl: float = DEFAULT_LOCK_TTL
    # When set, Kafka's bootstrap servers come from this connection, not from the config.
    kafka_config_id: str | None = None

    @cached_property
    def hook(self) -> PgToolsHook:
        """Built for the pipeline's meta schema (from its config), once: no call passes it again."""
        return PgToolsHook(postgres_conn_id=self.postgres_conn_id, pg_bin_dir=self.pg_bin_dir,
                           meta_schema=self.load_config().meta_schema)

    def resolve_store(self) -> SnapshotStore:
        """The store this step reads or writes: its own ``snapshot_store``, else the deployment's
        ``[eos] snapshot_store``, resolved now rather than when the DAG file was parsed."""
        from airflow_provider_eos.utils import provider_config

        return SnapshotStore(getattr(self, "snapshot_store", None) or provider_config.snapshot_store())

    def load_config(self) -> Any:
        try:
            return load_pipeline_config(self.pipeline_config)
        except PipelineConfigError as exc:
            raise AirflowException(str(exc)) from exc

    def app_config(self) -> Any:
        """The pipeline config with the database taken from the Airflow connection
        (password included, for in-process use only), and Kafka's bootstrap servers and security
        options from ``kafka_config_id`` when the operator has one."""
        config = self.load_config()
        if self.kafka_config_id:
            from airflow_provider_eos.hooks.kafka_connection import kafka_client_settings

            kafka = kafka_client_settings(self.kafka_config_id)
            config.kafka_bootstrap = kafka.bootstrap
            config.kafka_options = {**kafka.security, **config.kafka_options}
        # The same target the submitted app gets (libpq options included), plus the password.
        for key, value in self.hook.app_target().items():
            setattr(config.postgres, key, value)
        config.postgres.password = self.hook.app_password()
        return config

    def pipeline_lineage(self, write: bool, audit: dict[str, Any] | None = None) -> Any:
        """OpenLineage for this step: the pipeline's topics in, its target tables out (``write``)
        or in (read, with ``audit``'s assertions). None of it on a dry run, which touches nothing."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        from airflow_provider_eos.utils.lineage import operator_lineage, topics_read
        from airflow_provider_eos.utils.params import as_bool
        from airflow_provider_eos.utils.subscription import subscribed_topics
        from spark_apps.eos_stream.records.spec import load_spec

        if as_bool(getattr(self, "plan_only", False)):
            return OperatorLineage()
        config = self.app_config()
        def resolve(entries: list[str]) -> list[str]:
            from confluent_kafka.admin import AdminClient

            from spark_apps.eos_stream.kafka.metadata import expand_patterns

            admin = AdminClient({"bootstrap.servers": config.kafka_bootstrap, **config.librdkafka_options()})
            return expand_patterns(entries, admin.list_topics(timeout=10).topics)

        topics = topics_read(subscribed_topics(config), resolve)
        return operator_lineage(config.kafka_bootstrap, topics, vars(config.postgres), config.target_schema,
                                load_spec(config.spec), audit=audit, write=write)

    def lock_key(self, config: Any) -> str:
        return target_lock_key(self.hook.dbname, config.target_schema, config.pipeline)

    def lock_guard(self, config: Any, context: Any) -> AbstractContextManager[Any]:
        """Holds the recovery lock for this run while the step works (when ``hold_lock``)."""
        if not self.hold_lock:
            return nullcontext({})
        return holding_lock(self.hook, self.lock_key(config), holder_of(context), float(self.lock_ttl))


class KafkaOffsetsMixin(PipelineOperatorMixin):
    """For operators that must know what Kafka still holds (``recovery.retention``)."""

    kafka_config_id: str

    def kafka_offsets(self, topics: list[str]) -> dict[tuple[str, int], Any]:
        from airflow_provider_eos.recovery import retention

        return retention.kafka_offsets(self.kafka_config_id, topics)

    def check_retention(self, needed: dict[tuple[str, int], int], topics: list[str], what: str) -> dict[str, Any]:
        from airflow_provider_eos.recovery import retention

        return retention.check_retention(self.kafka_config_id, needed, topics, what)


CHECK_XCOM_KEY = "eos_check"


def record_check(context: Any, outcome: dict[str, Any]) -> None:
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is not None:
        ti.xcom_push(key=CHECK_XCOM_KEY, value=outcome)


class CheckOutcomeMixin:
    """Records ``{"check", "ok", "message", "report"}`` as XCom ``eos_check`` around ``execute``
    and ``resume_execution`` (a deferral passes through unrecorded). ``report`` is what the
    check measured: its dict result when it passes, its ``last_report`` when it fails (a
    failing check sets that before raising), None when it measured nothing."""

    check_name: str = "check"
    last_report: dict[str, Any] | None = None

    def _recorded(self, context: Any, call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except TaskDeferred:
            raise
        except BaseException as err:
            record_check(context, {"check": self.check_name, "ok": False,
                                   "message": str(err) or type(err).__name__, "report": self.last_report})
            raise
        report = result if isinstance(result, dict) else self.last_report
        message = result.get("message") if isinstance(result, dict) else None
        record_check(context, {"check": self.check_name, "ok": True, "message": message or "ok", "report": report})
        return result

    def execute(self, context: Any) -> Any:
        parent: Any = super()
        return self._recorded(context, lambda: parent.execute(context))

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any) -> Any:
        parent: Any = super()
        return self._recorded(context, lambda: parent.resume_execution(next_method, next_kwargs, context))
