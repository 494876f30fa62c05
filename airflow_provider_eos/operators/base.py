"""What the pipeline steps share: the pipeline config, the PostgreSQL hook, the recovery lock
and the step timing that the recovery summary reports."""

from __future__ import annotations

import functools
import time
import warnings
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
from airflow_provider_eos.utils.pipeline_definition import (
    PipelineDefinition,
    PipelineDefinitionError,
    parse_definition,
)

T = TypeVar("T")

# What a step given an app config instead of the pipeline's definition is told (read for one release).
DEPRECATED_PIPELINE_CONFIG = (
    "pipeline_config is deprecated and will be removed in the next release: pass the pipeline's definition "
    "(definition=<PipelineDefinition, its dict or its name>); the step gets its complete app config from it")
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
    """Shared by the recovery operators: the pipeline's definition, its one complete app config and
    the snapshot hook.

    A step takes the pipeline's ``definition`` (a ``PipelineDefinition``, its dict form, or its
    name in ``[eos] pipeline_config_dir``) and gets the app's config from one call,
    :meth:`app_config` (``hooks.app_config.complete_app_config``: the connections filled in, nothing
    mutated afterwards). ``pipeline_config`` (an app config dict or JSON file) is read for one
    release, with a FutureWarning: its Kafka and database are then the connections' too."""

    definition: Any = None
    pipeline_config: Any = None
    postgres_conn_id: str
    pg_bin_dir: str | None
    # Steps of a recovery run hold the target's recovery lock (see recovery/lock.py).
    hold_lock: bool = False
    lock_ttl: float = DEFAULT_LOCK_TTL
    # When set, Kafka's bootstrap servers come from this connection, not from the definition's (or the config).
    kafka_config_id: str | None = None

    def take_definition(self, definition: Any, pipeline_config: Any) -> None:
        """Keeps what the step was given: a definition, or (deprecated) an app config."""
        if (definition is None) == (pipeline_config is None):
            raise ValueError("give the pipeline's definition: definition=<PipelineDefinition, its dict or its name>")
        if pipeline_config is not None:
            warnings.warn(DEPRECATED_PIPELINE_CONFIG, FutureWarning, stacklevel=3)  # shown by default, as engine's is
        self.definition = definition
        self.pipeline_config = pipeline_config

    def pipeline_definition(self) -> PipelineDefinition | None:
        """The step's validated definition (a dict or a name read once); None for a deprecated ``pipeline_config``."""
        if self.definition is None or isinstance(self.definition, PipelineDefinition):
            return self.definition
        from airflow_provider_eos.utils import provider_config
        from airflow_provider_eos.utils.definition_folder import find_definition

        try:
            self.definition = (find_definition(provider_config.pipeline_config_dir(), self.definition)
                               if isinstance(self.definition, str)
                               else parse_definition(self.definition, source=f"task {getattr(self, 'task_id', '?')}"))
        except PipelineDefinitionError as exc:
            raise AirflowException(str(exc)) from exc
        return self.definition

    @cached_property
    def hook(self) -> PgToolsHook:
        """Built for the pipeline's meta schema, once: no call passes it again."""
        definition = self.pipeline_definition()
        meta_schema = definition.meta_schema if definition is not None else self.load_config().meta_schema
        return PgToolsHook(postgres_conn_id=self.postgres_conn_id, pg_bin_dir=self.pg_bin_dir, meta_schema=meta_schema)

    def resolve_store(self) -> SnapshotStore:
        """The store this step reads or writes: its own ``snapshot_store``, else the deployment's
        ``[eos] snapshot_store``, resolved now rather than when the DAG file was parsed."""
        from airflow_provider_eos.utils import provider_config

        return SnapshotStore(getattr(self, "snapshot_store", None) or provider_config.snapshot_store())

    def load_config(self) -> Any:
        """The pipeline's app config: for a definition the complete one (:meth:`app_config`); a
        deprecated ``pipeline_config`` as it was given."""
        if self.pipeline_definition() is not None:
            return self.app_config()
        try:
            return load_pipeline_config(self.pipeline_config)
        except PipelineConfigError as exc:
            raise AirflowException(str(exc)) from exc

    def app_config(self) -> Any:
        """The pipeline's complete app config, from one call: Kafka's bootstrap servers and security
        options from ``kafka_config_id`` (else, for a definition, its Kafka connection; for a
        deprecated ``pipeline_config``, that config's bootstrap servers), the database from
        ``postgres_conn_id``, its password included (for in-process use and the launchers only)."""
        if self.__dict__.get("_app_config") is None:
            self.__dict__["_app_config"] = self._complete_config()
        return self.__dict__["_app_config"]

    def _complete_config(self) -> Any:
        from airflow_provider_eos.hooks.app_config import complete_app_config, connections_filled_in

        definition = self.pipeline_definition()
        if definition is None:
            return connections_filled_in(self.load_config(), kafka_config_id=self.kafka_config_id, postgres=self.hook)
        if self.kafka_config_id:
            kafka = self.kafka_config_id
        else:
            from airflow_provider_eos.utils import provider_config

            kafka = definition.connections.resolved(provider_config.connection_defaults()).kafka
        return complete_app_config(definition, kafka_config_id=kafka, postgres=self.hook)

    def pipeline_lineage(self, write: bool, audit: dict[str, Any] | None = None) -> Any:
        """OpenLineage for this step: the pipeline's topics in, its target tables out (``write``)
        or in (read, with ``audit``'s assertions). None of it on a dry run, which touches nothing."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        from airflow_provider_eos.utils.lineage import operator_lineage, topics_read
        from airflow_provider_eos.utils.params import as_bool
        from airflow_provider_eos.utils.subscription import subscribed_topics
        from spark_apps.eos_stream.records.spec import spec_of

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
                                spec_of(config), audit=audit, write=write)

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
