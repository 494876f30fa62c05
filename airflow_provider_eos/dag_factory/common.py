"""What every DAG of a pipeline shares: its ids, tags, connections and run-conf checks."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_provider_eos.utils import provider_config
from airflow_provider_eos.utils.definition_sections import ResolvedConnections
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition

# A scheduled DAG's first interval; catchup is off everywhere, so only "now" matters.
START_DATE = datetime(2026, 1, 1, tzinfo=timezone.utc)
KINDS = ("stream", "stop", "health", "snapshot", "recovery")
# The factory's waits defer whatever ``[operators] default_deferrable`` says (Airflow's default: no):
# they last minutes (a recovery's gate, stop and catch-up; the health sensors of every pipeline, every
# few minutes), and a worker slot held by each would starve the workers that run the streams and
# replays. The operators and sensors used directly follow Airflow's convention (operators.base).
DEFERRABLE = True


def dag_id(kind: str, pipeline: str) -> str:
    """``eos_<kind>__<pipeline>``: the id names the pipeline, so two pipelines never share a DAG."""
    if kind not in KINDS:
        raise ValueError(f"unknown DAG kind {kind!r}; one of {KINDS}")
    return f"eos_{kind}__{pipeline}"


def tags(definition: PipelineDefinition, *more: str) -> list[str]:
    return ["eos", f"pipeline:{definition.name}", *more, *definition.airflow.tags]


def task_defaults(definition: PipelineDefinition) -> dict[str, Any]:
    """Every task's ``default_args`` from the definition's ``airflow`` section (owner, queue, pool,
    retries, callbacks); what it leaves unset stays Airflow's default."""
    from airflow_provider_eos.utils.definition_checks import load_callable

    settings = definition.airflow
    args: dict[str, Any] = {"owner": settings.owner, "queue": settings.queue, "pool": settings.pool,
                            "retries": settings.retries}
    if settings.retry_delay_seconds is not None:
        args["retry_delay"] = timedelta(seconds=settings.retry_delay_seconds)
    # Checked when the definitions were loaded (definition_checks), so they import here.
    args.update({key: load_callable(reference) for key, reference in settings.callbacks().items()})
    return {key: value for key, value in args.items() if value is not None}


def resumable_wait(definition: PipelineDefinition) -> dict[str, Any]:
    """The retries of a deferred wait that may simply start again (a stop request repeated, a wait
    begun anew): at least one, after 2 s unless the definition sets a delay.

    Airflow 3.3 can fail a deferred task whose trigger fires before the scheduler processed the
    executor's report that the deferring attempt exited (apache/airflow#72716): a wait that ends
    within seconds of deferring, on a loaded machine. One retry rides that out; a wait that really
    failed fails again."""
    args: dict[str, Any] = {"retries": max(1, definition.airflow.retries or 0)}
    if definition.airflow.retry_delay_seconds is None:
        args["retry_delay"] = timedelta(seconds=2)
    return args


def spark_task_args(definition: PipelineDefinition) -> dict[str, Any]:
    """The extra arguments of a task that spark-submits: its queue, so that only the workers of
    ``airflow.spark_queue`` need pyspark and Java."""
    queue = definition.airflow.spark_queue
    return {"queue": queue} if queue else {}


def connection_ids(definition: PipelineDefinition) -> ResolvedConnections:
    """The definition's connection ids, the deployment's defaults (``[eos] *_conn_id``) for the rest."""
    return definition.connections.resolved(provider_config.connection_defaults())


def refuse_undeclared_conf(context: Any, declared: Iterable[str]) -> None:
    """A run conf may tune how a run goes, never where it reads or writes: any key the DAG does
    not declare as a Param is refused before anything is touched."""
    provider_config.check_run_conf(context["dag_run"].conf, declared)
