"""Run one exactly-once Kafka -> Spark -> PostgreSQL pipeline (and stop it).

``eos_stream``: trigger with ``{"pipeline": "<name>"}`` to run that pipeline as the
deployment defines it in ``<[eos] pipeline_config_dir>/<name>.json`` (topics, spec,
delivery, target and meta schemas, checkpoint root). A run conf may tune how it runs
(trigger, batch size, restarts), never where it reads or writes: an undeclared key is
refused. ``availableNow`` processes what the topics hold and succeeds (one incremental
batch per run), ``processingTime`` runs until ``eos_stream_stop`` (or ``run_seconds``)
stops it. Connections: ``kafka_default``, ``eos_postgres``, ``spark_default``.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_provider_eos import settings
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.operators.stream import StreamingPipelineOperator

# Run-time knobs a conf may set; None means "as the pipeline config says".
TUNING = ("trigger", "trigger_interval", "max_offsets_per_trigger", "max_batch_attempts")


def _pinned(key: str) -> str:
    """A template for what ``check_conf`` resolved for this run (rendered natively)."""
    return "{{ ti.xcom_pull(task_ids='check_conf')['" + key + "'] }}"


def _pipeline_param() -> Param:
    return Param("ledger", type="string", pattern=settings.PIPELINE_NAME_PATTERN,
                 description="its definition is <[eos] pipeline_config_dir>/<pipeline>.json")


STREAM_PARAMS: dict[str, Param] = {
    "pipeline": _pipeline_param(),
    "trigger": Param(None, type=["null", "string"], enum=[None, "availableNow", "processingTime"],
                     description="null: the pipeline config's"),
    "trigger_interval": Param(None, type=["null", "string"], description="null: the pipeline config's"),
    "max_offsets_per_trigger": Param(None, type=["null", "integer"], minimum=1,
                                     description="null: the pipeline config's"),
    "max_batch_attempts": Param(None, type=["null", "integer"], minimum=1,
                                description="null: the pipeline config's"),
    "create_targets": Param(False, type="boolean"),
    "run_seconds": Param(0, type="number", minimum=0, description="processingTime: 0 = until stopped"),
    "max_restarts": Param(3, type="integer", minimum=0),
    "restart_backoff": Param(10, type="number", minimum=0),
}
STOP_PARAMS: dict[str, Param] = {"pipeline": _pipeline_param()}


@task
def check_conf(declared: list[str], **context: Any) -> dict[str, Any]:
    """Refuses undeclared conf keys and bad pipeline names, then resolves the pipeline's
    definition from the deployment's config directory, with this run's tuning on top.

    :param declared: the DAG's own Param names (``context["params"]`` already has the conf merged in)."""
    from airflow_provider_eos.snapshots import load_pipeline_config

    settings.check_run_conf(context["dag_run"].conf, declared)
    pipeline = settings.check_pipeline_name(context["params"]["pipeline"])
    config = load_pipeline_config(str(settings.pipeline_config_path(pipeline)), pipeline=pipeline)
    resolved = {key: getattr(config, key) for key in (
        "pipeline", "topics", "spec", "delivery", "checkpoint_dir", "target_schema", "meta_schema", *TUNING)}
    resolved.update({key: context["params"][key] for key in TUNING if context["params"].get(key) is not None})
    return resolved


with DAG(
    dag_id="eos_stream",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["eos"],
    doc_md=__doc__,
    params=STREAM_PARAMS,
) as stream_dag:
    check_conf(list(STREAM_PARAMS)) >> StreamingPipelineOperator(
        task_id="run_pipeline",
        pipeline=_pinned("pipeline"),
        topics=_pinned("topics"),
        spec=_pinned("spec"),
        delivery=_pinned("delivery"),
        trigger=_pinned("trigger"),
        trigger_interval=_pinned("trigger_interval"),
        max_offsets_per_trigger=_pinned("max_offsets_per_trigger"),
        checkpoint_dir=_pinned("checkpoint_dir"),
        target_schema=_pinned("target_schema"),
        meta_schema=_pinned("meta_schema"),
        max_batch_attempts=_pinned("max_batch_attempts"),
        create_targets="{{ params.create_targets }}",
        run_seconds="{{ params.run_seconds }}",
        max_restarts="{{ params.max_restarts }}",
        restart_backoff="{{ params.restart_backoff }}",
    )

with DAG(
    dag_id="eos_stream_stop",
    schedule=None,
    catchup=False,
    render_template_as_native_obj=True,
    tags=["eos"],
    params=STOP_PARAMS,
) as stop_dag:
    check_conf(list(STOP_PARAMS)) >> StopPipelineOperator(
        task_id="stop_pipeline", pipeline=_pinned("pipeline"), meta_schema=_pinned("meta_schema"))
