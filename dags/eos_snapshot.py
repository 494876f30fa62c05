"""eos_snapshot: hourly consistent snapshot of a pipeline's tables and replay point.

Params: pipeline (name; its config is ``<[eos] pipeline_config_dir>/<pipeline>.json``),
keep_last. Where the snapshot goes (``[eos] snapshot_store``) and where the
config is read are deployment settings, never run conf: a conf with any other
key is refused.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_provider_eos import settings
from airflow_provider_eos.operators.snapshot import SnapshotOperator

POSTGRES_CONN_ID = os.environ.get("EOS_POSTGRES_CONN_ID", "eos_postgres")
PARAMS: dict[str, Param] = {
    "pipeline": Param("ledger", type="string", pattern=settings.PIPELINE_NAME_PATTERN, description="pipeline name"),
    "keep_last": Param(24, type="integer", minimum=1, description="snapshots kept per pipeline"),
}

with DAG(
    dag_id="eos_snapshot",
    schedule="@hourly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["eos", "recovery"],
    doc_md=__doc__,
    params=PARAMS,
):

    @task
    def check_conf(**context: Any) -> dict[str, str]:
        """Refuses a conf with undeclared keys or a bad pipeline name; pins the deployment's paths."""
        from airflow_provider_eos.snapshots import load_pipeline_config

        settings.check_run_conf(context["dag_run"].conf, PARAMS)
        pipeline = settings.check_pipeline_name(context["params"]["pipeline"])
        path = str(settings.pipeline_config_path(pipeline))
        load_pipeline_config(path, pipeline=pipeline)  # the file must name this pipeline: it keys the store
        return {"pipeline_config": path, "snapshot_store": settings.snapshot_store()}

    check_conf() >> SnapshotOperator(
        task_id="snapshot",
        pipeline_config="{{ ti.xcom_pull(task_ids='check_conf')['pipeline_config'] }}",
        snapshot_store="{{ ti.xcom_pull(task_ids='check_conf')['snapshot_store'] }}",
        keep_last="{{ params.keep_last }}",
        postgres_conn_id=POSTGRES_CONN_ID,
    )
