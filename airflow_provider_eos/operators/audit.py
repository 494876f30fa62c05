"""AuditOperator: the exactly-once oracle as a task."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_eos.operators.base import PipelineOperatorMixin, timed_step
from airflow_provider_eos.recovery.contracts import Replayed
from airflow_provider_eos.recovery.lock import DEFAULT_LOCK_TTL
from airflow_provider_eos.utils.params import as_bool
from spark_apps.eos_stream.kafka.offsets import from_nested


class AuditMismatchError(AirflowException):
    """The database does not hold exactly what Kafka committed."""


class AuditOperator(PipelineOperatorMixin, BaseOperator):
    """
    Runs :func:`spark_apps.eos_stream.audit.oracle.audit`: every committed Kafka record
    (read_committed, up to the stored offsets, or the LSO) against the database, per
    partition and per aggregate key. Returns the report via XCom and fails on any mismatch
    (duplicates, missing rows, wrong totals, malformed records not quarantined, valid
    records quarantined).

    After a replay (the recovery's step) ``goal_offsets`` is the replay's ``lso_at_start``:
    the target is compared with Kafka up to the offsets it stores, and separately those
    offsets must have reached the goal. What producers committed after the replay started
    is the resumed stream's next work, not missing (see docs/audit.md, "After a replay").

    :param definition: the pipeline (``PipelineDefinition``, its dict, or its name); its complete app config
        comes from one call (``PipelineOperatorMixin.app_config``).
    :param pipeline_config: deprecated (read for one release): the app's config, dict or JSON file path.
    :param postgres_conn_id: the target database connection, default "eos_postgres"
    :param kafka_config_id: the Kafka connection whose ``bootstrap.servers`` the audit reads;
        None: the pipeline config's ``kafka_bootstrap``.
    :param fail_on_mismatch: raise AuditMismatchError when the report is not ok.
    :param hold_lock: hold the target's recovery lock while auditing (a recovery step).
    :param lock_ttl: seconds without heartbeat after which a lock left behind is taken over.
    :param plan_only: skip the audit (returns None).
    :param goal_offsets: ``{topic: {partition: offset}}`` the stored offsets must have reached
        (templated); None: no goal.
    :param replayed: instead of ``goal_offsets``: the replay's output (``contracts.Replayed``, its XCom
        or the replay task's ``.output``), whose ``lso_at_start`` is the goal.
    :param pending: how committed records above the stored offsets count (``auto``, ``missing``,
        ``allowed``; see :func:`spark_apps.eos_stream.audit.oracle.audit`).
    """

    template_fields: Sequence[str] = ("pipeline_config", "plan_only", "goal_offsets", "replayed")
    ui_color = "#f3e8fd"

    def __init__(self, *, definition: Any = None, pipeline_config: Any = None,
                 postgres_conn_id: str = "eos_postgres",
                 kafka_config_id: str | None = None, fail_on_mismatch: bool = True, hold_lock: bool = False,
                 lock_ttl: float = DEFAULT_LOCK_TTL,
                 plan_only: Any = False, pg_bin_dir: str | None = None, goal_offsets: Any = None,
                 replayed: Any = None, pending: str = "auto", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.take_definition(definition, pipeline_config)
        self.postgres_conn_id = postgres_conn_id
        self.kafka_config_id = kafka_config_id
        self.fail_on_mismatch = fail_on_mismatch
        self.hold_lock = hold_lock
        self.lock_ttl = lock_ttl
        self.plan_only = plan_only
        self.pg_bin_dir = pg_bin_dir
        self.goal_offsets = goal_offsets
        self.replayed = replayed
        self.pending = pending

    @timed_step
    def execute(self, context: Any) -> dict[str, Any] | None:
        from spark_apps.eos_stream.audit.oracle import audit
        from spark_apps.eos_stream.records.spec import spec_of

        if as_bool(self.plan_only):
            self.log.info("dry run: audit skipped")
            return None
        config = self.app_config()
        goal = self.goal()
        with self.lock_guard(config, context):
            report = audit(config, spec_of(config), pending=self.pending, goal=goal)
        self.report = report  # for the lineage's data-quality facet, on success and on failure
        self.log.info("audit of %s: ok=%s summary=%s mismatches=%s", config.pipeline, report["ok"],
                      report["summary"], report["mismatches"])
        if not report["ok"] and self.fail_on_mismatch:
            raise AuditMismatchError(
                f"audit of pipeline {config.pipeline!r} failed: mismatches {report['mismatches']}, "
                f"summary {report['summary']}, aggregates {report['aggregates']}"
            )
        return report

    def goal(self) -> dict[tuple[str, int], int] | None:
        """The goal: the replay's ``lso_at_start``, else the rendered ``goal_offsets`` (a dict, or its
        JSON). A goal rendered from a missing XCom (None, "None", "") is no goal, so the audit
        demands everything up to the LSO rather than nothing: never green for want of a goal."""
        if self.replayed:
            return Replayed.from_xcom(self.replayed).lso_at_start or None
        value = self.goal_offsets
        if isinstance(value, str):
            value = None if value.strip() in ("", "None", "null") else json.loads(value)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise AirflowException(f"goal_offsets must be {{topic: {{partition: offset}}}}, got {value!r}")
        return from_nested(value)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """The topics and the target tables it read, each table with the audit's assertions
        (no_duplicates, no_missing or aggregates_exact, no_valid_record_quarantined)."""
        return self.pipeline_lineage(write=False, audit=getattr(self, "report", None))

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        return self.get_openlineage_facets_on_complete(task_instance)
