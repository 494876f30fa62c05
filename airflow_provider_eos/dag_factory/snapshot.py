"""``eos_snapshot__<pipeline>``: a consistent snapshot of the pipeline's tables and replay point.

On the definition's ``snapshot.schedule``, keeping its ``keep_last`` newest. Where snapshots go
is the deployment's ``[eos] snapshot_store``, pinned when the run starts; a run takes no conf.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import DAG, task

from airflow_provider_eos.dag_factory.common import (
    START_DATE,
    connection_ids,
    dag_id,
    refuse_undeclared_conf,
    tags,
    task_defaults,
)
from airflow_provider_eos.operators.snapshot import SnapshotOperator
from airflow_provider_eos.utils import provider_config
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition


@task
def pin_snapshot_store(**context: Any) -> dict[str, str]:
    """Refuses any conf, and pins the deployment's snapshot store for this run."""
    refuse_undeclared_conf(context, ())
    return {"snapshot_store": provider_config.snapshot_store()}


def build_snapshot_dag(definition: PipelineDefinition) -> DAG:
    conns = connection_ids(definition)
    with DAG(
        default_args=task_defaults(definition),
        dag_id=dag_id("snapshot", definition.name),
        schedule=definition.snapshot.schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        tags=tags(definition, "recovery"),
        doc_md=__doc__,
    ) as dag:
        pin_snapshot_store() >> SnapshotOperator(
            task_id="snapshot",
            definition=definition,
            snapshot_store="{{ ti.xcom_pull(task_ids='pin_snapshot_store')['snapshot_store'] }}",
            keep_last=definition.snapshot.keep_last,
            postgres_conn_id=conns.postgres,
        )
    return dag
