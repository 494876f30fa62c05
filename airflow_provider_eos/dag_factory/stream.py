"""``eos_stream__<pipeline>`` runs the pipeline under supervision; ``eos_stop__<pipeline>`` stops it.

Everything about the pipeline comes from its definition. A run conf may tune how this run goes
(the engine, the trigger and batch limits, ``null`` meaning the definition's; run time; restarts), never where
it reads or writes: any other key is refused.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_provider_eos.dag_factory.assets import PipelineAssets
from airflow_provider_eos.dag_factory.common import (
    DEFERRABLE,
    START_DATE,
    connection_ids,
    dag_id,
    refuse_undeclared_conf,
    resumable_wait,
    spark_task_args,
    tags,
    task_defaults,
)
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.operators.stream import StreamingPipelineOperator
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition
from spark_apps.eos_stream.run.config_rules import DEPRECATED_CONTINUOUS_TRIGGER, ENGINES, TRIGGERS

# Knobs a run conf may set; null means "as the definition says".
TUNING = ("engine", "trigger", "trigger_interval", "max_offsets_per_trigger", "max_batch_attempts")


def stream_params(definition: PipelineDefinition) -> dict[str, Param]:
    stream = definition.stream
    return {
        "engine": Param(None, type=["null", "string"], enum=[None, *ENGINES],
                        description=f"null: the definition's ({stream.engine})"),
        # "continuous" is engine: continuous's old spelling, read as it for one release.
        "trigger": Param(None, type=["null", "string"], enum=[None, *TRIGGERS, DEPRECATED_CONTINUOUS_TRIGGER],
                         description=f"null: the definition's ({stream.trigger})"),
        "trigger_interval": Param(None, type=["null", "string"],
                                  description=f"null: the definition's ({stream.trigger_interval})"),
        "max_offsets_per_trigger": Param(None, type=["null", "integer"], minimum=1,
                                         description=f"null: the definition's ({stream.max_offsets_per_trigger})"),
        "max_batch_attempts": Param(None, type=["null", "integer"], minimum=1,
                                    description=f"null: the definition's ({stream.max_batch_attempts})"),
        "run_seconds": Param(0, type="number", minimum=0,
                             description="processingTime or engine continuous: 0 = until stopped"),
        "max_restarts": Param(stream.max_restarts, type="integer", minimum=0),
        "restart_backoff": Param(stream.restart_backoff, type="number", minimum=0),
    }


@task
def resolve_run(defaults: dict[str, Any], declared: list[str], **context: Any) -> dict[str, Any]:
    """Refuses undeclared conf keys, then pins this run's tuning: the definition's values
    (``defaults``) with the run's non-null Params on top."""
    refuse_undeclared_conf(context, declared)
    resolved = dict(defaults)
    resolved.update({key: context["params"][key] for key in TUNING if context["params"].get(key) is not None})
    return resolved


@task
def refuse_any_conf(**context: Any) -> None:
    """The stop DAG takes no conf: the DAG is the pipeline."""
    refuse_undeclared_conf(context, ())


def build_stream_dag(definition: PipelineDefinition, assets: PipelineAssets | None = None) -> DAG:
    """:param assets: the pipeline's assets; its topics become the stream task's inlets. The targets
        are not its outlets: their events come from the committed-offsets watcher, with the offsets,
        never from a task that ends."""
    conns = connection_ids(definition)
    params = stream_params(definition)
    with DAG(
        default_args=task_defaults(definition),
        dag_id=dag_id("stream", definition.name),
        schedule=definition.stream.schedule,
        start_date=START_DATE,
        catchup=False,
        # One supervised stream per pipeline; other pipelines' streams have DAGs of their own.
        max_active_runs=1,
        render_template_as_native_obj=True,
        tags=tags(definition, "stream"),
        doc_md=__doc__,
        params=params,
    ) as dag:
        defaults = {key: getattr(definition.stream, key) for key in TUNING}
        resolve_run(defaults, list(params)) >> StreamingPipelineOperator(
            task_id="run_pipeline",
            definition=definition,
            tuning="{{ ti.xcom_pull(task_ids='resolve_run') }}",
            run_seconds="{{ params.run_seconds }}",
            max_restarts="{{ params.max_restarts }}",
            restart_backoff="{{ params.restart_backoff }}",
            kafka_config_id=conns.kafka,
            postgres_conn_id=conns.postgres,
            spark_conn_id=conns.spark,
            inlets=list(assets.topics) if assets else [],
            **spark_task_args(definition),
        )
    return dag


def build_stop_dag(definition: PipelineDefinition) -> DAG:
    conns = connection_ids(definition)
    with DAG(
        default_args=task_defaults(definition),
        dag_id=dag_id("stop", definition.name),
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        tags=tags(definition, "stream"),
        doc_md=f"Stops the pipeline {definition.name!r} at its next batch boundary: a stop request, then a "
               "deferred wait until neither its supervisor nor a driver runs.",
    ) as dag:
        refuse_any_conf() >> StopPipelineOperator(
            task_id="stop_pipeline",
            definition=definition,
            postgres_conn_id=conns.postgres,
            deferrable=DEFERRABLE,
            **resumable_wait(definition),
        )
    return dag
