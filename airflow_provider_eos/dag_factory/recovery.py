"""``eos_recovery__<pipeline>``: put the pipeline's target back to a snapshot and replay Kafka from it.

check_conf -> gate (no partition stuck) -> lock -> stop stream -> choose snapshot -> retention
check -> restore (scratch validation, single-transaction swap; the old tables kept aside) ->
replay (from the restored offsets to the last stable offsets: in the worker, ``direct``, up to
``stream.replay_direct_max_records`` records, else through spark-submit; the stop request stays
set) -> wait caught up -> audit (up to the stored offsets, which must reach the replay's goal: a live topic's newer
records are the resumed stream's work) -> finalize (drop the old tables) -> resume ``eos_stream__<pipeline>`` (the same
pipeline, in the mode its definition gives) and announce (an Asset event on each target table,
with the restored and replayed offsets) -> summary. If replay, caught-up or audit fails,
``rollback`` puts the old tables back and the run fails; the stream stays stopped either way.
The lock is released whatever happened. Every step is this pipeline's own: recovering one
pipeline never stops, pauses or blocks another.

Params: snapshot (``latest``, an id, or an ISO-8601 timestamp: newest before it), dry_run
(plan only: snapshot, offsets, retention check; changes nothing), resume (trigger the stream
DAG at the end), quiet_seconds. The snapshot store is the deployment's ``[eos]
snapshot_store``, never run conf: a conf with any other key is refused.
"""

from __future__ import annotations

import json
from typing import Any

from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Param, task
from airflow.sdk.exceptions import AirflowSkipException

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
from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.metrics.scheme import recovery_metrics
from airflow_provider_eos.metrics.sender import emit
from airflow_provider_eos.operators.audit import AuditOperator
from airflow_provider_eos.operators.replay import ReplayOperator, RetentionCheckOperator
from airflow_provider_eos.operators.restore import (
    FinalizeRestoreOperator,
    RecoveryLockOperator,
    RestoreOperator,
    RollbackRestoreOperator,
)
from airflow_provider_eos.operators.stop import StopPipelineOperator
from airflow_provider_eos.recovery.contracts import ChosenSnapshot, RecoverySettings, Replayed, Restored
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL
from airflow_provider_eos.sensors.lso_lag import LastStableOffsetLagSensor
from airflow_provider_eos.sensors.stream_progress import StreamCaughtUpSensor
from airflow_provider_eos.state.offsets import committed_offsets
from airflow_provider_eos.utils import provider_config
from airflow_provider_eos.utils.committed_position import committed_position
from airflow_provider_eos.utils.definition_sections import ResolvedConnections
from airflow_provider_eos.utils.params import as_bool
from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition
from airflow_provider_eos.utils.subscription import subscribed_topics

STEPS = ("gate", "lock", "stop_stream", "choose_snapshot", "retention_check", "restore", "replay",
         "wait_caught_up", "audit", "finalize")
SENSOR_STEPS = ("gate", "wait_caught_up")
PARAMS: dict[str, Param] = {
    "snapshot": Param("latest", type="string", minLength=1,
                      description="'latest', a snapshot id, or an ISO-8601 timestamp (newest before it)"),
    "dry_run": Param(False, type="boolean", description="print the plan, change nothing"),
    "resume": Param(True, type="boolean", description="start this pipeline's stream DAG again at the end"),
    "quiet_seconds": Param(0, type="number", minimum=0,
                           description="also require no micro-batch for this long (the running lock decides)"),
    # A safety override, not a location: which tables and which store stay the deployment's.
    "allow_table_changes": Param(False, type="boolean",
                                 description="restore even though the pipeline's tables differ from the "
                                 "snapshot's (a target added since): a rollback still gives back exactly "
                                 "the state the recovery found"),
}
DRY_RUN = "{{ params.dry_run }}"


@task(multiple_outputs=True)
def check_conf(**context: Any) -> dict[str, Any]:
    """Refuses a conf with undeclared keys before anything is touched, and pins the deployment's
    snapshot store and aside retention for the rest of the run (``contracts.RecoverySettings``)."""
    refuse_undeclared_conf(context, PARAMS)
    return RecoverySettings(snapshot_store=provider_config.snapshot_store(),
                            aside_retention_days=provider_config.aside_retention_days()).to_xcom()


@task(trigger_rule="none_failed")
def summary(pipeline: str, chosen: Any, retention: Any, restored: Any, replayed: Any, audit: Any,
            **context: Any) -> dict[str, Any]:
    """Rows restored, events replayed, seconds per step; a real run (not a dry run) also sends
    each step's seconds as the timer ``eos.<pipeline>.recovery.<step>`` through Airflow's Stats.

    :param pipeline: the pipeline recovered (names the metrics).
    :param chosen: the choosing step's ``ChosenSnapshot``; ``restored``: the restore's ``Restored``;
        ``replayed``: the replay's ``Replayed`` (their XComs); ``retention`` and ``audit``: those
        steps' reports.
    """
    ti = context["ti"]
    out: dict[str, Any] = {"dry_run": context["params"]["dry_run"]}
    done = Restored.from_xcom(restored)
    replay = Replayed.from_xcom(replayed)
    retention = retention or {}
    out["snapshot"] = ChosenSnapshot.from_xcom(chosen).manifest.summary()
    out["retention"] = {k: retention.get(k) for k in ("needed", "earliest", "records_to_replay")}
    out["rows_restored"] = done.rows_restored
    out["restore_timings"] = done.details.get("timings")
    out["events_replayed"] = replay.events_replayed
    out["offsets_replayed"] = replay.details.get("offsets_replayed")  # records and markers, a mirror's changes
    out["replay_engine"] = replay.details.get("engine")  # which engine ran, and why (auto: by the records)
    out["replay_seconds"] = replay.details.get("seconds")
    out["audit"] = {"ok": (audit or {}).get("ok"), "summary": (audit or {}).get("summary")}
    # Every step after the gate returns its own duration (the sensors' time is waiting).
    out["seconds_per_step"] = {step: (ti.xcom_pull(task_ids=step) or {}).get("step_seconds")
                               for step in STEPS if step not in SENSOR_STEPS}
    print("eos_recovery summary:\n" + json.dumps(out, indent=2, default=str))
    # A dry run's steps only plan: their seconds would pull the recovery timings towards zero.
    if not out["dry_run"]:
        emit(recovery_metrics(pipeline, out["seconds_per_step"]))
    return out


@task
def announce_recovered(pipeline: str, postgres_conn_id: str, meta_schema: str, dry_run: Any,
                       **context: Any) -> dict[str, Any]:
    """An Asset event on each target (this task's outlets): the target was put back to a snapshot and
    caught up again, and holds everything Kafka committed below the offsets in ``extra["payload"]``
    (shaped like the committed-offsets watcher's, with ``change: "recovered"`` and the snapshot).

    :param pipeline: the pipeline recovered.
    :param postgres_conn_id: its target database.
    :param meta_schema: its bookkeeping schema.
    :param dry_run: a dry run changed nothing, so it announces nothing (the task is skipped).
    """
    if as_bool(dry_run):
        raise AirflowSkipException("a dry run changed nothing: no recovery to announce")
    hook = EosPostgresHook(postgres_conn_id=postgres_conn_id, meta_schema=meta_schema)
    position = committed_position(pipeline, committed_offsets(hook, pipeline)) or {"pipeline": pipeline}
    # Pulled rather than wired: the announcement's only upstream is finalize (it must not wait on more).
    chosen = ChosenSnapshot.from_xcom(context["ti"].xcom_pull(task_ids="choose_snapshot"))
    payload = {**position, "change": "recovered", "snapshot_id": chosen.snapshot_id}
    for asset in context["task"].outlets:
        context["outlet_events"][asset].extra = {"payload": payload}
    return payload


def _stop_the_stream(definition: PipelineDefinition, conns: ResolvedConnections, common: dict[str, Any],
                     locked: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The steps before anything is chosen: the gate on Kafka's stable offsets, the recovery lock,
    and the stream stopped and fenced."""
    # Deferred to the triggerer: waiting on a stuck partition holds no worker slot.
    gate = LastStableOffsetLagSensor(task_id="gate", topics=subscribed_topics(definition), kafka_config_id=conns.kafka,
                                     watch_mode="gate", poke_interval=2, timeout=600, deferrable=DEFERRABLE,
                                     **resumable_wait(definition))
    lock = RecoveryLockOperator(task_id="lock", action="acquire", lock_ttl=DEFAULT_LOCK_TTL, plan_only=DRY_RUN,
                                **common)
    # The stop request and an epoch bump, then a deferred wait until neither the pipeline's
    # supervisor nor a driver runs (the trigger keeps the recovery lock's heartbeat).
    stop = StopPipelineOperator(task_id="stop_stream", fence=True, quiet_seconds="{{ params.quiet_seconds }}",
                                plan_only=DRY_RUN, deferrable=DEFERRABLE, **resumable_wait(definition), **locked)
    return gate, lock, stop


def _choose_and_restore(conns: ResolvedConnections, checked: Any, common: dict[str, Any],
                        locked: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The snapshot chosen once, its offsets checked against Kafka's retention, and its restore."""
    # The one choice of the run: every later step is handed this ChosenSnapshot (manifest and store).
    choose = RestoreOperator(task_id="choose_snapshot", snapshot="{{ params.snapshot }}",
                             snapshot_store=checked["snapshot_store"],
                             allow_table_changes="{{ params.allow_table_changes }}", plan_only=True, **common)
    retention = RetentionCheckOperator(task_id="retention_check", snapshot=choose.output,
                                       kafka_config_id=conns.kafka, **common)
    # keep_old: the replaced tables stay aside until replay and audit prove the new state (finalize
    # drops them) or one of them fails (rollback puts them back).
    restore = RestoreOperator(task_id="restore", snapshot=choose.output, keep_old=True,
                              kafka_config_id=conns.kafka, quiet_seconds="{{ params.quiet_seconds }}",
                              allow_table_changes="{{ params.allow_table_changes }}",
                              plan_only=DRY_RUN, **locked)
    return choose, retention, restore


def _replay_and_audit(definition: PipelineDefinition, conns: ResolvedConnections,
                      locked: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The steps after the restore that prove it: the replay, the wait until the stored offsets
    reach its goal, and the audit."""
    spark, engine = definition.spark, definition.stream.replay_engine
    # On spark_queue unless it never spark-submits: ``auto`` may, by the size it finds.
    replay = ReplayOperator(task_id="replay", kafka_config_id=conns.kafka, spark_conn_id=conns.spark,
                            engine=engine, direct_max_records=definition.stream.replay_direct_max_records,
                            plan_only=DRY_RUN, spark_conf=spark.submit_conf(), driver_memory=spark.driver_memory,
                            jars=spark.all_jars(provider_config.spark_jars()) if spark.jars else None,
                            **(spark_task_args(definition) if engine != "direct" else {}), **locked)
    # Stored offsets reach the LSO the replay started from (deferred; the replay already checked it
    # once, this is the database's word after the app has gone). A wait shorter than the lock's TTL.
    caught_up = StreamCaughtUpSensor(
        task_id="wait_caught_up", pipeline=definition.name, topics=subscribed_topics(definition),
        meta_schema=definition.meta_schema, kafka_config_id=conns.kafka, postgres_conn_id=conns.postgres,
        replayed=replay.output, plan_only=DRY_RUN, poke_interval=5, timeout=600, deferrable=DEFERRABLE,
        **resumable_wait(definition))
    # Compared up to the offsets the target stores, which must have reached the replay's goal:
    # what producers committed since the replay started is the resumed stream's work, not missing.
    audit = AuditOperator(task_id="audit", kafka_config_id=conns.kafka, plan_only=DRY_RUN,
                          replayed=replay.output, **locked)
    return replay, caught_up, audit


def _rollback_and_resume(definition: PipelineDefinition, restore: Any,
                         locked: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The two ways a recovery ends: the rollback when a step after the swap failed, else the
    stream's resumption (unless the params say not to). ``restore`` is the restore step: only its
    ``Restored`` says whether there is a swap to roll back."""
    # Only a run whose restore swapped can roll back; one refused earlier (conf, gate, lock, stop,
    # retention, restore) changed no table, and must not touch a lock another run may hold.
    needs_rollback = ShortCircuitOperator(
        task_id="needs_rollback",
        trigger_rule="one_failed",
        python_callable=lambda restored, dry_run: bool(restored and Restored.from_xcom(restored).aside_schema)
        and not bool(dry_run),
        op_kwargs={"restored": restore.output, "dry_run": DRY_RUN},
    )
    rollback = RollbackRestoreOperator(task_id="rollback", restored=restore.output, **locked)
    should_resume = ShortCircuitOperator(
        task_id="should_resume",
        python_callable=lambda resume, dry_run: bool(resume) and not bool(dry_run),
        op_kwargs={"resume": "{{ params.resume }}", "dry_run": DRY_RUN},
        ignore_downstream_trigger_rules=False,
    )
    # This pipeline's own stream DAG: its definition gives the mode the stream had.
    resume = TriggerDagRunOperator(task_id="resume_stream", trigger_dag_id=dag_id("stream", definition.name),
                                   wait_for_completion=False)
    return needs_rollback, rollback, should_resume, resume


def build_recovery_dag(definition: PipelineDefinition, assets: PipelineAssets | None = None) -> DAG:
    """:param assets: the pipeline's assets; a finished recovery announces its target assets."""
    conns = connection_ids(definition)
    common: dict[str, Any] = {"definition": definition, "postgres_conn_id": conns.postgres}
    # Steps that change the target hold the pipeline's recovery lock.
    locked: dict[str, Any] = {**common, "hold_lock": True, "lock_ttl": DEFAULT_LOCK_TTL}
    with DAG(
        default_args=task_defaults(definition),
        dag_id=dag_id("recovery", definition.name),
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        render_template_as_native_obj=True,
        tags=tags(definition, "recovery"),
        doc_md=__doc__,
        params=PARAMS,
    ) as dag:
        # multiple_outputs: each setting is its own XCom, wired by key below.
        checked: Any = check_conf()
        gate, lock, stop = _stop_the_stream(definition, conns, common, locked)
        choose, retention, restore = _choose_and_restore(conns, checked, common, locked)
        replay, caught_up, audit = _replay_and_audit(definition, conns, locked)
        # Also sweeps this target's asides older than the deployment's retention (failed recoveries never undone).
        finalize = FinalizeRestoreOperator(task_id="finalize", restored=restore.output,
                                           retention_days=checked["aside_retention_days"], plan_only=DRY_RUN,
                                           **locked)
        needs_rollback, rollback, should_resume, resume = _rollback_and_resume(definition, restore, locked)
        announce = announce_recovered.override(outlets=list(assets.targets) if assets else [])(
            definition.name, conns.postgres, definition.meta_schema, DRY_RUN)
        done = summary(definition.name, choose.output, retention.output, restore.output, replay.output,
                       audit.output)
        # A teardown: runs whenever the lock was taken, and does not decide the run's state.
        release = RecoveryLockOperator(task_id="release_lock", action="release", plan_only=DRY_RUN,
                                       **common).as_teardown(setups=lock)

        checked >> gate >> lock >> stop >> choose >> retention >> restore >> replay >> caught_up >> audit
        audit >> finalize >> should_resume >> resume >> done
        finalize >> announce >> done
        [replay, caught_up, audit] >> needs_rollback >> rollback
        # The lock is held until the rollback is done, so no other recovery starts on a half-way target.
        [done, rollback] >> release
    return dag
