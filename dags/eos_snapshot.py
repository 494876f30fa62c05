"""eos_snapshot: hourly consistent snapshot of a pipeline's tables and replay point.

Params: pipeline (name; its config is ``{config_dir}/{pipeline}.json``),
config_dir, snapshot_store (local dir or object storage URL), keep_last.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_eos.operators.snapshot import SnapshotOperator

POSTGRES_CONN_ID = os.environ.get("EOS_POSTGRES_CONN_ID", "eos_postgres")
CONFIG_DIR = os.environ.get("EOS_PIPELINE_CONFIG_DIR", "/opt/eos/pipelines")
SNAPSHOT_STORE = os.environ.get("EOS_SNAPSHOT_STORE", "/tmp/eos-snapshots")

with DAG(
    dag_id="eos_snapshot",
    schedule="@hourly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["eos", "recovery"],
    doc_md=__doc__,
    params={
        "pipeline": Param("ledger", type="string", minLength=1, description="pipeline name"),
        "config_dir": Param(CONFIG_DIR, type="string", description="directory of <pipeline>.json configs"),
        "snapshot_store": Param(SNAPSHOT_STORE, type="string", description="local dir or object storage URL"),
        "keep_last": Param(24, type="integer", minimum=1, description="snapshots kept per pipeline"),
    },
):
    SnapshotOperator(
        task_id="snapshot",
        pipeline_config="{{ params.config_dir }}/{{ params.pipeline }}.json",
        snapshot_store="{{ params.snapshot_store }}",
        keep_last="{{ params.keep_last }}",
        postgres_conn_id=POSTGRES_CONN_ID,
    )
