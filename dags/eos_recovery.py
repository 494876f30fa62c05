"""eos_recovery: put a pipeline's target back to a snapshot and replay Kafka from it.

gate (LSO lag 0) -> lock -> stop stream -> choose snapshot -> retention check ->
restore (scratch validation, single-transaction swap) -> replay (availableNow
from the restored offsets) -> wait caught up -> audit -> resume the supervised
stream -> summary; the lock is released whatever happened.

Params: snapshot (``latest``, an id, or an ISO-8601 timestamp: newest before
it), pipeline, dry_run (plan only: snapshot, offsets, retention check; changes
nothing), resume (trigger ``resume_dag_id`` at the end).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Param, task

from airflow_provider_eos.operators.audit import AuditOperator
from airflow_provider_eos.operators.replay import CaughtUpOperator, ReplayOperator, RetentionCheckOperator
from airflow_provider_eos.operators.restore import RecoveryLockOperator, RequestStopOperator, RestoreOperator
from airflow_provider_eos.recovery_lock import DEFAULT_LOCK_TTL
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor

POSTGRES_CONN_ID = os.environ.get("EOS_POSTGRES_CONN_ID", "eos_postgres")
KAFKA_CONN_ID = os.environ.get("EOS_KAFKA_CONN_ID", "kafka_default")
SPARK_CONN_ID = os.environ.get("EOS_SPARK_CONN_ID", "spark_default")
CONFIG_DIR = os.environ.get("EOS_PIPELINE_CONFIG_DIR", "/opt/eos/pipelines")
SNAPSHOT_STORE = os.environ.get("EOS_SNAPSHOT_STORE", "/tmp/eos-snapshots")
LOCK_TTL = float(os.environ.get("EOS_RECOVERY_LOCK_TTL", DEFAULT_LOCK_TTL))
CONFIG = "{{ params.config_dir }}/{{ params.pipeline }}.json"
DRY_RUN = "{{ params.dry_run }}"
PINNED = "{{ ti.xcom_pull(task_ids='choose_snapshot')['snapshot']['snapshot_id'] }}"
STEPS = ("gate", "lock", "stop_stream", "choose_snapshot", "retention_check", "restore", "replay",
         "wait_caught_up", "audit")


def pipeline_topics(config_path: str) -> list[str]:
    """Jinja macro: the topics of a pipeline config (a list, rendered natively)."""
    try:
        return list(json.loads(Path(config_path).read_text())["topics"])
    except (OSError, ValueError, KeyError):
        return ["__missing_pipeline_config__"]  # the lock task then fails with the real reason


common: dict[str, Any] = {"pipeline_config": CONFIG, "postgres_conn_id": POSTGRES_CONN_ID}
locked: dict[str, Any] = {**common, "hold_lock": True, "lock_ttl": LOCK_TTL}  # steps that change the target

with DAG(
    dag_id="eos_recovery",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    user_defined_macros={"pipeline_topics": pipeline_topics},
    tags=["eos", "recovery"],
    doc_md=__doc__,
    params={
        "snapshot": Param("latest", type="string", minLength=1,
                          description="'latest', a snapshot id, or an ISO-8601 timestamp (newest before it)"),
        "pipeline": Param("ledger", type="string", minLength=1, description="pipeline name"),
        "dry_run": Param(False, type="boolean", description="print the plan, change nothing"),
        "resume": Param(True, type="boolean", description="trigger the supervised stream's DAG at the end"),
        "resume_dag_id": Param("eos_stream", type="string"),
        "config_dir": Param(CONFIG_DIR, type="string", description="directory of <pipeline>.json configs"),
        "snapshot_store": Param(SNAPSHOT_STORE, type="string", description="local dir or object storage URL"),
        "quiet_seconds": Param(0, type="number", minimum=0,
                               description="also require no micro-batch for this long (the running lock decides)"),
    },
):
    gate = LastStableOffsetLagSensor(
        task_id="gate",
        topics="{{ pipeline_topics(params.config_dir ~ '/' ~ params.pipeline ~ '.json') }}",
        kafka_config_id=KAFKA_CONN_ID,
        watch_mode="gate",
        poke_interval=2,
        timeout=600,
        deferrable=False,
    )
    lock = RecoveryLockOperator(task_id="lock", action="acquire", lock_ttl=LOCK_TTL, plan_only=DRY_RUN, **common)
    # The control-table stop request, then wait until no driver holds the pipeline's running lock.
    stop = RequestStopOperator(task_id="stop_stream", quiet_seconds="{{ params.quiet_seconds }}",
                               plan_only=DRY_RUN, **locked)
    choose = RestoreOperator(task_id="choose_snapshot", snapshot="{{ params.snapshot }}",
                             snapshot_store="{{ params.snapshot_store }}", plan_only=True, **common)
    retention = RetentionCheckOperator(task_id="retention_check", snapshot=PINNED,
                                       snapshot_store="{{ params.snapshot_store }}", kafka_config_id=KAFKA_CONN_ID,
                                       **common)
    restore = RestoreOperator(task_id="restore", snapshot=PINNED, snapshot_store="{{ params.snapshot_store }}",
                              quiet_seconds="{{ params.quiet_seconds }}", plan_only=DRY_RUN, **locked)
    replay = ReplayOperator(task_id="replay", kafka_config_id=KAFKA_CONN_ID, spark_conn_id=SPARK_CONN_ID,
                            plan_only=DRY_RUN, **locked)
    caught_up = CaughtUpOperator(task_id="wait_caught_up", replay_task_id="replay", kafka_config_id=KAFKA_CONN_ID,
                                 plan_only=DRY_RUN, **locked)
    audit = AuditOperator(task_id="audit", plan_only=DRY_RUN, **locked)
    should_resume = ShortCircuitOperator(
        task_id="should_resume",
        python_callable=lambda resume, dry_run: bool(resume) and not bool(dry_run),
        op_kwargs={"resume": "{{ params.resume }}", "dry_run": DRY_RUN},
        ignore_downstream_trigger_rules=False,
    )
    resume = TriggerDagRunOperator(task_id="resume_stream", trigger_dag_id="{{ params.resume_dag_id }}",
                                   wait_for_completion=False)

    @task(trigger_rule="none_failed")
    def summary(**context: Any) -> dict[str, Any]:
        """Rows restored, events replayed, seconds per step."""
        ti = context["ti"]
        out: dict[str, Any] = {"dry_run": context["params"]["dry_run"]}
        restored = ti.xcom_pull(task_ids="restore") or {}
        replayed = ti.xcom_pull(task_ids="replay") or {}
        plan = ti.xcom_pull(task_ids="choose_snapshot") or {}
        retention_report = ti.xcom_pull(task_ids="retention_check") or {}
        out["snapshot"] = plan.get("snapshot")
        out["retention"] = {k: retention_report.get(k) for k in ("needed", "earliest", "records_to_replay")}
        out["rows_restored"] = restored.get("rows_restored")
        out["restore_timings"] = restored.get("timings")
        out["events_replayed"] = replayed.get("events_replayed")
        out["replay_seconds"] = replayed.get("seconds")
        audit_report = ti.xcom_pull(task_ids="audit") or {}
        out["audit"] = {"ok": audit_report.get("ok"), "summary": audit_report.get("summary")}
        # Every step after the gate returns its own duration (the gate is a sensor: its time is waiting).
        out["seconds_per_step"] = {step: (ti.xcom_pull(task_ids=step) or {}).get("step_seconds")
                                   for step in STEPS if step != "gate"}
        print("eos_recovery summary:\n" + json.dumps(out, indent=2, default=str))
        return out

    done = summary()
    # A teardown: runs whenever the lock was taken, and does not decide the run's state.
    release = RecoveryLockOperator(task_id="release_lock", action="release", plan_only=DRY_RUN,
                                   **common).as_teardown(setups=lock)

    gate >> lock >> stop >> choose >> retention >> restore >> replay >> caught_up >> audit >> should_resume
    should_resume >> resume >> done
    audit >> done >> release
