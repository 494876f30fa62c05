"""Run one exactly-once Kafka -> Spark -> PostgreSQL pipeline (and stop it).

``eos_stream``: trigger with a config to run a pipeline; ``availableNow`` processes what the
topics hold and succeeds (one incremental batch per run), ``processingTime`` runs until
``eos_stream_stop`` (or ``run_seconds``) stops it. Connections: ``kafka_default``,
``eos_postgres``, ``spark_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.operators.stream import StreamingPipelineOperator

with DAG(
    dag_id="eos_stream",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["eos"],
    params={
        "pipeline": Param("ledger", type="string", minLength=1, description="keys offsets, progress, dead letters"),
        "topics": Param(["ledger.events"], type="array", items={"type": "string"}, minItems=1),
        "spec": Param("spark_apps.ledger.spec:LEDGER", type="string", description="module:ATTRIBUTE"),
        "delivery": Param("exactly_once", enum=["exactly_once", "two_phase", "idempotent", "at_least_once"]),
        "trigger": Param("availableNow", enum=["availableNow", "processingTime"]),
        "trigger_interval": Param("5 seconds", type="string"),
        "max_offsets_per_trigger": Param(20000, type="integer", minimum=1),
        "checkpoint_dir": Param("/tmp/eos-checkpoints", type="string"),
        "target_schema": Param("public", type="string"),
        "meta_schema": Param("eos", type="string"),
        "max_batch_attempts": Param(3, type="integer", minimum=1),
        "create_targets": Param(False, type="boolean"),
        "run_seconds": Param(0, type="number", minimum=0, description="processingTime: 0 = until stopped"),
        "max_restarts": Param(3, type="integer", minimum=0),
        "restart_backoff": Param(10, type="number", minimum=0),
    },
) as stream_dag:
    StreamingPipelineOperator(
        task_id="run_pipeline",
        pipeline="{{ params.pipeline }}",
        topics="{{ params.topics }}",
        spec="{{ params.spec }}",
        delivery="{{ params.delivery }}",
        trigger="{{ params.trigger }}",
        trigger_interval="{{ params.trigger_interval }}",
        max_offsets_per_trigger="{{ params.max_offsets_per_trigger }}",
        checkpoint_dir="{{ params.checkpoint_dir }}",
        target_schema="{{ params.target_schema }}",
        meta_schema="{{ params.meta_schema }}",
        max_batch_attempts="{{ params.max_batch_attempts }}",
        create_targets="{{ params.create_targets }}",
        run_seconds="{{ params.run_seconds }}",
        max_restarts="{{ params.max_restarts }}",
        restart_backoff="{{ params.restart_backoff }}",
    )

with DAG(
    dag_id="eos_stream_stop",
    schedule=None,
    catchup=False,
    tags=["eos"],
    params={
        "pipeline": Param("ledger", type="string", minLength=1),
        "meta_schema": Param("eos", type="string"),
    },
) as stop_dag:
    StopPipelineOperator(task_id="stop_pipeline", pipeline="{{ params.pipeline }}",
                         meta_schema="{{ params.meta_schema }}")
