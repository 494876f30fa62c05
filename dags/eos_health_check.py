"""Every 5 minutes: is the pipeline healthy? One summary task fails with a readable verdict.

Checks: the topics' last stable offset is not stuck (hanging Kafka transactions), a batch
finished recently (liveness), stored offsets reach the LSO (caught up), no new dead letters,
no in-doubt prepared transactions in the target database. A stream without new input writes
no progress rows, so a stale liveness with caught-up passing is reported as idle, not failed.

The watched pipeline comes from the environment at parse time (the LSO sensor takes a fixed
topic list): EOS_HEALTH_PIPELINE, EOS_HEALTH_TOPICS (comma-separated), EOS_HEALTH_META_SCHEMA;
timing from EOS_HEALTH_STUCK_AFTER, EOS_HEALTH_SENSOR_TIMEOUT, EOS_HEALTH_POKE_INTERVAL (seconds).
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG, Param

from airflow_provider_eos.operators.dead_letters import (
    DeadLetterCheckOperator,
    PreparedTransactionsCheckOperator,
    StreamHealthSummaryOperator,
)
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor, StreamLivenessSensor

PIPELINE = os.environ.get("EOS_HEALTH_PIPELINE", "ledger")
TOPICS = [t.strip() for t in os.environ.get("EOS_HEALTH_TOPICS", "ledger.events").split(",") if t.strip()]
META_SCHEMA = os.environ.get("EOS_HEALTH_META_SCHEMA", "eos")
STUCK_AFTER = float(os.environ.get("EOS_HEALTH_STUCK_AFTER", "60"))
SENSOR_TIMEOUT = float(os.environ.get("EOS_HEALTH_SENSOR_TIMEOUT", "120"))
POKE_INTERVAL = float(os.environ.get("EOS_HEALTH_POKE_INTERVAL", "10"))

with DAG(
    dag_id="eos_health_check",
    schedule=timedelta(minutes=5),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=5),
    render_template_as_native_obj=True,
    tags=["eos", "health"],
    params={
        "pipeline": Param(PIPELINE, type="string", minLength=1),
        "topics": Param(TOPICS, type="array", items={"type": "string"}, minItems=1),
        "meta_schema": Param(META_SCHEMA, type="string"),
        "max_age_seconds": Param(300, type="number", minimum=1, description="liveness: newest batch age"),
        "max_lag": Param(0, type="integer", minimum=0, description="caught up: records per partition"),
        "prepared_older_than": Param(60, type="number", minimum=0),
    },
) as dag:
    lso = LastStableOffsetLagSensor(
        task_id="lso_lag", topics=TOPICS, watch_mode="health", stuck_after=STUCK_AFTER,
        poke_interval=min(POKE_INTERVAL, STUCK_AFTER), timeout=SENSOR_TIMEOUT + STUCK_AFTER,
    )
    liveness = StreamLivenessSensor(
        task_id="liveness", pipeline="{{ params.pipeline }}", meta_schema="{{ params.meta_schema }}",
        max_age_seconds="{{ params.max_age_seconds }}", poke_interval=POKE_INTERVAL, timeout=SENSOR_TIMEOUT,
    )
    caught_up = StreamCaughtUpSensor(
        task_id="caught_up", pipeline="{{ params.pipeline }}", topics="{{ params.topics }}",
        meta_schema="{{ params.meta_schema }}", max_lag="{{ params.max_lag }}",
        poke_interval=POKE_INTERVAL, timeout=SENSOR_TIMEOUT,
    )
    dead_letters = DeadLetterCheckOperator(
        task_id="dead_letters", pipeline="{{ params.pipeline }}", meta_schema="{{ params.meta_schema }}",
    )
    in_doubt = PreparedTransactionsCheckOperator(
        task_id="prepared_transactions", older_than_seconds="{{ params.prepared_older_than }}",
    )
    checks = [lso, liveness, caught_up, dead_letters, in_doubt]
    summary = StreamHealthSummaryOperator(
        task_id="summary", check_task_ids=[t.task_id for t in checks],
        liveness_task_id=liveness.task_id, caught_up_task_id=caught_up.task_id,
    )
    checks >> summary
