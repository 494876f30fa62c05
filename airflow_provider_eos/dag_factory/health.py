"""``eos_health__<pipeline>``: is the pipeline healthy? One summary task fails with a readable verdict.

Checks: the topics' last stable offset is not stuck (an open Kafka transaction; one stuck across
runs for longer than ``health.hanging_after`` is reported as hanging, with its producer and the
abort that would end it), a batch
finished recently (liveness), stored offsets reach the LSO (caught up), no new dead letters,
no in-doubt prepared transactions in the target database. A stream without new input writes
no progress rows, so a stale liveness with caught-up passing is reported as idle, not failed.
The summary also sends what the checks measured as metrics through Airflow's Stats
(docs/metrics.md). Thresholds and timing come from the definition's ``health`` section; a run conf may tighten or
loosen the three thresholds below for that run.

A definition with a ``cdc`` section (a pipeline fed by Debezium) adds two checks of its source:
each connector and its tasks RUNNING (``connector``), and the WAL each replication slot holds
back, in bytes and age (``replication_slot__<slot>``). The LSO sensor watches the change topics
as any topics: Connect's exactly-once source writes them in transactions (docs/cdc.md). A mirror
with ``transactions: whole`` adds ``held_transactions``: no source transaction's changes held
longer than ``health.max_transaction_wait`` waiting for its END.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, Param, task

from airflow_provider_eos.dag_factory.common import (
    DEFERRABLE,
    START_DATE,
    connection_ids,
    dag_id,
    refuse_undeclared_conf,
    tags,
    task_defaults,
)
from airflow_provider_eos.operators.cdc_health import (
    ConnectorHealthCheckOperator,
    HeldTransactionsCheckOperator,
    ReplicationSlotCheckOperator,
)
from airflow_provider_eos.operators.dead_letters import (
    DeadLetterCheckOperator,
    PreparedTransactionsCheckOperator,
    StreamHealthSummaryOperator,
)
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor, StreamLivenessSensor
from airflow_provider_eos.utils.definition_sections import CdcSourceSettings
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition
from airflow_provider_eos.utils.subscription import subscribed_topics
from spark_apps.eos_stream.cdc.transactions import WHOLE


@task
def check_health_conf(declared: list[str], **context: Any) -> None:
    """Refuses conf keys the health DAG does not declare."""
    refuse_undeclared_conf(context, declared)


def build_health_dag(definition: PipelineDefinition) -> DAG:
    health, conns = definition.health, connection_ids(definition)
    params = {
        "max_age_seconds": Param(health.max_age_seconds, type="number", minimum=1,
                                 description="liveness: newest batch age"),
        "max_lag": Param(health.max_lag, type="integer", minimum=0, description="caught up: records per partition"),
        "prepared_older_than": Param(health.prepared_older_than, type="number", minimum=0),
    }
    # The whole run fits in the sensors' windows plus the quick checks.
    run_timeout = timedelta(seconds=health.sensor_timeout + health.stuck_after + 120)
    with DAG(
        default_args=task_defaults(definition),
        dag_id=dag_id("health", definition.name),
        schedule=health.schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=run_timeout,
        render_template_as_native_obj=True,
        tags=tags(definition, "health"),
        doc_md=__doc__,
        params=params,
    ) as dag:
        checked = check_health_conf(list(params))
        lso = LastStableOffsetLagSensor(
            task_id="lso_lag", topics=subscribed_topics(definition), kafka_config_id=conns.kafka, watch_mode="health",
            stuck_after=health.stuck_after, poke_interval=min(health.poke_interval, health.stuck_after),
            timeout=health.sensor_timeout + health.stuck_after,
            # Stuck-since times kept in <meta>.lso_watch across runs: a run watches for minutes, a
            # hanging transaction is one stuck for longer than hanging_after.
            pipeline=definition.name, meta_schema=definition.meta_schema, postgres_conn_id=conns.postgres,
            hanging_after=health.hanging_after, deferrable=DEFERRABLE,
        )
        liveness = StreamLivenessSensor(
            task_id="liveness", pipeline=definition.name, meta_schema=definition.meta_schema,
            postgres_conn_id=conns.postgres, max_age_seconds="{{ params.max_age_seconds }}",
            poke_interval=health.poke_interval, timeout=health.sensor_timeout, deferrable=DEFERRABLE,
        )
        caught_up = StreamCaughtUpSensor(
            task_id="caught_up", pipeline=definition.name, topics=subscribed_topics(definition),
            meta_schema=definition.meta_schema, max_lag="{{ params.max_lag }}", kafka_config_id=conns.kafka,
            postgres_conn_id=conns.postgres, poke_interval=health.poke_interval, timeout=health.sensor_timeout,
            deferrable=DEFERRABLE,
        )
        dead_letters = DeadLetterCheckOperator(
            task_id="dead_letters", pipeline=definition.name, meta_schema=definition.meta_schema,
            postgres_conn_id=conns.postgres,
        )
        in_doubt = PreparedTransactionsCheckOperator(
            task_id="prepared_transactions", postgres_conn_id=conns.postgres,
            older_than_seconds="{{ params.prepared_older_than }}",
        )
        checks = [lso, liveness, caught_up, dead_letters, in_doubt, *change_stream_checks(definition, conns.postgres)]
        summary = StreamHealthSummaryOperator(
            task_id="summary", check_task_ids=[t.task_id for t in checks],
            liveness_task_id=liveness.task_id, caught_up_task_id=caught_up.task_id, pipeline=definition.name,
        )
        checked >> checks
        checks >> summary
    return dag


def cdc_source_checks(cdc: CdcSourceSettings | None) -> list[Any]:
    """The checks of a change-data-capture source, in the DAG being built: its connectors, then
    one task per replication slot (a slot each, so the summary names the one holding WAL); none
    without a ``cdc`` section."""
    if cdc is None:
        return []
    checks: list[Any] = [ConnectorHealthCheckOperator(
        task_id="connector", connectors=list(cdc.connectors), kafka_connect_conn_id=cdc.kafka_connect_conn_id)]
    for slot in cdc.replication_slots:
        assert cdc.source_postgres_conn_id is not None  # the section refuses slots without it
        checks.append(ReplicationSlotCheckOperator(
            task_id=f"replication_slot__{slot}", slot_name=slot, postgres_conn_id=cdc.source_postgres_conn_id,
            max_held_bytes=cdc.max_held_bytes, max_age_seconds=cdc.max_held_age_seconds))
    return checks


def change_stream_checks(definition: PipelineDefinition, postgres_conn_id: str) -> list[Any]:
    """The checks of a change stream's source (``cdc_source_checks``) and, for a mirror of whole
    source transactions, the check that none waits too long for its END."""
    checks = cdc_source_checks(definition.cdc)
    if (definition.mirror or {}).get("transactions") != WHOLE:
        return checks
    return [*checks, HeldTransactionsCheckOperator(
        task_id="held_transactions", pipeline=definition.name, meta_schema=definition.meta_schema,
        postgres_conn_id=postgres_conn_id, max_wait_seconds=definition.health.max_transaction_wait)]
